/*
 * A polled virtio-net driver for the test guests, and frame helpers.
 * See net.h.
 */
#include "net.h"

u64 net_deadline(u64 us)
{
	return rdtsc() + us * (tsc_hz() / 1000000);
}

bool net_expired(u64 deadline)
{
	return (s64)(rdtsc() - deadline) >= 0;
}

static void post_rx(struct net_pair *pr, u16 slot)
{
	struct vbuf b = { pr->rx_bufs + (u64)slot * NET_BUF_LEN, pr->rx_len };
	if (virtq_add(pr->rx, &b, 0, 1, (void *)(u64)(slot + 1)) < 0)
		fail("net: receive queue %u full when posting a buffer", pr->rx->index);
}

/* Queue `index` with its own MSI-X entry and vector when interrupts are on. */
static struct virtq *setup_queue(struct net_dev *n, u16 index, u16 size)
{
	u16 entry = n->irq_on ? (u16)(index + 1) : VIRTIO_MSI_NO_VECTOR;
	struct virtq *q = virtio_queue_setup(&n->vd, index, size, entry);
	if (q && n->irq_on) {
		virtio_msix_route(&n->vd, entry, lapic_id(), (u8)(NET_VECTOR_BASE + entry));
		virtq_bind_irq(q, (u8)(NET_VECTOR_BASE + entry));
	}
	return q;
}

static bool setup_pair(struct net_dev *n, unsigned p)
{
	struct net_pair *pr = &n->pair[p];
	memset(pr, 0, sizeof(*pr));
	pr->rx = setup_queue(n, (u16)(2 * p), n->qsize);
	pr->tx = virtio_queue_setup(&n->vd, (u16)(2 * p + 1), n->qsize, VIRTIO_MSI_NO_VECTOR);
	if (!pr->rx || !pr->tx)
		return false;
	pr->rx_len = n->rx_len && n->rx_len < NET_BUF_LEN ? n->rx_len : NET_BUF_LEN;
	pr->rx_bufs = dma_alloc((u64)pr->rx->size * NET_BUF_LEN, 4096);
	pr->tx_bufs = dma_alloc((u64)pr->tx->size * NET_BUF_LEN, 4096);
	for (u16 i = 0; i < pr->rx->size; i++)
		post_rx(pr, i);
	return true;
}

bool net_start(struct net_dev *n, u64 wanted, unsigned pairs, u16 qsize)
{
	struct virtio_dev *vd = &n->vd;
	if (pairs < 1)
		pairs = 1;
	if (pairs > NET_MAX_PAIRS)
		pairs = NET_MAX_PAIRS;
	wanted |= VIRTIO_BIT(VIRTIO_NET_F_MAC) | VIRTIO_BIT(VIRTIO_NET_F_STATUS) |
		  VIRTIO_BIT(VIRTIO_NET_F_CTRL_VQ);
	if (pairs > 1)
		wanted |= VIRTIO_BIT(VIRTIO_NET_F_MQ);
	if (!virtio_init(vd, wanted))
		return false;
	unsigned max = virtio_has(vd, VIRTIO_NET_F_MQ) ? virtio_cfg_read16(vd, VIRTIO_NET_CFG_MAX_PAIRS) : 1;
	if (pairs > max)
		pairs = max;
	unsigned ctrl_index = 2 * max;
	if (virtio_has(vd, VIRTIO_NET_F_CTRL_VQ) && ctrl_index >= VIRTIO_MAX_QUEUES) {
		printf("net: control queue %u is beyond the kit's %u queues\n", ctrl_index,
		       VIRTIO_MAX_QUEUES);
		return false;
	}
	n->qsize = qsize;
	n->irq_on = n->irq && vd->has_msix && vd->msix.entries >= ctrl_index + 2;
	if (n->irq_on) {
		if (!virtio_msix_enable(vd, 0))
			return false;
		virtio_msix_route(vd, 0, lapic_id(), NET_VECTOR_BASE);
		virtio_bind_config_irq(vd, NET_VECTOR_BASE);
	}
	for (unsigned p = 0; p < pairs; p++)
		if (!setup_pair(n, p))
			return false;
	n->pairs = pairs;
	n->ctrl = NULL;
	if (virtio_has(vd, VIRTIO_NET_F_CTRL_VQ)) {
		n->ctrl = virtio_queue_setup(vd, (u16)ctrl_index, 16, VIRTIO_MSI_NO_VECTOR);
		if (!n->ctrl)
			return false;
		n->ctrl_buf = dma_alloc(4096, 4096);
	}
	virtio_driver_ok(vd);
	for (unsigned p = 0; p < pairs; p++)
		virtq_kick(n->pair[p].rx);
	for (int i = 0; i < 6; i++)
		n->mac[i] = virtio_cfg_read8(vd, VIRTIO_NET_CFG_MAC + i);
	if (pairs > 1) {
		u16 le = (u16)pairs;
		int ack = net_ctrl(n, VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET, &le, 2);
		if (ack != VIRTIO_NET_OK) {
			printf("net: VQ_PAIRS_SET %u answered %d\n", pairs, ack);
			return false;
		}
	}
	return true;
}

