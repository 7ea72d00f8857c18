/* Serial console and printf. */
#include "kit.h"

#define LSR_THRE 0x20

void serial_init(void);

void serial_init(void)
{
	outb(SERIAL_PORT + 1, 0x00);	/* IER: no interrupts */
	outb(SERIAL_PORT + 3, 0x80);	/* LCR: DLAB */
	outb(SERIAL_PORT + 0, 0x01);	/* DLL: 115200 baud */
	outb(SERIAL_PORT + 1, 0x00);	/* DLM */
	outb(SERIAL_PORT + 3, 0x03);	/* LCR: 8N1 */
	outb(SERIAL_PORT + 2, 0x07);	/* FCR: enable and clear FIFOs */
	outb(SERIAL_PORT + 4, 0x03);	/* MCR: DTR, RTS */
}

void serial_putc(char c)
{
	/* Bounded, so a missing UART cannot hang the guest. */
	for (unsigned i = 0; i < 1000000 && !(inb(SERIAL_PORT + 5) & LSR_THRE); i++)
		pause();
	outb(SERIAL_PORT, (u8)c);
}

void serial_write(const char *s, size_t n)
{
	while (n--)
		serial_putc(*s++);
}

/* printf, vprintf, puts and putchar hold the console lock (smp.c) per call. */
int putchar(int c)
{
	console_lock();
	serial_putc((char)c);
	console_unlock();
	return (u8)c;
}

int puts(const char *s)
{
	size_t n = strlen(s);
	console_lock();
	serial_write(s, n);
	serial_putc('\n');
	console_unlock();
	return (int)n + 1;
}

/* ---- formatter ---- */

struct sink {
	char *buf;		/* NULL: straight to the serial port */
	size_t size, pos;
};

static void emit(struct sink *o, char c)
{
	if (!o->buf)
		serial_putc(c);
	else if (o->pos + 1 < o->size)
		o->buf[o->pos] = c;
	o->pos++;
}

static void emit_pad(struct sink *o, char c, int n)
{
	while (n-- > 0)
		emit(o, c);
}

enum { F_LEFT = 1, F_ZERO = 2, F_PLUS = 4, F_SPACE = 8, F_ALT = 16 };

static void emit_number(struct sink *o, u64 v, bool neg, unsigned base, bool upper,
			int flags, int width)
{
	const char *digits = upper ? "0123456789ABCDEF" : "0123456789abcdef";
	char tmp[24];
	int n = 0;
	const char *prefix = "";

	do {
		unsigned d;
		if (base == 16) {
			d = v & 15;
			v >>= 4;
		} else if (base == 8) {
			d = v & 7;
			v >>= 3;
		} else {
			d = (unsigned)(v % 10);
			v /= 10;
		}
		tmp[n++] = digits[d];
	} while (v);

	if (neg)
		prefix = "-";
	else if (flags & F_PLUS)
		prefix = "+";
	else if (flags & F_SPACE)
		prefix = " ";
	else if ((flags & F_ALT) && base == 16)
		prefix = upper ? "0X" : "0x";
	else if ((flags & F_ALT) && base == 8 && tmp[n - 1] != '0')
		prefix = "0";

	int plen = (int)strlen(prefix);
	int pad = width - n - plen;
	if (!(flags & (F_LEFT | F_ZERO)))
		emit_pad(o, ' ', pad);
	for (const char *p = prefix; *p; p++)
		emit(o, *p);
	if ((flags & F_ZERO) && !(flags & F_LEFT))
		emit_pad(o, '0', pad);
	while (n)
		emit(o, tmp[--n]);
	if (flags & F_LEFT)
		emit_pad(o, ' ', pad);
}

