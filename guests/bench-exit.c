/*
 * bench-exit: exit round trips to user space, for bench/bench.py.  Under ferrovm,
 * QEMU and the raw KVM_RUN loop (bench/rawkvm.c) alike, timed with RDTSC:
 *
 *   pio-out     OUTB to port 0x3ff (COM1 scratch register: a user-space device in
 *               all three; the raw loop ignores it)
 *   pio-in      INB from port 0x3ff
 *   mmio-write  32-bit store to 0xd0000000 (no RAM, no device: an MMIO exit that
 *               user space answers, all ones on reads)
 *   mmio-read   32-bit load from 0xd0000000
 *   nop         the same loop with NOPs instead (no exit): the loop's own cost,
 *               which in ring 0 on PVM hosts is instruction emulation
 *   cr8-write   MOV to CR8 (the task-priority register; ring 0 only): what a guest
 *               that hammers the TPR pays per write.  No exit at all where the CPU
 *               shadows the TPR; a kernel exit (or, on PVM, emulation) otherwise
 *
 * each from ring 3 and from ring 0, `n3=` / `n0=` accesses per measurement (8 per
 * loop iteration, unrolled), `reps=` rounds, tests interleaved within a round.
 * Output, one line per measurement, then PASS:
 *   exit: ring=<0|3> test=<name> rep=<k> n=<accesses> cycles=<tsc cycles>
 */
#include "kit.h"

#define PIO_PORT	0x3ff
#define MMIO_ADDR	0xd0000000UL

enum { T_NOP, T_PIO_OUT, T_PIO_IN, T_MMIO_WRITE, T_MMIO_READ, T_CR8, T_COUNT };
static const char *const test_name[T_COUNT] = {
	"nop", "pio-out", "pio-in", "mmio-write", "mmio-read", "cr8-write",
};

#define REP8(x) x x x x x x x x

static u64 iters;	/* loop iterations (accesses / 8) for the next measurement */

static u64 __attribute__((noinline)) measure(u64 test)
{
	volatile u32 *mmio = (volatile u32 *)MMIO_ADDR;
	u64 n = iters, t0, t1;
	u32 sink = 0;

	t0 = rdtsc();
	switch (test) {
	case T_NOP:
		for (u64 i = 0; i < n; i++)
			__asm__ volatile(REP8("nop\n\t") ::: "memory");
		break;
	case T_PIO_OUT:
		for (u64 i = 0; i < n; i++)
			__asm__ volatile(REP8("outb %%al, %%dx\n\t") :: "a"(0x5a), "d"(PIO_PORT) : "memory");
		break;
	case T_PIO_IN:
		for (u64 i = 0; i < n; i++) {
			u8 v;
			__asm__ volatile(REP8("inb %%dx, %%al\n\t") : "=a"(v) : "d"(PIO_PORT) : "memory");
			sink += v;
		}
		break;
	case T_MMIO_WRITE:
		for (u64 i = 0; i < n; i++) {
			REP8(*mmio = (u32)i;)
		}
		break;
	case T_MMIO_READ:
		for (u64 i = 0; i < n; i++) {
			REP8(sink += *mmio;)
		}
		break;
	case T_CR8:
		/* Priority 0 masks nothing, so the writes change no behaviour. */
		for (u64 i = 0; i < n; i++)
			__asm__ volatile(REP8("mov %0, %%cr8\n\t") :: "r"(0UL) : "memory");
		break;
	}
	t1 = rdtsc();
	__asm__ volatile("" :: "r"(sink));
	return t1 - t0;
}

void guest_main(void)
{
	u64 n3 = cmdline_uint("n3", 2000), n0 = cmdline_uint("n0", 2000);
	u64 reps = cmdline_uint("reps", 3);

	n3 = (n3 + 7) / 8 * 8;
	n0 = (n0 + 7) / 8 * 8;
	printf("bench-exit: port 0x%x, mmio 0x%lx, %lu accesses in ring 3, %lu in ring 0, %lu reps\n",
	       PIO_PORT, MMIO_ADDR, n3, n0, reps);
	for (u64 rep = 0; rep < reps; rep++) {
		for (int ring = 3; ring >= 0; ring -= 3) {
			u64 n = ring ? n3 : n0;
			for (u64 t = 0; t < T_COUNT; t++) {
				if (t == T_CR8 && ring)
					continue;	/* privileged: #GP in ring 3 */
				iters = n / 8;
				u64 c = ring ? enter_ring3(measure, t) : measure(t);
				printf("exit: ring=%d test=%s rep=%lu n=%lu cycles=%lu\n",
				       ring, test_name[t], rep, n, c);
			}
		}
	}
	pass();
}
