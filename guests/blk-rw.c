/*
 * blk-rw: the basic virtio-blk operations against the first virtio-blk PCI
 * function, driven from ring 3 through the kit's virtio driver.
 *
 * Read-write run (default): capacity; a fresh pattern (seeded from the TSC,
 * so an earlier run's data cannot pass) written over `count=` sectors at
 * `start=` in requests of 1-16 sectors split over 1-4 descriptors; FLUSH;
 * read back with another split and compared; GET_ID compared with `serial=`;
 * DISCARD (if offered) then, unless `discard_zeroes=0`, zeroes read back;
 * WRITE_ZEROES (if offered; with the UNMAP flag too if the device allows
 * it) then zeroes read back.
 * Read-only run (`ro=1`): the RO feature must be offered; a read works, a
 * write must fail with IOERR and leave the data as it was.
 *
 * Completion by MSI-X interrupt (queue entry 1 -> vector 0x41, config entry
 * 0 -> 0x40) when the device has MSI-X and `irq=1` (default); polling with
 * `irq=0` or without MSI-X.  Every completion awaited by interrupt must have
 * had one.  Other parameters: `indirect=0` / `event_idx=0` refuse those
 * features, `qsize=` limits the queue, `capacity=` expected sectors,
 * `pci=cf8` configuration through ports instead of ECAM (where both exist,
 * the header registers of every function must read the same both ways),
 * `timeout_ms=5000` per request.
 */
#include "kit.h"

#define VECTOR_BASE	0x40
#define MAX_COUNT	2048		/* sectors: 1 MiB of buffers each way */

static struct blk_dev blk;
static struct virtq *q;
static u64 timeout_us;
static u8 *wbuf, *rbuf;

static u64 xorshift(u64 *s)
{
	u64 x = *s;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *s = x;
}

static int io(u32 type, u64 sector, void *data, u32 len, unsigned segs)
{
	return blk_sync(q, type, sector, data, len, segs, timeout_us);
}

static void expect(int status, int want, const char *what, u64 sector)
{
	if (status != want)
		fail("%s at sector %lu: %s (%d), expected %s", what, sector, blk_status_name(status),
		     status, blk_status_name(want));
}

/* Sectors [sector, sector + n) in requests of 1, 8, 3, 16, ... sectors,
 * each split into 1-4 descriptors (the pattern shifted by `phase`). */
static unsigned transfer(u32 type, u64 sector, u8 *buf, u64 n, unsigned phase)
{
	static const unsigned sizes[] = { 1, 8, 3, 16, 5, 2, 13, 4 };
	unsigned reqs = 0;
	for (u64 done = 0; done < n; reqs++) {
		u64 k = sizes[(reqs + phase) % ARRAY_SIZE(sizes)];
		if (k > n - done)
			k = n - done;
		unsigned segs = 1 + (reqs + phase) % 4;
		int st = io(type, sector + done, buf + done * BLK_SECTOR, (u32)(k * BLK_SECTOR), segs);
		expect(st, VIRTIO_BLK_S_OK, type == VIRTIO_BLK_T_IN ? "read" : "write", sector + done);
		done += k;
	}
	return reqs;
}

static void compare(const u8 *want, const u8 *got, u64 sector, u64 n, const char *what)
{
	for (u64 i = 0; i < n * BLK_SECTOR; i++) {
		if (want[i] != got[i])
			fail("%s: sector %lu byte %lu reads 0x%02x, expected 0x%02x", what,
			     sector + i / BLK_SECTOR, i % BLK_SECTOR, got[i], want[i]);
	}
}

static bool all_zero(const u8 *p, u64 bytes)
{
	for (u64 i = 0; i < bytes; i++)
		if (p[i])
			return false;
	return true;
}