static void format(struct sink *o, const char *fmt, va_list ap)
{
	for (; *fmt; fmt++) {
		if (*fmt != '%') {
			emit(o, *fmt);
			continue;
		}
		fmt++;

		int flags = 0;
		for (;; fmt++) {
			if (*fmt == '-') flags |= F_LEFT;
			else if (*fmt == '0') flags |= F_ZERO;
			else if (*fmt == '+') flags |= F_PLUS;
			else if (*fmt == ' ') flags |= F_SPACE;
			else if (*fmt == '#') flags |= F_ALT;
			else break;
		}

		int width = 0;
		if (*fmt == '*') {
			width = va_arg(ap, int);
			if (width < 0) {
				flags |= F_LEFT;
				width = -width;
			}
			fmt++;
		} else {
			while (*fmt >= '0' && *fmt <= '9')
				width = width * 10 + (*fmt++ - '0');
		}

		int prec = -1;
		if (*fmt == '.') {
			fmt++;
			prec = 0;
			if (*fmt == '*') {
				prec = va_arg(ap, int);
				fmt++;
			} else {
				while (*fmt >= '0' && *fmt <= '9')
					prec = prec * 10 + (*fmt++ - '0');
			}
		}

		int len = 0;	/* 0 int, 1 long, 2 long long, -1 short, -2 char */
		for (;; fmt++) {
			if (*fmt == 'l') len++;
			else if (*fmt == 'h') len--;
			else if (*fmt == 'z' || *fmt == 'j' || *fmt == 't') len = 1;
			else break;
		}

		u64 u;
		s64 s;
		switch (*fmt) {
		case 'd':
		case 'i':
			if (len >= 1)
				s = va_arg(ap, long);
			else
				s = va_arg(ap, int);
			if (len == -1)
				s = (short)s;
			else if (len <= -2)
				s = (signed char)s;
			emit_number(o, s < 0 ? -(u64)s : (u64)s, s < 0, 10, false, flags, width);
			break;
		case 'u':
		case 'x':
		case 'X':
		case 'o':
			if (len >= 1)
				u = va_arg(ap, unsigned long);
			else
				u = va_arg(ap, unsigned int);
			if (len == -1)
				u = (u16)u;
			else if (len <= -2)
				u = (u8)u;
			emit_number(o, u, false, *fmt == 'u' ? 10 : *fmt == 'o' ? 8 : 16,
				    *fmt == 'X', flags & ~(F_PLUS | F_SPACE), width);
			break;
		case 'p':
			u = (u64)va_arg(ap, void *);
			emit_number(o, u, false, 16, false, (flags & ~(F_PLUS | F_SPACE)) | F_ALT, width);
			break;
		case 'c': {
			char c = (char)va_arg(ap, int);
			if (!(flags & F_LEFT))
				emit_pad(o, ' ', width - 1);
			emit(o, c);
			if (flags & F_LEFT)
				emit_pad(o, ' ', width - 1);
			break;
		}
		case 's': {
			const char *str = va_arg(ap, const char *);
			if (!str)
				str = "(null)";
			int n = 0;
			while (str[n] && (prec < 0 || n < prec))
				n++;
			if (!(flags & F_LEFT))
				emit_pad(o, ' ', width - n);
			for (int i = 0; i < n; i++)
				emit(o, str[i]);
			if (flags & F_LEFT)
				emit_pad(o, ' ', width - n);
			break;
		}
		case '%':
			emit(o, '%');
			break;
		case '\0':
			return;
		default:
			emit(o, '%');
			emit(o, *fmt);
			break;
		}
	}
}

int vprintf(const char *fmt, va_list ap)
{
	struct sink o = { 0 };
	console_lock();
	format(&o, fmt, ap);
	console_unlock();
	return (int)o.pos;
}

int printf(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vprintf(fmt, ap);
	va_end(ap);
	return n;
}

int vsnprintf(char *buf, size_t size, const char *fmt, va_list ap)
{
	struct sink o = { .buf = buf, .size = size, .pos = 0 };
	format(&o, fmt, ap);
	if (size)
		buf[o.pos < size ? o.pos : size - 1] = '\0';
	return (int)o.pos;
}

int snprintf(char *buf, size_t size, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, size, fmt, ap);
	va_end(ap);
	return n;
}
