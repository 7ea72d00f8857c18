/*
 * ioapic-route: an I/O APIC redirection entry's destination decides which
 * CPU takes the interrupt.
 *
 * The line is COM1's (ISA IRQ 4, I/O APIC pin 4): the guest raises it
 * itself, one edge per raise, with the 16550's transmitter-empty interrupt
 * (read IIR to acknowledge, write IER = 0x02: the transmitter is always
 * empty, so enabling its interrupt raises it; IER = 0 again after).  For
 * every CPU in turn the BSP points pin 4 at that CPU, first by physical
 * destination (its APIC ID), then by logical destination (flat model, each
 * CPU's LDR = 1 << index, first 8 CPUs), raises the line `raises=` times
 * (default 3), waiting for each delivery, and masks the entry again.  Every
 * raise must be taken exactly once, by the target and only the target.
 * The APs wait in "sti; hlt"; the 8259s and LINT0 are masked.
 */
#include "kit.h"

#define V_COM1	0x44
#define MAXC	KIT_MAX_CPUS

#define COM1_IER	(SERIAL_PORT + 1)
#define COM1_IIR	(SERIAL_PORT + 2)
#define IER_THRE	0x02

static volatile u32 hits[MAXC];
static volatile u32 total, stray;
static unsigned ncpu;

static void handler(struct frame *f)
{
	if (f->vector == V_COM1) {
		atomic_inc(&hits[cpu_index()]);
		atomic_inc(&total);
	} else {
		atomic_inc(&stray);
	}
	lapic_eoi();
}

/* One edge on IRQ 4. */
static void com1_raise(void)
{
	outb(COM1_IER, 0);
	(void)inb(COM1_IIR);		/* acknowledge anything pending */
	outb(COM1_IER, IER_THRE);	/* THR empty: interrupt */
	outb(COM1_IER, 0);
}

static void ap_main(unsigned idx)
{
	if (idx < 8)
		lapic_set_logical_id((u8)(1u << idx));
	for (;;) {
		sti();
		hlt();
	}
}

/* Waits until `total` reaches `want` or `us` pass (call with interrupts on:
 * on PVM hosts an interrupt that became pending while ring 0 had IF=0 is
 * injected only up to a host tick after STI). */
static bool wait_total(u32 want, u64 us)
{
	u64 end = rdtsc() + us * (tsc_hz() / 1000000);
	while (total < want && (s64)(rdtsc() - end) < 0)
		pause();
	return total >= want;
}

static unsigned check(unsigned target, bool logical, u32 raises)
{
	u8 dest = logical ? (u8)(1u << target) : (u8)cpu_apic_id(target);
	for (unsigned i = 0; i < ncpu; i++)
		hits[i] = 0;
	total = 0;
	ioapic_route(ISA_IRQ_COM1, V_COM1, dest, logical ? IOAPIC_LOGICAL : 0);
	sti();
	for (u32 r = 0; r < raises; r++) {
		com1_raise();
		if (!wait_total(r + 1, 1000000))
			break;
	}
	(void)wait_total(raises + 1, 5000);	/* late duplicates */
	cli();
	ioapic_mask(ISA_IRQ_COM1);

	unsigned bad = 0;
	console_lock();
	printf("ioapic-route: cpu %u %-8s dest 0x%02x: %u raises, taken by", target,
	       logical ? "logical" : "physical", dest, raises);
	for (unsigned i = 0; i < ncpu; i++) {
		if (hits[i])
			printf(" cpu %u x%u", i, hits[i]);
		if (hits[i] != (i == target ? raises : 0))
			bad++;
	}
	if (!total)
		printf(" nobody");
	printf("%s\n", bad ? "  <-- wrong" : "");
	console_unlock();
	return bad;
}

void guest_main(void)
{
	u32 raises = (u32)cmdline_uint("raises", 3);
	ncpu = cpu_count();
	if (ncpu > MAXC)
		ncpu = MAXC;
	for (unsigned v = 0x20; v < 0xff; v++)
		set_handler(v, handler);
	lapic_enable();
	lapic_mask_lint0();	/* nothing through the 8259s */
	pic_disable();
	outb(COM1_IER, 0);
	ioapic_mask_all();
	lapic_set_logical_id(1);
	tsc_hz();
	unsigned aps = smp_start_aps(ap_main);
	if (aps != ncpu - 1)
		fail("%u of %u APs started", aps, ncpu - 1);
	printf("ioapic-route: I/O APIC id %u, version 0x%02x, %u pins; COM1 IRQ 4 -> pin 4, vector 0x%x\n",
	       ioapic_id(), ioapic_version(), ioapic_pins(), V_COM1);

	u64 t0 = rdtsc();
	unsigned bad = 0, routes = 0;
	for (unsigned t = 0; t < ncpu; t++) {
		bad += check(t, false, raises);
		routes++;
		if (t < 8) {
			bad += check(t, true, raises);
			routes++;
		}
	}
	u64 us = (rdtsc() - t0) * 1000000 / tsc_hz();
	if (stray)
		fail("%u interrupts on unexpected vectors", stray);
	if (bad)
		fail("%u (target, mode, cpu) counts wrong", bad);
	printf("ioapic-route: %u routes x %u raises, each taken once by its target only (%lu ms)\n",
	       routes, raises, us / 1000);
	pass();
}
