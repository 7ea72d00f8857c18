/*
 * net-echo: ARP, UDP echo and ICMP echo against a host peer through the
 * first virtio-net PCI function, driven from ring 3 by the kit's polled
 * driver (lib/net.c).
 *
 * The guest is `ip=` (default 10.0.2.15); the peer `peer=` (10.0.2.2)
 * answers ARP and ICMP (its kernel) and echoes UDP on port `port=` (7777).
 * Checks: the configuration space's MAC equals `mac=` when given and the
 * link is up; the peer's MAC is resolved by ARP; `rounds=` UDP echoes
 * (default 20; each payload carries its sequence number and a pattern
 * derived from it, and a lost one is sent again after 300 ms, at most 20
 * times) and `pings=` ICMP echoes (default 5) come back intact.  ARP
 * requests for the guest are answered all along.  With
 * VIRTIO_NET_F_GUEST_ANNOUNCE negotiated, a VIRTIO_NET_S_ANNOUNCE seen in
 * the status (after a restore or a migration) is answered with a
 * gratuitous ARP and VIRTIO_NET_CTRL_ANNOUNCE_ACK, and reported
 * ("net-echo: announced").  `progress=N` prints a line every N rounds;
 * `pause_us=` waits between rounds (for snapshot tests).  `irq=1` receives
 * by MSI-X interrupt (every wait must end with one; an announcement must
 * have come with a configuration interrupt) instead of polling.  `mrg=1`
 * negotiates VIRTIO_NET_F_MRG_RXBUF (every frame's num_buffers checked).
 * `tso=1` negotiates mergeable buffers with GUEST_CSUM and GUEST_TSO4, posts
 * 1530-byte receive buffers and at the end asks the peer (a datagram with the
 * guest's MAC to port+1) for a large TCP segment, which the peer writes to the
 * tap as one GSO frame (TCPV4) carrying TSO_PAYLOAD bytes, and a BIG_DATAGRAM-
 * byte UDP datagram (the tap's MTU is 9000): both must arrive whole, each
 * spread over several buffers.
 */
#include "net.h"

static struct net_dev net;
static u32 my_ip, peer_ip;
static u8 peer_mac[6];
static u16 port;
static u8 frame[NET_BUF_LEN], rxbuf[NET_BUF_LEN];
static unsigned announced, retries;

#define TSO_PAYLOAD	60000
#define BIG_DATAGRAM	8000
static u8 big[TSO_PAYLOAD + 256];

static bool pattern_ok(const u8 *p, u32 len)
{
	for (u32 i = 0; i < len; i++)
		if (p[i] != (u8)(i % 251))
			return false;
	return true;
}

/* One large frame from the peer, checked; 1 for the TSO frame, 2 for the datagram. */
static unsigned big_frame(u32 len, u16 sport)
{
	const u8 *hdr = big, *f = big + NET_HDR_LEN;
	u16 num_buffers = (u16)(hdr[10] | hdr[11] << 8);
	struct rx_frame rx;
	if (len < NET_HDR_LEN || !parse_frame(f, len - NET_HDR_LEN, &rx))
		return 0;
	if (net_answer_arp(&net, 0, &rx, my_ip) || rx.type != ETH_P_IP || rx.sip != peer_ip)
		return 0;
	if (rx.proto == IPPROTO_UDP && rx.sport == port + 1 && rx.dport == sport) {
		if (rx.payload_len != BIG_DATAGRAM || !pattern_ok(rx.payload, rx.payload_len))
			fail("the large datagram came back damaged (%u bytes)", rx.payload_len);
		printf("net-echo: a %u-byte datagram in %u buffers\n", len - NET_HDR_LEN, num_buffers);
		return 2;
	}
	if (rx.proto != IPPROTO_TCP)
		return 0;
	const u8 *tcp = f + 14 + (f[14] & 15) * 4;
	u32 data_off = (u32)(tcp[12] >> 4) * 4;
	const u8 *payload = tcp + data_off;
	u32 payload_len = len - (u32)(payload - big);
	u16 gso_size = (u16)(hdr[4] | hdr[5] << 8);
	if (hdr[1] != 1 /* VIRTIO_NET_HDR_GSO_TCPV4 */ || payload_len != TSO_PAYLOAD)
		fail("TCP frame: gso_type %u, %u payload bytes (a TSO frame of %u expected)", hdr[1],
		     payload_len, TSO_PAYLOAD);
	if (!pattern_ok(payload, payload_len))
		fail("the TSO frame came back damaged");
	printf("net-echo: a %u-byte TSO frame (gso_size %u) in %u buffers\n", len - NET_HDR_LEN,
	       gso_size, num_buffers);
	return 1;
}