unsigned net_tx_reap(struct net_dev *n, unsigned p)
{
	struct net_pair *pr = &n->pair[p];
	unsigned done = 0;
	u32 len;
	while (virtq_get(pr->tx, &len)) {
		pr->tx_inflight--;
		done++;
	}
	return done;
}

/* Reaps finished transmissions until fewer than a ring's worth are in flight, or the
 * deadline passes (false).  The device completes them in order, so slot tx_next is then
 * free. */
static bool net_tx_wait_slot(struct net_dev *n, unsigned p, u64 deadline)
{
	struct net_pair *pr = &n->pair[p];
	net_tx_reap(n, p);
	while (pr->tx_inflight >= pr->tx->size) {
		if (net_expired(deadline))
			return false;
		pause();
		net_tx_reap(n, p);
	}
	return true;
}

bool net_send(struct net_dev *n, unsigned p, const void *frame, u32 len)
{
	struct net_pair *pr = &n->pair[p];
	if (len > NET_BUF_LEN - NET_HDR_LEN)
		fail("net_send: %u-byte frame", len);
	u64 deadline = net_deadline(1000000);
	if (!net_tx_wait_slot(n, p, deadline))
		return false;
	u16 slot = pr->tx_next;
	pr->tx_next = (u16)((slot + 1) % pr->tx->size);
	u8 *buf = pr->tx_bufs + (u64)slot * NET_BUF_LEN;
	memset(buf, 0, NET_HDR_LEN);
	memcpy(buf + NET_HDR_LEN, frame, len);
	struct vbuf b = { buf, NET_HDR_LEN + len };
	if (virtq_add(pr->tx, &b, 1, 0, (void *)(u64)(slot + 1)) < 0)
		return false;
	pr->tx_inflight++;
	pr->tx_frames++;
	virtq_kick(pr->tx);
	return true;
}

bool net_send_chain(struct net_dev *n, unsigned p, const struct net_hdr *vh, const void *head,
		    u32 hlen, const void *data, u32 dlen)
{
	struct net_pair *pr = &n->pair[p];
	if (hlen > NET_BUF_LEN - NET_HDR_LEN)
		fail("net_send_chain: %u bytes of headers", hlen);
	u64 deadline = net_deadline(1000000);
	if (!net_tx_wait_slot(n, p, deadline))
		return false;
	u16 slot = pr->tx_next;
	u8 *buf = pr->tx_bufs + (u64)slot * NET_BUF_LEN;
	memcpy(buf, vh, NET_HDR_LEN);
	buf[10] = buf[11] = 0;
	memcpy(buf + NET_HDR_LEN, head, hlen);
	struct vbuf b[2] = { { buf, NET_HDR_LEN + hlen }, { (void *)data, dlen } };
	/* Without indirect tables a chain takes two ring slots: wait for room. */
	while (virtq_add(pr->tx, b, dlen ? 2 : 1, 0, (void *)(u64)(slot + 1)) < 0) {
		if (net_expired(deadline))
			return false;
		pause();
		net_tx_reap(n, p);
	}
	pr->tx_next = (u16)((slot + 1) % pr->tx->size);
	pr->tx_inflight++;
	pr->tx_frames++;
	virtq_kick(pr->tx);
	return true;
}

