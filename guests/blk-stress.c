/*
 * blk-stress: many virtio-blk requests in flight on several queues, each
 * queue driven by its own vCPU in ring 3 and completing by MSI-X on that
 * vCPU, every sector read back and verified.  Built to keep going across a
 * pause, a snapshot/restore or a live migration.
 *
 * Region: `sectors=4096` sectors at `start=0`, split into equal contiguous
 * shares, one per queue (`queues=2`; VIRTIO_BLK_F_MQ; fewer if the device
 * has fewer).  Queue q belongs to CPU q % W (W = min(vCPUs, queues)); its
 * MSI-X entry q + 1 sends vector 0x51 + q to that CPU (entry 0, config
 * changes, 0x50 to the BSP); the handler checks it runs on the owner.
 *
 * Sector contents (512 bytes, self-describing): u64 magic "FVSTRESS",
 * u64 sector number, u64 generation, 60 xorshift words seeded from (sector,
 * generation), CRC-32 of bytes 0-507 in bytes 508-511.  Round r (1, 2, ...)
 * writes generation gen0 + r - 1 (`gen0=1`).  A queue works through its
 * share in batches of `depth=32` sectors: `depth` one-sector writes in
 * flight (split over 1-2 descriptors), then `depth` reads, each verified
 * (magic, sector, generation, CRC).  After every round, all CPUs meet, a
 * FLUSH goes out on queue 0 and the BSP prints
 *
 *   stress: round <r> ok: <q> queues x <n> sectors, <d> in flight, <ms> ms
 *
 * `rounds=4` rounds (0: forever), then a summary line and PASS.  Any error:
 *   stress: queue <q> sector <s>: <what> ...   and   FAIL: ...
 *
 * `check=1`: no writes; reads the region (same queues and depth) and checks
 * every sector is intact and names itself; per share the generations must
 * read G up to some point and G - 1 after it (a ragged edge of `depth`
 * sectors allowed: writes of one batch complete in any order; G - 1 = 0
 * means never written, all zeroes), which is what an interrupted run leaves;
 * `gen=G` demands generation G everywhere (a finished run).  Prints
 *   stress: check: queue <q> sectors [<a>, <b>): <n> at generation <G>[, <m> at <G-1>]
 *
 * Other parameters: `irq=0` polls, `indirect=0`, `event_idx=0`,
 * `timeout_ms=10000` per wait (guest time: a paused VM does not count).
 */
#include "kit.h"

#define VECTOR_BASE	0x50
#define MAX_QUEUES	4
#define MAX_DEPTH	64
#define MAGIC		0x5353455254535646ULL	/* "FVSTRESS" */
#define WORDS		(BLK_SECTOR / 8)

struct queue_state {
	struct virtq *q;
	unsigned owner;			/* CPU index */
	u64 first, count;		/* share */
	struct blk_req *reqs;		/* depth requests */
	u8 *wbuf, *rbuf;		/* depth sectors each */
	u64 requests;
	volatile u32 wrong_cpu;
	u64 at_gen, at_prev;		/* check mode: sectors per generation */
	u64 top;			/* check mode: newest generation in the share */
} __attribute__((aligned(64)));

static struct blk_dev blk;
static struct queue_state qs[MAX_QUEUES];
static unsigned nq, nworkers, depth;
static u64 rounds, gen0, timeout_us;
static bool check_mode;
static volatile u32 go;
static smp_barrier_t round_barrier = SMP_BARRIER_INIT;
static volatile u32 workers_done;
static u32 crc_table[256];

static void check_generations(unsigned qi, const u64 *gens);
static void summary(void);

/* ---- the sector pattern ---- */

static void crc_init(void)
{
	for (u32 i = 0; i < 256; i++) {
		u32 c = i;
		for (int k = 0; k < 8; k++)
			c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
		crc_table[i] = c;
	}
}

static u32 crc32(const u8 *p, size_t n)
{
	u32 c = ~0u;
	while (n--)
		c = crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
	return ~c;
}

