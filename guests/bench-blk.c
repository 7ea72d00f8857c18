/*
 * bench-blk: the guest side of the virtio-blk benchmark (bench/bench.py --only blk).
 * Drives the first virtio-blk device with the kit's driver, in ring 3 with
 * interrupts on, one queue, completions by MSI-X, and times each measurement
 * with the TSC:
 *
 *   seqwrite   `seq_bs=` (262144) byte writes, in order over the region, `seq_qd=` (4) in flight
 *   seqread    the same, reads
 *   randread   4 KiB reads at random 4 KiB-aligned offsets of the region, depth 1 then 32
 *   randwrite  4 KiB writes, the same way
 *
 * (`tests=` picks them, e.g. `tests=randread1,randread32`; the default runs all six, in
 * the order above.)  With `queues=2` (VIRTIO_BLK_F_MQ) `randread32x2` and `randwrite32x2`
 * keep 32 requests in flight on each of two queues, both driven by this vCPU: the queues'
 * interrupts are armed together and the wait ends with either.  Before the first measurement the whole region — `mib=` (64)
 * MiB from sector `start=` (0) — is written once with `seq_bs` writes and flushed, so that
 * reads hit allocated blocks.  Random offsets come from a xorshift64* generator seeded
 * with `seed=` (1) at the start of every measurement: every VMM sees the same sequence.
 *
 * A measurement keeps `qd` requests in flight: it submits `qd`, then waits for the used
 * ring (virtq_wait: arms the interrupt, waits for the MSI-X handler's count to move; with
 * `wait=hlt` in `sti; hlt`), reaps every completed request and submits one new request
 * for each, until `ms=` (1000) ms of TSC time are over or `max_n=` requests were
 * submitted; then it drains.  It prints, per measurement (`reps=` (1) times each),
 *
 *   blk: test=<name> qd=<d> [queues=<q> ]bs=<bytes> rep=<k> n=<requests> cycles=<tsc> irqs=<i> kicks=<k> waits=<w>
 *
 * (qd: in flight per queue; queues= only for the two-queue tests; counts summed over queues)
 * (irqs: MSI-X interrupts taken, kicks: doorbell writes, waits: waits that ended with an
 * interrupt), a FLUSH at the end, then PASS.  Other parameters: `segs=` (1) data
 * descriptors per request, `indirect=0`, `event_idx=0`, `timeout_ms=5000` per wait,
 * `max_n=` requests at most per measurement.
 */
#include "kit.h"

#define VECTOR_BASE	0x40
#define MAX_DEPTH	64		/* requests in flight, all queues together */
#define MAX_QUEUES	2
#define WAKE_VECTOR	0xef		/* the kit's halt bound (wait=hlt installs it) */
#define WAKE_COUNT	2000000u
#define SECTOR		512UL
#define MIB		(1024UL * 1024)
#define RAND_BS		4096U

struct job {
	const char *key;	/* in tests= */
	const char *name;	/* in the output */
	u32 type;		/* VIRTIO_BLK_T_IN / _OUT */
	bool random;
	unsigned qd;		/* per queue; 0: seq_qd */
	unsigned queues;
};

static const struct job jobs[] = {
	{ "seqwrite", "seqwrite", VIRTIO_BLK_T_OUT, false, 0, 1 },
	{ "seqread", "seqread", VIRTIO_BLK_T_IN, false, 0, 1 },
	{ "randread1", "randread", VIRTIO_BLK_T_IN, true, 1, 1 },
	{ "randread32", "randread", VIRTIO_BLK_T_IN, true, 32, 1 },
	{ "randwrite1", "randwrite", VIRTIO_BLK_T_OUT, true, 1, 1 },
	{ "randwrite32", "randwrite", VIRTIO_BLK_T_OUT, true, 32, 1 },
	{ "randread32x2", "randread", VIRTIO_BLK_T_IN, true, 32, 2 },
	{ "randwrite32x2", "randwrite", VIRTIO_BLK_T_OUT, true, 32, 2 },
};
#define JOB_COUNT	(sizeof(jobs) / sizeof(jobs[0]))

static struct blk_dev blk;
static struct virtq *q;			/* queue 0 */
static struct blk_req *reqs;
static u8 *bufs[MAX_DEPTH];
static u64 region_start, region_bytes, seq_bs, seq_qd, budget_ms, max_n, seed, reps;
static u64 timeout_us;
static unsigned segs, nqueues;
static bool halt_waits;

/* ---- the offset sequence ---- */

struct cursor {
	u64 rng;		/* xorshift64* state */
	u64 next_seq;		/* byte offset of the next sequential request */
};

