/*
 * bench-start: the start-up benchmark's guest (bench/bench.py).  The kit's set-up
 * (serial, TSS, IDT, boot info) runs, then the guest's very first action is to enter
 * ring 3 and write there: one byte '!' to the UART (0x3f8), then 0 to the debug-exit
 * port 0xf4, which ends the VM in ferrovm and in QEMU (isa-debug-exit) with status 1.
 * The harness times process start -> first byte on the serial pipe, and -> exit.
 */
#include "kit.h"

static u64 first_write(u64 arg)
{
	(void)arg;
	outb(SERIAL_PORT, '!');
	outb(DEBUG_EXIT_PORT, EXIT_PASS);
	halt_forever();
}

void guest_main(void)
{
	enter_ring3(first_write, 0);
}
