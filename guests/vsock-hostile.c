/*
 * vsock-hostile: malformed and abusive virtio-vsock traffic from the guest,
 * after which the device must still serve a good connection.
 *
 *  - dropped without an answer: a wrong source cid, a length of 1 MiB, a
 *    length beyond the buffer, a header split over short descriptors, a
 *    device-writable transmit buffer, a buffer outside RAM;
 *  - answered with RST: a SEQPACKET request, an unknown op, data for no
 *    connection, a request to a host port nobody listens on;
 *  - a guest that ignores the device's credit (host port 1235, whose host
 *    end never reads) is reset once its data exceeds the window;
 *  - a guest that never reads (host port 1236 sends 1 MiB) gets exactly its
 *    window and no more, and the device answers a CREDIT_REQUEST;
 *  - then 256 KiB are echoed through host port 1234, checked.
 */
#include "kit.h"

#define VECTOR	0x41
#define ECHO_PORT	1234
#define SINK_PORT	1235
#define FLOOD_PORT	1236

static struct vsock vs;
static u8 buf[8192], back[8192];

static void settle(void)
{
	for (int i = 0; i < 20; i++)
		vsock_wait(&vs, 10000);
}

static void raw(u64 src_cid, u32 dst_port, u16 type, u16 op, u32 len)
{
	struct vsock_hdr h = { src_cid, VSOCK_HOST_CID, 0x7000, dst_port, len, type, op, 0,
			       VSOCK_BUF_ALLOC, 0 };
	if (!vsock_send_raw(&vs, &h, buf, len > sizeof(buf) ? 0 : len))
		fail("vsock-hostile: transmit ring full");
}

static void chain(const struct vbuf *b, unsigned n_out, unsigned n_in)
{
	if (!vsock_send_chain(&vs, b, n_out, n_in))
		fail("vsock-hostile: transmit ring full");
}

static void expect_rsts(u32 want, const char *what)
{
	settle();
	if (vs.rsts_unmatched != want)
		fail("vsock-hostile: %s: %u RSTs, expected %u", what, vs.rsts_unmatched, want);
	printf("vsock-hostile: %s: %u RST(s) so far, as expected\n", what, want);
}

static void malformed(void)
{
	struct vsock_hdr *h = dma_alloc(4096, 64);
	memset(h, 0, 4096);
	raw(vs.cid + 1, ECHO_PORT, VSOCK_TYPE_STREAM, VSOCK_OP_REQUEST, 0);
	raw(vs.cid, ECHO_PORT, VSOCK_TYPE_STREAM, VSOCK_OP_RW, 1 << 20);
	*h = (struct vsock_hdr){ vs.cid, VSOCK_HOST_CID, 1, ECHO_PORT, 100, VSOCK_TYPE_STREAM,
				 VSOCK_OP_RW, 0, 0, 0 };
	struct vbuf only_header = { h, sizeof(*h) };
	chain(&only_header, 1, 0);
	struct vbuf split[2] = { { h, 20 }, { (u8 *)h + 20, sizeof(*h) - 20 } };
	chain(split, 2, 0);
	struct vbuf writable = { h, 64 };
	chain(&writable, 0, 1);
	struct vbuf outside = { (void *)0xf0000000ul, 64 };
	chain(&outside, 1, 0);
	expect_rsts(0, "malformed packets dropped");
	raw(vs.cid, ECHO_PORT, 2, VSOCK_OP_REQUEST, 0);
	raw(vs.cid, ECHO_PORT, VSOCK_TYPE_STREAM, 99, 0);
	raw(vs.cid, ECHO_PORT, VSOCK_TYPE_STREAM, VSOCK_OP_RW, 16);
	raw(vs.cid, 4321, VSOCK_TYPE_STREAM, VSOCK_OP_REQUEST, 0);
	expect_rsts(4, "bad type, unknown op, stray data, closed port");
}

/* Sends up to 8 MiB ignoring credit to a host end that never reads: far more
 * than any socket buffer and the window together. */
