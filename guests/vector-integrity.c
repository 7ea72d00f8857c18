/*
 * vector-integrity: N interrupts (default 10000, "n=" on the command line)
 * spread evenly over eight vectors, all taken by the BSP: self-IPIs sent by
 * the BSP from ring 3 (interrupts on) and, with more than one CPU, fixed IPIs
 * sent by every AP (from ring 3) to the BSP.  Each vector arrives through its
 * own IDT gate; the handler counts per vector and checks the vector's ISR bit.
 *
 * A LAPIC holds at most one pending (IRR) instance of a vector, so two sends
 * of the same vector racing each other may legitimately merge.  Senders
 * therefore claim a vector (busy flag) before sending it and the handler
 * releases it: at most one instance of each vector is in flight, and every
 * send must produce exactly one interrupt.  (The LAPIC also serves the
 * highest pending vector first, so 0x20 may wait while others keep coming;
 * the time-out is on overall progress.)
 *
 * The APs send from ring 0 and, when no vector is free, sleep in HLT until
 * a 100 us one-shot LAPIC timer: spinning APs would take host CPUs from the
 * BSP, which does all the (emulated, on PVM hosts) interrupt handling.
 */
#include "kit.h"

static const u8 vectors[] = { 0x20, 0x21, 0x30, 0x41, 0x80, 0xa5, 0xee, 0xfe };
#define NV ARRAY_SIZE(vectors)

static volatile u32 busy[NV];
static volatile u32 sent[NV], received[NV];
static volatile u32 isr_seen, total_received;
static volatile u32 timed_out;
static u32 quota[KIT_MAX_CPUS][NV];	/* [sender][vector index] */
static u8 slot_of[256];
static unsigned nsenders;
static u32 bsp_apic;
static volatile u32 go, senders_done;

static void handler(struct frame *f)
{
	unsigned v = (unsigned)f->vector;
	unsigned i = slot_of[v];
	received[i]++;
	total_received++;
	if (lapic_vector_bit(LAPIC_ISR, (u8)v))
		isr_seen++;
	busy[i] = 0;
	lapic_eoi();
}

#define V_WAKE 0xf1

static void wake_handler(struct frame *f)
{
	(void)f;
	lapic_eoi();
}

/* Sends this sender's quota, one claimed vector at a time: the BSP from
 * ring 3 with interrupts on (self-IPIs), APs from ring 0 (IPIs to the BSP). */
static u64 sender(u64 idx)
{
	u32 left[NV], total = 0;
	for (unsigned i = 0; i < NV; i++)
		total += left[i] = quota[idx][i];
	while (!go)
		pause();
	u64 hz = tsc_hz();
	u32 seen = total_received;
	u64 deadline = rdtsc() + 3 * hz;
	while (total) {
		bool progress = false;
		for (unsigned i = 0; i < NV; i++) {
			if (!left[i] || busy[i] || atomic_xchg(&busy[i], 1))
				continue;
			if (idx == 0)
				lapic_self_ipi(vectors[i]);
			else
				lapic_send_ipi(bsp_apic, vectors[i]);
			atomic_inc(&sent[i]);
			left[i]--;
			total--;
			progress = true;
		}
		if (total_received != seen) {
			seen = total_received;
			deadline = rdtsc() + 3 * hz;	/* the BSP is still taking them */
		} else if (timed_out || (s64)(rdtsc() - deadline) >= 0) {
			timed_out = 1;
			break;
		}
		if (!progress && idx != 0) {
			lapic_timer_oneshot(V_WAKE, 100000, LAPIC_DIV_1);	/* 100 us at 1 GHz */
			__asm__ volatile("sti; hlt; cli" ::: "memory");
		}
	}
	atomic_inc(&senders_done);
	return 0;
}

static void ap_main(unsigned idx)
{
	sender(idx);
}

void guest_main(void)
{
	u32 n = (u32)cmdline_uint("n", 10000);
	unsigned ncpu = cpu_count();
	if (ncpu > KIT_MAX_CPUS)
		ncpu = KIT_MAX_CPUS;
	nsenders = ncpu;
	for (unsigned i = 0; i < NV; i++) {
		u32 per_vec = n / NV + (i < n % NV);
		for (unsigned s = 0; s < nsenders; s++)
			quota[s][i] = per_vec / nsenders + (s < per_vec % nsenders);
		slot_of[vectors[i]] = (u8)i;
		set_handler(vectors[i], handler);
	}
	set_handler(V_WAKE, wake_handler);
	lapic_enable();
	lapic_mask_lint0();	/* nothing from the PIC (SeaBIOS runs the PIT) */
	bsp_apic = lapic_id();
	unsigned aps = smp_start_aps(ap_main);
	if (aps != ncpu - 1)
		fail("%u of %u APs started", aps, ncpu - 1);

	u64 t0 = rdtsc();
	go = 1;
	enter_ring3_irq(sender, 0, true);
	/* Wait, halted with interrupts on, for the APs and the last interrupts. */
	u64 end = rdtsc() + 30 * tsc_hz();
	while (senders_done < nsenders && !timed_out && (s64)(rdtsc() - end) < 0) {
		lapic_timer_oneshot(V_WAKE, 1000000, LAPIC_DIV_1);	/* 1 ms */
		__asm__ volatile("sti; hlt; cli" ::: "memory");
	}
	lapic_timer_stop();
	sti();
	u32 tot_sent = 0, tot_recv = 0;
	end = rdtsc() + tsc_hz();
	for (;;) {
		tot_sent = tot_recv = 0;
		for (unsigned i = 0; i < NV; i++) {
			tot_sent += sent[i];
			tot_recv += received[i];
		}
		if (tot_recv >= tot_sent || (s64)(rdtsc() - end) >= 0)
			break;
		pause();
	}
	u64 t1 = rdtsc();
	tsc_delay_us(10000);	/* late duplicates */
	cli();

	u32 lost = 0, dup = 0;
	tot_recv = 0;
	for (unsigned i = 0; i < NV; i++) {
		u32 want = n / NV + (i < n % NV);
		tot_recv += received[i];
		if (received[i] < sent[i])
			lost += sent[i] - received[i];
		else
			dup += received[i] - sent[i];
		if (sent[i] != want || received[i] != want)
			printf("vector-integrity: vector 0x%02x: want %u, sent %u, received %u\n",
			       vectors[i], want, sent[i], received[i]);
	}
	u64 us = (t1 - t0) * 1000000 / tsc_hz();
	printf("vector-integrity: %u sent, %u received, %u lost, %u duplicated\n",
	       tot_sent, tot_recv, lost, dup);
	printf("vector-integrity: %u vectors, %u sender(s) (BSP self-IPIs%s), %lu ms, %lu us per interrupt\n",
	       (unsigned)NV, nsenders, nsenders > 1 ? " + APs' IPIs" : "", us / 1000,
	       tot_recv ? us / tot_recv : 0);
	/* Informational: on PVM hosts the in-kernel LAPIC never shows the
	 * vector in ISR (nor PPR) while its handler runs. */
	printf("vector-integrity: ISR bit set in %u of %u handlers\n", isr_seen, tot_recv);
	if (timed_out)
		fail("senders timed out (a vector stayed in flight)");
	if (lost || dup || tot_sent != n || tot_recv != n)
		fail("%u lost, %u duplicated, %u of %u sent", lost, dup, tot_sent, n);
	pass();
}