int net_recv(struct net_dev *n, unsigned p, void *out, u64 timeout_us)
{
	struct net_pair *pr = &n->pair[p];
	if (n->irq_on) {
		if (virtq_wait(pr->rx, timeout_us) != 1)
			return 0;
	} else {
		u64 deadline = net_deadline(timeout_us);
		while (!virtq_has_used(pr->rx)) {
			if (net_expired(deadline))
				return 0;
			pause();
		}
	}
	u32 len;
	u64 token = (u64)virtq_get(pr->rx, &len);
	if (token == 0 || token > pr->rx->size)
		fail("net: receive queue %u returned token %lu", pr->rx->index, token);
	u16 slot = (u16)(token - 1);
	int got = -1;
	if (len < NET_HDR_LEN)
		pr->rx_short++;
	if (len >= NET_HDR_LEN && len <= pr->rx_len) {
		const u8 *hdr = pr->rx_bufs + (u64)slot * NET_BUF_LEN;
		u16 num_buffers = (u16)(hdr[10] | hdr[11] << 8);
		if (virtio_has(&n->vd, VIRTIO_NET_F_MRG_RXBUF) && num_buffers != 1)
			fail("net: a %u-byte frame in one buffer says num_buffers %u", len, num_buffers);
		got = (int)(len - NET_HDR_LEN);
		memcpy(out, pr->rx_bufs + (u64)slot * NET_BUF_LEN + NET_HDR_LEN, (size_t)got);
		pr->rx_frames++;
	}
	post_rx(pr, slot);
	virtq_kick(pr->rx);
	return got;
}

/* Waits for a used receive buffer of pair p; false on timeout. */
static bool rx_wait(struct net_dev *n, struct net_pair *pr, u64 timeout_us)
{
	if (n->irq_on)
		return virtq_wait(pr->rx, timeout_us) == 1;
	u64 deadline = net_deadline(timeout_us);
	while (!virtq_has_used(pr->rx)) {
		if (net_expired(deadline))
			return false;
		pause();
	}
	return true;
}

/* Takes the next used receive buffer: its slot and length. */
static u16 rx_take(struct net_pair *pr, u32 *len)
{
	u64 token = (u64)virtq_get(pr->rx, len);
	if (token == 0 || token > pr->rx->size)
		fail("net: receive queue %u returned token %lu", pr->rx->index, token);
	return (u16)(token - 1);
}

int net_recv_merged(struct net_dev *n, unsigned p, void *out, u32 cap, u64 timeout_us)
{
	struct net_pair *pr = &n->pair[p];
	if (!rx_wait(n, pr, timeout_us))
		return 0;
	u32 len;
	u16 slot = rx_take(pr, &len);
	const u8 *buf = pr->rx_bufs + (u64)slot * NET_BUF_LEN;
	if (len < NET_HDR_LEN || len > pr->rx_len) {
		pr->rx_short++;
		post_rx(pr, slot);
		virtq_kick(pr->rx);
		return -1;
	}
	u16 num_buffers = (u16)(buf[10] | buf[11] << 8);
	if (num_buffers == 0)
		fail("net: a frame with num_buffers 0");
	u32 total = 0;
	for (u16 i = 0; i < num_buffers; i++) {
		if (i) {
			/* Published together with the first: no waiting. */
			if (!virtq_has_used(pr->rx))
				fail("net: num_buffers %u but only %u buffers used", num_buffers, i);
			slot = rx_take(pr, &len);
			buf = pr->rx_bufs + (u64)slot * NET_BUF_LEN;
			if (len > pr->rx_len)
				fail("net: used length %u beyond the %u-byte buffer", len, pr->rx_len);
		}
		if (total + len > cap)
			fail("net: a frame of more than %u bytes", cap);
		memcpy((u8 *)out + total, buf, len);
		total += len;
		post_rx(pr, slot);
	}
	virtq_kick(pr->rx);
	pr->rx_frames++;
	return (int)total;
}

int net_ctrl(struct net_dev *n, u8 class, u8 cmd, const void *data, u32 len)
{
	if (!n->ctrl || len > 1024)
		return -1;
	u8 *b = n->ctrl_buf;
	b[0] = class;
	b[1] = cmd;
	memcpy(b + 16, data, len);
	b[2048] = 0xff;
	struct vbuf bufs[3] = { { b, 2 }, { b + 16, len }, { b + 2048, 1 } };
	u32 used;
	int r;
	if (len)
		r = virtq_sync(n->ctrl, bufs, 2, 1, &used, 1000000);
	else {
		bufs[1] = bufs[2];
		r = virtq_sync(n->ctrl, bufs, 1, 1, &used, 1000000);
	}
	if (r != 1)
		return -1;
	return ((volatile u8 *)b)[2048];
}

/* ---- frames ---- */

