/*
 * serial-echo: echoes every byte it receives on COM1 back to COM1, until it
 * receives Ctrl-D (0x04).  Then prints how many bytes it received and their
 * sum, and passes.  Polls the line status register from ring 3 (no
 * interrupts), so the host's input path is tested without the guest's
 * interrupt handling: input that arrives faster than the guest reads must
 * wait in the VMM, not be lost.
 *
 *   serial-echo: ready
 *   <the bytes received, echoed>
 *   serial-echo: N bytes, sum S
 *   PASS
 */
#include "kit.h"

#define COM1_DATA	SERIAL_PORT
#define COM1_LSR	(SERIAL_PORT + 5)
#define LSR_DATA_READY	0x01
#define LSR_THR_EMPTY	0x20
#define CTRL_D		0x04

struct echo_count {
	u64 bytes, sum;
};

static u64 echo(u64 arg)
{
	struct echo_count *count = (struct echo_count *)arg;
	for (;;) {
		while (!(inb(COM1_LSR) & LSR_DATA_READY))
			pause();
		u8 c = inb(COM1_DATA);
		if (c == CTRL_D)
			return 0;
		while (!(inb(COM1_LSR) & LSR_THR_EMPTY))
			pause();
		outb(COM1_DATA, c);
		count->bytes++;
		count->sum += c;
	}
}

void guest_main(void)
{
	static struct echo_count count;
	printf("serial-echo: ready\n");
	enter_ring3(echo, (u64)&count);
	printf("\nserial-echo: %lu bytes, sum %lu\n", count.bytes, count.sum);
	pass();
}
