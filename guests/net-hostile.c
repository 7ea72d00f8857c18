/*
 * net-hostile: a virtio-net driver that breaks the rules, then checks that
 * the device still works (addresses and `port=` as in net-echo.c).
 *
 * Transmit chains: a buffer outside guest RAM, a chain shorter than the
 * virtio-net header, a device-writable buffer only, and a frame longer than
 * any the negotiated features allow (split over two descriptors): each must
 * come back used with length 0, and a good echo passes after them.
 * Control queue: an unknown class, VQ_PAIRS_SET without MQ, a command
 * longer than the device reads, ANNOUNCE_ACK with stray data: each answered
 * VIRTIO_NET_ERR; a command without a writable byte comes back with length
 * 0.  Last, a transmit head beyond the queue: the device must set
 * DEVICE_NEEDS_RESET; the driver resets it, starts again, and a good echo
 * passes.  Then receive buffers of 64 bytes: the ARP reply fits, a 200-byte
 * echo does not and must come back as a used buffer of length 0; after a
 * reset with full-size buffers a good echo passes again.
 */
#include "net.h"

static struct net_dev net;
static u32 my_ip, peer_ip;
static u8 peer_mac[6];
static u16 port;

static void good_echo(const char *when)
{
	static const char msg[] = "still alive";
	if (!net_udp_echo(&net, 0, my_ip, peer_ip, peer_mac, 44000, port, msg, sizeof(msg), 3000000))
		fail("no good echo %s", when);
	printf("net-hostile: good echo %s\n", when);
}

/* Queues one hostile transmit chain and expects it back with length 0. */
static void bad_tx(const char *what, const struct vbuf *bufs, unsigned n_out, unsigned n_in)
{
	struct virtq *tx = net.pair[0].tx;
	net_tx_reap(&net, 0);
	u32 len = 0xdead;
	int r = virtq_sync(tx, bufs, n_out, n_in, &len, 2000000);
	if (r != 1)
		fail("%s: not returned (%d)", what, r);
	if (len != 0)
		fail("%s: used length %u, expected 0", what, len);
	printf("net-hostile: %s returned\n", what);
}

static void bad_ctrl(const char *what, u8 class, u8 cmd, const void *data, u32 len)
{
	int ack = net_ctrl(&net, class, cmd, data, len);
	if (ack != VIRTIO_NET_ERR)
		fail("control %s answered %d, expected VIRTIO_NET_ERR", what, ack);
	printf("net-hostile: control %s refused\n", what);
}

static void hostile_tx(void)
{
	u8 *buf = dma_alloc(8192, 4096);
	memset(buf, 0, 8192);
	struct vbuf outside = { (void *)0x7f00000000ULL, 256 };
	bad_tx("a buffer outside RAM", &outside, 1, 0);
	struct vbuf short_hdr = { buf, 4 };
	bad_tx("a chain shorter than the header", &short_hdr, 1, 0);
	struct vbuf writable = { buf, 128 };
	bad_tx("a device-writable transmit buffer", &writable, 0, 1);
	struct vbuf huge[2] = { { buf, 4096 }, { buf + 4096, 4096 } };
	bad_tx("an over-long frame", huge, 2, 0);
}

static void hostile_ctrl(void)
{
	u8 data[1024];
	memset(data, 0, sizeof(data));
	bad_ctrl("class 99", 99, 0, data, 2);
	u16 pairs = 1;
	bad_ctrl("VQ_PAIRS_SET without MQ", VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET, &pairs, 2);
	bad_ctrl("of 1000 bytes", VIRTIO_NET_CTRL_ANNOUNCE, VIRTIO_NET_CTRL_ANNOUNCE_ACK, data, 1000);
	bad_ctrl("ANNOUNCE_ACK with data", VIRTIO_NET_CTRL_ANNOUNCE, VIRTIO_NET_CTRL_ANNOUNCE_ACK, data, 4);
	struct vbuf no_ack = { net.ctrl_buf, 2 };
	u32 len = 0xdead;
	if (virtq_sync(net.ctrl, &no_ack, 1, 0, &len, 2000000) != 1 || len != 0)
		fail("a control command without an answer byte: used length %u", len);
	printf("net-hostile: control command without an answer byte returned\n");
}

static void head_beyond_queue(void)
{
	struct virtq *tx = net.pair[0].tx;
	virtq_publish_raw(tx, (u16)(tx->size + 5));
	virtq_notify(tx);
	u64 deadline = net_deadline(2000000);
	while (!(virtio_status(&net.vd) & VIRTIO_S_NEEDS_RESET)) {
		if (net_expired(deadline))
			fail("no DEVICE_NEEDS_RESET after a head beyond the queue");
		pause();
	}
	printf("net-hostile: a head beyond the queue set DEVICE_NEEDS_RESET\n");
	if (!virtio_reset(&net.vd) || !net_start(&net, 0, 1, 256))
		fail("virtio-net did not start again after the reset");
}

static void small_receive_buffers(void)
{
	if (!virtio_reset(&net.vd))
		fail("reset failed");
	net.rx_len = 64;
	if (!net_start(&net, 0, 1, 256))
		fail("virtio-net did not start with small buffers");
	if (!net_resolve(&net, 0, my_ip, peer_ip, peer_mac, 10000000))
		fail("no ARP reply into a 64-byte buffer");
	static u8 payload[200], buf[NET_BUF_LEN];
	memset(payload, 0x5a, sizeof(payload));
	u8 frame[300];
	u32 len = udp_frame(frame, net.mac, peer_mac, my_ip, peer_ip, 44001, port, payload,
			    sizeof(payload));
	for (int attempt = 0; attempt < 10 && !net.pair[0].rx_short; attempt++) {
		net_send(&net, 0, frame, len);
		u64 deadline = net_deadline(300000);
		while (!net_expired(deadline) && !net.pair[0].rx_short)
			net_recv(&net, 0, buf, 10000);
	}
	if (!net.pair[0].rx_short)
		fail("a frame longer than the receive buffer did not come back with length 0");
	printf("net-hostile: a frame longer than the receive buffer came back with length 0\n");
	if (!virtio_reset(&net.vd))
		fail("reset failed");
	net.rx_len = 0;
	if (!net_start(&net, 0, 1, 256))
		fail("virtio-net did not start again");
}

static u64 work(u64 arg)
{
	(void)arg;
	my_ip = parse_ip("10.0.2.15", 9);
	peer_ip = parse_ip("10.0.2.2", 8);
	port = (u16)cmdline_uint("port", 7777);
	if (!virtio_open(&net.vd, VIRTIO_ID_NET, 0))
		fail("no virtio-net device");
	if (!net_start(&net, VIRTIO_BIT(VIRTIO_NET_F_GUEST_ANNOUNCE), 1, 256))
		fail("virtio-net did not start");
	if (!net_resolve(&net, 0, my_ip, peer_ip, peer_mac, 10000000))
		fail("no ARP reply from the peer");
	good_echo("before");
	hostile_tx();
	good_echo("after the bad transmit chains");
	hostile_ctrl();
	good_echo("after the bad control commands");
	head_beyond_queue();
	good_echo("after the reset");
	small_receive_buffers();
	good_echo("after the small receive buffers");
	return 0;
}

void guest_main(void)
{
	tsc_hz();
	enter_ring3_irq(work, 0, false);
	pass();
}
