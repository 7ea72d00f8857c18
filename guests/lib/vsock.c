/*
 * virtio-vsock driver for test guests: stream connections with the
 * protocol's credit flow control, in ring 3 like the other kit drivers.
 * Receive buffers are single descriptors (header and up to 4 KiB of
 * payload); transmit packets likewise.  The receive queue may complete by
 * MSI-X; the transmit and event queues are polled.
 */
#include "kit.h"

#define HDR_SIZE	((u32)sizeof(struct vsock_hdr))
#define BUF_SIZE	(HDR_SIZE + VSOCK_PKT_PAYLOAD)
#define EVENT_BUFS	4
#define FIRST_PORT	0x10000

static void post_rx(struct vsock *vs, u8 *buf)
{
	struct vbuf b = { buf, BUF_SIZE };
	if (virtq_add(vs->rx, &b, 0, 1, buf) < 0)
		fail("vsock: receive ring full");
}

static void post_event(struct vsock *vs, u8 *buf)
{
	struct vbuf b = { buf, 8 };
	if (virtq_add(vs->ev, &b, 0, 1, buf) < 0)
		fail("vsock: event ring full");
}

bool vsock_open(struct vsock *vs, bool irq, u8 vector)
{
	memset(vs, 0, sizeof(*vs));
	if (!virtio_open(&vs->vd, VIRTIO_ID_VSOCK, 0))
		return false;
	if (!virtio_init(&vs->vd, VIRTIO_BIT(VIRTIO_F_EVENT_IDX)))
		return false;
	irq = irq && vs->vd.has_msix && virtio_msix_enable(&vs->vd, 0);
	if (irq)
		virtio_msix_route(&vs->vd, 1, lapic_id(), vector);
	vs->rx = virtio_queue_setup(&vs->vd, 0, 0, irq ? 1 : VIRTIO_MSI_NO_VECTOR);
	vs->tx = virtio_queue_setup(&vs->vd, 1, 0, VIRTIO_MSI_NO_VECTOR);
	vs->ev = virtio_queue_setup(&vs->vd, 2, 0, VIRTIO_MSI_NO_VECTOR);
	if (!vs->rx || !vs->tx || !vs->ev) {
		printf("vsock: queue set-up failed\n");
		return false;
	}
	if (irq)
		virtq_bind_irq(vs->rx, vector);
	vs->cid = virtio_cfg_read64(&vs->vd, 0);
	vs->tx_slots = dma_alloc(VSOCK_TX_SLOTS * BUF_SIZE, 64);
	for (u16 i = 0; i < VSOCK_TX_SLOTS; i++)
		vs->tx_free[vs->tx_nfree++] = i;
	for (unsigned i = 0; i < VSOCK_MAX_CONNS; i++)
		vs->conns[i].rxbuf = dma_alloc(VSOCK_BUF_ALLOC, 64);
	u8 *bufs = dma_alloc(VSOCK_RX_BUFS * BUF_SIZE, 64);
	for (unsigned i = 0; i < VSOCK_RX_BUFS; i++)
		post_rx(vs, bufs + i * BUF_SIZE);
	u8 *events = dma_alloc(EVENT_BUFS * 8, 8);
	for (unsigned i = 0; i < EVENT_BUFS; i++)
		post_event(vs, events + i * 8);
	vs->next_port = FIRST_PORT;
	virtio_driver_ok(&vs->vd);
	virtq_kick(vs->rx);
	virtq_kick(vs->ev);
	printf("vsock: guest cid %lu, queue sizes %u/%u/%u, %s receive\n", vs->cid, vs->rx->size,
	       vs->tx->size, vs->ev->size, irq ? "MSI-X" : "polled");
	return true;
}

static void reclaim_tx(struct vsock *vs)
{
	u32 len;
	u8 *slot;
	while ((slot = virtq_get(vs->tx, &len)))
		vs->tx_free[vs->tx_nfree++] = (u16)((slot - vs->tx_slots) / BUF_SIZE);
}

