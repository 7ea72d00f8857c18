/*
 * blk-intx: a virtio-blk disk completing by legacy INTx instead of MSI-X.
 * The driver leaves MSI-X off, routes the function's interrupt line (its
 * configuration register, which must be the GSI the DSDT's _PRT gives the
 * slot: 16 + slot % 4 for INTA#) level-triggered through the I/O APIC, and
 * reads `n=` (default 8) sectors, one request at a time, from ring 3 with
 * interrupts on.  Each interrupt's handler reads the ISR (which clears it
 * and lowers the line) before its EOI, so the level-triggered pin is not
 * taken again.  Checks: every request completes with status OK and each
 * raised an interrupt whose ISR had the queue bit set.  Interrupts with an
 * empty ISR are counted, not failed: a shared level-triggered line may give
 * them, and a local APIC that signals the EOI of a level-triggered vector at
 * delivery (KVM-PVM's in-kernel one does) has the I/O APIC deliver the still
 * asserted line once more before the handler lowers it.  More than one per
 * completion means the line is not lowered.
 */
#include "kit.h"

#define INTX_VECTOR	0x60
#define WAIT_US		5000000

static struct virtio_dev vd;
static struct virtq *q;
static volatile u32 interrupts, queue_bits, empty_isr;

static void intx_handler(struct frame *f)
{
	(void)f;
	u8 isr = virtio_isr(&vd);
	interrupts++;
	if (isr & 1)
		queue_bits++;
	if (!isr)
		empty_isr++;
	lapic_eoi();
}

static unsigned route_line(void)
{
	struct pci_dev *d = vd.pci;
	unsigned slot = (d->bdf >> 3) & 0x1f;
	unsigned expected = 16 + slot % 4;
	if (d->int_pin != 1)
		fail("intx: interrupt pin %u, expected INTA# (1)", d->int_pin);
	if (d->int_line != expected)
		fail("intx: interrupt line %u for slot %u, the _PRT says %u", d->int_line, slot,
		     expected);
	ioapic_route(d->int_line, INTX_VECTOR, (u8)lapic_id(), IOAPIC_LEVEL | IOAPIC_ACTIVE_LOW);
	printf("intx: slot %u INTA# -> GSI %u -> vector 0x%x, level-triggered\n", slot, d->int_line,
	       INTX_VECTOR);
	return d->int_line;
}

static void start(void)
{
	if (!virtio_open(&vd, VIRTIO_ID_BLOCK, 0))
		fail("no usable virtio-blk device");
	if (!virtio_init(&vd, 0))
		fail("virtio-blk initialisation failed");
	q = virtio_queue_setup(&vd, 0, 0, VIRTIO_MSI_NO_VECTOR);
	if (!q)
		fail("virtio-blk queue set-up failed");
	virtio_driver_ok(&vd);
}

/* One read of `sector`; waits for its interrupt. */
static void read_one(struct blk_req *r, u8 *buf, u64 sector)
{
	u32 before = interrupts;
	if (blk_submit(q, r, VIRTIO_BLK_T_IN, sector, buf, BLK_SECTOR, 1) < 0)
		fail("intx: queue full");
	virtq_kick(q);
	u64 deadline = rdtsc() + WAIT_US * (tsc_hz() / 1000000);
	while (interrupts == before) {
		if (rdtsc() > deadline)
			fail("intx: no interrupt for the read of sector %lu (ISR 0x%x)", sector,
			     virtio_isr(&vd));
		pause();
	}
	if (!blk_reap(q) || !r->done)
		fail("intx: the interrupt came but sector %lu's request is not in the used ring",
		     sector);
	if (r->status != VIRTIO_BLK_S_OK)
		fail("intx: sector %lu: %s", sector, blk_status_name(r->status));
}

static u64 work(u64 n)
{
	start();
	struct blk_req *r = blk_req_alloc(1);
	u8 *buf = dma_alloc(BLK_SECTOR, BLK_SECTOR);
	for (u64 i = 0; i < n; i++) {
		r->done = false;
		read_one(r, buf, i);
	}
	return 0;
}

void guest_main(void)
{
	u64 n = cmdline_uint("n", 8);
	if (!n || n > 1024)
		fail("n=%lu: 1 to 1024", n);
	set_handler(INTX_VECTOR, intx_handler);
	lapic_enable();
	/* The device must be probed before its line is routed; probing is cheap. */
	pci_scan();
	if (!virtio_find(VIRTIO_ID_BLOCK, 0))
		fail("no virtio-blk function");
	vd.pci = virtio_find(VIRTIO_ID_BLOCK, 0);
	route_line();
	vd.pci = NULL;
	enter_ring3_irq(work, n, true);
	printf("intx: %lu reads, %u interrupts, %u with the queue bit, %u with an empty ISR\n", n,
	       interrupts, queue_bits, empty_isr);
	if (queue_bits < n)
		fail("intx: %u of %lu completions signalled the queue", queue_bits, n);
	if (empty_isr > n)
		fail("intx: %u interrupts with an empty ISR for %lu reads (the line stays asserted)",
		     empty_isr, n);
	pass();
}
