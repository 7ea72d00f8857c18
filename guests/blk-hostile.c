/*
 * blk-hostile: malformed requests to the first virtio-blk PCI function.
 * The device must answer each one - an error status, a used element whose
 * status byte stayed unwritten, or DEVICE_NEEDS_RESET - and never hang,
 * report success for it, write into a device-readable buffer or return a
 * used element for another head; after a
 * reset and a fresh initialisation it must serve a good read again.
 *
 * Before the cases, sectors 0-15 get a pattern (the good reads compare
 * with it).  Each case starts from a freshly initialised device (one
 * queue, MSI-X config interrupt on vector 0x40 if the device has MSI-X),
 * builds its chain by hand in the descriptor table, publishes it and rings
 * the doorbell, then waits up to `case_ms=2000` ms for a used element or
 * NEEDS_RESET.  Then:
 *   - if the device answered and did not set NEEDS_RESET, a good read of
 *     sectors 0-7 on the same queue must still work (no reset);
 *   - in every case a reset (status reads 0) and re-initialisation, then a
 *     good read must work.
 * Per case one line:
 *   hostile: <case>: <outcome> -> <verdict>[; still serving][; reset: good read ok]
 * outcome: "status IOERR|UNSUPP|OK (used len <n>)", "used len <n>, status
 * unwritten", "NEEDS_RESET[ + config interrupt]", "no answer in <ms> ms";
 * verdict: "allowed", "served (tolerated)" (a success with the right data
 * where the spec sets the driver a rule but the device none; `strict=1`
 * fails it), or "WRONG: ..." (the guest fails after all cases).
 *
 * `bad_addr=0x8000000000` is the address "beyond RAM" used.  `only=NAME`
 * runs one case, `skip=NAME,NAME,...` leaves cases out.  `irq=0`: no MSI-X.
 */
#include "kit.h"

#define VECTOR_BASE	0x40
#define GOOD_SECTORS	16
#define READ_SECTORS	8
#define SCRATCH_SECTOR	64		/* writes of the cases land here, if anywhere */
#define LONG_PIECE	16		/* bytes per data descriptor in the long chain */
#define LONG_MAX_PIECES	4096		/* 1-byte pieces of 8 sectors; the table has room */

/* What a case allows besides hanging (never allowed). */
#define A_IOERR		0x01
#define A_UNSUPP	0x02
#define A_UNWRITTEN	0x04		/* used element, status byte untouched */
#define A_RESET		0x08		/* NEEDS_RESET */
#define A_SERVED	0x10		/* OK with the right data (tolerated unless strict=1) */
#define A_ERRORS	(A_IOERR | A_UNSUPP | A_UNWRITTEN | A_RESET)

enum outcome { O_USED, O_RESET, O_HANG };

struct bufs {
	struct virtio_blk_hdr *hdr;
	u8 *data;			/* READ_SECTORS sectors */
	volatile u8 *status;
	struct virtq_desc *table;	/* indirect table room */
};

struct hcase {
	const char *name;
	const char *what;
	unsigned allowed;
	bool status_readable;		/* the status byte is device-readable */
	u8 served_sectors;		/* for A_SERVED: sectors from 0 the chain reads */
	u16 (*build)(struct virtq *q, struct bufs *b);
};

static struct blk_dev blk;
static struct bufs b;
static u8 *good;			/* the pattern of sectors 0-15 */
static u64 bad_addr, case_us;
static bool strict, irq;
static unsigned n_err, n_reset, n_unwritten, n_served, n_wrong;

/* ---- chain building ---- */

static void put(struct virtq *q, u16 i, u64 addr, u32 len, u16 flags, u16 next)
{
	q->desc[i].addr = addr;
	q->desc[i].len = len;
	q->desc[i].flags = flags;
	q->desc[i].next = next;
}

#define R	0
#define W	VIRTQ_DESC_F_WRITE
#define N	VIRTQ_DESC_F_NEXT

static void hdr(u32 type, u64 sector)
{
	*b.hdr = (struct virtio_blk_hdr){ .type = type, .sector = sector };
}

/* A normal IN chain for sectors [sector, +n) at descriptors i, i+1, i+2. */
static u16 read_chain(struct virtq *q, u16 i, u64 sector, u32 n)
{
	hdr(VIRTIO_BLK_T_IN, sector);
	put(q, i, (u64)b.hdr, sizeof(*b.hdr), R | N, i + 1);
	put(q, i + 1, (u64)b.data, n * BLK_SECTOR, W | N, i + 2);
	put(q, i + 2, (u64)b.status, 1, W, 0);
	return i;
}

