/*
 * net-stress: many UDP frames in flight on `pairs=` (default 2) virtio-net
 * queue pairs against a host peer that echoes them (see net-echo.c for the
 * addresses and `port=`).  `count=` frames (default 4000) of 64 to 1400
 * bytes, `window=` (default 32) per pair unanswered at a time; each payload
 * carries its sequence number, its pair and a pattern derived from both,
 * checked on return (`size=` makes every payload that long).  Frame k goes out on pair k % pairs from its own UDP
 * source port, and answers are taken from every receive queue.  A stall
 * (nothing new for 500 ms) sends every outstanding frame again, counted;
 * more than 20 stalls fail.  Duplicates (answers to resent frames) are
 * counted and otherwise ignored.  Prints frames per pair and the rate.
 * `irq=1`: receive queues interrupt by MSI-X (polled otherwise).
 *
 * One-way modes for the benchmark: `mode=send` sends `count=` datagrams of
 * `size=` bytes to the peer's port `sink_port=` (7778), round-robin over
 * the pairs, then an end marker, and reports how many the host counted;
 * `mode=recv` asks the peer's port `blast_port=` (7779) for `count=`
 * datagrams of `size=` bytes and counts what arrives (until all did or
 * nothing came for 1 s), from the first to the last.  With `mrg=1` it
 * negotiates VIRTIO_NET_F_MRG_RXBUF, so datagrams up to 8972 bytes (over a
 * 9000-byte MTU) arrive spread over several receive buffers.
 */
#include "net.h"

#define MAX_COUNT 65536

static struct net_dev net;
static u8 frame[NET_BUF_LEN], rxbuf[NET_BUF_LEN];
static u8 received[MAX_COUNT / 8];
static u32 my_ip, peer_ip;
static u8 peer_mac[6];
static u16 port;
static unsigned pairs;

static bool got(u32 seq) { return received[seq / 8] >> (seq % 8) & 1; }

static u32 fixed_size;			/* size=: every payload this long */

static u32 payload_len(u32 seq) { return fixed_size ? fixed_size : 64 + (seq * 37) % 1337; }

static void fill(u8 *p, u32 seq)
{
	u32 len = payload_len(seq);
	memcpy(p, &seq, 4);
	p[4] = (u8)(seq % pairs);
	for (u32 i = 5; i < len; i++)
		p[i] = (u8)(seq ^ (i * 13));
}

static void send_seq(u32 seq)
{
	static u8 payload[1536];
	fill(payload, seq);
	unsigned p = seq % pairs;
	u32 flen = udp_frame(frame, net.mac, peer_mac, my_ip, peer_ip, (u16)(42000 + p), port,
			     payload, payload_len(seq));
	if (!net_send(&net, p, frame, flen))
		fail("pair %u: transmit queue stuck", p);
}

/* One frame from any receive queue; returns the sequence number it
 * answers, or -1. */
static s64 receive_one(unsigned p, u32 count, u64 *dups)
{
	static u8 want[1536];
	int len = net_recv(&net, p, rxbuf, 0);
	struct rx_frame rx;
	if (len <= 0 || !parse_frame(rxbuf, (u32)len, &rx))
		return -1;
	if (net_answer_arp(&net, p, &rx, my_ip))
		return -1;
	if (rx.type != ETH_P_IP || rx.proto != IPPROTO_UDP || rx.sport != port || rx.payload_len < 5)
		return -1;
	u32 seq;
	memcpy(&seq, rx.payload, 4);
	if (seq >= count)
		fail("an echo names frame %u of %u", seq, count);
	fill(want, seq);
	if (rx.payload_len != payload_len(seq) || memcmp(want, rx.payload, rx.payload_len) != 0)
		fail("echo of frame %u corrupted (%u bytes)", seq, rx.payload_len);
	if (got(seq)) {
		(*dups)++;
		return -1;
	}
	received[seq / 8] |= (u8)(1 << (seq % 8));
	return seq;
}