static u64 xorshift64s(u64 *s)
{
	u64 x = *s;
	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	*s = x;
	return x * 0x2545f4914f6cdd1dULL;
}

/* Sector of the next request of `bs` bytes. */
static u64 next_sector(struct cursor *c, bool random, u32 bs)
{
	u64 slots = region_bytes / bs, off;
	if (random) {
		off = (xorshift64s(&c->rng) >> 11) % slots * bs;
	} else {
		off = c->next_seq;
		c->next_seq = off + bs >= slots * bs ? 0 : off + bs;
	}
	return region_start + off / SECTOR;
}

/* ---- one measurement ---- */

struct run {
	const struct job *job;
	struct cursor cur;
	u32 bs;
	unsigned qd;		/* per queue: slot i belongs to queue i / qd */
	u64 deadline, limit;	/* no new request after the deadline or `limit` requests */
	u64 submitted;
};

static void submit(struct run *run, unsigned slot)
{
	struct virtq *vq = blk.q[slot / run->qd];
	u64 sector = next_sector(&run->cur, run->job->random, run->bs);
	if (blk_submit(vq, &reqs[slot], run->job->type, sector, bufs[slot], run->bs, segs) < 0)
		fail("bench-blk: queue %u full at slot %u", vq->index, slot);
	run->submitted++;
}

/* Submits a new request in `slot` unless the time is up. */
static void resubmit(struct run *run, unsigned slot)
{
	if ((s64)(rdtsc() - run->deadline) < 0 && run->submitted < run->limit)
		submit(run, slot);
}

/* Reaps queue `qi`: checks each completion, resubmits in its slot; how many completed. */
static unsigned reap(struct run *run, unsigned qi)
{
	unsigned k = 0;
	u32 len;
	struct blk_req *r;
	while ((r = virtq_get(blk.q[qi], &len))) {
		if (r->status != VIRTIO_BLK_S_OK)
			fail("bench-blk: request at sector %lu: %s", r->hdr.sector,
			     blk_status_name(r->status));
		resubmit(run, (unsigned)(r - reqs));
		k++;
	}
	return k;
}

static bool any_used(unsigned nq)
{
	for (unsigned qi = 0; qi < nq; qi++)
		if (virtq_has_used(blk.q[qi]))
			return true;
	return false;
}

static u32 irq_count(unsigned nq)
{
	u32 n = 0;
	for (unsigned qi = 0; qi < nq; qi++)
		n += blk.q[qi]->irqs;
	return n;
}

/* Ring 0, interrupts off: halts until an interrupt (at most ~2 ms) unless one came. */
static u64 halt_unless(u64 seen)
{
	if (irq_count(nqueues) != (u32)seen)
		return 0;
	lapic_timer_oneshot(WAKE_VECTOR, WAKE_COUNT, LAPIC_DIV_1);
	__asm__ volatile("sti; hlt; cli" ::: "memory");
	return 0;
}

/* Several queues: arms every queue's interrupt, re-checks, then waits for any of them
 * (the kit's virtq_wait waits for one queue). */
static void wait_any(unsigned nq, u64 *waits)
{
	struct timeout t;
	timeout_start(&t, timeout_us);
	while (!any_used(nq)) {
		for (unsigned qi = 0; qi < nq; qi++)
			virtq_irq_enable(blk.q[qi], true);
		__asm__ volatile("mfence" ::: "memory");
		u32 seen = irq_count(nq);
		if (any_used(nq))
			return;
		while (irq_count(nq) == seen) {
			if (timeout_expired(&t))
				fail("bench-blk: timeout with %u queues", nq);
			if (halt_waits)
				ring0_call(halt_unless, seen);
			else
				pause();
		}
		(*waits)++;
	}
}

static void wait_used(unsigned nq, u64 inflight, u64 *waits)
{
	if (nq > 1) {
		wait_any(nq, waits);
		return;
	}
	int w = virtq_wait(q, timeout_us);
	if (w <= 0)
		fail("bench-blk: %s with %lu requests in flight", w == 0 ? "timeout" : "NEEDS_RESET",
		     inflight);
}

static void kick_all(unsigned nq)
{
	for (unsigned qi = 0; qi < nq; qi++)
		virtq_kick(blk.q[qi]);
}

struct counts { u64 irqs, kicks, waits; };

static struct counts counts(unsigned nq, u64 own_waits)
{
	struct counts c = { 0, 0, own_waits };
	for (unsigned qi = 0; qi < nq; qi++) {
		c.irqs += blk.q[qi]->irqs;
		c.kicks += blk.q[qi]->kicks;
		c.waits += blk.q[qi]->waits_irq;
	}
	return c;
}