u16 inet_csum(const void *data, u32 len)
{
	const u8 *p = data;
	u32 sum = 0;
	for (u32 i = 0; i + 1 < len; i += 2)
		sum += (u32)(p[i] << 8 | p[i + 1]);
	if (len & 1)
		sum += (u32)p[len - 1] << 8;
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	return (u16)~sum;
}

static void put16(u8 *p, u16 v) { p[0] = (u8)(v >> 8); p[1] = (u8)v; }
static void put32(u8 *p, u32 v) { put16(p, (u16)(v >> 16)); put16(p + 2, (u16)v); }
static u16 get16(const u8 *p) { return (u16)(p[0] << 8 | p[1]); }
static u32 get32(const u8 *p) { return (u32)get16(p) << 16 | get16(p + 2); }

u32 eth_hdr(u8 *f, const u8 *dst, const u8 *src, u16 type)
{
	memcpy(f, dst, 6);
	memcpy(f + 6, src, 6);
	put16(f + 12, type);
	return 14;
}

u32 arp_frame(u8 *f, u16 op, const u8 *src_mac, u32 src_ip, const u8 *dst_mac, u32 dst_ip)
{
	static const u8 bcast[6] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
	static const u8 zero[6];
	u8 *a = f + eth_hdr(f, op == 1 ? bcast : dst_mac, src_mac, ETH_P_ARP);
	put16(a, 1);
	put16(a + 2, ETH_P_IP);
	a[4] = 6;
	a[5] = 4;
	put16(a + 6, op);
	memcpy(a + 8, src_mac, 6);
	put32(a + 14, src_ip);
	memcpy(a + 18, op == 1 ? zero : dst_mac, 6);
	put32(a + 24, dst_ip);
	return 42;
}

static u32 ip_hdr(u8 *ip, u8 proto, u32 src, u32 dst, u32 payload_len)
{
	static u16 ident;
	ip[0] = 0x45;
	ip[1] = 0;
	put16(ip + 2, (u16)(20 + payload_len));
	put16(ip + 4, ++ident);
	put16(ip + 6, 0x4000);	/* don't fragment */
	ip[8] = 64;
	ip[9] = proto;
	put16(ip + 10, 0);
	put32(ip + 12, src);
	put32(ip + 16, dst);
	put16(ip + 10, inet_csum(ip, 20));
	return 20;
}

u32 udp_frame(u8 *f, const u8 *src_mac, const u8 *dst_mac, u32 src_ip, u32 dst_ip,
	      u16 sport, u16 dport, const void *payload, u32 len)
{
	u8 *ip = f + eth_hdr(f, dst_mac, src_mac, ETH_P_IP);
	u8 *udp = ip + ip_hdr(ip, IPPROTO_UDP, src_ip, dst_ip, 8 + len);
	put16(udp, sport);
	put16(udp + 2, dport);
	put16(udp + 4, (u16)(8 + len));
	put16(udp + 6, 0);	/* no checksum (IPv4) */
	memcpy(udp + 8, payload, len);
	return 14 + 20 + 8 + len;
}

u32 icmp_echo_frame(u8 *f, const u8 *src_mac, const u8 *dst_mac, u32 src_ip, u32 dst_ip,
		    u16 id, u16 seq, const void *payload, u32 len)
{
	u8 *ip = f + eth_hdr(f, dst_mac, src_mac, ETH_P_IP);
	u8 *icmp = ip + ip_hdr(ip, IPPROTO_ICMP, src_ip, dst_ip, 8 + len);
	icmp[0] = 8;
	icmp[1] = 0;
	put16(icmp + 2, 0);
	put16(icmp + 4, id);
	put16(icmp + 6, seq);
	memcpy(icmp + 8, payload, len);
	put16(icmp + 2, inet_csum(icmp, 8 + len));
	return 14 + 20 + 8 + len;
}

static bool parse_ip4(const u8 *ip, u32 len, struct rx_frame *out)
{
	if (len < 20 || (ip[0] >> 4) != 4)
		return false;
	u32 ihl = (u32)(ip[0] & 15) * 4, total = get16(ip + 2);
	if (ihl < 20 || total < ihl || total > len || inet_csum(ip, ihl) != 0)
		return false;
	out->proto = ip[9];
	out->sip = get32(ip + 12);
	out->dip = get32(ip + 16);
	const u8 *l4 = ip + ihl;
	u32 l4_len = total - ihl;
	if (out->proto == IPPROTO_UDP && l4_len >= 8) {
		out->sport = get16(l4);
		out->dport = get16(l4 + 2);
		u32 ulen = get16(l4 + 4);
		if (ulen < 8 || ulen > l4_len)
			return false;
		out->payload = l4 + 8;
		out->payload_len = ulen - 8;
	} else if (out->proto == IPPROTO_ICMP && l4_len >= 8) {
		if (inet_csum(l4, l4_len) != 0)
			return false;
		out->icmp_type = l4[0];
		out->icmp_id = get16(l4 + 4);
		out->icmp_seq = get16(l4 + 6);
		out->payload = l4 + 8;
		out->payload_len = l4_len - 8;
	}
	return true;
}