static u64 us_since(u64 start)
{
	return (rdtsc() - start) / (tsc_hz() / 1000000);
}

static void one_way_send(u32 count)
{
	u16 sink = (u16)cmdline_uint("sink_port", 7778);
	static u8 payload[1536];
	u32 size = fixed_size ? fixed_size : 1400;
	memset(payload, 0x11, size);
	u64 start = rdtsc();
	for (u32 i = 0; i < count; i++) {
		unsigned p = i % pairs;
		memcpy(payload, &i, 4);
		u32 flen = udp_frame(frame, net.mac, peer_mac, my_ip, peer_ip, (u16)(46000 + p), sink,
				     payload, size);
		if (!net_send(&net, p, frame, flen))
			fail("pair %u: transmit queue stuck", p);
	}
	for (unsigned p = 0; p < pairs; p++)
		while (net.pair[p].tx_inflight)
			net_tx_reap(&net, p);
	u64 us = us_since(start);
	u32 end = 0xffffffffu, host = 0;
	u32 flen = udp_frame(frame, net.mac, peer_mac, my_ip, peer_ip, 46100, sink, &end, 4);
	u64 deadline = net_deadline(2000000);
	net_send(&net, 0, frame, flen);
	while (!net_expired(deadline)) {
		int len = net_recv(&net, 0, rxbuf, 10000);
		struct rx_frame rx;
		if (len <= 0 || !parse_frame(rxbuf, (u32)len, &rx) || net_answer_arp(&net, 0, &rx, my_ip))
			continue;
		if (rx.type == ETH_P_IP && rx.proto == IPPROTO_UDP && rx.sport == sink && rx.payload_len == 4) {
			memcpy(&host, rx.payload, 4);
			break;
		}
	}
	printf("net-stress: sent %u datagrams of %u bytes in %lu us, the host received %u\n", count,
	       size, us, host);
}

static u8 bigbuf[9216];

/* The next frame of pair p (no header) in rxbuf-like storage; see net_recv. */
static int receive_any(unsigned p, const u8 **out)
{
	if (!virtio_has(&net.vd, VIRTIO_NET_F_MRG_RXBUF)) {
		*out = rxbuf;
		return net_recv(&net, p, rxbuf, 0);
	}
	int len = net_recv_merged(&net, p, bigbuf, sizeof(bigbuf), 0);
	*out = bigbuf + NET_HDR_LEN;
	return len > NET_HDR_LEN ? len - NET_HDR_LEN : len > 0 ? 0 : len;
}

static void one_way_receive(u32 count)
{
	u16 blast = (u16)cmdline_uint("blast_port", 7779);
	u32 size = fixed_size ? fixed_size : 1400;
	char request[32];
	int rlen = snprintf(request, sizeof(request), "%u %u", count, size);
	u32 flen = udp_frame(frame, net.mac, peer_mac, my_ip, peer_ip, 46200, blast, request, (u32)rlen);
	net_send(&net, 0, frame, flen);
	u32 got = 0;
	u64 first = 0, last = 0, idle = net_deadline(3000000);
	while (got < count && !net_expired(idle)) {
		for (unsigned p = 0; p < pairs; p++) {
			const u8 *f;
			int len = receive_any(p, &f);
			struct rx_frame rx;
			if (len <= 0 || !parse_frame(f, (u32)len, &rx) || net_answer_arp(&net, p, &rx, my_ip))
				continue;
			if (rx.type != ETH_P_IP || rx.proto != IPPROTO_UDP || rx.sport != blast)
				continue;
			if (rx.payload_len != size)
				fail("a %u-byte datagram, expected %u", rx.payload_len, size);
			last = rdtsc();
			if (!got++)
				first = last;
			idle = net_deadline(1000000);
		}
	}
	printf("net-stress: received %u of %u datagrams of %u bytes in %lu us\n", got, count, size,
	       got ? (last - first) / (tsc_hz() / 1000000) : 0);
	printf("net-stress: receive notifications %lu\n", net.pair[0].rx->kicks);
}