static void read_write(u64 start, u64 count)
{
	u64 seed = rdtsc() | 1;
	printf("blk-rw: pattern seed 0x%lx\n", seed);
	for (u64 s = 0; s < count; s++) {
		u64 *w = (u64 *)(wbuf + s * BLK_SECTOR);
		w[0] = start + s;		/* each sector names itself */
		for (unsigned i = 1; i < BLK_SECTOR / 8; i++)
			w[i] = xorshift(&seed);
	}
	unsigned wr = transfer(VIRTIO_BLK_T_OUT, start, wbuf, count, 0);
	if (virtio_has(&blk.vd, VIRTIO_BLK_F_FLUSH)) {
		expect(io(VIRTIO_BLK_T_FLUSH, 0, NULL, 0, 1), VIRTIO_BLK_S_OK, "flush", 0);
		printf("blk-rw: wrote %lu sectors at %lu in %u requests, FLUSH ok\n", count, start, wr);
	} else {
		printf("blk-rw: wrote %lu sectors at %lu in %u requests (no FLUSH feature)\n", count,
		       start, wr);
	}
	memset(rbuf, 0xa5, count * BLK_SECTOR);
	unsigned rd = transfer(VIRTIO_BLK_T_IN, start, rbuf, count, 3);
	compare(wbuf, rbuf, start, count, "read-back");
	printf("blk-rw: read back %lu sectors in %u requests: identical\n", count, rd);
}

static void get_id(void)
{
	u8 *id = dma_alloc(VIRTIO_BLK_ID_BYTES + 1, 64);
	int st = io(VIRTIO_BLK_T_GET_ID, 0, id, VIRTIO_BLK_ID_BYTES, 1);
	size_t want_len;
	const char *want = cmdline_arg("serial", &want_len);
	if (st == VIRTIO_BLK_S_UNSUPP && !want) {
		printf("blk-rw: GET_ID unsupported\n");
		return;
	}
	expect(st, VIRTIO_BLK_S_OK, "GET_ID", 0);
	size_t n = 0;
	while (n < VIRTIO_BLK_ID_BYTES && id[n])
		n++;
	printf("blk-rw: GET_ID \"%.*s\"\n", (int)n, (const char *)id);
	if (!want)
		return;
	if (want_len > VIRTIO_BLK_ID_BYTES)
		want_len = VIRTIO_BLK_ID_BYTES;
	if (n != want_len || memcmp(id, want, n))
		fail("GET_ID \"%.*s\", expected serial \"%.*s\"", (int)n, (const char *)id,
		     (int)want_len, want);
}

/* A range of up to 64 sectors inside [start, start + count), aligned to
 * `align` sectors, in the part given by `slot` (0-3). */
static bool pick_range(u64 start, u64 count, u32 align, unsigned slot, u64 max, u64 *s, u64 *n)
{
	if (align == 0)
		align = 1;
	u64 quarter = count / 4;
	u64 a = (start + slot * quarter + align - 1) / align * align;
	u64 end = start + (slot + 1) * quarter;
	u64 len = end > a ? (end - a) / align * align : 0;
	if (len > 64)
		len = 64 / align * align;
	if (max && len > max)
		len = max / align * align;
	*s = a;
	*n = len;
	return len > 0;
}

static void discard(u64 start, u64 count)
{
	if (!virtio_has(&blk.vd, VIRTIO_BLK_F_DISCARD)) {
		printf("blk-rw: DISCARD not offered\n");
		return;
	}
	u32 align = virtio_cfg_read32(&blk.vd, VIRTIO_BLK_CFG_DISCARD_ALIGN);
	u32 max = virtio_cfg_read32(&blk.vd, VIRTIO_BLK_CFG_MAX_DISCARD_SECTORS);
	u64 s, n;
	if (!pick_range(start, count, align < 8 ? 8 : align, 1, max, &s, &n)) {
		printf("blk-rw: DISCARD skipped: no aligned range (alignment %u)\n", align);
		return;
	}
	expect(io(VIRTIO_BLK_T_DISCARD, s, NULL, (u32)(n * BLK_SECTOR), 1), VIRTIO_BLK_S_OK,
	       "discard", s);
	memset(rbuf, 0xa5, n * BLK_SECTOR);
	transfer(VIRTIO_BLK_T_IN, s, rbuf, n, 1);
	bool zero = all_zero(rbuf, n * BLK_SECTOR);
	printf("blk-rw: DISCARD %lu sectors at %lu (alignment %u, max %u): reads back %s\n", n, s,
	       align, max, zero ? "zeroes" : "old data");
	if (!zero && cmdline_uint("discard_zeroes", 1))
		fail("discarded sectors at %lu do not read back as zeroes", s);
}