bool vsock_send_raw(struct vsock *vs, const struct vsock_hdr *h, const void *payload,
		    u32 payload_len)
{
	reclaim_tx(vs);
	if (!vs->tx_nfree || payload_len > VSOCK_PKT_PAYLOAD)
		return false;
	u8 *slot = vs->tx_slots + vs->tx_free[--vs->tx_nfree] * BUF_SIZE;
	memcpy(slot, h, HDR_SIZE);
	if (payload_len)
		memcpy(slot + HDR_SIZE, payload, payload_len);
	struct vbuf b = { slot, HDR_SIZE + payload_len };
	if (virtq_add(vs->tx, &b, 1, 0, slot) < 0) {
		vs->tx_nfree++;
		return false;
	}
	virtq_kick(vs->tx);
	vs->tx_packets++;
	return true;
}

bool vsock_send_chain(struct vsock *vs, const struct vbuf *bufs, unsigned n_out, unsigned n_in)
{
	reclaim_tx(vs);
	if (!vs->tx_nfree)
		return false;
	u8 *slot = vs->tx_slots + vs->tx_free[--vs->tx_nfree] * BUF_SIZE;
	if (virtq_add(vs->tx, bufs, n_out, n_in, slot) < 0) {
		vs->tx_nfree++;
		return false;
	}
	virtq_kick(vs->tx);
	vs->tx_packets++;
	return true;
}

static void fill_hdr(struct vsock *vs, struct vsock_hdr *h, u32 local, u32 peer, u16 op)
{
	memset(h, 0, sizeof(*h));
	h->src_cid = vs->cid;
	h->dst_cid = VSOCK_HOST_CID;
	h->src_port = local;
	h->dst_port = peer;
	h->type = VSOCK_TYPE_STREAM;
	h->op = op;
	h->buf_alloc = VSOCK_BUF_ALLOC;
}

/* Sends one packet, spinning (bounded) while the transmit ring is full. */
static void send_pkt(struct vsock *vs, const struct vsock_hdr *h, const void *payload)
{
	struct timeout t;
	timeout_start(&t, 5000000);
	while (!vsock_send_raw(vs, h, payload, h->len))
		if (timeout_expired(&t))
			fail("vsock: transmit ring stuck");
}

bool vsock_send_ctl(struct vsock *vs, struct vsock_conn *c, u16 op, u32 flags)
{
	struct vsock_hdr h;
	fill_hdr(vs, &h, c->local_port, c->peer_port, op);
	h.flags = flags;
	h.fwd_cnt = c->fwd_cnt;
	c->reported_fwd_cnt = c->fwd_cnt;
	send_pkt(vs, &h, NULL);
	return true;
}

static void send_rst_for(struct vsock *vs, const struct vsock_hdr *in)
{
	struct vsock_hdr h;
	fill_hdr(vs, &h, in->dst_port, in->src_port, VSOCK_OP_RST);
	send_pkt(vs, &h, NULL);
}

static struct vsock_conn *find(struct vsock *vs, u32 local, u32 peer)
{
	for (unsigned i = 0; i < VSOCK_MAX_CONNS; i++) {
		struct vsock_conn *c = &vs->conns[i];
		if (c->state != VSOCK_FREE && c->local_port == local && c->peer_port == peer)
			return c;
	}
	return NULL;
}

static struct vsock_conn *new_conn(struct vsock *vs, u32 local, u32 peer, enum vsock_state st)
{
	for (unsigned i = 0; i < VSOCK_MAX_CONNS; i++) {
		struct vsock_conn *c = &vs->conns[i];
		if (c->state != VSOCK_FREE)
			continue;
		u8 *rxbuf = c->rxbuf;
		memset(c, 0, sizeof(*c));
		c->rxbuf = rxbuf;
		c->state = st;
		c->local_port = local;
		c->peer_port = peer;
		return c;
	}
	return NULL;
}

static void on_request(struct vsock *vs, const struct vsock_hdr *h)
{
	struct vsock_conn *c = NULL;
	if (vs->listen_port && h->dst_port == vs->listen_port && !find(vs, h->dst_port, h->src_port))
		c = new_conn(vs, h->dst_port, h->src_port, VSOCK_ESTABLISHED);
	if (!c) {
		send_rst_for(vs, h);
		return;
	}
	c->peer_buf_alloc = h->buf_alloc;
	c->peer_fwd_cnt = h->fwd_cnt;
	c->pending_accept = true;
	vsock_send_ctl(vs, c, VSOCK_OP_RESPONSE, 0);
}

