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
 * (`tests=` picks and orders them, e.g. `tests=randread1,randread32`; the default runs all
 * six in the order above.)  Before the first measurement the whole region — `mib=` (64)
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
 *   blk: test=<name> qd=<d> bs=<bytes> rep=<k> n=<requests> cycles=<tsc> irqs=<i> kicks=<k> waits=<w>
 *
 * (irqs: MSI-X interrupts taken, kicks: doorbell writes, waits: waits that ended with an
 * interrupt), a FLUSH at the end, then PASS.  Other parameters: `segs=` (1) data
 * descriptors per request, `indirect=0`, `event_idx=0`, `timeout_ms=5000` per wait.
 */
#include "kit.h"

#define VECTOR_BASE	0x40
#define MAX_DEPTH	64
#define SECTOR		512UL
#define MIB		(1024UL * 1024)
#define RAND_BS		4096U

struct job {
	const char *key;	/* in tests= */
	const char *name;	/* in the output */
	u32 type;		/* VIRTIO_BLK_T_IN / _OUT */
	bool random;
	unsigned qd;		/* 0: seq_qd */
};

static const struct job jobs[] = {
	{ "seqwrite", "seqwrite", VIRTIO_BLK_T_OUT, false, 0 },
	{ "seqread", "seqread", VIRTIO_BLK_T_IN, false, 0 },
	{ "randread1", "randread", VIRTIO_BLK_T_IN, true, 1 },
	{ "randread32", "randread", VIRTIO_BLK_T_IN, true, 32 },
	{ "randwrite1", "randwrite", VIRTIO_BLK_T_OUT, true, 1 },
	{ "randwrite32", "randwrite", VIRTIO_BLK_T_OUT, true, 32 },
};
#define JOB_COUNT	(sizeof(jobs) / sizeof(jobs[0]))

static struct blk_dev blk;
static struct virtq *q;
static struct blk_req *reqs;
static u8 *bufs[MAX_DEPTH];
static u64 region_start, region_bytes, seq_bs, seq_qd, budget_ms, max_n, seed, reps;
static u64 timeout_us;
static unsigned segs;

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

static void submit(unsigned slot, u32 type, u64 sector, u32 bs)
{
	if (blk_submit(q, &reqs[slot], type, sector, bufs[slot], bs, segs) < 0)
		fail("bench-blk: queue full at slot %u", slot);
}

/* Waits for at least one completion; for each, checks its status and calls back. */
static unsigned reap(unsigned inflight, void (*done)(unsigned slot, void *ctx), void *ctx)
{
	int w = virtq_wait(q, timeout_us);
	if (w <= 0)
		fail("bench-blk: %s with %u requests in flight", w == 0 ? "timeout" : "NEEDS_RESET",
		     inflight);
	unsigned k = 0;
	u32 len;
	struct blk_req *r;
	while ((r = virtq_get(q, &len))) {
		if (r->status != VIRTIO_BLK_S_OK)
			fail("bench-blk: request at sector %lu: %s", r->hdr.sector,
			     blk_status_name(r->status));
		done((unsigned)(r - reqs), ctx);
		k++;
	}
	return k;
}

struct run {
	const struct job *job;
	struct cursor cur;
	u32 bs;
	u64 deadline, submitted;
};

static void resubmit(unsigned slot, void *ctx)
{
	struct run *run = ctx;
	if ((s64)(rdtsc() - run->deadline) >= 0 || run->submitted >= max_n)
		return;
	submit(slot, run->job->type, next_sector(&run->cur, run->job->random, run->bs), run->bs);
	run->submitted++;
}

static void measure(const struct job *job, u64 rep)
{
	unsigned qd = job->qd ? job->qd : (unsigned)seq_qd;
	struct run run = { job, { seed, 0 }, job->random ? RAND_BS : (u32)seq_bs, 0, 0 };
	u32 irqs0 = q->irqs;
	u64 kicks0 = q->kicks, waits0 = q->waits_irq;
	u64 t0 = rdtsc();
	run.deadline = t0 + budget_ms * (tsc_hz() / 1000);
	for (unsigned i = 0; i < qd; i++)
		resubmit(i, &run);
	u64 inflight = run.submitted;
	virtq_kick(q);
	while (inflight) {
		u64 before = run.submitted;
		inflight -= reap((unsigned)inflight, resubmit, &run);
		inflight += run.submitted - before;
		virtq_kick(q);
	}
	u64 cycles = rdtsc() - t0;
	printf("blk: test=%s qd=%u bs=%u rep=%lu n=%lu cycles=%lu irqs=%u kicks=%lu waits=%lu\n",
	       job->name, qd, run.bs, rep, run.submitted, cycles, q->irqs - irqs0, q->kicks - kicks0,
	       q->waits_irq - waits0);
}

/* ---- set-up ---- */

static void count_done(unsigned slot, void *ctx)
{
	(void)slot;
	(*(u64 *)ctx)++;
}

/* Writes the whole region once (seq_bs requests, seq_qd in flight), then FLUSH. */
static void fill(void)
{
	struct cursor cur = { seed, 0 };
	u64 total = region_bytes / seq_bs, sent = 0, done = 0;
	u64 t0 = rdtsc();
	while (done < total) {
		for (unsigned i = 0; i < seq_qd && sent < total; i++, sent++)
			submit(i, VIRTIO_BLK_T_OUT, next_sector(&cur, false, (u32)seq_bs), (u32)seq_bs);
		virtq_kick(q);
		u64 batch_done = 0;
		while (done + batch_done < sent)
			reap((unsigned)(sent - done - batch_done), count_done, &batch_done);
		done += batch_done;
	}
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
	if (!blk_start(&blk, wanted, 1, 0, true, NULL, VECTOR_BASE))
		fail("bench-blk: virtio-blk start-up failed");
	if (!blk.irq)
		fail("bench-blk: the device has no MSI-X: interrupt-driven completion is required");
	if (!virtio_has(&blk.vd, VIRTIO_BLK_F_FLUSH))
		fail("bench-blk: FLUSH not offered: writes would be write-through");
	q = blk.q[0];
	u32 per_req = q->indirect ? 1 : segs + 2;
	u64 depth = seq_qd > 32 ? seq_qd : 32;
	if (depth * per_req > q->size)
		fail("bench-blk: %lu requests of %u descriptors do not fit queue size %u", depth,
		     per_req, q->size);
}

static bool wanted_test(const char *key)
{
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
	alloc_buffers(seq_qd > 32 ? (unsigned)seq_qd : 32, seq_bs);
	printf("bench-blk: capacity %lu MiB, queue size %u%s%s, region %lu MiB at sector %lu, "
	       "%lu ms per measurement, seq %lu bytes x %lu in flight, %u data descriptor(s)\n",
	       blk.capacity * SECTOR / MIB, q->size, q->indirect ? ", indirect" : "",
	       q->event_idx ? ", event-idx" : "", region_bytes / MIB, region_start, budget_ms,
	       seq_bs, seq_qd, segs);
	if (cmdline_uint("fill", 1))
		fill();
	for (u64 rep = 0; rep < reps; rep++)
		for (unsigned j = 0; j < JOB_COUNT; j++)
			if (wanted_test(jobs[j].key))
				measure(&jobs[j], rep);
	int st = blk_sync(q, VIRTIO_BLK_T_FLUSH, 0, NULL, 0, 1, timeout_us);
	if (st != VIRTIO_BLK_S_OK)
		fail("bench-blk: final FLUSH: %s", blk_status_name(st));
	printf("bench-blk: %lu completions, %u interrupts, %lu doorbells\n", q->completions, q->irqs,
	       q->kicks);
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