/* Asks the peer for a TSO frame and a large datagram until both have come. */
static void large_frames(void)
{
	u16 sport = 40100;
	unsigned seen = 0;
	for (unsigned attempt = 0; attempt < 10 && seen != 3; attempt++) {
		u32 flen = udp_frame(frame, net.mac, peer_mac, my_ip, peer_ip, sport, (u16)(port + 1),
				     net.mac, 6);
		if (!net_send(&net, 0, frame, flen))
			fail("transmit queue stuck");
		u64 deadline = net_deadline(1000000);
		while (seen != 3 && !net_expired(deadline)) {
			int got = net_recv_merged(&net, 0, big, sizeof(big), 10000);
			if (got > 0)
				seen |= big_frame((u32)got, sport);
		}
	}
	if (seen != 3)
		fail("large frames from the peer: %u of 3", seen);
}

static u32 ip_arg(const char *key, const char *dflt)
{
	size_t len;
	const char *v = cmdline_arg(key, &len);
	if (!v) {
		v = dflt;
		len = strlen(dflt);
	}
	u32 ip = parse_ip(v, len);
	if (!ip)
		fail("%s=: not an IPv4 address", key);
	return ip;
}

static void check_mac(void)
{
	size_t len;
	const char *want = cmdline_arg("mac", &len);
	char got[18];
	snprintf(got, sizeof(got), "%02x:%02x:%02x:%02x:%02x:%02x", net.mac[0], net.mac[1],
		 net.mac[2], net.mac[3], net.mac[4], net.mac[5]);
	printf("net-echo: mac %s\n", got);
	if (want && (len != 17 || memcmp(want, got, 17) != 0))
		fail("configuration space MAC %s, expected %.*s", got, (int)len, want);
	u16 status = virtio_cfg_read16(&net.vd, VIRTIO_NET_CFG_STATUS);
	if (!(status & VIRTIO_NET_S_LINK_UP))
		fail("link down (status 0x%x)", status);
}

/* Answers VIRTIO_NET_S_ANNOUNCE: gratuitous ARP, then the acknowledgement. */
static void check_announce(void)
{
	if (!virtio_has(&net.vd, VIRTIO_NET_F_GUEST_ANNOUNCE))
		return;
	u16 status = virtio_cfg_read16(&net.vd, VIRTIO_NET_CFG_STATUS);
	if (!(status & VIRTIO_NET_S_ANNOUNCE))
		return;
	static const u8 bcast[6] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
	u32 len = arp_frame(frame, 1, net.mac, my_ip, NULL, my_ip);
	memcpy(frame, bcast, 6);
	net_send(&net, 0, frame, len);
	int ack = net_ctrl(&net, VIRTIO_NET_CTRL_ANNOUNCE, VIRTIO_NET_CTRL_ANNOUNCE_ACK, NULL, 0);
	if (ack != VIRTIO_NET_OK)
		fail("ANNOUNCE_ACK answered %d", ack);
	if (virtio_cfg_read16(&net.vd, VIRTIO_NET_CFG_STATUS) & VIRTIO_NET_S_ANNOUNCE)
		fail("VIRTIO_NET_S_ANNOUNCE still set after the acknowledgement");
	announced++;
	printf("net-echo: announced\n");
}

static void fill_payload(u8 *p, u32 len, u32 seq)
{
	memcpy(p, &seq, 4);
	for (u32 i = 4; i < len; i++)
		p[i] = (u8)(seq * 7 + i);
}

/* Receives until `match` accepts a frame or the wait ends; answers ARP. */
static bool await(bool (*match)(const struct rx_frame *, u32), u32 arg, u64 us)
{
	u64 deadline = net_deadline(us);
	while (!net_expired(deadline)) {
		int got = net_recv(&net, 0, rxbuf, 10000);
		struct rx_frame rx;
		if (got <= 0 || !parse_frame(rxbuf, (u32)got, &rx))
			continue;
		if (net_answer_arp(&net, 0, &rx, my_ip))
			continue;
		if (match(&rx, arg))
			return true;
	}
	return false;
}

static bool udp_reply(const struct rx_frame *rx, u32 seq)
{
	if (rx->type != ETH_P_IP || rx->proto != IPPROTO_UDP || rx->sip != peer_ip ||
	    rx->sport != port || rx->payload_len < 4)
		return false;
	u32 got;
	memcpy(&got, rx->payload, 4);
	if (got != seq)
		return false;	/* a late answer to a retransmission */
	u8 want[256];
	fill_payload(want, rx->payload_len, seq);
	if (rx->payload_len != 64 + seq % 128 || memcmp(want, rx->payload, rx->payload_len) != 0)
		fail("UDP echo %u came back corrupted (%u bytes)", seq, rx->payload_len);
	return true;
}

