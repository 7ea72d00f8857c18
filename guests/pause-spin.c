/*
 * pause-spin: does the BSP keep getting its timer interrupts while the
 * other vCPUs spin on PAUSE?
 *
 * The BSP's LAPIC timer runs periodic (vector 0x30, initial count "count="
 * at divide 1, default 1000000: 1 kHz with KVM's 1 GHz APIC bus).  The BSP
 * waits in ring 3 with interrupts on and counts ticks over a fixed TSC
 * interval ("ms=", default 300) twice: first with the APs not started
 * (parked in wait-for-SIPI), then with every AP spinning on PAUSE in ring 3.
 * ("ring0" on the command line: the APs spin in ring 0 instead.)
 * PASS if the second rate is at least a quarter of the first ("min_pct=",
 * default 25) in one of "attempts=" (default 3) measurements with the APs
 * spinning: the host's other load can take the BSP's CPU for part of one
 * interval, which a fair VMM cannot prevent, while a VMM that starves the
 * BSP loses the ticks in every interval.  A VMM that
 * lets spinning vCPUs starve the others (no PAUSE-loop exiting / yielding
 * on a host with fewer CPUs than vCPUs) loses most ticks; a fair one loses
 * at most the share the spinners take (on a 2-CPU host with 4 vCPUs the BSP
 * gets about half a CPU, and KVM merges ticks that expire while a vCPU is
 * descheduled).
 */
#include "kit.h"

#define V_TIMER 0x30

static volatile u32 ticks;
static volatile u32 spinning, stop;

static void timer_handler(struct frame *f)
{
	(void)f;
	ticks++;
	lapic_eoi();
}

/* Ring 3, interrupts on: count ticks over `cycles` TSC cycles. */
static u64 measure(u64 cycles)
{
	u32 start = ticks;
	u64 end = rdtsc() + cycles;
	while ((s64)(rdtsc() - end) < 0)
		pause();
	return ticks - start;
}

static u64 spin(u64 arg)
{
	(void)arg;
	atomic_inc(&spinning);
	while (!stop)
		pause();
	return 0;
}

static bool spin_ring0;

static void ap_main(unsigned idx)
{
	(void)idx;
	if (spin_ring0)
		spin(0);	/* every PAUSE emulated on PVM hosts */
	else
		enter_ring3(spin, 0);
}

void guest_main(void)
{
	u32 count = (u32)cmdline_uint("count", 1000000);
	u64 ms = cmdline_uint("ms", 300);
	u64 min_pct = cmdline_uint("min_pct", 25);
	spin_ring0 = cmdline_arg("ring0", NULL) != NULL;
	unsigned n = cpu_count();

	set_handler(V_TIMER, timer_handler);
	lapic_enable();
	lapic_mask_lint0();	/* nothing from the PIC (SeaBIOS runs the PIT) */
	u64 hz = tsc_hz();
	u64 cycles = hz / 1000 * ms;

	lapic_timer_periodic(V_TIMER, count, LAPIC_DIV_1);
	enter_ring3_irq(measure, hz / 20, true);	/* settle */
	u64 t1 = enter_ring3_irq(measure, cycles, true);

	unsigned aps = smp_start_aps(ap_main);
	if (aps != n - 1)
		fail("%u of %u APs started", aps, n - 1);
	u64 end = rdtsc() + 2 * hz;
	while (spinning < aps && (s64)(rdtsc() - end) < 0)
		pause();
	if (spinning < aps)
		fail("only %u of %u APs spinning", spinning, aps);
	u64 attempts = cmdline_uint("attempts", 3), tried = 0, t2 = 0;
	while (tried < attempts && (tried == 0 || t2 * 100 < t1 * min_pct)) {
		u64 t = enter_ring3_irq(measure, cycles, true);
		t2 = t > t2 ? t : t2;
		tried++;
	}
	stop = 1;
	lapic_timer_stop();

	u64 r1 = t1 * 1000 / ms, r2 = t2 * 1000 / ms;
	u64 ratio = r1 ? r2 * 100 / r1 : 0;
	printf("pause-spin: idle rate %lu/s, with %u APs spinning %lu/s (best of %lu), "
	       "ratio %lu.%02lu\n", r1, aps, r2, tried, ratio / 100, ratio % 100);
	if (!r1)
		fail("no timer interrupts at all");
	if (ratio < min_pct)
		fail("timer rate fell below %lu%% with %u APs spinning%s", min_pct, aps,
		     spin_ring0 ? " in ring 0" : "");
	pass();
}