bool parse_frame(const u8 *f, u32 len, struct rx_frame *out)
{
	memset(out, 0, sizeof(*out));
	if (len < 14)
		return false;
	out->type = get16(f + 12);
	out->src_mac = f + 6;
	const u8 *p = f + 14;
	if (out->type == ETH_P_ARP) {
		if (len < 42)
			return false;
		out->arp_op = get16(p + 6);
		out->arp_sha = p + 8;
		out->arp_sip = get32(p + 14);
		out->arp_tip = get32(p + 24);
		return true;
	}
	if (out->type == ETH_P_IP)
		return parse_ip4(p, len - 14, out);
	return true;
}

bool net_answer_arp(struct net_dev *n, unsigned p, const struct rx_frame *rx, u32 ip)
{
	if (rx->type != ETH_P_ARP || rx->arp_op != 1 || rx->arp_tip != ip)
		return false;
	u8 f[64];
	u32 len = arp_frame(f, 2, n->mac, ip, rx->arp_sha, rx->arp_sip);
	net_send(n, p, f, len);
	return true;
}

bool net_resolve(struct net_dev *n, unsigned p, u32 my_ip, u32 ip, u8 *mac, u64 timeout_us)
{
	static u8 buf[NET_BUF_LEN];
	u64 deadline = net_deadline(timeout_us);
	while (!net_expired(deadline)) {
		u8 f[64];
		u32 len = arp_frame(f, 1, n->mac, my_ip, NULL, ip);
		if (!net_send(n, p, f, len))
			return false;
		u64 retry = net_deadline(200000);
		while (!net_expired(retry)) {
			int got = net_recv(n, p, buf, 20000);
			struct rx_frame rx;
			if (got <= 0 || !parse_frame(buf, (u32)got, &rx))
				continue;
			if (net_answer_arp(n, p, &rx, my_ip))
				continue;
			if (rx.type == ETH_P_ARP && rx.arp_op == 2 && rx.arp_sip == ip) {
				memcpy(mac, rx.arp_sha, 6);
				return true;
			}
		}
	}
	return false;
}

u32 parse_ip(const char *s, size_t len)
{
	u32 ip = 0;
	unsigned parts = 0, v = 0, digits = 0;
	for (size_t i = 0; i <= len; i++) {
		if (i == len || s[i] == '.') {
			if (!digits || v > 255)
				return 0;
			ip = ip << 8 | v;
			parts++;
			v = digits = 0;
		} else if (s[i] >= '0' && s[i] <= '9') {
			v = v * 10 + (unsigned)(s[i] - '0');
			digits++;
		} else {
			return 0;
		}
	}
	return parts == 4 ? ip : 0;
}

bool net_udp_echo(struct net_dev *n, unsigned p, u32 my_ip, u32 peer_ip, const u8 *peer_mac,
		  u16 sport, u16 port, const void *payload, u32 len, u64 timeout_us)
{
	static u8 f[NET_BUF_LEN], buf[NET_BUF_LEN];
	u32 flen = udp_frame(f, n->mac, peer_mac, my_ip, peer_ip, sport, port, payload, len);
	if (!net_send(n, p, f, flen))
		return false;
	u64 deadline = net_deadline(timeout_us);
	while (!net_expired(deadline)) {
		int got = net_recv(n, p, buf, 10000);
		struct rx_frame rx;
		if (got <= 0 || !parse_frame(buf, (u32)got, &rx))
			continue;
		if (net_answer_arp(n, p, &rx, my_ip))
			continue;
		if (rx.type == ETH_P_IP && rx.proto == IPPROTO_UDP && rx.sip == peer_ip &&
		    rx.sport == port && rx.dport == sport && rx.payload_len == len &&
		    memcmp(rx.payload, payload, len) == 0)
			return true;
	}
	return false;
}