static u16 c_data_beyond_ram(struct virtq *q, struct bufs *x)
{
	u16 h = read_chain(q, 0, 0, 1);
	q->desc[1].addr = bad_addr;
	(void)x;
	return h;
}

static u16 c_hdr_beyond_ram(struct virtq *q, struct bufs *x)
{
	u16 h = read_chain(q, 0, 0, 1);
	q->desc[0].addr = bad_addr;
	(void)x;
	return h;
}

static u16 c_desc_loop(struct virtq *q, struct bufs *x)
{
	(void)x;
	hdr(VIRTIO_BLK_T_IN, 0);
	put(q, 0, (u64)b.hdr, sizeof(*b.hdr), R | N, 1);
	put(q, 1, (u64)b.data, BLK_SECTOR, W | N, 2);
	put(q, 2, (u64)b.data + BLK_SECTOR, BLK_SECTOR, W | N, 1);	/* back to 1 */
	return 0;
}

static u16 c_zero_len(struct virtq *q, struct bufs *x)
{
	(void)x;
	hdr(VIRTIO_BLK_T_IN, 0);
	put(q, 0, (u64)b.hdr, sizeof(*b.hdr), R | N, 1);
	put(q, 1, (u64)b.data, 0, W | N, 2);
	put(q, 2, (u64)b.data, BLK_SECTOR, W | N, 3);
	put(q, 3, (u64)b.status, 1, W, 0);
	return 0;
}

/* header + (queue size) 16-byte pieces of 8 sectors... + status: longer
 * than the queue, through one indirect table. */
static u16 c_long_indirect(struct virtq *q, struct bufs *x)
{
	u32 pieces = READ_SECTORS * BLK_SECTOR / LONG_PIECE;	/* 256 */
	if (pieces < q->size)
		pieces = q->size;	/* at least the queue size of data alone */
	if (pieces > LONG_MAX_PIECES)
		fail("long-indirect: queue size %u is beyond this test's %u", q->size, LONG_MAX_PIECES);
	struct virtq_desc *t = x->table;
	hdr(VIRTIO_BLK_T_IN, 0);
	t[0] = (struct virtq_desc){ (u64)b.hdr, sizeof(*b.hdr), R | N, 1 };
	u32 bytes = READ_SECTORS * BLK_SECTOR, piece = bytes / pieces;
	for (u32 i = 0; i < pieces; i++)
		t[1 + i] = (struct virtq_desc){ (u64)b.data + i * piece, piece, W | N, (u16)(i + 2) };
	t[1 + pieces] = (struct virtq_desc){ (u64)b.status, 1, W, 0 };
	put(q, 0, (u64)t, 16 * (pieces + 2), VIRTQ_DESC_F_INDIRECT, 0);
	return 0;
}

static u16 c_nested_indirect(struct virtq *q, struct bufs *x)
{
	struct virtq_desc *t = x->table, *inner = x->table + 16;
	hdr(VIRTIO_BLK_T_IN, 0);
	inner[0] = (struct virtq_desc){ (u64)b.data, BLK_SECTOR, W | N, 1 };
	inner[1] = (struct virtq_desc){ (u64)b.status, 1, W, 0 };
	t[0] = (struct virtq_desc){ (u64)b.hdr, sizeof(*b.hdr), R | N, 1 };
	t[1] = (struct virtq_desc){ (u64)inner, 32, VIRTQ_DESC_F_INDIRECT, 0 };
	put(q, 0, (u64)t, 32, VIRTQ_DESC_F_INDIRECT, 0);
	return 0;
}

static u16 c_indirect_bad_len(struct virtq *q, struct bufs *x)
{
	struct virtq_desc *t = x->table;
	hdr(VIRTIO_BLK_T_IN, 0);
	t[0] = (struct virtq_desc){ (u64)b.hdr, sizeof(*b.hdr), R | N, 1 };
	t[1] = (struct virtq_desc){ (u64)b.data, BLK_SECTOR, W | N, 2 };
	t[2] = (struct virtq_desc){ (u64)b.status, 1, W, 0 };
	put(q, 0, (u64)t, 3 * 16 - 8, VIRTQ_DESC_F_INDIRECT, 0);	/* not a multiple of 16 */
	return 0;
}

static u16 c_writable_hdr(struct virtq *q, struct bufs *x)
{
	(void)x;
	u16 h = read_chain(q, 0, 0, 1);
	q->desc[0].flags |= W;
	return h;
}