static u64 work(u64 arg)
{
	(void)arg;
	size_t len;
	const char *v = cmdline_arg("ip", &len);
	my_ip = v ? parse_ip(v, len) : parse_ip("10.0.2.15", 9);
	v = cmdline_arg("peer", &len);
	peer_ip = v ? parse_ip(v, len) : parse_ip("10.0.2.2", 8);
	port = (u16)cmdline_uint("port", 7777);
	u32 count = (u32)cmdline_uint("count", 4000), window = (u32)cmdline_uint("window", 32);
	fixed_size = (u32)cmdline_uint("size", 0);
	bool mrg = cmdline_uint("mrg", 0);
	u32 max_size = mrg ? 8972 : 1472;
	if (fixed_size && (fixed_size < 8 || fixed_size > max_size))
		fail("size=%u: 8 to %u bytes", fixed_size, max_size);
	if (count > MAX_COUNT)
		fail("count=%u: at most %u", count, MAX_COUNT);
	if (!virtio_open(&net.vd, VIRTIO_ID_NET, 0))
		fail("no virtio-net device");
	net.irq = cmdline_uint("irq", 0);
	u64 wanted = mrg ? VIRTIO_BIT(VIRTIO_NET_F_MRG_RXBUF) : 0;
	if (!net_start(&net, wanted, (unsigned)cmdline_uint("pairs", 2), 256))
		fail("virtio-net did not start");
	pairs = net.pairs;
	printf("net-stress: %u queue pairs\n", pairs);
	if (!net_resolve(&net, 0, my_ip, peer_ip, peer_mac, 10000000))
		fail("no ARP reply from the peer");
	size_t mlen;
	const char *mode = cmdline_arg("mode", &mlen);
	if (mode && mlen == 4 && !memcmp(mode, "send", 4)) {
		one_way_send(count);
		return 0;
	}
	if (mode && mlen == 4 && !memcmp(mode, "recv", 4)) {
		one_way_receive(count);
		return 0;
	}
	u32 sent = 0, done = 0, stalls = 0;
	u64 dups = 0, resent = 0, start = rdtsc();
	u64 stall_at = net_deadline(500000);
	while (done < count) {
		while (sent < count && sent - done < window * pairs)
			send_seq(sent++);
		bool progress = false;
		for (unsigned p = 0; p < pairs; p++)
			while (receive_one(p, count, &dups) >= 0) {
				done++;
				progress = true;
			}
		if (progress) {
			stall_at = net_deadline(500000);
			continue;
		}
		if (!net_expired(stall_at))
			continue;
		if (++stalls > 20)
			fail("stalled: %u of %u echoes after %u resends", done, count, stalls - 1);
		for (u32 seq = 0; seq < sent; seq++)
			if (!got(seq)) {
				send_seq(seq);
				resent++;
			}
		stall_at = net_deadline(500000);
	}
	u64 us = (rdtsc() - start) / (tsc_hz() / 1000000);
	for (unsigned p = 0; p < pairs; p++)
		printf("net-stress: pair %u: tx %lu rx %lu, notifications tx %lu rx %lu\n", p,
		       net.pair[p].tx_frames, net.pair[p].rx_frames, net.pair[p].tx->kicks,
		       net.pair[p].rx->kicks);
	printf("net-stress: %u echoes intact in %lu us, %lu resent, %lu duplicates, %u stalls\n",
	       count, us, resent, dups, stalls);
	static const char hello[] = "after the stress";
	if (!net_udp_echo(&net, 0, my_ip, peer_ip, peer_mac, 43000, port, hello, sizeof(hello), 2000000))
		fail("a last echo did not come back");
	return 0;
}

void guest_main(void)
{
	tsc_hz();
	bool irq = cmdline_uint("irq", 0);
	if (irq) {
		lapic_enable();
		lapic_mask_lint0();
		pic_disable();
	}
	enter_ring3_irq(work, 0, irq);
	pass();
}