static void write_zeroes_one(u64 s, u64 n, bool unmap)
{
	struct blk_req *r = blk_req_alloc(1);
	r->range.flags = unmap ? VIRTIO_BLK_WZ_UNMAP : 0;
	if (blk_submit(q, r, VIRTIO_BLK_T_WRITE_ZEROES, s, NULL, (u32)(n * BLK_SECTOR), 1) < 0)
		fail("queue full");
	virtq_kick(q);
	while (!r->done) {
		int w = virtq_wait(q, timeout_us);
		if (w <= 0)
			fail("write-zeroes at %lu: %s", s, w == 0 ? "timeout" : "NEEDS_RESET");
		blk_reap(q);
	}
	expect(r->status, VIRTIO_BLK_S_OK, "write-zeroes", s);
	memset(rbuf, 0xa5, n * BLK_SECTOR);
	transfer(VIRTIO_BLK_T_IN, s, rbuf, n, 2);
	if (!all_zero(rbuf, n * BLK_SECTOR))
		fail("WRITE_ZEROES%s at %lu: sectors do not read back as zeroes", unmap ? " (unmap)" : "", s);
	printf("blk-rw: WRITE_ZEROES%s %lu sectors at %lu: reads back zeroes\n",
	       unmap ? " (unmap)" : "", n, s);
}

static void write_zeroes(u64 start, u64 count)
{
	if (!virtio_has(&blk.vd, VIRTIO_BLK_F_WRITE_ZEROES)) {
		printf("blk-rw: WRITE_ZEROES not offered\n");
		return;
	}
	u32 max = virtio_cfg_read32(&blk.vd, VIRTIO_BLK_CFG_MAX_WZ_SECTORS);
	u64 s, n;
	if (pick_range(start, count, 1, 2, max, &s, &n))
		write_zeroes_one(s, n, false);
	if (virtio_cfg_read8(&blk.vd, VIRTIO_BLK_CFG_WZ_MAY_UNMAP) &&
	    pick_range(start, count, 8, 3, max, &s, &n))
		write_zeroes_one(s, n, true);
}

static void read_only(u64 start, u64 count)
{
	if (!virtio_has(&blk.vd, VIRTIO_BLK_F_RO))
		fail("ro=1 but the device does not offer VIRTIO_BLK_F_RO");
	transfer(VIRTIO_BLK_T_IN, start, rbuf, count, 0);
	memset(wbuf, 0x5a, BLK_SECTOR);
	int st = io(VIRTIO_BLK_T_OUT, start, wbuf, BLK_SECTOR, 1);
	expect(st, VIRTIO_BLK_S_IOERR, "write to a read-only device", start);
	memset(wbuf, 0, count * BLK_SECTOR);
	transfer(VIRTIO_BLK_T_IN, start, wbuf, count, 1);
	compare(rbuf, wbuf, start, count, "read-only data after a refused write");
	printf("blk-rw: read-only: RO offered, read %lu sectors, write refused with IOERR, data unchanged\n",
	       count);
}