static void ignore_credit(void)
{
	struct vsock_conn *c = vsock_connect(&vs, SINK_PORT, 5000000);
	if (!c)
		fail("vsock-hostile: host port %u refused", SINK_PORT);
	u32 sent = 0;
	while (sent < (8u << 20) && c->state == VSOCK_ESTABLISHED) {
		struct vsock_hdr h = { vs.cid, VSOCK_HOST_CID, c->local_port, c->peer_port,
				       VSOCK_PKT_PAYLOAD, VSOCK_TYPE_STREAM, VSOCK_OP_RW, 0,
				       VSOCK_BUF_ALLOC, c->fwd_cnt };
		if (vsock_send_raw(&vs, &h, buf, VSOCK_PKT_PAYLOAD))
			sent += VSOCK_PKT_PAYLOAD;
		vsock_poll(&vs);
	}
	settle();
	if (c->state != VSOCK_CLOSED || !c->was_reset)
		fail("vsock-hostile: %u bytes beyond the credit and no RST", sent);
	printf("vsock-hostile: reset after %u KiB sent ignoring the credit\n", sent >> 10);
	c->state = VSOCK_FREE;
}

/* Reads nothing while the host sends 1 MiB: the device stops at the window. */
static void never_read(void)
{
	struct vsock_conn *c = vsock_connect(&vs, FLOOD_PORT, 5000000);
	if (!c)
		fail("vsock-hostile: host port %u refused", FLOOD_PORT);
	struct timeout t;
	timeout_start(&t, 10000000);
	while (c->rx_len < VSOCK_BUF_ALLOC && !timeout_expired(&t))
		vsock_wait(&vs, 10000);
	settle();
	if (c->rx_len != VSOCK_BUF_ALLOC || c->state != VSOCK_ESTABLISHED)
		fail("vsock-hostile: %u bytes buffered of a %u window", c->rx_len, VSOCK_BUF_ALLOC);
	u64 before = vs.rx_packets;
	vsock_send_ctl(&vs, c, VSOCK_OP_CREDIT_REQUEST, 0);
	settle();
	if (vs.rx_packets != before + 1 || c->rx_len != VSOCK_BUF_ALLOC)
		fail("vsock-hostile: CREDIT_REQUEST gave %lu packets", vs.rx_packets - before);
	printf("vsock-hostile: a guest that never reads holds exactly its %u KiB window\n",
	       VSOCK_BUF_ALLOC >> 10);
	vsock_send_ctl(&vs, c, VSOCK_OP_RST, 0);
	c->state = VSOCK_FREE;
}

static void good_echo(u32 total)
{
	struct vsock_conn *c = vsock_connect(&vs, ECHO_PORT, 5000000);
	if (!c)
		fail("vsock-hostile: the good connection was refused");
	u32 sent = 0, got = 0;
	struct timeout t;
	timeout_start(&t, 30000000);
	while (got < total) {
		if (timeout_expired(&t) || c->state != VSOCK_ESTABLISHED)
			fail("vsock-hostile: good connection: %u sent, %u back", sent, got);
		for (u32 i = 0; i < sizeof(buf); i++)
			buf[i] = (u8)(sent + i) * 13;
		u32 want = total - sent < sizeof(buf) ? total - sent : sizeof(buf);
		sent += vsock_send(&vs, c, buf, want);
		u32 r = vsock_recv(&vs, c, back, sizeof(back));
		for (u32 i = 0; i < r; i++)
			if (back[i] != (u8)((got + i) * 13))
				fail("vsock-hostile: byte %u of the echo is wrong", got + i);
		got += r;
		vsock_wait(&vs, 1000);
	}
	vsock_close(&vs, c, 5000000);
	printf("vsock-hostile: then a good connection echoed %u bytes intact\n", total);
}

static u64 work(u64 arg)
{
	(void)arg;
	if (!vsock_open(&vs, cmdline_uint("irq", 1), VECTOR))
		fail("vsock-hostile: no usable virtio-vsock device");
	malformed();
	ignore_credit();
	never_read();
	good_echo(256 << 10);
	return 0;
}

void guest_main(void)
{
	run_ring3_device_guest(work);
}