static void on_data(struct vsock_conn *c, const u8 *payload, u32 len)
{
	if (c->rx_len + len > VSOCK_BUF_ALLOC)
		fail("vsock: the device sent %u bytes with %u of %u buffered: beyond our credit",
		     len, c->rx_len, VSOCK_BUF_ALLOC);
	for (u32 i = 0; i < len; i++)
		c->rxbuf[(c->rx_head + c->rx_len + i) % VSOCK_BUF_ALLOC] = payload[i];
	c->rx_len += len;
}

static void on_packet(struct vsock *vs, const struct vsock_hdr *h, const u8 *payload, u32 used)
{
	if (used < HDR_SIZE || h->len > used - HDR_SIZE)
		fail("vsock: receive buffer used %u bytes for a packet of %u", used, h->len);
	if (h->src_cid != VSOCK_HOST_CID || h->dst_cid != vs->cid || h->type != VSOCK_TYPE_STREAM)
		fail("vsock: packet from cid %lu to %lu type %u", h->src_cid, h->dst_cid, h->type);
	vs->rx_packets++;
	if (h->op == VSOCK_OP_REQUEST) {
		on_request(vs, h);
		return;
	}
	struct vsock_conn *c = find(vs, h->dst_port, h->src_port);
	if (!c || c->state == VSOCK_CLOSED) {
		if (h->op == VSOCK_OP_RST)
			vs->rsts_unmatched++;
		else
			send_rst_for(vs, h);
		return;
	}
	c->peer_buf_alloc = h->buf_alloc;
	c->peer_fwd_cnt = h->fwd_cnt;
	switch (h->op) {
	case VSOCK_OP_RESPONSE:
		if (c->state == VSOCK_CONNECTING)
			c->state = VSOCK_ESTABLISHED;
		break;
	case VSOCK_OP_RST:
		c->state = VSOCK_CLOSED;
		c->was_reset = true;
		break;
	case VSOCK_OP_SHUTDOWN:
		c->peer_shutdown = true;
		break;
	case VSOCK_OP_RW:
		on_data(c, payload, h->len);
		break;
	case VSOCK_OP_CREDIT_REQUEST:
		vsock_send_ctl(vs, c, VSOCK_OP_CREDIT_UPDATE, 0);
		break;
	default:
		break;
	}
}

static void on_event(struct vsock *vs, const u8 *buf)
{
	u32 id;
	memcpy(&id, buf, 4);
	if (id != VSOCK_EVENT_TRANSPORT_RESET)
		fail("vsock: unknown event %u", id);
	vs->transport_resets++;
	/* Every connection is gone; the cid may have changed. */
	for (unsigned i = 0; i < VSOCK_MAX_CONNS; i++)
		if (vs->conns[i].state != VSOCK_FREE) {
			vs->conns[i].state = VSOCK_CLOSED;
			vs->conns[i].was_reset = true;
		}
	vs->cid = virtio_cfg_read64(&vs->vd, 0);
}

bool vsock_poll(struct vsock *vs)
{
	bool any = false;
	u32 len;
	u8 *buf;
	unsigned n = 0;
	while (n < VSOCK_RX_BUFS && (buf = virtq_get(vs->rx, &len))) {
		on_packet(vs, (const struct vsock_hdr *)buf, buf + HDR_SIZE, len);
		post_rx(vs, buf);
		n++;
	}
	if (n) {
		virtq_kick(vs->rx);
		any = true;
	}
	while ((buf = virtq_get(vs->ev, &len))) {
		if (len < 4)
			fail("vsock: event of %u bytes", len);
		on_event(vs, buf);
		post_event(vs, buf);
		virtq_kick(vs->ev);
		any = true;
	}
	reclaim_tx(vs);
	return any;
}

void vsock_wait(struct vsock *vs, u64 us)
{
	if (vsock_poll(vs))
		return;
	if (virtq_wait(vs->rx, us) < 0)
		fail("vsock: the device needs a reset");
	vsock_poll(vs);
}

