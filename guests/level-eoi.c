/*
 * level-eoi: a level-triggered I/O APIC line is delivered again after the
 * EOI while its source still asserts it, and not once the source let go.
 *
 * The source is the RTC's periodic interrupt (IRQ 8 follows IRQF as a level
 * until register C is read, or until PIE is cleared), on I/O APIC pin 8
 * programmed level triggered, active high, vector 0x58, fixed delivery to
 * the last CPU (the BSP with one CPU), which runs the three phases in ring
 * 0 and waits in "sti; hlt" (1 ms LAPIC one-shot timer):
 *
 *   A  no EOI:  the handler neither EOIs nor drops the source.  Remote IRR
 *               holds the line: exactly 1 delivery in 20 ms.  The source is
 *               then dropped (PIE off, register C read) and the EOI sent.
 *   B  EOI, source held: the handler EOIs without touching the RTC: the
 *               line must come again, `n=` times (default 10); the n-th
 *               handler drops the source before its EOI: then no more.
 *   C  source dropped before the EOI: `n=` raises (PIE on, one at a time);
 *               the handler clears PIE, reads register C (IRQF must be
 *               set), EOIs: exactly one delivery per raise, none after.
 *
 * Remote IRR must read set in every handler (before its EOI) and clear at
 * the end of each phase.  The handlers also note the vector's TMR (must be
 * set: level), ISR (informational) and IRR bits: a vector already pending
 * again in IRR before its handler sent any EOI means the EOI happened at
 * delivery.  On PVM hosts the in-kernel LAPIC never sets ISR and EOIs at
 * delivery: phase A then sees the line again and again without any EOI; the
 * guest says so ("host LAPIC EOIs level interrupts at delivery") and fails.
 */
#include "kit.h"

#define V_LEVEL		0x58
#define V_WAKE		0xf0
#define PIN		ISA_IRQ_RTC
#define CAP_A		20	/* phase A: give up holding the line after this many */

enum { PHASE_NONE, PHASE_A, PHASE_B, PHASE_C };

static volatile u32 phase, n_want;
static volatile u32 deliveries, rirr_set, tmr_set, isr_set, irr_pending, irqf_clear;
static volatile u32 handlers_total;
static volatile u32 done;
static volatile u32 wakeups, waits;	/* the target CPU's progress, for a timeout report */

struct result {
	u32 deliveries, rirr_set, irqf_clear, rirr_left;
};
static struct result res[4];
static u32 raises_c;

/* Drops the RTC's IRQ 8 for good: reads register C (returned: IRQF shows
 * whether the line was up), clears PIE, reads C again (a period that ended
 * in between). */
static u8 drop_source(void)
{
	u8 c = rtc_read(RTC_REG_C);
	rtc_write(RTC_REG_B, rtc_read(RTC_REG_B) & ~RTC_B_PIE);
	(void)rtc_read(RTC_REG_C);
	return c;
}

static void handler(struct frame *f)
{
	(void)f;
	u32 n = ++deliveries;
	handlers_total++;
	if (lapic_vector_bit(LAPIC_TMR, V_LEVEL))
		tmr_set++;
	if (lapic_vector_bit(LAPIC_ISR, V_LEVEL))
		isr_set++;
	if (lapic_vector_bit(LAPIC_IRR, V_LEVEL))
		irr_pending++;
	if (ioapic_remote_irr(PIN))
		rirr_set++;
	switch (phase) {
	case PHASE_A:		/* no EOI */
		if (n >= CAP_A)
			(void)drop_source();
		break;
	case PHASE_B:		/* EOI with the source held, until the n-th */
		if (n >= n_want)
			(void)drop_source();
		lapic_eoi();
		break;
	case PHASE_C:		/* source dropped first */
		if (!(drop_source() & RTC_C_IRQF))
			irqf_clear++;
		lapic_eoi();
		break;
	default:
		(void)drop_source();
		lapic_eoi();
	}
}

static void wake_handler(struct frame *f)
{
	(void)f;
	wakeups++;
	lapic_eoi();
}

