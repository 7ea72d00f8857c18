/*
 * pic-mode: interrupts through the 8259 pair alone, as a legacy OS takes
 * them: the I/O APIC is left as at reset (every entry masked: checked),
 * the 8259s are initialised with ICW1-ICW4, and IRQ 0 (PIT channel 0,
 * mode 2, 1 kHz), IRQ 4 (COM1 THR-empty interrupt, raised by the guest one
 * edge at a time) and IRQ 8 (RTC periodic interrupt, 1024 Hz, through the
 * slave and the cascade on IR2) are unmasked.  The 8259's INTR reaches the
 * BSP as ExtINT through LVT LINT0, which is left at its reset value
 * (ExtINT, unmasked); with one CPU the local APIC is not touched at all
 * (software-disabled, as at reset), with more it is enabled (virtual-wire
 * mode) so that the APs can be started: they wait in "sti; hlt" and must
 * receive nothing.
 *
 * Two rounds, vector bases 0x20/0x28 and then 0x50/0x68 (`n=` interrupts of
 * each IRQ per round, default 30).  Every interrupt must arrive on base +
 * irq with the 8259's in-service bit of its IRQ set (and, for IRQ 8, the
 * master's IR2 bit), and is ended with specific EOIs (OCW2 0x60 | ir: the
 * slave's, then the master's for IRQ 8).  The RTC handler reads register C
 * (PF must be set); each COM1 raise must be delivered exactly once.
 */
#include "kit.h"

#define COM1_IER	(SERIAL_PORT + 1)
#define COM1_IIR	(SERIAL_PORT + 2)
#define NIRQ		3
static const unsigned irqs[NIRQ] = { ISA_IRQ_PIT, ISA_IRQ_COM1, ISA_IRQ_RTC };

static u8 base_m, base_s, prev_m, prev_s;	/* this round's and the last round's bases */
static volatile u32 count[16], isr_bad[16], rtc_nopf, unexpected, unexpected_vec, late;
static volatile u32 ap_got[KIT_MAX_CPUS];
static volatile u16 isr_seen_bad;
static unsigned ncpu;

static unsigned irq_of(unsigned v, u8 m, u8 s)
{
	if (m && v >= m && v < m + 8u)
		return v - m;
	if (s && v >= s && v < s + 8u)
		return v - s + 8;
	return 16;
}

static void handler(struct frame *f)
{
	unsigned v = (unsigned)f->vector;
	if (cpu_index() != 0) {
		ap_got[cpu_index()]++;
		lapic_eoi();
		return;
	}
	unsigned irq = irq_of(v, base_m, base_s);
	if (irq == 16 && irq_of(v, prev_m, prev_s) != 16) {
		late++;		/* acknowledged before the last round ended (loaded host) */
		return;
	}
	if (irq != ISA_IRQ_PIT && irq != ISA_IRQ_COM1 && irq != ISA_IRQ_RTC) {
		unexpected++;
		unexpected_vec = v;
		if (irq < 16)	/* e.g. a spurious IRQ 7 / 15: no EOI on that chip */
			return;
		lapic_eoi();
		return;
	}
	u16 isr = pic_isr();
	u16 want = (u16)(1u << irq);
	if (irq >= 8)
		want |= 1u << PIC_CASCADE_IRQ;
	if ((isr & want) != want) {
		isr_bad[irq]++;
		isr_seen_bad = isr;
	}
	if (irq == ISA_IRQ_RTC && !(rtc_ack() & RTC_C_PF))
		rtc_nopf++;
	count[irq]++;
	pic_eoi(irq);
}

static void com1_raise(void)
{
	outb(COM1_IER, 0);
	(void)inb(COM1_IIR);
	outb(COM1_IER, 0x02);
	outb(COM1_IER, 0);
}

static void ap_main(unsigned idx)
{
	(void)idx;
	for (;;) {
		sti();
		hlt();
	}
}

static volatile u32 want_n, raised_n, lost_raise_n;

/* Ring 3, interrupts on: lets what is still in flight arrive. */
static u64 drain(u64 us)
{
	tsc_delay_us(us);
	return 0;
}

/*
 * Ring 3, interrupts on: raise COM1 `want_n` times (one at a time, each
 * must arrive within 1 s) and wait until `want_n` of each IRQ arrived
 * (3 s at most).  The waiting is done in ring 3 on purpose: on PVM hosts an
 * interrupt that became pending while ring 0 ran with IF=0 (an 8259 request
 * left over when a handler ends) is injected only at the next exit, up to a
 * host tick (~1 ms) after STI/IRET in ring 0, but at once on the return to
 * ring 3.  A ring-0 wait loop plus a 1 kHz PIT at the 8259's top priority
 * lets IRQ 0 win every one of those late injections (see README).
 */
static u64 waiter(u64 unused)
{
	(void)unused;
	u32 n = want_n;
	u64 hz = tsc_hz();
	u64 end = rdtsc() + 3 * hz;
	raised_n = lost_raise_n = 0;
	while ((count[0] < n || count[4] < n || count[8] < n) && (s64)(rdtsc() - end) < 0) {
		if (raised_n < n) {
			u32 want = count[ISA_IRQ_COM1] + 1;
			com1_raise();
			raised_n++;
			u64 limit = rdtsc() + hz;
			while (count[ISA_IRQ_COM1] < want && (s64)(rdtsc() - limit) < 0)
				pause();
			if (count[ISA_IRQ_COM1] < want) {
				lost_raise_n = raised_n;
				break;
			}
		} else {
			pause();
		}
	}
	return 0;
}