static void pattern(u8 *buf, u64 sector, u64 gen)
{
	u64 *w = (u64 *)buf;
	u64 x = (sector * 0x9e3779b97f4a7c15ULL) ^ (gen * 0xc2b2ae3d27d4eb4fULL) ^ MAGIC;
	w[0] = MAGIC;
	w[1] = sector;
	w[2] = gen;
	for (unsigned i = 3; i < WORDS; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		w[i] = x;
	}
	u32 c = crc32(buf, BLK_SECTOR - 4);
	memcpy(buf + BLK_SECTOR - 4, &c, 4);
}

static bool all_zero(const u8 *p)
{
	for (unsigned i = 0; i < BLK_SECTOR; i++)
		if (p[i])
			return false;
	return true;
}

/* 0 if intact (generation in *gen), else a description. */
static const char *inspect(const u8 *buf, u64 sector, u64 *gen)
{
	const u64 *w = (const u64 *)buf;
	u32 c;
	memcpy(&c, buf + BLK_SECTOR - 4, 4);
	if (w[0] != MAGIC)
		return all_zero(buf) ? "all zeroes" : "bad magic";
	if (crc32(buf, BLK_SECTOR - 4) != c)
		return "bad CRC";
	if (w[1] != sector)
		return "names another sector";
	*gen = w[2];
	return NULL;
}

static NORETURN void bad_sector(unsigned qi, u64 sector, const char *what, const u8 *buf)
{
	const u64 *w = (const u64 *)buf;
	console_lock();
	printf("stress: queue %u sector %lu: %s (words 0x%lx 0x%lx 0x%lx)\n", qi, sector, what,
	       w[0], w[1], w[2]);
	fail("queue %u sector %lu: %s", qi, sector, what);
}

/* ---- requests ---- */

static void wait_all(struct queue_state *s, unsigned qi, unsigned n, const char *what)
{
	for (unsigned i = 0; i < n; i++) {
		while (!s->reqs[i].done) {
			int w = virtq_wait(s->q, timeout_us);
			if (w <= 0)
				fail("queue %u: %s batch: %s (%u of %u done)", qi, what,
				     w == 0 ? "timeout" : "device needs reset", i, n);
			blk_reap(s->q);
		}
		if (s->reqs[i].status != VIRTIO_BLK_S_OK)
			fail("queue %u: %s of sector %lu: %s", qi, what, s->reqs[i].tag,
			     blk_status_name(s->reqs[i].status));
	}
}

static void submit(struct queue_state *s, unsigned i, u32 type, u64 sector, u8 *buf)
{
	s->reqs[i].tag = sector;
	if (blk_submit(s->q, &s->reqs[i], type, sector, buf, BLK_SECTOR, 1 + (i & 1)) < 0)
		fail("queue %u full at request %u of %u", s->q->index, i, depth);
	s->requests++;
}

/* Writes and verifies sectors [at, at + n) of queue qi's share. */
static void batch_write_read(unsigned qi, u64 at, unsigned n, u64 gen)
{
	struct queue_state *s = &qs[qi];
	for (unsigned i = 0; i < n; i++) {
		pattern(s->wbuf + i * BLK_SECTOR, at + i, gen);
		submit(s, i, VIRTIO_BLK_T_OUT, at + i, s->wbuf + i * BLK_SECTOR);
	}
	virtq_kick(s->q);
	wait_all(s, qi, n, "write");
	for (unsigned i = n; i-- > 0;) {	/* reverse order: a different mix */
		memset(s->rbuf + i * BLK_SECTOR, 0xee, BLK_SECTOR);
		submit(s, i, VIRTIO_BLK_T_IN, at + i, s->rbuf + i * BLK_SECTOR);
	}
	virtq_kick(s->q);
	wait_all(s, qi, n, "read");
	for (unsigned i = 0; i < n; i++) {
		u64 g = 0;
		const u8 *b = s->rbuf + i * BLK_SECTOR;
		const char *err = inspect(b, at + i, &g);
		if (err)
			bad_sector(qi, at + i, err, b);
		if (g != gen) {
			console_lock();
			printf("stress: queue %u sector %lu: generation %lu, expected %lu\n", qi, at + i,
			       g, gen);
			fail("queue %u sector %lu: generation %lu, expected %lu", qi, at + i, g, gen);
		}
	}
}