/* Halts with interrupts on for `us`, or until deliveries reaches `until`. */
static void wait_us(u64 us, u32 until)
{
	u64 end = rdtsc() + us * (tsc_hz() / 1000000);
	while ((s64)(rdtsc() - end) < 0 && deliveries < until) {
		waits++;
		lapic_timer_oneshot(V_WAKE, 1000000, LAPIC_DIV_1);	/* 1 ms at KVM's 1 GHz */
		__asm__ volatile("sti; hlt; cli" ::: "memory");
	}
	lapic_timer_stop();
}

static void begin(u32 ph)
{
	deliveries = rirr_set = irqf_clear = 0;
	(void)drop_source();
	phase = ph;
}

/* Lets a delivery still in flight land (on a loaded host it can arrive
 * milliseconds after the phase's last wait) before remote IRR is judged:
 * up to 200 ms, with interrupts on. */
static void settle(void)
{
	for (int i = 0; i < 200 && ioapic_remote_irr(PIN); i++)
		wait_us(1000, ~0u);
}

static void end(u32 ph)
{
	settle();
	res[ph].deliveries = deliveries;
	res[ph].rirr_set = rirr_set;
	res[ph].irqf_clear = irqf_clear;
	res[ph].rirr_left = ioapic_remote_irr(PIN);
	phase = PHASE_NONE;
}

/* Runs on the target CPU, ring 0, interrupts off between waits. */
static void run_phases(void)
{
	u32 n = n_want;
	ioapic_route(PIN, V_LEVEL, (u8)lapic_id(), IOAPIC_LEVEL);

	/* A: no EOI at all. */
	begin(PHASE_A);
	rtc_periodic(6);			/* 1024 Hz: first raise within ~1 ms */
	wait_us(500000, 1);
	wait_us(20000, CAP_A);
	(void)drop_source();
	lapic_eoi();				/* ends the one (correct LAPIC) in service */
	wait_us(5000, ~0u);
	end(PHASE_A);

	/* B: EOI with the source held. */
	begin(PHASE_B);
	rtc_periodic(6);
	wait_us(500000, n);
	wait_us(20000, ~0u);			/* none after the n-th */
	end(PHASE_B);

	/* C: source dropped before the EOI, n raises. */
	begin(PHASE_C);
	raises_c = 0;
	for (u32 i = 0; i < n; i++) {
		u32 before = deliveries;
		rtc_periodic(6);
		raises_c++;
		wait_us(500000, before + 1);
		if (deliveries == before)
			break;
		wait_us(5000, ~0u);		/* a second delivery would show */
	}
	end(PHASE_C);
	ioapic_mask(PIN);
	(void)drop_source();
}

static void ap_main(unsigned idx)
{
	if (idx == cpu_count() - 1 || idx == KIT_MAX_CPUS - 1) {
		run_phases();
		done = 1;
	}
}

