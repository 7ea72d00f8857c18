/*
 * ipi: every CPU sends, from ring 3 with interrupts on,
 *   - a fixed physical IPI to every CPU including itself (vector 0x40 + sender),
 *   - a self-shorthand IPI (0x60 + sender),
 *   - an all-excluding-self broadcast (0x80 + sender);
 * the BSP also sends a flat-logical IPI to every CPU (0xa0; logical ID
 * 1 << cpu_index(), first 8 CPUs) and an all-including-self broadcast (0xa1).
 * Receivers count per (sender, receiver); every IPI must arrive exactly once.
 */
#include "kit.h"

#define V_PAIR	0x40
#define V_SELF	0x60
#define V_BCAST	0x80
#define V_LOGICAL 0xa0
#define V_ALL	0xa1
#define MAXC	KIT_MAX_CPUS

static volatile u32 pair[MAXC][MAXC];	/* [sender][receiver] */
static volatile u32 selfc[MAXC];
static volatile u32 bcast[MAXC][MAXC];
static volatile u32 logical[MAXC], allincl[MAXC];
static volatile u32 received[MAXC];
static volatile u32 stray;
static unsigned ncpu;
static smp_barrier_t bar = SMP_BARRIER_INIT;

static void handler(struct frame *f)
{
	unsigned me = cpu_index();
	unsigned v = (unsigned)f->vector;
	if (v >= V_PAIR && v < V_PAIR + MAXC)
		pair[v - V_PAIR][me]++;
	else if (v >= V_SELF && v < V_SELF + MAXC)
		selfc[me]++;
	else if (v >= V_BCAST && v < V_BCAST + MAXC)
		bcast[v - V_BCAST][me]++;
	else if (v == V_LOGICAL)
		logical[me]++;
	else if (v == V_ALL)
		allincl[me]++;
	else
		stray++;
	received[me]++;
	lapic_eoi();
}

static unsigned expected_per_cpu(unsigned me)
{
	return ncpu + 1 + (ncpu - 1) + (me < 8) + 1;
}

/* Ring 3, interrupts on. */
static u64 worker(u64 me)
{
	smp_barrier_wait(&bar, ncpu);
	for (unsigned j = 0; j < ncpu; j++)
		lapic_send_ipi(cpu_apic_id(j), (u8)(V_PAIR + me));
	lapic_self_ipi((u8)(V_SELF + me));
	lapic_broadcast_ipi((u8)(V_BCAST + me), 0);
	if (me == 0) {
		u8 mask = ncpu >= 8 ? 0xff : (u8)((1u << ncpu) - 1);
		lapic_send_ipi_logical(mask, V_LOGICAL);
		lapic_broadcast_ipi(V_ALL, 1);
	}
	u64 end = rdtsc() + 2 * tsc_hz();
	while (received[me] < expected_per_cpu((unsigned)me) && (s64)(rdtsc() - end) < 0)
		pause();
	/* Linger a little so that duplicates would show. */
	u64 linger = rdtsc() + tsc_hz() / 100;
	while ((s64)(rdtsc() - linger) < 0)
		pause();
	smp_barrier_wait(&bar, ncpu);
	return 0;
}

static void cpu_setup(unsigned idx)
{
	if (idx < 8)
		lapic_set_logical_id((u8)(1u << idx));
}

static void ap_main(unsigned idx)
{
	cpu_setup(idx);
	enter_ring3_irq(worker, idx, true);
}

void guest_main(void)
{
	ncpu = cpu_count();
	if (ncpu > MAXC)
		ncpu = MAXC;
	for (unsigned v = V_PAIR; v < V_PAIR + MAXC; v++) {
		set_handler(v, handler);
		set_handler(v + (V_SELF - V_PAIR), handler);
		set_handler(v + (V_BCAST - V_PAIR), handler);
	}
	set_handler(V_LOGICAL, handler);
	set_handler(V_ALL, handler);
	lapic_enable();
	lapic_mask_lint0();	/* nothing from the PIC (SeaBIOS runs the PIT) */
	cpu_setup(0);
	unsigned aps = smp_start_aps(ap_main);
	if (aps != ncpu - 1)
		fail("%u of %u APs started", aps, ncpu - 1);
	u64 t0 = rdtsc();
	enter_ring3_irq(worker, 0, true);
	u64 t1 = rdtsc();

	unsigned bad = 0, npair = 0, nself = 0, nb = 0, nlog = 0, nall = 0;
	for (unsigned s = 0; s < ncpu; s++) {
		for (unsigned r = 0; r < ncpu; r++) {
			if (pair[s][r] != 1 && bad++ < 10)
				printf("ipi: %u -> %u fixed: received %u times\n", s, r, pair[s][r]);
			npair += pair[s][r];
			u32 want = s != r;
			if (bcast[s][r] != want && bad++ < 10)
				printf("ipi: %u -> %u broadcast: received %u times, want %u\n", s, r,
				       bcast[s][r], want);
			nb += bcast[s][r];
		}
		if (selfc[s] != 1 && bad++ < 10)
			printf("ipi: cpu %u self shorthand: received %u times\n", s, selfc[s]);
		nself += selfc[s];
		if (logical[s] != (s < 8) && bad++ < 10)
			printf("ipi: cpu %u logical: received %u times\n", s, logical[s]);
		nlog += logical[s];
		if (allincl[s] != 1 && bad++ < 10)
			printf("ipi: cpu %u all-including-self: received %u times\n", s, allincl[s]);
		nall += allincl[s];
	}
	if (stray)
		fail("%u interrupts on unexpected vectors", stray);
	if (bad)
		fail("%u (sender, receiver, kind) entries wrong", bad);
	unsigned pairs_ne = npair - ncpu;
	printf("ipi: %u pair IPIs, %u self IPIs (%u physical + %u shorthand), "
	       "%u broadcasts x %u receivers, logical x %u, all-including-self x %u, all delivered once\n",
	       pairs_ne, ncpu + nself, ncpu, nself, ncpu, ncpu - 1, nlog, nall);
	printf("ipi: %u IPIs in %lu us\n", npair + nself + nb + nlog + nall,
	       (t1 - t0) * 1000000 / tsc_hz());
	pass();
}