static u16 c_readonly_status(struct virtq *q, struct bufs *x)
{
	(void)x;
	hdr(VIRTIO_BLK_T_OUT, SCRATCH_SECTOR);
	put(q, 0, (u64)b.hdr, sizeof(*b.hdr), R | N, 1);
	put(q, 1, (u64)b.data, BLK_SECTOR, R | N, 2);
	put(q, 2, (u64)b.status, 1, R, 0);
	return 0;
}

static u16 c_beyond_capacity(struct virtq *q, struct bufs *x)
{
	(void)x;
	return read_chain(q, 0, blk.capacity, 1);
}

static u16 c_straddle_capacity(struct virtq *q, struct bufs *x)
{
	(void)x;
	return read_chain(q, 0, blk.capacity - 1, 2);
}

static u16 c_unknown_type(struct virtq *q, struct bufs *x)
{
	(void)x;
	u16 h = read_chain(q, 0, 0, 1);
	hdr(0x7f, 0);
	return h;
}

static u16 c_head_out_of_range(struct virtq *q, struct bufs *x)
{
	(void)x;
	read_chain(q, 0, 0, 1);
	return (u16)(q->size + 3);
}

static u16 c_next_out_of_range(struct virtq *q, struct bufs *x)
{
	(void)x;
	u16 h = read_chain(q, 0, 0, 1);
	q->desc[1].next = (u16)(q->size + 7);
	return h;
}

static const struct hcase cases[] = {
	{ "data-beyond-ram", "data buffer beyond RAM", A_ERRORS, false, 0, c_data_beyond_ram },
	{ "header-beyond-ram", "request header beyond RAM", A_ERRORS, false, 0, c_hdr_beyond_ram },
	{ "descriptor-loop", "next pointing back into the chain", A_ERRORS, false, 0, c_desc_loop },
	{ "zero-length-data", "a zero-length data descriptor before a sector", A_ERRORS | A_SERVED,
	  false, 1, c_zero_len },
	{ "long-indirect", "indirect chain longer than the queue", A_ERRORS | A_SERVED, false,
	  READ_SECTORS, c_long_indirect },
	{ "nested-indirect", "an indirect descriptor inside an indirect table", A_ERRORS, false, 0,
	  c_nested_indirect },
	{ "indirect-bad-length", "indirect table length not a multiple of 16", A_ERRORS, false, 0,
	  c_indirect_bad_len },
	{ "writable-header", "device-writable request header", A_ERRORS, false, 0, c_writable_hdr },
	{ "readonly-status", "write with a device-readable status byte",
	  A_UNWRITTEN | A_RESET, true, 0, c_readonly_status },
	{ "beyond-capacity", "read at sector = capacity", A_IOERR | A_RESET, false, 0,
	  c_beyond_capacity },
	{ "straddle-capacity", "2-sector read at capacity - 1", A_IOERR | A_RESET, false, 0,
	  c_straddle_capacity },
	{ "unknown-type", "request type 0x7f", A_UNSUPP | A_IOERR | A_RESET, false, 0, c_unknown_type },
	{ "head-out-of-range", "available head index >= queue size", A_ERRORS, false, 0,
	  c_head_out_of_range },
	{ "next-out-of-range", "next index >= queue size", A_ERRORS, false, 0, c_next_out_of_range },
};

static bool uses_indirect(const struct hcase *c)
{
	return c->build == c_long_indirect || c->build == c_nested_indirect ||
	       c->build == c_indirect_bad_len;
}

/* ---- device ---- */

static bool start_device(void)
{
	u64 wanted = VIRTIO_BIT(VIRTIO_F_INDIRECT_DESC) | VIRTIO_BIT(VIRTIO_BLK_F_FLUSH);
	if (!blk_start(&blk, wanted, 1, 0, irq, NULL, VECTOR_BASE))
		return false;
	virtq_irq_enable(blk.q[0], false);	/* the cases poll */
	return true;
}

static bool good_read(const char **why)
{
	memset(b.data, 0xee, READ_SECTORS * BLK_SECTOR);
	int st = blk_sync(blk.q[0], VIRTIO_BLK_T_IN, 0, b.data, READ_SECTORS * BLK_SECTOR, 2,
			  case_us);
	if (st != VIRTIO_BLK_S_OK) {
		*why = blk_status_name(st);
		return false;
	}
	if (memcmp(b.data, good, READ_SECTORS * BLK_SECTOR)) {
		*why = "wrong data";
		return false;
	}
	return true;
}