struct vsock_conn *vsock_connect(struct vsock *vs, u32 port, u64 timeout_us)
{
	struct vsock_conn *c = new_conn(vs, vs->next_port++, port, VSOCK_CONNECTING);
	if (!c)
		fail("vsock: no free connection");
	vsock_send_ctl(vs, c, VSOCK_OP_REQUEST, 0);
	struct timeout t;
	timeout_start(&t, timeout_us);
	while (c->state == VSOCK_CONNECTING && !timeout_expired(&t))
		vsock_wait(vs, 10000);
	if (c->state == VSOCK_ESTABLISHED)
		return c;
	if (c->state == VSOCK_CONNECTING)
		vsock_send_ctl(vs, c, VSOCK_OP_RST, 0);
	c->state = VSOCK_FREE;
	return NULL;
}

struct vsock_conn *vsock_accept(struct vsock *vs, u32 port, u64 timeout_us)
{
	vs->listen_port = port;
	struct timeout t;
	timeout_start(&t, timeout_us);
	do {
		for (unsigned i = 0; i < VSOCK_MAX_CONNS; i++) {
			struct vsock_conn *c = &vs->conns[i];
			if (c->state == VSOCK_ESTABLISHED && c->pending_accept) {
				c->pending_accept = false;
				return c;
			}
		}
		vsock_wait(vs, 10000);
	} while (!timeout_expired(&t));
	return NULL;
}

u32 vsock_send(struct vsock *vs, struct vsock_conn *c, const void *buf, u32 len)
{
	const u8 *p = buf;
	u32 sent = 0;
	while (sent < len && c->state == VSOCK_ESTABLISHED) {
		u32 in_flight = c->tx_cnt - c->peer_fwd_cnt;
		u32 credit = in_flight > c->peer_buf_alloc ? 0 : c->peer_buf_alloc - in_flight;
		u32 n = len - sent;
		if (n > credit)
			n = credit;
		if (n > VSOCK_PKT_PAYLOAD)
			n = VSOCK_PKT_PAYLOAD;
		if (!n)
			break;
		struct vsock_hdr h;
		fill_hdr(vs, &h, c->local_port, c->peer_port, VSOCK_OP_RW);
		h.len = n;
		h.fwd_cnt = c->fwd_cnt;
		if (!vsock_send_raw(vs, &h, p + sent, n))
			break;
		c->reported_fwd_cnt = c->fwd_cnt;
		c->tx_cnt += n;
		sent += n;
	}
	return sent;
}

u32 vsock_recv(struct vsock *vs, struct vsock_conn *c, void *buf, u32 len)
{
	u8 *p = buf;
	u32 n = len < c->rx_len ? len : c->rx_len;
	for (u32 i = 0; i < n; i++)
		p[i] = c->rxbuf[(c->rx_head + i) % VSOCK_BUF_ALLOC];
	c->rx_head = (c->rx_head + n) % VSOCK_BUF_ALLOC;
	c->rx_len -= n;
	c->fwd_cnt += n;
	if (c->state == VSOCK_ESTABLISHED && c->fwd_cnt - c->reported_fwd_cnt >= VSOCK_BUF_ALLOC / 4)
		vsock_send_ctl(vs, c, VSOCK_OP_CREDIT_UPDATE, 0);
	return n;
}

void vsock_close(struct vsock *vs, struct vsock_conn *c, u64 timeout_us)
{
	if (c->state == VSOCK_ESTABLISHED) {
		vsock_send_ctl(vs, c, VSOCK_OP_SHUTDOWN, VSOCK_SHUTDOWN_BOTH);
		struct timeout t;
		timeout_start(&t, timeout_us);
		while (c->state == VSOCK_ESTABLISHED && !timeout_expired(&t))
			vsock_wait(vs, 10000);
		if (c->state == VSOCK_ESTABLISHED) {
			printf("vsock: no RST for port %u after SHUTDOWN; resetting\n", c->local_port);
			vsock_send_ctl(vs, c, VSOCK_OP_RST, 0);
		}
	}
	c->state = VSOCK_FREE;
}
