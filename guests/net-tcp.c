/*
 * net-tcp: bulk TCP between the guest (the kit's TCP, lib/tcp.c, in ring
 * 3 over the polled virtio-net driver) and a real TCP socket on the host.
 *
 * The guest is `ip=` (default 10.0.2.15) and connects to `peer=` (10.0.2.2)
 * port `port=` (default 5001).  The stream is a checkable pattern: byte o is
 * pattern(o mod 65521), pattern(i) = bits 16-23 of i * 2654435761 (32-bit).
 *
 * `mode=send` (default): streams `bytes=` (default 64 MiB) and closes; the
 * host checks every byte and answers one line before its FIN ("ok N US",
 * its count and the microseconds from its first byte to our FIN), printed.
 * `mode=recv`: sends "N\n" (N = `bytes=`); the host sends N bytes of the
 * pattern and closes; the guest checks every byte.
 *
 * `tso=1` (default) negotiates VIRTIO_NET_F_CSUM and HOST_TSO4 (segments of
 * up to 64 KiB go out as GSO frames: a two-buffer chain, header then data
 * straight from the pattern) and GUEST_CSUM and GUEST_TSO4 (the host's GSO
 * frames come whole, over mergeable receive buffers); `tso=0` negotiates
 * none: MSS-sized frames, checksums computed and checked by the guest.
 * `mss=` is the MSS the guest announces (default 1460).  Prints the
 * throughput, the frames' sizes, and a verdict; fails (with a line saying
 * where the stream stood) when it stops moving for `stall_ms=` (5000).
 */
#include "tcp.h"

#define PERIOD 65521u

static struct net_dev net;
static struct tcp_conn conn;
static u8 *pattern;		/* PERIOD + 64 KiB: any segment is one slice */
static u64 first_rx, last_rx;
static char verdict[128];
static u32 verdict_len;
static bool checking;

static u8 pattern_byte(u32 i) { return (u8)((i * 2654435761u) >> 16); }

static const u8 *from_pattern(void *ctx, u64 offset, u32 len)
{
	(void)ctx;
	(void)len;
	return pattern + offset % PERIOD;
}

static const u8 *from_text(void *ctx, u64 offset, u32 len)
{
	(void)len;
	return (const u8 *)ctx + offset;
}

/* Incoming bytes: checked against the pattern (mode=recv) or kept (the verdict). */
static void take(void *ctx, u64 offset, const u8 *data, u32 len)
{
	(void)ctx;
	last_rx = rdtsc();
	if (!first_rx)
		first_rx = last_rx;
	if (!checking) {
		for (u32 i = 0; i < len && verdict_len + 1 < sizeof(verdict); i++)
			verdict[verdict_len++] = (char)data[i];
		return;
	}
	if (memcmp(data, pattern + offset % PERIOD, len) != 0) {
		for (u32 i = 0; i < len; i++)
			if (data[i] != pattern[(offset + i) % PERIOD])
				fail("net-tcp: byte %lu is 0x%x, expected 0x%x", offset + i, data[i],
				     pattern[(offset + i) % PERIOD]);
	}
}

static u64 us_of(u64 ticks) { return ticks / (tsc_hz() / 1000000); }

static void report_frames(void)
{
	struct tcp_conn *c = &conn;
	printf("net-tcp: frames out %lu (%lu GSO, largest %lu bytes), in %lu (%lu GSO, largest %lu "
	       "bytes); %lu retransmits, %lu out of order, %lu bad checksums\n",
	       c->tx_segments, c->tx_gso_segments, c->tx_largest, c->rx_frames, c->rx_gso_frames,
	       c->rx_largest, c->retransmits, c->rx_ooo, c->rx_bad_csum);
	printf("net-tcp: notifications: receive queue %lu, transmit queue %lu\n", net.pair[0].rx->kicks,
	       net.pair[0].tx->kicks);
}

static void send_mode(u64 bytes, u64 stall_us)
{
	u64 start = rdtsc();
	tcp_send_all(&conn, bytes, from_pattern, NULL, stall_us);
	u64 us = us_of(rdtsc() - start);
	if (!tcp_close(&conn, stall_us))
		fail("net-tcp: the host did not close");
	verdict[verdict_len] = 0;
	while (verdict_len && (verdict[verdict_len - 1] == '\n' || verdict[verdict_len - 1] == '\r'))
		verdict[--verdict_len] = 0;
	printf("net-tcp: sent %lu bytes in %lu us (%lu Mbit/s), all acknowledged\n", bytes, us,
	       us ? bytes * 8 / us : 0);
	report_frames();
	printf("net-tcp: host says: %s\n", verdict);
	char want[32];
	int n = snprintf(want, sizeof(want), "ok %lu ", bytes);
	if (verdict_len < (u32)n || memcmp(verdict, want, (size_t)n) != 0)
		fail("net-tcp: the host's verdict is not \"%s...\"", want);
}

