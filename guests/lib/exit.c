/* Ending the VM: debug-exit, PASS/FAIL, i8042 reset. */
#include "kit.h"

NORETURN void halt_forever(void)
{
	for (;;) {
		if (cpl() == 0) {
			cli();
			hlt();
		} else {
			pause();	/* HLT would #GP at CPL 3 */
		}
	}
}

NORETURN void exit_vm(u8 code)
{
	outb(DEBUG_EXIT_PORT, code);
	halt_forever();
}

NORETURN void pass(void)
{
	console_lock();		/* never released: PASS stays the last line */
	puts("PASS");
	exit_vm(EXIT_PASS);
}

static NORETURN void vfail(u8 code, const char *fmt, va_list ap)
{
	console_lock();		/* one line, even with several CPUs printing */
	printf("FAIL: ");
	vprintf(fmt, ap);
	putchar('\n');
	exit_vm(code);		/* the lock is never released: nothing prints after */
}

NORETURN void fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vfail(EXIT_FAIL, fmt, ap);
}

NORETURN void fail_code(u8 code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vfail(code, fmt, ap);
}

void i8042_reset(void)
{
	outb(0x64, 0xfe);
	/* A VMM handles the reset during the OUT exit; real hardware takes a
	 * moment.  Give it a few thousand port reads (~50 ms emulated). */
	for (int i = 0; i < 10000; i++)
		(void)inb(0x64);
}