/* Publishes `head`, rings, and waits for its used element or NEEDS_RESET. */
static enum outcome run_chain(struct virtq *q, u16 head, struct virtq_used_elem *e)
{
	virtq_publish_raw(q, head);
	__asm__ volatile("mfence" ::: "memory");
	virtq_notify(q);
	struct timeout t;
	timeout_start(&t, case_us);
	u64 next = 0;
	for (;;) {
		if (virtq_get_raw(q, e))
			return O_USED;
		u64 now = rdtsc();
		if ((s64)(now - next) >= 0) {	/* status every ~1 ms: an MMIO exit each */
			next = now + tsc_hz() / 1000;
			if (virtio_status(&blk.vd) & VIRTIO_S_NEEDS_RESET)
				return O_RESET;
		}
		if (timeout_expired(&t))
			return O_HANG;
		pause();
	}
}

/* A good read by hand on the same queue, at the top descriptors. */
static bool still_serving(struct virtq *q)
{
	struct virtq_used_elem e;
	memset(b.data, 0xee, READ_SECTORS * BLK_SECTOR);
	*b.status = 0xff;
	u16 h = read_chain(q, (u16)(q->size - 3), 0, READ_SECTORS);
	return run_chain(q, h, &e) == O_USED && e.id == h && *b.status == VIRTIO_BLK_S_OK &&
	       !memcmp(b.data, good, READ_SECTORS * BLK_SECTOR);
}

/* ---- judging ---- */

struct verdict {
	char outcome[80];
	const char *label;		/* "allowed", "served (tolerated)" or "WRONG: ..." */
	bool wrong;
};

static void set(struct verdict *v, const char *label, bool wrong)
{
	v->label = label;
	v->wrong = wrong;
}

/* The head the case published; checked against the used element when it is a
 * valid index. */
static struct {
	u16 head;
	bool head_valid;
} published;

static void judge_used(const struct hcase *c, struct virtq_used_elem *e, struct verdict *v)
{
	u8 st = *b.status;
	if (published.head_valid && e->id != published.head) {
		snprintf(v->outcome, sizeof(v->outcome), "used element for descriptor %u, not %u",
			 e->id, published.head);
		set(v, "WRONG: used element names another chain", true);
		return;
	}
	if (st == 0xff) {
		snprintf(v->outcome, sizeof(v->outcome), "used len %u, status unwritten", e->len);
		n_unwritten++;
		set(v, (c->allowed & A_UNWRITTEN) ? "allowed" : "WRONG: status not written",
		    !(c->allowed & A_UNWRITTEN));
		return;
	}
	snprintf(v->outcome, sizeof(v->outcome), "status %s (used len %u)", blk_status_name(st), e->len);
	if (c->status_readable) {
		set(v, "WRONG: the device wrote a device-readable buffer", true);
	} else if (st == VIRTIO_BLK_S_IOERR || st == VIRTIO_BLK_S_UNSUPP) {
		bool ok = c->allowed & (st == VIRTIO_BLK_S_IOERR ? A_IOERR : A_UNSUPP);
		n_err++;
		set(v, ok ? "allowed" : "WRONG: unexpected error status", !ok);
	} else if (st != VIRTIO_BLK_S_OK) {
		set(v, "WRONG: invalid status value", true);
	} else if (!(c->allowed & A_SERVED)) {
		set(v, "WRONG: success", true);
	} else if (memcmp(b.data, good, (size_t)c->served_sectors * BLK_SECTOR)) {
		set(v, "WRONG: success with wrong data", true);
	} else {
		n_served++;
		set(v, strict ? "WRONG: served (strict=1)" : "served (tolerated)", strict);
	}
}

static void judge(const struct hcase *c, enum outcome o, struct virtq_used_elem *e,
		  struct verdict *v)
{
	if (o == O_USED) {
		judge_used(c, e, v);
	} else if (o == O_RESET) {
		snprintf(v->outcome, sizeof(v->outcome), "NEEDS_RESET%s",
			 blk.vd.config_irqs ? " + config interrupt" : "");
		n_reset++;
		set(v, (c->allowed & A_RESET) ? "allowed" : "WRONG: NEEDS_RESET",
		    !(c->allowed & A_RESET));
	} else {
		snprintf(v->outcome, sizeof(v->outcome), "no answer in %lu ms", case_us / 1000);
		set(v, "WRONG: no answer", true);
	}
}

/* ---- cases ---- */

static bool skipped(const char *name)
{
	size_t len, n = strlen(name);
	const char *p = cmdline_arg("skip", &len);
	while (p && len) {
		size_t k = 0;
		while (k < len && p[k] != ',')
			k++;
		if (k == n && !strncmp(p, name, n))
			return true;
		p += k < len ? k + 1 : k;
		len -= k < len ? k + 1 : k;
	}
	return false;
}