static u64 features_wanted(bool ro)
{
	u64 f = VIRTIO_BIT(VIRTIO_BLK_F_RO) | VIRTIO_BIT(VIRTIO_BLK_F_BLK_SIZE) |
		VIRTIO_BIT(VIRTIO_BLK_F_FLUSH) | VIRTIO_BIT(VIRTIO_BLK_F_SEG_MAX) |
		VIRTIO_BIT(VIRTIO_BLK_F_SIZE_MAX);
	if (!ro)
		f |= VIRTIO_BIT(VIRTIO_BLK_F_DISCARD) | VIRTIO_BIT(VIRTIO_BLK_F_WRITE_ZEROES);
	if (cmdline_uint("indirect", 1))
		f |= VIRTIO_BIT(VIRTIO_F_INDIRECT_DESC);
	if (cmdline_uint("event_idx", 1))
		f |= VIRTIO_BIT(VIRTIO_F_EVENT_IDX);
	return f;
}

static void start_device(bool ro)
{
	if (!virtio_open(&blk.vd, VIRTIO_ID_BLOCK, 0))
		fail("no usable virtio-blk device");
	if (!blk_start(&blk, features_wanted(ro), 1, (u16)cmdline_uint("qsize", 0),
		       cmdline_uint("irq", 1), NULL, VECTOR_BASE))
		fail("virtio-blk start-up failed");
	int fns = 0, diff = pci_compare_mechanisms(&fns);
	if (diff > 0)
		fail("CF8 and ECAM disagree on %d registers", diff);
	if (diff == 0)
		printf("blk-rw: CF8 and ECAM agree on %d functions\n", fns);
	q = blk.q[0];
	u32 bs = virtio_has(&blk.vd, VIRTIO_BLK_F_BLK_SIZE) ?
		 virtio_cfg_read32(&blk.vd, VIRTIO_BLK_CFG_BLK_SIZE) : 512;
	printf("blk-rw: features offered 0x%lx, negotiated 0x%lx; queue 0 size %u%s%s, %s\n",
	       blk.vd.device_features, blk.vd.features, q->size, q->indirect ? ", indirect" : "",
	       q->event_idx ? ", event-idx" : "",
	       blk.irq ? "MSI-X completion" : "polled completion");
	printf("blk-rw: capacity %lu sectors (%lu MiB), block size %u\n", blk.capacity,
	       blk.capacity >> 11, bs);
	u64 want;
	if (cmdline_find_uint("capacity", &want) && want != blk.capacity)
		fail("capacity %lu sectors, expected %lu", blk.capacity, want);
}

static u64 work(u64 arg)
{
	(void)arg;
	bool ro = cmdline_uint("ro", 0);
	timeout_us = cmdline_uint("timeout_ms", 5000) * 1000;
	start_device(ro);
	u64 start = cmdline_uint("start", 0), count = cmdline_uint("count", 256);
	if (count < 4 || count > MAX_COUNT)
		fail("count=%lu: 4 to %u sectors", count, MAX_COUNT);
	if (start + count > blk.capacity)
		fail("sectors [%lu, %lu) exceed the capacity (%lu)", start, start + count, blk.capacity);
	wbuf = dma_alloc(count * BLK_SECTOR, 4096);
	rbuf = dma_alloc(count * BLK_SECTOR, 4096);
	if (ro) {
		read_only(start, count);
	} else {
		read_write(start, count);
		get_id();
		discard(start, count);
		write_zeroes(start, count);
	}
	if (ro)
		get_id();
	if (blk.irq) {
		printf("blk-rw: %lu completions, %u MSI-X interrupts, %lu waits ended by one, %lu missed\n",
		       q->completions, q->irqs, q->waits_irq, q->missed_irqs);
		if (q->missed_irqs)
			fail("%lu completions arrived without their MSI-X interrupt", q->missed_irqs);
		if (!q->irqs)
			fail("no MSI-X interrupt at all");
	} else {
		printf("blk-rw: %lu completions (polled), %lu doorbells\n", q->completions, q->kicks);
	}
	return 0;
}

void guest_main(void)
{
	run_ring3_device_guest(work);
}
