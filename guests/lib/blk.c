/* virtio-blk requests over the kit's virtqueues. */
#include "kit.h"

#define MAX_SEGS	(VIRTQ_INDIRECT_MAX - 2)

struct blk_req *blk_req_alloc(unsigned n)
{
	return dma_alloc(sizeof(struct blk_req) * n, 64);
}

static bool device_writes_data(u32 type)
{
	return type == VIRTIO_BLK_T_IN || type == VIRTIO_BLK_T_GET_ID;
}

int blk_submit(struct virtq *q, struct blk_req *r, u32 type, u64 sector, void *data, u32 len,
	       unsigned segs)
{
	struct vbuf b[MAX_SEGS + 2];
	unsigned n = 0;
	r->hdr = (struct virtio_blk_hdr){ .type = type, .sector = sector };
	r->status = 0xff;
	r->done = false;
	r->used_len = 0;
	b[n++] = (struct vbuf){ &r->hdr, sizeof(r->hdr) };
	if (type == VIRTIO_BLK_T_DISCARD || type == VIRTIO_BLK_T_WRITE_ZEROES) {
		r->range = (struct virtio_blk_range){ sector, len / BLK_SECTOR, r->range.flags };
		r->hdr.sector = 0;
		b[n++] = (struct vbuf){ &r->range, sizeof(r->range) };
	} else if (len) {
		if (segs < 1)
			segs = 1;
		if (segs > MAX_SEGS)
			segs = MAX_SEGS;
		u32 piece = (len + segs - 1) / segs;
		for (u32 off = 0; off < len; off += piece)
			b[n++] = (struct vbuf){ (u8 *)data + off, len - off < piece ? len - off : piece };
	}
	unsigned n_out = n;
	if (device_writes_data(type) && len)
		n_out = 1;
	b[n++] = (struct vbuf){ (void *)&r->status, 1 };
	return virtq_add(q, b, n_out, n - n_out, r);
}

unsigned blk_reap(struct virtq *q)
{
	unsigned k = 0;
	u32 len;
	struct blk_req *r;
	while ((r = virtq_get(q, &len))) {
		r->used_len = len;
		r->done = true;
		k++;
	}
	return k;
}

int blk_sync(struct virtq *q, u32 type, u64 sector, void *data, u32 len, unsigned segs,
	     u64 timeout_us)
{
	static struct blk_req *reqs[VIRTIO_MAX_QUEUES];
	if (!reqs[q->index])
		reqs[q->index] = blk_req_alloc(1);
	struct blk_req *r = reqs[q->index];
	r->range.flags = 0;
	if (blk_submit(q, r, type, sector, data, len, segs) < 0)
		fail("blk: queue %u full for a synchronous request", q->index);
	virtq_kick(q);
	while (!r->done) {
		int w = virtq_wait(q, timeout_us);
		if (w <= 0)
			return w == 0 ? -1 : -2;
		blk_reap(q);
	}
	return r->status;
}

const char *blk_status_name(int status)
{
	switch (status) {
	case VIRTIO_BLK_S_OK: return "OK";
	case VIRTIO_BLK_S_IOERR: return "IOERR";
	case VIRTIO_BLK_S_UNSUPP: return "UNSUPP";
	case 0xff: return "unwritten";
	case -1: return "timeout";
	case -2: return "NEEDS_RESET";
	default: return "bad status";
	}
}

bool blk_start(struct blk_dev *b, u64 wanted, unsigned nq, u16 qsize, bool irq,
	       const u32 *apic_ids, u8 vector)
{
	struct virtio_dev *vd = &b->vd;
	memset(b->q, 0, sizeof(b->q));
	if (!virtio_init(vd, wanted))
		return false;
	if (nq > VIRTIO_MAX_QUEUES)
		nq = VIRTIO_MAX_QUEUES;
	unsigned have = virtio_has(vd, VIRTIO_BLK_F_MQ) ? virtio_cfg_read16(vd, VIRTIO_BLK_CFG_NUM_QUEUES) : 1;
	if (nq > have)
		nq = have;
	if (nq > vd->num_queues)
		nq = vd->num_queues;
	b->irq = irq && vd->has_msix && vd->msix.entries >= nq + 1;
	if (b->irq && !virtio_msix_enable(vd, 0))
		return false;
	if (b->irq) {
		virtio_msix_route(vd, 0, lapic_id(), vector);
		virtio_bind_config_irq(vd, vector);
	}
	for (unsigned i = 0; i < nq; i++) {
		u16 entry = b->irq ? (u16)(i + 1) : VIRTIO_MSI_NO_VECTOR;
		b->q[i] = virtio_queue_setup(vd, (u16)i, qsize, entry);
		if (!b->q[i])
			return false;
		if (b->irq) {
			virtio_msix_route(vd, entry, apic_ids ? apic_ids[i] : lapic_id(),
					  (u8)(vector + 1 + i));
			virtq_bind_irq(b->q[i], (u8)(vector + 1 + i));
		}
	}
	b->nq = nq;
	virtio_driver_ok(vd);
	b->capacity = virtio_cfg_read64(vd, VIRTIO_BLK_CFG_CAPACITY);
	return true;
}