/* Check mode: reads [at, at + n) and tallies generations against `top`. */
static void batch_check(unsigned qi, u64 at, unsigned n, u64 *gens)
{
	struct queue_state *s = &qs[qi];
	for (unsigned i = 0; i < n; i++)
		submit(s, i, VIRTIO_BLK_T_IN, at + i, s->rbuf + i * BLK_SECTOR);
	virtq_kick(s->q);
	wait_all(s, qi, n, "read");
	for (unsigned i = 0; i < n; i++) {
		const u8 *b = s->rbuf + i * BLK_SECTOR;
		u64 g = 0;
		const char *err = inspect(b, at + i, &g);
		if (err && !all_zero(b))
			bad_sector(qi, at + i, err, b);
		gens[at + i - s->first] = err ? 0 : g;	/* zeroes: never written */
	}
}

/* ---- workers ---- */

static bool owns(unsigned cpu, unsigned qi) { return qs[qi].owner == cpu; }

/* One pass over the shares of this CPU's queues, a batch of each in turn. */
static void pass_over_shares(unsigned cpu, u64 gen, u64 **gens)
{
	for (u64 off = 0;; off += depth) {
		bool any = false;
		for (unsigned qi = 0; qi < nq; qi++) {
			struct queue_state *s = &qs[qi];
			if (!owns(cpu, qi) || off >= s->count)
				continue;
			unsigned n = s->count - off < depth ? (unsigned)(s->count - off) : depth;
			if (check_mode)
				batch_check(qi, s->first + off, n, gens[qi]);
			else
				batch_write_read(qi, s->first + off, n, gen);
			any = true;
		}
		if (!any)
			return;
	}
}

static u64 ms_since(u64 t0) { return (rdtsc() - t0) / (tsc_hz() / 1000); }

static void end_of_round(unsigned cpu, u64 r, u64 t0)
{
	smp_barrier_wait(&round_barrier, nworkers);
	if (cpu != 0)
		return;
	if (virtio_has(&blk.vd, VIRTIO_BLK_F_FLUSH)) {
		int st = blk_sync(qs[0].q, VIRTIO_BLK_T_FLUSH, 0, NULL, 0, 1, timeout_us);
		if (st != VIRTIO_BLK_S_OK)
			fail("flush after round %lu: %s", r, blk_status_name(st));
	}
	printf("stress: round %lu ok: %u queues x %lu sectors, %u in flight, %lu ms\n", r, nq,
	       qs[0].count, depth, ms_since(t0));
}

/* Runs in ring 3 on CPU `cpu`; the BSP's also waits for the others and
 * ends the VM. */
static u64 worker(u64 cpu)
{
	if (check_mode) {
		u64 *gens[MAX_QUEUES] = { 0 };
		for (unsigned qi = 0; qi < nq; qi++)
			if (owns((unsigned)cpu, qi))
				gens[qi] = dma_alloc(8 * qs[qi].count, 64);
		pass_over_shares((unsigned)cpu, 0, gens);
		for (unsigned qi = 0; qi < nq; qi++)
			if (gens[qi])
				check_generations(qi, gens[qi]);
	} else {
		for (u64 r = 1; rounds == 0 || r <= rounds; r++) {
			u64 t0 = rdtsc();
			pass_over_shares((unsigned)cpu, gen0 + r - 1, NULL);
			end_of_round((unsigned)cpu, r, t0);
		}
	}
	atomic_inc(&workers_done);
	if (cpu != 0)
		return 0;
	struct timeout t;
	timeout_start(&t, 5000000);
	while (workers_done < nworkers)
		if (timeout_expired(&t))
			fail("%u of %u workers finished", workers_done, nworkers);
	summary();
	pass();
}

/* Check mode: the generations of one share must read G..G, G-1..G-1 with a
 * ragged edge of at most `depth` sectors. */