static void round_(u8 mbase, u8 sbase, u32 n)
{
	prev_m = base_m;
	prev_s = base_s;
	base_m = mbase;
	base_s = sbase;
	late = 0;
	for (unsigned i = 0; i < 16; i++)
		count[i] = isr_bad[i] = 0;
	rtc_nopf = unexpected = 0;
	for (unsigned v = 0; v < 8; v++) {
		set_handler(mbase + v, handler);
		set_handler(sbase + v, handler);
	}
	pic_init(mbase, sbase);
	(void)rtc_ack();
	pit_periodic((u16)(PIT_INPUT_HZ / 1000));
	rtc_periodic(6);
	for (unsigned i = 0; i < NIRQ; i++)
		pic_unmask_irq(irqs[i]);

	u64 hz = tsc_hz();
	want_n = n;
	u64 t0 = rdtsc();
	enter_ring3_irq(waiter, 0, true);
	u32 raised = raised_n, lost_raise = lost_raise_n;
	u64 t1 = rdtsc();
	u16 irr_end = pic_irr(), isr_end = pic_isr(), imr_end = pic_imr();
	u8 c_end = rtc_read(RTC_REG_C);
	if (lost_raise)
		printf("pic-mode: at the time-out: 8259 IRR 0x%04x ISR 0x%04x IMR 0x%04x, RTC C 0x%02x, COM1 IIR 0x%02x\n",
		       irr_end, isr_end, imr_end, c_end, inb(COM1_IIR));
	pic_disable();
	pit_stop();
	rtc_write(RTC_REG_B, rtc_read(RTC_REG_B) & ~RTC_B_PIE);
	enter_ring3_irq(drain, 2000, true);	/* ring 3: see waiter() */

	u32 c0 = count[ISA_IRQ_PIT], c4 = count[ISA_IRQ_COM1], c8 = count[ISA_IRQ_RTC];
	printf("pic-mode: bases 0x%02x/0x%02x: IRQ0 -> 0x%02x x%u, IRQ4 -> 0x%02x x%u (%u raises), "
	       "IRQ8 -> 0x%02x x%u, %lu ms\n", mbase, sbase, mbase, c0, mbase + 4, c4, raised,
	       sbase, c8, (t1 - t0) * 1000 / hz);
	if (late)
		printf("pic-mode: %u late interrupts on the previous round's vectors\n", late);
	if (unexpected)
		fail("bases 0x%02x/0x%02x: %u interrupts on other vectors (last 0x%02x)", mbase, sbase,
		     unexpected, unexpected_vec);
	for (unsigned i = 0; i < NIRQ; i++)
		if (isr_bad[irqs[i]])
			fail("bases 0x%02x/0x%02x: IRQ %u: 8259 in-service bit not set in %u handlers "
			     "(ISR 0x%04x)", mbase, sbase, irqs[i], isr_bad[irqs[i]], isr_seen_bad);
	if (lost_raise)
		fail("bases 0x%02x/0x%02x: COM1 raise #%u not delivered within 1 s", mbase, sbase,
		     lost_raise);
	if (c4 != raised)
		fail("bases 0x%02x/0x%02x: COM1 raised %u times, delivered %u", mbase, sbase, raised, c4);
	if (rtc_nopf)
		fail("bases 0x%02x/0x%02x: %u RTC interrupts without PF in register C", mbase, sbase,
		     rtc_nopf);
	if (c0 < n || c8 < n)
		fail("bases 0x%02x/0x%02x: want %u of each, got IRQ0 %u, IRQ8 %u in 3 s", mbase, sbase,
		     n, c0, c8);
	for (unsigned i = 1; i < ncpu; i++)
		if (ap_got[i])
			fail("cpu %u received %u interrupts (ExtINT goes to the BSP only)", i, ap_got[i]);
}

void guest_main(void)
{
	u32 n = (u32)cmdline_uint("n", 30);
	ncpu = cpu_count();
	if (ncpu > KIT_MAX_CPUS)
		ncpu = KIT_MAX_CPUS;
	outb(COM1_IER, 0);
	unsigned pins = ioapic_pins(), unmasked = 0;
	for (unsigned p = 0; p < pins; p++)
		if (!(ioapic_get_entry(p) & IOAPIC_MASKED))
			unmasked++;
	if (unmasked)
		fail("%u of %u I/O APIC entries unmasked at start (want all masked, as at reset)",
		     unmasked, pins);
	if (!rtc_present())
		fail("no RTC at ports 0x70/0x71 (register D = 0x%02x)", rtc_read(RTC_REG_D));
	rtc_periodic_stop();
	tsc_hz();
	if (ncpu > 1) {
		for (unsigned v = 0x20; v < 0xff; v++)
			set_handler(v, handler);
		unsigned aps = smp_start_aps(ap_main);	/* enables the BSP's LAPIC */
		if (aps != ncpu - 1)
			fail("%u of %u APs started", aps, ncpu - 1);
	}
	u32 svr = lapic_read(LAPIC_SVR), lint0 = lapic_read(LAPIC_LVT_LINT0);
	printf("pic-mode: %u I/O APIC entries masked; BSP LAPIC %s, LINT0 0x%05x (%s); ELCR 0x%04x\n",
	       pins, (svr & 0x100) ? "enabled" : "software-disabled", lint0,
	       (lint0 & (LAPIC_LVT_MASKED | 0x700)) == 0x700 ? "ExtINT" : "not ExtINT", elcr_read());
	round_(0x20, 0x28, n);
	round_(0x50, 0x68, n);
	printf("pic-mode: %u of each IRQ per round through the 8259s, vectors = base + irq, "
	       "in-service bits set, %s\n", n, ncpu > 1 ? "nothing on the APs" : "one CPU");
	pass();
}
