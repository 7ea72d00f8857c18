/*
 * rng: reads the first virtio-rng PCI function `reads=` times (default 4),
 * `bytes=` bytes each (default 64, at most 4096), from ring 3, and checks
 * that every read returned data, that no read is one repeated byte, and
 * that no two reads are equal.  A device may return fewer bytes than asked
 * for: the guest asks again until the buffer is full (at most 64 requests
 * per read).  Completion by MSI-X (entry 1 -> vector 0x41) unless `irq=0`
 * or the device has none.
 */
#include "kit.h"

#define VECTOR_BASE	0x40
#define MAX_READS	16
#define MAX_BYTES	4096
#define MAX_TRIES	64

static struct virtio_dev vd;
static struct virtq *q;

static void start(void)
{
	if (!virtio_open(&vd, VIRTIO_ID_RNG, 0))
		fail("no usable virtio-rng device");
	if (!virtio_init(&vd, VIRTIO_BIT(VIRTIO_F_EVENT_IDX)))
		fail("virtio-rng initialisation failed");
	bool irq = cmdline_uint("irq", 1) && vd.has_msix && virtio_msix_enable(&vd, 0);
	if (irq)
		virtio_msix_route(&vd, 0, lapic_id(), VECTOR_BASE);
	q = virtio_queue_setup(&vd, 0, 0, irq ? 1 : VIRTIO_MSI_NO_VECTOR);
	if (!q)
		fail("virtio-rng request queue set-up failed");
	if (irq) {
		virtio_msix_route(&vd, 1, lapic_id(), VECTOR_BASE + 1);
		virtq_bind_irq(q, VECTOR_BASE + 1);
	}
	virtio_driver_ok(&vd);
	printf("rng: features 0x%lx, queue size %u, %s completion\n", vd.features, q->size,
	       irq ? "MSI-X" : "polled");
}

/* Fills buf completely; returns the number of requests it took. */
static unsigned fill(u8 *buf, u32 bytes)
{
	u32 got = 0;
	unsigned tries = 0;
	while (got < bytes) {
		if (++tries > MAX_TRIES)
			fail("rng: %u bytes of %u after %u requests", got, bytes, MAX_TRIES);
		struct vbuf b = { buf + got, bytes - got };
		u32 len = 0;
		int w = virtq_sync(q, &b, 0, 1, &len, 5000000);
		if (w <= 0)
			fail("rng: request %s", w == 0 ? "timed out" : "made the device need a reset");
		if (len > bytes - got)
			fail("rng: device claims %u bytes written into a %u-byte buffer", len, bytes - got);
		got += len;
	}
	return tries;
}

static bool constant(const u8 *p, u32 n)
{
	for (u32 i = 1; i < n; i++)
		if (p[i] != p[0])
			return false;
	return true;
}

static u64 work(u64 arg)
{
	(void)arg;
	unsigned reads = (unsigned)cmdline_uint("reads", 4);
	u32 bytes = (u32)cmdline_uint("bytes", 64);
	if (reads < 2 || reads > MAX_READS || bytes < 8 || bytes > MAX_BYTES)
		fail("rng: reads=%u (2-%u), bytes=%u (8-%u)", reads, MAX_READS, bytes, MAX_BYTES);
	start();
	u8 *buf[MAX_READS];
	for (unsigned r = 0; r < reads; r++) {
		buf[r] = dma_alloc(bytes, 64);
		unsigned n = fill(buf[r], bytes);
		printf("rng: read %u: %u bytes in %u request(s):", r, bytes, n);
		for (u32 i = 0; i < 16 && i < bytes; i++)
			printf(" %02x", buf[r][i]);
		printf(" ...\n");
		if (constant(buf[r], bytes))
			fail("rng: read %u is %u times the byte 0x%02x", r, bytes, buf[r][0]);
		for (unsigned o = 0; o < r; o++)
			if (!memcmp(buf[o], buf[r], bytes))
				fail("rng: reads %u and %u are identical", o, r);
	}
	printf("rng: %u reads of %u bytes, none constant, all different (%lu completions, %u interrupts)\n",
	       reads, bytes, q->completions, q->irqs);
	return 0;
}

void guest_main(void)
{
	run_ring3_device_guest(work);
}