static void check_generations(unsigned qi, const u64 *gens)
{
	struct queue_state *s = &qs[qi];
	u64 top = 0, want;
	bool exact = cmdline_find_uint("gen", &want);
	for (u64 i = 0; i < s->count; i++)
		if (gens[i] > top)
			top = gens[i];
	if (exact && top != want)
		fail("check: queue %u: newest generation %lu, expected %lu", qi, top, want);
	u64 last_top = 0, first_prev = s->count;
	for (u64 i = 0; i < s->count; i++) {
		if (gens[i] == top) {
			s->at_gen++;
			last_top = i;
		} else if (gens[i] + 1 == top && !exact) {
			s->at_prev++;
			if (first_prev == s->count)
				first_prev = i;
		} else {
			fail("check: queue %u sector %lu: generation %lu (newest %lu)%s", qi,
			     s->first + i, gens[i], top, exact ? ", a finished run was expected" : "");
		}
	}
	s->top = top;
	if (first_prev < s->count && last_top >= first_prev + depth)
		fail("check: queue %u: generation %lu at sector %lu but %lu already at sector %lu",
		     qi, top, s->first + last_top, top - 1, s->first + first_prev);
	console_lock();
	printf("stress: check: queue %u sectors [%lu, %lu): %lu at generation %lu", qi, s->first,
	       s->first + s->count, s->at_gen, top);
	if (s->at_prev)
		printf(", %lu at %lu%s", s->at_prev, top - 1, top == 1 ? " (never written)" : "");
	printf("\n");
	console_unlock();
}

/* ---- interrupts ---- */

static void stress_irq(struct frame *f)
{
	unsigned qi = (unsigned)f->vector - (VECTOR_BASE + 1);
	if (qi < nq) {
		atomic_inc(&qs[qi].q->irqs);
		if (cpu_index() != qs[qi].owner)
			atomic_inc(&qs[qi].wrong_cpu);
	}
	lapic_eoi();
}

static u64 install_irq(u64 vector)
{
	set_handler((unsigned)vector, stress_irq);
	return 0;
}

/* ---- set-up ---- */

static void setup_queues(u64 start, u64 sectors)
{
	u64 share = sectors / nq;
	for (unsigned qi = 0; qi < nq; qi++) {
		struct queue_state *s = &qs[qi];
		s->q = blk.q[qi];
		s->owner = qi % nworkers;
		s->first = start + qi * share;
		s->count = share;
		s->reqs = blk_req_alloc(depth);
		s->wbuf = dma_alloc((u64)depth * BLK_SECTOR, 4096);
		s->rbuf = dma_alloc((u64)depth * BLK_SECTOR, 4096);
		u32 per_req = s->q->indirect ? 1 : 4;
		if ((u32)depth * per_req > s->q->size)
			fail("depth=%u needs %u descriptors, queue %u has %u", depth, depth * per_req,
			     qi, s->q->size);
		if (blk.irq)
			ring0_call(install_irq, VECTOR_BASE + 1 + qi);
	}
}