static void recv_mode(u64 bytes, u64 stall_us)
{
	char request[32];
	int n = snprintf(request, sizeof(request), "%lu\n", bytes);
	tcp_send_all(&conn, (u64)n, from_text, request, stall_us);
	checking = true;
	u64 stall = net_deadline(stall_us), seen = 0;
	while (!conn.fin_rcvd) {
		tcp_poll(&conn);
		if (conn.received != seen) {
			seen = conn.received;
			stall = net_deadline(stall_us);
		} else if (net_expired(stall)) {
			fail("net-tcp: stalled: %lu of %lu bytes received, %lu out of order", conn.received,
			     bytes, conn.rx_ooo);
		}
	}
	if (conn.received != bytes)
		fail("net-tcp: the host closed after %lu of %lu bytes", conn.received, bytes);
	u64 us = first_rx ? us_of(last_rx - first_rx) : 0;
	if (!tcp_close(&conn, stall_us))
		fail("net-tcp: our FIN was not acknowledged");
	printf("net-tcp: received %lu bytes intact in %lu us (%lu Mbit/s, first to last byte)\n",
	       bytes, us, us ? bytes * 8 / us : 0);
	report_frames();
}

static u64 work(u64 arg)
{
	(void)arg;
	size_t len;
	const char *v = cmdline_arg("ip", &len);
	conn.my_ip = v ? parse_ip(v, len) : parse_ip("10.0.2.15", 9);
	v = cmdline_arg("peer", &len);
	conn.peer_ip = v ? parse_ip(v, len) : parse_ip("10.0.2.2", 8);
	conn.dport = (u16)cmdline_uint("port", 5001);
	conn.sport = (u16)(40000 + rdtsc() % 20000);
	conn.n = &net;
	conn.sink = take;
	u64 bytes = cmdline_uint("bytes", 64 << 20);
	u64 stall_us = cmdline_uint("stall_ms", 5000) * 1000;
	bool tso = cmdline_uint("tso", 1);
	pattern = dma_alloc(PERIOD + 65536, 4096);
	for (u32 i = 0; i < PERIOD + 65536; i++)
		pattern[i] = pattern_byte(i % PERIOD);
	if (!virtio_open(&net.vd, VIRTIO_ID_NET, 0))
		fail("no virtio-net device");
	u64 wanted = VIRTIO_BIT(VIRTIO_NET_F_MRG_RXBUF) | VIRTIO_BIT(VIRTIO_F_INDIRECT_DESC) |
		     VIRTIO_BIT(VIRTIO_F_EVENT_IDX);
	if (tso)
		wanted |= VIRTIO_BIT(VIRTIO_NET_F_CSUM) | VIRTIO_BIT(VIRTIO_NET_F_HOST_TSO4) |
			  VIRTIO_BIT(VIRTIO_NET_F_GUEST_CSUM) | VIRTIO_BIT(VIRTIO_NET_F_GUEST_TSO4);
	if (!net_start(&net, wanted, 1, 256))
		fail("virtio-net did not start");
	if (tso && !(virtio_has(&net.vd, VIRTIO_NET_F_HOST_TSO4) && virtio_has(&net.vd, VIRTIO_NET_F_GUEST_TSO4)))
		fail("net-tcp: tso=1 but the device does not offer HOST_TSO4 and GUEST_TSO4");
	if (!tcp_connect(&conn, (u16)cmdline_uint("mss", 1460), 10000000))
		fail("net-tcp: no connection");
	printf("net-tcp: connected, peer MSS %u, window scale %u, %s\n", conn.mss, conn.snd_wscale,
	       conn.tso ? "TSO (segments of up to 64 KiB)" : "no TSO");
	v = cmdline_arg("mode", &len);
	if (v && len == 4 && !memcmp(v, "recv", 4))
		recv_mode(bytes, stall_us);
	else
		send_mode(bytes, stall_us);
	return 0;
}

void guest_main(void)
{
	tsc_hz();
	enter_ring3(work, 0);
	pass();
}