static bool icmp_reply(const struct rx_frame *rx, u32 seq)
{
	if (rx->type != ETH_P_IP || rx->proto != IPPROTO_ICMP || rx->sip != peer_ip ||
	    rx->icmp_type != 0 || rx->icmp_id != 0x4242 || rx->icmp_seq != seq)
		return false;
	u8 want[64];
	fill_payload(want, 56, seq);
	if (rx->payload_len != 56 || memcmp(want, rx->payload, 56) != 0)
		fail("ICMP echo reply %u carries other data", seq);
	return true;
}

static void udp_round(u32 seq)
{
	u8 payload[256];
	u32 len = 64 + seq % 128;
	fill_payload(payload, len, seq);
	for (unsigned attempt = 0; attempt < 20; attempt++) {
		u32 flen = udp_frame(frame, net.mac, peer_mac, my_ip, peer_ip, (u16)(40000 + seq % 16),
				     port, payload, len);
		if (!net_send(&net, 0, frame, flen))
			fail("transmit queue stuck");
		if (await(udp_reply, seq, 300000))
			return;
		retries++;
		check_announce();
	}
	fail("no UDP echo for round %u", seq);
}

static void ping(u32 seq)
{
	u8 payload[56];
	fill_payload(payload, sizeof(payload), seq);
	u32 flen = icmp_echo_frame(frame, net.mac, peer_mac, my_ip, peer_ip, 0x4242, (u16)seq,
				   payload, sizeof(payload));
	if (!net_send(&net, 0, frame, flen))
		fail("transmit queue stuck");
	if (!await(icmp_reply, seq, 2000000))
		fail("no ICMP echo reply %u", seq);
}

static u64 work(u64 arg)
{
	(void)arg;
	my_ip = ip_arg("ip", "10.0.2.15");
	peer_ip = ip_arg("peer", "10.0.2.2");
	port = (u16)cmdline_uint("port", 7777);
	if (!virtio_open(&net.vd, VIRTIO_ID_NET, 0))
		fail("no virtio-net device");
	net.irq = cmdline_uint("irq", 0);
	u64 wanted = VIRTIO_BIT(VIRTIO_NET_F_GUEST_ANNOUNCE);
	bool tso = cmdline_uint("tso", 0);
	if (cmdline_uint("mrg", 0) || tso)
		wanted |= VIRTIO_BIT(VIRTIO_NET_F_MRG_RXBUF);
	if (tso) {
		wanted |= VIRTIO_BIT(VIRTIO_NET_F_GUEST_CSUM) | VIRTIO_BIT(VIRTIO_NET_F_GUEST_TSO4);
		net.rx_len = 1530;
	}
	if (!net_start(&net, wanted, 1, 256))
		fail("virtio-net did not start");
	check_mac();
	printf("net-echo: mergeable receive buffers %s\n",
	       virtio_has(&net.vd, VIRTIO_NET_F_MRG_RXBUF) ? "on" : "off");
	if (!net_resolve(&net, 0, my_ip, peer_ip, peer_mac, 10000000))
		fail("no ARP reply from the peer");
	printf("net-echo: peer %02x:%02x:%02x:%02x:%02x:%02x\n", peer_mac[0], peer_mac[1],
	       peer_mac[2], peer_mac[3], peer_mac[4], peer_mac[5]);
	u64 rounds = cmdline_uint("rounds", 20), pings = cmdline_uint("pings", 5);
	u64 progress = cmdline_uint("progress", 0), pause_us = cmdline_uint("pause_us", 0);
	for (u32 seq = 1; seq <= rounds; seq++) {
		check_announce();
		udp_round(seq);
		if (progress && seq % progress == 0)
			printf("net-echo: %u rounds\n", seq);
		if (pause_us)
			tsc_delay_us(pause_us);
	}
	for (u32 seq = 1; seq <= pings; seq++)
		ping(seq);
	check_announce();
	if (tso) {
		if (!virtio_has(&net.vd, VIRTIO_NET_F_GUEST_TSO4))
			fail("the device does not offer GUEST_TSO4");
		large_frames();
	}
	if (net.irq_on) {
		struct virtq *rx = net.pair[0].rx;
		printf("net-echo: MSI-X: %u receive interrupts, %lu waits ended by one, %lu missed, %u configuration interrupts\n",
		       rx->irqs, rx->waits_irq, rx->missed_irqs, net.vd.config_irqs);
		if (!rx->irqs || rx->missed_irqs)
			fail("receive interrupts: %u, %lu frames without one", rx->irqs, rx->missed_irqs);
		if (announced && !net.vd.config_irqs)
			fail("announced without a configuration interrupt");
	}
	printf("net-echo: %lu UDP echoes (%u sent again), %lu pings, %u announcements, rx %lu tx %lu\n",
	       rounds, retries, pings, announced, net.pair[0].rx_frames, net.pair[0].tx_frames);
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