static u64 setup(u64 arg)
{
	(void)arg;
	crc_init();
	u64 start = cmdline_uint("start", 0), sectors = cmdline_uint("sectors", 4096);
	if (!virtio_open(&blk.vd, VIRTIO_ID_BLOCK, 0))
		fail("no usable virtio-blk device");
	u64 wanted = VIRTIO_BIT(VIRTIO_BLK_F_MQ) | VIRTIO_BIT(VIRTIO_BLK_F_FLUSH);
	if (cmdline_uint("indirect", 1))
		wanted |= VIRTIO_BIT(VIRTIO_F_INDIRECT_DESC);
	if (cmdline_uint("event_idx", 1))
		wanted |= VIRTIO_BIT(VIRTIO_F_EVENT_IDX);
	unsigned ncpu = smp_cpus_online();
	unsigned want_q = (unsigned)cmdline_uint("queues", 2);
	if (want_q < 1 || want_q > MAX_QUEUES)
		fail("queues=%u: 1 to %u", want_q, MAX_QUEUES);
	u32 apic[MAX_QUEUES];
	unsigned w = ncpu < want_q ? ncpu : want_q;
	for (unsigned qi = 0; qi < want_q; qi++)
		apic[qi] = ncpu > 1 ? cpu_apic_id(qi % w) : lapic_id();
	if (!blk_start(&blk, wanted, want_q, 0, cmdline_uint("irq", 1), apic, VECTOR_BASE))
		fail("virtio-blk start-up failed");
	nq = blk.nq;
	nworkers = ncpu < nq ? ncpu : nq;
	if (nworkers != w)	/* the device has fewer queues: re-route by the final count */
		for (unsigned qi = 0; qi < nq; qi++)
			virtio_msix_route(&blk.vd, (u16)(qi + 1), cpu_apic_id(qi % nworkers),
					  (u8)(VECTOR_BASE + 1 + qi));
	if (sectors < nq || start + sectors > blk.capacity)
		fail("sectors [%lu, %lu) do not fit the capacity (%lu)", start, start + sectors,
		     blk.capacity);
	setup_queues(start, sectors);
	printf("stress: %u queue(s) (device has %u), %u CPU(s) driving them, %u in flight per queue, "
	       "%s, %s%s, sectors [%lu, %lu)\n", nq, blk.vd.num_queues, nworkers, depth,
	       blk.irq ? "MSI-X" : "polled", qs[0].q->indirect ? "indirect" : "direct",
	       qs[0].q->event_idx ? ", event-idx" : "", start, start + nq * qs[0].count);
	for (unsigned qi = 0; qi < nq && blk.irq; qi++)
		printf("stress: queue %u -> MSI-X entry %u -> vector 0x%x -> cpu %u (APIC ID %u)\n", qi,
		       qi + 1, VECTOR_BASE + 1 + qi, qs[qi].owner, cpu_apic_id(qs[qi].owner));
	if (check_mode)
		printf("stress: check mode: reading only\n");
	return 0;
}

static void summary(void)
{
	u64 total = 0;
	for (unsigned qi = 0; qi < nq; qi++) {
		struct queue_state *s = &qs[qi];
		total += s->requests;
		if (blk.irq && s->wrong_cpu)
			fail("queue %u: %u interrupts arrived on another CPU than %u", qi, s->wrong_cpu,
			     s->owner);
		if (blk.irq && s->q->missed_irqs)
			fail("queue %u: %lu completions without their MSI-X interrupt", qi,
			     s->q->missed_irqs);
		printf("stress: queue %u: %lu requests, %u interrupts on cpu %u, %lu waits ended by one\n",
		       qi, s->requests, s->q->irqs, s->owner, s->q->waits_irq);
	}
	if (check_mode) {
		u64 lo = qs[0].top, hi = qs[0].top;
		for (unsigned qi = 1; qi < nq; qi++) {
			lo = qs[qi].top < lo ? qs[qi].top : lo;
			hi = qs[qi].top > hi ? qs[qi].top : hi;
		}
		if (hi - lo > 1)	/* rounds end together on every queue */
			fail("check: newest generations %lu to %lu across queues", lo, hi);
		printf("stress: check passed: %lu sectors verified\n", nq * qs[0].count);
	}
	else
		printf("stress: %lu rounds, %lu requests, every sector read back verified\n", rounds,
		       total);
}

/* APs wait in ring 3 until the BSP has set the device up. */
static u64 ap_worker(u64 idx)
{
	while (!go)
		pause();
	return idx < nworkers ? worker(idx) : 0;
}

static void ap_main(unsigned idx)
{
	enter_ring3_irq(ap_worker, idx, true);
}

void guest_main(void)
{
	depth = (unsigned)cmdline_uint("depth", 32);
	if (depth < 1 || depth > MAX_DEPTH)
		fail("depth=%u: 1 to %u", depth, MAX_DEPTH);
	rounds = cmdline_uint("rounds", 4);
	gen0 = cmdline_uint("gen0", 1);
	check_mode = cmdline_uint("check", 0);
	timeout_us = cmdline_uint("timeout_ms", 10000) * 1000;
	tsc_hz();
	lapic_enable();
	lapic_mask_lint0();
	pic_disable();
	if (cpu_count() > 1)
		smp_start_aps(ap_main);
	enter_ring3_irq(setup, 0, true);
	go = 1;
	enter_ring3_irq(worker, 0, true);	/* ends the VM */
}