/* Keeps run->qd requests in flight on each of `nq` queues until resubmit() stops, then
 * drains them. */
static void drive(struct run *run, unsigned nq, u64 *waits)
{
	for (unsigned i = 0; i < run->qd * nq; i++)
		resubmit(run, i);
	u64 inflight = run->submitted;
	kick_all(nq);
	while (inflight) {
		wait_used(nq, inflight, waits);
		u64 before = run->submitted;
		for (unsigned qi = 0; qi < nq; qi++)
			inflight -= reap(run, qi);
		inflight += run->submitted - before;
		kick_all(nq);
	}
}

static void measure(const struct job *job, u64 rep)
{
	unsigned nq = job->queues;
	struct run run = { job, { seed, 0 }, job->random ? RAND_BS : (u32)seq_bs,
			   job->qd ? job->qd : (unsigned)seq_qd, 0, max_n, 0 };
	u64 waits = 0;
	struct counts c0 = counts(nq, 0);
	u64 t0 = rdtsc();
	run.deadline = t0 + budget_ms * (tsc_hz() / 1000);
	drive(&run, nq, &waits);
	u64 cycles = rdtsc() - t0;
	struct counts c1 = counts(nq, waits);
	char queues[16] = "";
	if (nq > 1)
		snprintf(queues, sizeof(queues), " queues=%u", nq);
	printf("blk: test=%s qd=%u%s bs=%u rep=%lu n=%lu cycles=%lu irqs=%lu kicks=%lu waits=%lu\n",
	       job->name, run.qd, queues, run.bs, rep, run.submitted, cycles, c1.irqs - c0.irqs,
	       c1.kicks - c0.kicks, c1.waits - c0.waits);
}

/* ---- set-up ---- */

/* Writes the whole region once (seq_bs requests, seq_qd in flight), then FLUSH. */
static void fill(void)
{
	static const struct job write_all = { "fill", "fill", VIRTIO_BLK_T_OUT, false, 0, 1 };
	u64 t0 = rdtsc(), waits = 0;
	struct run run = { &write_all, { seed, 0 }, (u32)seq_bs, (unsigned)seq_qd, t0 + (1ULL << 62),
			   region_bytes / seq_bs, 0 };
	drive(&run, 1, &waits);
	int st = blk_sync(q, VIRTIO_BLK_T_FLUSH, 0, NULL, 0, 1, timeout_us);
	if (st != VIRTIO_BLK_S_OK)
		fail("bench-blk: FLUSH after the fill: %s", blk_status_name(st));
	printf("bench-blk: region written: %lu MiB in %lu ms\n", region_bytes / MIB,
	       (rdtsc() - t0) / (tsc_hz() / 1000));
}

/* Fills every request buffer with a pattern that differs per slot (what writes carry). */
static void alloc_buffers(unsigned depth, u64 bytes)
{
	reqs = blk_req_alloc(depth);
	for (unsigned i = 0; i < depth; i++) {
		bufs[i] = dma_alloc(bytes, 4096);
		u64 *w = (u64 *)bufs[i];
		for (u64 k = 0; k < bytes / 8; k++)
			w[k] = (k * 0x9e3779b97f4a7c15ULL) ^ ((u64)i << 56);
	}
}

static void start_device(void)
{
	if (!virtio_open(&blk.vd, VIRTIO_ID_BLOCK, 0))
		fail("bench-blk: no usable virtio-blk device");
	u64 wanted = VIRTIO_BIT(VIRTIO_BLK_F_FLUSH);	/* else write-through in both VMMs */
	if (cmdline_uint("indirect", 1))
		wanted |= VIRTIO_BIT(VIRTIO_F_INDIRECT_DESC);
	if (cmdline_uint("event_idx", 1))
		wanted |= VIRTIO_BIT(VIRTIO_F_EVENT_IDX);
	if (nqueues > 1)
		wanted |= VIRTIO_BIT(VIRTIO_BLK_F_MQ);
	if (!blk_start(&blk, wanted, nqueues, 0, true, NULL, VECTOR_BASE))
		fail("bench-blk: virtio-blk start-up failed");
	if (blk.nq != nqueues)
		fail("bench-blk: queues=%u but the device gave %u", nqueues, blk.nq);
	if (!blk.irq)
		fail("bench-blk: the device has no MSI-X: interrupt-driven completion is required");
	if (!virtio_has(&blk.vd, VIRTIO_BLK_F_FLUSH))
		fail("bench-blk: FLUSH not offered: writes would be write-through");
	q = blk.q[0];
	u32 per_req = q->indirect ? 1 : segs + 2;
	u64 depth = seq_qd > 32 ? seq_qd : 32;
	for (unsigned qi = 0; qi < nqueues; qi++)
		if (depth * per_req > blk.q[qi]->size)
			fail("bench-blk: %lu requests of %u descriptors do not fit queue %u's size %u",
			     depth, per_req, qi, blk.q[qi]->size);
}

