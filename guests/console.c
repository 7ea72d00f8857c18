/*
 * console: writes through the first virtio-console PCI function's
 * transmitq (queue 1, port 0, no MULTIPORT) from ring 3:
 *
 *   virtio-console: hello from hvc0            (one buffer)
 *   virtio-console: three buffers, one line    (a chain of three)
 *
 * each followed by "\n"; with `tag=WORD` the first line ends " WORD".  A
 * test looks for them in the VMM's console output; the serial console only
 * says how many bytes went out (never the text itself, so the two outputs
 * cannot be confused).  The receiveq (queue 0) is set up too, with no
 * buffers and no interrupt.  Completion by MSI-X (config entry 0 -> vector
 * 0x40, transmitq entry 1 -> 0x41) unless `irq=0` or the device has none.
 */
#include "kit.h"

#define VECTOR_BASE	0x40
#define RXQ		0
#define TXQ		1

static struct virtio_dev vd;
static struct virtq *tx;

static void start(void)
{
	if (!virtio_open(&vd, VIRTIO_ID_CONSOLE, 0))
		fail("no usable virtio-console device");
	if (!virtio_init(&vd, VIRTIO_BIT(VIRTIO_F_EVENT_IDX) | VIRTIO_BIT(VIRTIO_F_INDIRECT_DESC)))
		fail("virtio-console initialisation failed");
	bool irq = cmdline_uint("irq", 1) && vd.has_msix && vd.msix.entries >= 2 &&
		   virtio_msix_enable(&vd, 0);
	if (irq)
		virtio_msix_route(&vd, 0, lapic_id(), VECTOR_BASE);
	u16 txe = irq ? 1 : VIRTIO_MSI_NO_VECTOR;
	if (!virtio_queue_setup(&vd, RXQ, 0, VIRTIO_MSI_NO_VECTOR) ||
	    !(tx = virtio_queue_setup(&vd, TXQ, 0, txe)))
		fail("virtio-console queue set-up failed");
	if (irq) {
		virtio_msix_route(&vd, 1, lapic_id(), VECTOR_BASE + 1);
		virtq_bind_irq(tx, VECTOR_BASE + 1);
	}
	virtio_driver_ok(&vd);
	printf("console: features 0x%lx, %u queues, transmitq size %u, %s completion\n",
	       vd.features, vd.num_queues, tx->size, irq ? "MSI-X" : "polled");
}

/* Sends the buffers as one chain; returns the bytes sent. */
static u32 send(struct vbuf *b, unsigned n)
{
	u32 total = 0, len = 0;
	for (unsigned i = 0; i < n; i++)
		total += b[i].len;
	int w = virtq_sync(tx, b, n, 0, &len, 5000000);
	if (w <= 0)
		fail("console: transmit %s", w == 0 ? "timed out" : "made the device need a reset");
	return total;
}

static u64 work(u64 arg)
{
	(void)arg;
	start();
	char *line = dma_alloc(128, 64);
	size_t tag_len;
	const char *tag = cmdline_arg("tag", &tag_len);
	int n = snprintf(line, 128, "virtio-console: hello from hvc0%s%.*s\n", tag ? " " : "",
			 tag ? (int)(tag_len > 64 ? 64 : tag_len) : 0, tag ? tag : "");
	struct vbuf one = { line, (u32)n };
	u32 a = send(&one, 1);

	static const char *const parts[] = { "virtio-console: three ", "buffers, ", "one line\n" };
	struct vbuf three[3];
	for (int i = 0; i < 3; i++) {
		size_t len = strlen(parts[i]);
		char *p = dma_alloc(len, 16);
		memcpy(p, parts[i], len);
		three[i] = (struct vbuf){ p, (u32)len };
	}
	u32 b = send(three, 3);
	printf("console: 2 lines sent on the transmitq: %u bytes in 1 buffer, %u bytes in a chain of 3 "
	       "(%u interrupts)\n", a, b, tx->irqs);
	return 0;
}

void guest_main(void)
{
	run_ring3_device_guest(work);
}