/* Runs one case; false if it was skipped. */
static bool run_case(const struct hcase *c)
{
	if (!start_device())
		fail("%s: device start-up failed", c->name);
	struct virtq *q = blk.q[0];
	if ((uses_indirect(c) && !q->indirect) || skipped(c->name)) {
		printf("hostile: %s: skipped (%s)\n", c->name,
		       skipped(c->name) ? "skip=" : "no VIRTIO_F_INDIRECT_DESC");
		return false;
	}
	u64 t0 = rdtsc();
	memset(b.data, 0xee, READ_SECTORS * BLK_SECTOR);
	*b.status = 0xff;
	blk.vd.config_irqs = 0;
	struct virtq_used_elem e = { 0, 0 };
	published.head = c->build(q, &b);
	published.head_valid = published.head < q->size;
	enum outcome o = run_chain(q, published.head, &e);
	struct verdict v;
	judge(c, o, &e, &v);
	bool serving = o == O_USED && still_serving(q);
	const char *why = "";
	bool recovered = virtio_reset(&blk.vd) && start_device() && good_read(&why);
	console_lock();
	printf("hostile: %s (%s): %s -> %s", c->name, c->what, v.outcome, v.label);
	if (o == O_USED)
		printf(serving ? "; still serving" : "; NOT serving a good read after it");
	printf("; reset: %s%s (%lu ms)\n", recovered ? "good read ok" : "FAILED ", recovered ? "" : why,
	       (rdtsc() - t0) / (tsc_hz() / 1000));
	console_unlock();
	if (v.wrong || (o == O_USED && !serving))
		n_wrong++;
	if (!recovered)
		fail("%s: the device did not recover after a reset (%s)", c->name, why);
	return true;
}

static void write_good(void)
{
	u64 x = rdtsc() | 1;
	for (unsigned i = 0; i < GOOD_SECTORS * BLK_SECTOR; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		good[i] = (u8)x;
	}
	int st = blk_sync(blk.q[0], VIRTIO_BLK_T_OUT, 0, good, GOOD_SECTORS * BLK_SECTOR, 1, case_us);
	if (st != VIRTIO_BLK_S_OK)
		fail("writing the reference sectors: %s", blk_status_name(st));
	const char *why;
	if (!good_read(&why))
		fail("reading the reference sectors back: %s", why);
}

static u64 work(u64 arg)
{
	(void)arg;
	if (!virtio_open(&blk.vd, VIRTIO_ID_BLOCK, 0))
		fail("no usable virtio-blk device");
	b.hdr = dma_alloc(sizeof(*b.hdr), 64);
	b.status = dma_alloc(64, 64);
	b.data = dma_alloc(READ_SECTORS * BLK_SECTOR, 4096);
	b.table = dma_alloc(16 * (LONG_MAX_PIECES + 2), 4096);
	good = dma_alloc(GOOD_SECTORS * BLK_SECTOR, 4096);
	if (!start_device())
		fail("virtio-blk start-up failed");
	printf("hostile: capacity %lu sectors, queue size %u, %s, %s, bad address 0x%lx\n",
	       blk.capacity, blk.q[0]->size, blk.q[0]->indirect ? "indirect" : "no indirect",
	       blk.irq ? "MSI-X config interrupt" : "no MSI-X", bad_addr);
	write_good();
	size_t only_len;
	const char *only = cmdline_arg("only", &only_len);
	unsigned ran = 0, named = 0;
	for (unsigned i = 0; i < ARRAY_SIZE(cases); i++) {
		if (only && (strlen(cases[i].name) != only_len || strncmp(cases[i].name, only, only_len)))
			continue;
		named++;
		ran += run_case(&cases[i]);
	}
	if (!named)
		fail("no case named by only=");
	printf("hostile: %u cases: %u error status, %u NEEDS_RESET, %u used without status, %u served; "
	       "%u wrong; the device recovered after every reset\n", ran, n_err, n_reset,
	       n_unwritten, n_served, n_wrong);
	if (n_wrong)
		fail("%u case(s) handled wrongly (see the lines above)", n_wrong);
	return 0;
}

void guest_main(void)
{
	bad_addr = cmdline_uint("bad_addr", 0x8000000000ULL);
	case_us = cmdline_uint("case_ms", 2000) * 1000;
	strict = cmdline_uint("strict", 0);
	irq = cmdline_uint("irq", 1);
	run_ring3_device_guest(work);
}