void guest_main(void)
{
	n_want = (u32)cmdline_uint("n", 10);
	if (n_want < 2)
		n_want = 2;
	unsigned ncpu = cpu_count();
	if (ncpu > KIT_MAX_CPUS)
		ncpu = KIT_MAX_CPUS;
	set_handler(V_LEVEL, handler);
	set_handler(V_WAKE, wake_handler);
	lapic_enable();
	lapic_mask_lint0();
	pic_disable();
	ioapic_mask_all();
	tsc_hz();
	if (!rtc_present())
		fail("no RTC at ports 0x70/0x71 (register D = 0x%02x)", rtc_read(RTC_REG_D));
	(void)drop_source();
	unsigned aps = smp_start_aps(ap_main);
	if (aps != ncpu - 1)
		fail("%u of %u APs started", aps, ncpu - 1);
	unsigned target = ncpu - 1;
	if (target == 0) {
		run_phases();
	} else {
		/* The phases take about 6 s at worst; a loaded host stretches that. */
		u64 end_t = rdtsc() + 30 * tsc_hz();
		while (!done && (s64)(rdtsc() - end_t) < 0) {
			lapic_timer_oneshot(V_WAKE, 1000000, LAPIC_DIV_1);
			__asm__ volatile("sti; hlt; cli" ::: "memory");
		}
		lapic_timer_stop();
		if (!done)
			fail("cpu %u did not finish the phases: phase %u, %u deliveries, %u waits, "
			     "%u wake-ups, %u handlers", target, phase, deliveries, waits, wakeups,
			     handlers_total);
	}

	u32 n = n_want;
	printf("level-eoi: RTC IRQ 8 -> pin 8, level, vector 0x%x, cpu %u (APIC ID %u)\n", V_LEVEL,
	       target, cpu_apic_id(target));
	printf("level-eoi: A no EOI, source held: %u deliveries in 20 ms (want 1), remote IRR set in %u\n",
	       res[PHASE_A].deliveries, res[PHASE_A].rirr_set);
	printf("level-eoi: B EOI, source held: %u deliveries (want %u), remote IRR set in %u\n",
	       res[PHASE_B].deliveries, n, res[PHASE_B].rirr_set);
	printf("level-eoi: C source dropped, then EOI: %u deliveries for %u raises (want %u), "
	       "%u found IRQF clear, remote IRR set in %u\n", res[PHASE_C].deliveries, raises_c, n,
	       res[PHASE_C].irqf_clear, res[PHASE_C].rirr_set);
	printf("level-eoi: in %u handlers: TMR set %u, ISR set %u, vector pending again in IRR %u\n",
	       handlers_total, tmr_set, isr_set, irr_pending);

	if (res[PHASE_A].deliveries == 0 || res[PHASE_B].deliveries == 0 || res[PHASE_C].deliveries == 0)
		fail("the level-triggered RTC line was not delivered (A %u, B %u, C %u)",
		     res[PHASE_A].deliveries, res[PHASE_B].deliveries, res[PHASE_C].deliveries);
	if (res[PHASE_A].deliveries > 1 && isr_set == 0) {
		printf("level-eoi: host LAPIC does not hold level interrupts until EOI (ISR never set; "
		       "redelivered %u times without any EOI)\n", res[PHASE_A].deliveries - 1);
		/* What the rest of the machine did, given EOIs at delivery: every
		 * raise taken once with the line up, extras only after it fell. */
		u32 real_c = res[PHASE_C].deliveries - res[PHASE_C].irqf_clear;
		bool consistent = (res[PHASE_B].deliveries == n || res[PHASE_B].deliveries == n + 1) &&
				  real_c == n && res[PHASE_C].irqf_clear <= n &&
				  !res[PHASE_A].rirr_left && !res[PHASE_B].rirr_left && !res[PHASE_C].rirr_left;
		printf("level-eoi: given EOI at delivery, the I/O APIC side is %s: B %u (n or n+1), "
		       "C %u raises taken with IRQF set, %u extra with the line already low, "
		       "remote IRR clear at the end %s\n", consistent ? "consistent" : "NOT consistent",
		       res[PHASE_B].deliveries, real_c, res[PHASE_C].irqf_clear,
		       (res[PHASE_A].rirr_left || res[PHASE_B].rirr_left || res[PHASE_C].rirr_left) ? "no" : "yes");
		fail("host LAPIC EOIs level interrupts at delivery: A %u deliveries without EOI (want 1), "
		     "B %u (want %u), C %u for %u raises",
		     res[PHASE_A].deliveries, res[PHASE_B].deliveries, n, res[PHASE_C].deliveries, n);
	}
	if (res[PHASE_A].deliveries != 1)
		fail("A: %u deliveries without EOI, want 1 (remote IRR must hold a level line)",
		     res[PHASE_A].deliveries);
	if (res[PHASE_B].deliveries != n)
		fail("B: %u deliveries, want %u (%s)", res[PHASE_B].deliveries, n,
		     res[PHASE_B].deliveries < n ? "not redelivered after EOI with the line still asserted"
						 : "delivered after the source was dropped");
	if (raises_c != n || res[PHASE_C].deliveries != n)
		fail("C: %u deliveries for %u raises, want %u", res[PHASE_C].deliveries, raises_c, n);
	if (tmr_set != handlers_total)
		fail("TMR bit clear in %u of %u handlers (level vector)", handlers_total - tmr_set,
		     handlers_total);
	for (unsigned p = PHASE_A; p <= PHASE_C; p++) {
		if (res[p].rirr_set != res[p].deliveries)
			fail("phase %c: remote IRR clear in %u of %u handlers", 'A' + p - 1,
			     res[p].deliveries - res[p].rirr_set, res[p].deliveries);
		if (res[p].rirr_left)
			fail("phase %c: remote IRR still set after the last EOI", 'A' + p - 1);
	}
	pass();
}
