/*
 * nmi: the BSP sends NMI IPIs (ICR delivery mode NMI, physical destination) to every AP,
 * which waits for them in ring 3 with interrupts on, then in ring 0 with interrupts off
 * (an NMI is not maskable by IF), and counts them in its #NMI handler.  Every NMI must
 * arrive exactly once: this is how Linux's RCU stall detector and its all-CPU backtraces
 * reach the other CPUs.  Prints "nmi: cpu N got K/K (ring 3) K/K (ring 0, IF=0)", PASS.
 */
#include "kit.h"

#define ROUNDS		8
#define ICR_NMI		(4u << 8)
#define ICR_ASSERT	(1u << 14)

static volatile u32 got[KIT_MAX_CPUS];
static volatile u32 phase_done[KIT_MAX_CPUS];
static volatile u32 sent;

static void on_nmi(struct frame *f)
{
	(void)f;
	got[cpu_index()]++;
}

/* Waits until `want` NMIs arrived or the sender gave up (20 s). */
static u32 wait_for(unsigned me, u32 want)
{
	u64 deadline = rdtsc() + 20 * tsc_hz();
	while (got[me] < want && rdtsc() < deadline)
		pause();
	return got[me];
}

static u64 ring3_wait(u64 me)
{
	return wait_for((unsigned)me, ROUNDS);
}

static void ap_main(unsigned me)
{
	u32 in_ring3 = (u32)enter_ring3_irq(ring3_wait, me, true);
	phase_done[me] = 1;
	cli();
	u32 total = wait_for(me, 2 * ROUNDS);
	printf("nmi: cpu %u got %u/%u (ring 3) %u/%u (ring 0, IF=0)\n", me, in_ring3, ROUNDS,
	       total - in_ring3, ROUNDS);
	phase_done[me] = 2;
}

/* One NMI to each AP at a time, the next once it arrived: NMIs sent faster than a CPU
 * takes them may be merged (one can be pending), which is not what is measured here. */
static void send_round(unsigned ncpu, u32 base)
{
	for (unsigned r = 1; r <= ROUNDS; r++) {
		for (unsigned c = 1; c < ncpu; c++) {
			lapic_send_icr(cpu_apic_id(c), ICR_NMI | ICR_ASSERT);
			u64 deadline = rdtsc() + 2 * tsc_hz();
			while (got[c] < base + r && rdtsc() < deadline)
				pause();
		}
	}
}

void guest_main(void)
{
	set_handler(2, on_nmi);
	lapic_enable();
	unsigned ncpu = smp_start_aps(ap_main) + 1;
	printf("nmi: %u CPUs\n", ncpu);
	send_round(ncpu, 0);
	for (unsigned c = 1; c < ncpu; c++)
		while (phase_done[c] < 1)
			pause();
	send_round(ncpu, ROUNDS);
	while (smp_aps_finished() < ncpu - 1)
		pause();
	for (unsigned c = 1; c < ncpu; c++)
		if (got[c] != 2 * ROUNDS)
			fail("nmi: cpu %u got %u NMIs, expected %u", c, got[c], 2 * ROUNDS);
	pass();
}