static bool wanted_test(const struct job *job)
{
	if (job->queues > nqueues)
		return false;
	const char *key = job->key;
	size_t len;
	const char *list = cmdline_arg("tests", &len);
	if (!list)
		return true;
	size_t k = strlen(key);
	for (size_t i = 0; i < len;) {
		size_t j = i;
		while (j < len && list[j] != ',')
			j++;
		if (j - i == k && !strncmp(list + i, key, k))
			return true;
		i = j + 1;
	}
	return false;
}

static u64 bench(u64 unused)
{
	(void)unused;
	start_device();
	u64 region_end = region_start * SECTOR + region_bytes;
	if (region_end > blk.capacity * SECTOR)
		fail("bench-blk: region [%lu, %lu) MiB beyond the disk's %lu MiB",
		     region_start * SECTOR / MIB, region_end / MIB, blk.capacity * SECTOR / MIB);
	unsigned slots = 32 * nqueues;
	alloc_buffers(seq_qd > slots ? (unsigned)seq_qd : slots, seq_bs);
	printf("bench-blk: capacity %lu MiB, %u queue(s) of size %u%s%s, region %lu MiB at sector "
	       "%lu, %lu ms per measurement, seq %lu bytes x %lu in flight, %u data descriptor(s)%s\n",
	       blk.capacity * SECTOR / MIB, nqueues, q->size, q->indirect ? ", indirect" : "",
	       q->event_idx ? ", event-idx" : "", region_bytes / MIB, region_start, budget_ms,
	       seq_bs, seq_qd, segs, halt_waits ? ", waits halt" : "");
	if (cmdline_uint("fill", 1))
		fill();
	for (u64 rep = 0; rep < reps; rep++)
		for (unsigned j = 0; j < JOB_COUNT; j++)
			if (wanted_test(&jobs[j]))
				measure(&jobs[j], rep);
	int st = blk_sync(q, VIRTIO_BLK_T_FLUSH, 0, NULL, 0, 1, timeout_us);
	if (st != VIRTIO_BLK_S_OK)
		fail("bench-blk: final FLUSH: %s", blk_status_name(st));
	struct counts c = counts(nqueues, 0);
	u64 completions = 0;
	for (unsigned qi = 0; qi < nqueues; qi++)
		completions += blk.q[qi]->completions;
	printf("bench-blk: %lu completions, %lu interrupts, %lu doorbells\n", completions, c.irqs,
	       c.kicks);
	return 0;
}

void guest_main(void)
{
	region_start = cmdline_uint("start", 0);
	region_bytes = cmdline_uint("mib", 64) * MIB;
	seq_bs = cmdline_uint("seq_bs", 262144);
	seq_qd = cmdline_uint("seq_qd", 4);
	budget_ms = cmdline_uint("ms", 1000);
	max_n = cmdline_uint("max_n", ~0UL);
	seed = cmdline_uint("seed", 1);
	reps = cmdline_uint("reps", 1);
	segs = (unsigned)cmdline_uint("segs", 1);
	timeout_us = cmdline_uint("timeout_ms", 5000) * 1000;
	nqueues = (unsigned)cmdline_uint("queues", 1);
	size_t len;
	const char *w = cmdline_arg("wait", &len);
	halt_waits = w && len == 3 && !strncmp(w, "hlt", 3);	/* virtio_open installs the wake-up */
	if (nqueues < 1 || nqueues > MAX_QUEUES)
		fail("bench-blk: queues=%u: 1 to %u", nqueues, MAX_QUEUES);
	if (seq_bs < RAND_BS || seq_bs % RAND_BS || seq_bs > 4 * MIB)
		fail("bench-blk: seq_bs=%lu: a multiple of 4096 up to 4 MiB", seq_bs);
	if (seq_qd < 1 || seq_qd > MAX_DEPTH || !seed || !region_bytes || segs < 1 || segs > 16)
		fail("bench-blk: seq_qd 1-%u, seed and mib non-zero, segs 1-16", MAX_DEPTH);
	if (region_bytes % seq_bs)
		fail("bench-blk: mib=%lu is not a multiple of seq_bs", region_bytes / MIB);
	tsc_hz();
	lapic_enable();
	lapic_mask_lint0();
	pic_disable();
	enter_ring3_irq(bench, 0, true);
	pass();
}
