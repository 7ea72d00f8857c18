/*
 * A minimal TCP for bulk transfer over the kit's virtio-net driver.
 * See tcp.h.
 */
#include "tcp.h"

#define FRAME_CAP	(NET_HDR_LEN + 14 + 65536)
#define RTO_US		200000
#define POLL_BATCH	32
#define MY_WSCALE	7

static u8 rx_frame_buf[FRAME_CAP];

static void put16(u8 *p, u16 v) { p[0] = (u8)(v >> 8); p[1] = (u8)v; }
static void put32(u8 *p, u32 v) { put16(p, (u16)(v >> 16)); put16(p + 2, (u16)v); }
static u16 get16(const u8 *p) { return (u16)(p[0] << 8 | p[1]); }
static u32 get32(const u8 *p) { return (u32)get16(p) << 16 | get16(p + 2); }

/* One's-complement sum of big-endian 16-bit words (len even, or last). */
static u64 csum_add(u64 sum, const u8 *p, u32 len)
{
	u32 i = 0;
	for (; i + 1 < len; i += 2)
		sum += (u32)(p[i] << 8 | p[i + 1]);
	if (len & 1)
		sum += (u32)p[len - 1] << 8;
	return sum;
}

static u16 csum_fold(u64 sum)
{
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	return (u16)sum;
}

static u64 pseudo_sum(u32 src, u32 dst, u32 tcp_len)
{
	return (src >> 16) + (src & 0xffff) + (dst >> 16) + (dst & 0xffff) + IPPROTO_TCP + tcp_len;
}

static u32 ack_number(struct tcp_conn *c)
{
	return c->irs + 1 + (u32)c->received + (c->fin_rcvd ? 1 : 0);
}

/* Builds and queues one segment: `flags`, sequence `seq`, TCP options, data in place. */
static bool send_segment(struct tcp_conn *c, u8 flags, u32 seq, const u8 *opts, u32 optlen,
			 const u8 *data, u32 dlen)
{
	static u16 ident;
	u8 h[14 + 20 + 40];
	u32 thl = 20 + optlen, tcp_len = thl + dlen;
	u8 *ip = h + eth_hdr(h, c->peer_mac, c->n->mac, ETH_P_IP);
	memset(ip, 0, 20 + thl);
	ip[0] = 0x45;
	put16(ip + 2, (u16)(20 + tcp_len));
	put16(ip + 4, ++ident);
	put16(ip + 6, 0x4000);
	ip[8] = 64;
	ip[9] = IPPROTO_TCP;
	put32(ip + 12, c->my_ip);
	put32(ip + 16, c->peer_ip);
	put16(ip + 10, inet_csum(ip, 20));
	u8 *t = ip + 20;
	put16(t, c->sport);
	put16(t + 2, c->dport);
	put32(t + 4, seq);
	put32(t + 8, flags & TCP_ACK ? ack_number(c) : 0);
	t[12] = (u8)((thl / 4) << 4);
	t[13] = flags;
	put16(t + 14, 0xffff);	/* taken at once: the window never closes */
	memcpy(t + 20, opts, optlen);
	struct net_hdr vh = { 0 };
	u64 pseudo = pseudo_sum(c->my_ip, c->peer_ip, tcp_len);
	if (c->csum) {
		vh.flags = VIRTIO_NET_HDR_F_NEEDS_CSUM;
		vh.csum_start = 14 + 20;
		vh.csum_offset = 16;
		put16(t + 16, csum_fold(pseudo));
	} else {
		put16(t + 16, (u16)~csum_fold(csum_add(csum_add(pseudo, t, thl), data, dlen)));
	}
	if (c->tso && dlen > c->mss) {
		vh.gso_type = VIRTIO_NET_HDR_GSO_TCPV4;
		vh.gso_size = c->mss;
		vh.hdr_len = (u16)(14 + 20 + thl);
		c->tx_gso_segments++;
	}
	c->tx_segments++;
	if (14 + 20 + tcp_len > c->tx_largest)
		c->tx_largest = 14 + 20 + tcp_len;
	return net_send_chain(c->n, c->pair, &vh, h, 14 + 20 + thl, data, dlen);
}

static void send_ack(struct tcp_conn *c)
{
	if (!send_segment(c, TCP_ACK, c->iss + 1 + (u32)c->sent_max, NULL, 0, NULL, 0))
		fail("tcp: transmit queue stuck sending an ACK");
	c->acked_rcv = c->received + (c->fin_rcvd ? 1 : 0);
	c->ack_now = false;
}

static void parse_options(struct tcp_conn *c, const u8 *o, u32 len)
{
	for (u32 i = 0; i < len;) {
		if (o[i] == 0)
			break;
		if (o[i] == 1) {
			i++;
			continue;
		}
		if (i + 1 >= len || o[i + 1] < 2 || i + o[i + 1] > len)
			break;
		if (o[i] == 2 && o[i + 1] == 4)
			c->mss = get16(o + i + 2);
		if (o[i] == 3 && o[i + 1] == 3)
			c->snd_wscale = o[i + 2] > 14 ? 14 : o[i + 2];
		i += o[i + 1];
	}
}

/* The SYN-ACK: the peer's sequence, MSS and window scale. */
static void syn_ack(struct tcp_conn *c, const u8 *t, u32 thl)
{
	c->irs = get32(t + 4);
	c->mss = 536;
	c->snd_wscale = 0;
	parse_options(c, t + 20, thl - 20);
	c->wnd = get16(t + 14);	/* never scaled in a SYN */
	c->acked = 0;
	c->sent = c->sent_max = 0;
	c->max_seg = c->tso ? (65495 / c->mss) * c->mss : c->mss;
	c->established = true;
	c->ack_now = true;
}

/* The ACK field: what it acknowledges and the window it carries. */
static void take_ack(struct tcp_conn *c, u32 ack, u16 win)
{
	u32 una = c->iss + 1 + (u32)c->acked;
	u32 advance = ack - una;
	if (advance > c->sent_max - c->acked)
		return;	/* old, or beyond what was sent */
	c->acked += advance;
	if (c->sent < c->acked)
		c->sent = c->acked;
	c->wnd = (u64)win << c->snd_wscale;
}

/* Data and FIN of an established connection's segment. */
static void take_data(struct tcp_conn *c, u32 seq, u8 flags, const u8 *data, u32 dlen)
{
	u32 expect = c->irs + 1 + (u32)c->received;
	if (dlen && !c->fin_rcvd) {
		s32 have = (s32)(expect - seq);
		if (have < 0) {
			c->rx_ooo++;
			c->ack_now = true;
		} else if ((u32)have < dlen) {
			if (c->sink)
				c->sink(c->sink_ctx, c->received, data + have, dlen - (u32)have);
			c->received += dlen - (u32)have;
		} else {
			c->ack_now = true;	/* a duplicate */
		}
	}
	if (flags & TCP_FIN) {
		if (!c->fin_rcvd && seq + dlen == c->irs + 1 + (u32)c->received)
			c->fin_rcvd = true;
		c->ack_now = true;
	}
}

static void take_segment(struct tcp_conn *c, const u8 *t, u32 thl, u32 tlen)
{
	u8 flags = t[13];
	if (flags & TCP_RST)
		fail("tcp: the peer reset the connection (%lu bytes acknowledged, %lu received)",
		     c->acked, c->received);
	if (!c->established) {
		if ((flags & (TCP_SYN | TCP_ACK)) == (TCP_SYN | TCP_ACK) && get32(t + 8) == c->iss + 1)
			syn_ack(c, t, thl);
		return;
	}
	if (flags & TCP_SYN) {
		c->ack_now = true;	/* a repeated SYN-ACK: our ACK was lost */
		return;
	}
	if (flags & TCP_ACK)
		take_ack(c, get32(t + 8), get16(t + 14));
	take_data(c, get32(t + 4), flags, t + thl, tlen - thl);
}

/* One received frame (with its header): ARP answered, our segments taken. */
static void take_frame(struct tcp_conn *c, const u8 *buf, u32 len)
{
	struct net_hdr vh;
	memcpy(&vh, buf, NET_HDR_LEN);
	const u8 *f = buf + NET_HDR_LEN;
	u32 flen = len - NET_HDR_LEN;
	c->rx_frames++;
	if (vh.gso_type != VIRTIO_NET_HDR_GSO_NONE)
		c->rx_gso_frames++;
	if (flen > c->rx_largest)
		c->rx_largest = flen;
	struct rx_frame rx;
	if (!parse_frame(f, flen, &rx) || net_answer_arp(c->n, c->pair, &rx, c->my_ip))
		return;
	if (rx.type != ETH_P_IP || rx.proto != IPPROTO_TCP || rx.sip != c->peer_ip || rx.dip != c->my_ip)
		return;
	const u8 *ip = f + 14;
	u32 ihl = (u32)(ip[0] & 15) * 4, tlen = get16(ip + 2) - ihl;
	const u8 *t = ip + ihl;
	if (tlen < 20 || get16(t) != c->dport || get16(t + 2) != c->sport)
		return;
	u32 thl = (u32)(t[12] >> 4) * 4;
	if (thl < 20 || thl > tlen)
		return;
	/* A header that vouches for nothing: the checksum is ours to check. */
	bool vouched = vh.flags & (VIRTIO_NET_HDR_F_NEEDS_CSUM | VIRTIO_NET_HDR_F_DATA_VALID);
	if (!vouched && csum_fold(csum_add(pseudo_sum(rx.sip, rx.dip, tlen), t, tlen)) != 0xffff) {
		c->rx_bad_csum++;
		return;
	}
	take_segment(c, t, thl, tlen);
}

unsigned tcp_poll(struct tcp_conn *c)
{
	unsigned taken = 0;
	while (taken < POLL_BATCH) {
		int len = net_recv_merged(c->n, c->pair, c->frame, FRAME_CAP, 0);
		if (len == 0)
			break;
		taken++;
		if (len > NET_HDR_LEN)
			take_frame(c, c->frame, (u32)len);
	}
	if (c->established && (c->ack_now || c->acked_rcv != c->received + (c->fin_rcvd ? 1 : 0)))
		send_ack(c);
	return taken;
}

bool tcp_connect(struct tcp_conn *c, u16 my_mss, u64 timeout_us)
{
	struct virtio_dev *vd = &c->n->vd;
	if (!virtio_has(vd, VIRTIO_NET_F_MRG_RXBUF)) {
		printf("tcp: the kit's TCP needs VIRTIO_NET_F_MRG_RXBUF\n");
		return false;
	}
	c->frame = rx_frame_buf;
	c->csum = virtio_has(vd, VIRTIO_NET_F_CSUM);
	c->tso = c->csum && virtio_has(vd, VIRTIO_NET_F_HOST_TSO4);
	if (!net_resolve(c->n, c->pair, c->my_ip, c->peer_ip, c->peer_mac, timeout_us)) {
		printf("tcp: no ARP reply from the peer\n");
		return false;
	}
	c->iss = (u32)rdtsc();
	const u8 opts[8] = { 2, 4, (u8)(my_mss >> 8), (u8)my_mss, 1, 3, 3, MY_WSCALE };
	u64 deadline = net_deadline(timeout_us);
	while (!c->established) {
		if (net_expired(deadline)) {
			printf("tcp: no SYN-ACK from %u.%u.%u.%u:%u\n", c->peer_ip >> 24,
			       c->peer_ip >> 16 & 255, c->peer_ip >> 8 & 255, c->peer_ip & 255, c->dport);
			return false;
		}
		if (!send_segment(c, TCP_SYN, c->iss, opts, sizeof(opts), NULL, 0))
			return false;
		u64 retry = net_deadline(500000);
		while (!c->established && !net_expired(retry))
			tcp_poll(c);
	}
	tcp_poll(c);
	if (c->ack_now)
		send_ack(c);
	return true;
}

/* Sends what the window allows of [sent, upto). */
static void push(struct tcp_conn *c, u64 upto, tcp_source_fn src, void *ctx)
{
	while (c->sent < upto) {
		u64 inflight = c->sent - c->acked;
		if (c->wnd <= inflight)
			return;
		u64 seg = c->wnd - inflight, left = upto - c->sent;
		if (seg > c->max_seg)
			seg = c->max_seg;
		if (seg > left)
			seg = left;
		if (seg < left && seg < c->mss && inflight)
			return;	/* wait for a window worth a segment */
		const u8 *data = src(ctx, c->sent, (u32)seg);
		if (!send_segment(c, TCP_ACK | TCP_PSH, c->iss + 1 + (u32)c->sent, NULL, 0, data, (u32)seg))
			fail("tcp: transmit queue stuck at byte %lu", c->sent);
		c->sent += seg;
		if (c->sent > c->sent_max)
			c->sent_max = c->sent;
	}
}

void tcp_send_all(struct tcp_conn *c, u64 upto, tcp_source_fn src, void *ctx, u64 stall_us)
{
	u64 last = c->acked, stall = net_deadline(stall_us), rto = net_deadline(RTO_US);
	while (c->acked < upto) {
		push(c, upto, src, ctx);
		tcp_poll(c);
		if (c->acked != last) {
			last = c->acked;
			stall = net_deadline(stall_us);
			rto = net_deadline(RTO_US);
		} else if (net_expired(rto)) {
			/* Nothing acknowledged for a while: go back to the first unacknowledged byte. */
			if (c->sent > c->acked) {
				c->sent = c->acked;
				c->retransmits++;
			}
			rto = net_deadline(RTO_US);
		}
		if (net_expired(stall))
			fail("tcp: stalled: %lu of %lu bytes acknowledged, %lu sent, window %lu, "
			     "%lu retransmits", c->acked, upto, c->sent_max, c->wnd, c->retransmits);
	}
}

bool tcp_close(struct tcp_conn *c, u64 timeout_us)
{
	c->total = c->sent;
	u64 deadline = net_deadline(timeout_us), rto = 0;
	bool first = true;
	while (!(c->fin_rcvd && c->acked > c->total)) {
		if (net_expired(deadline)) {
			printf("tcp: closing timed out: our FIN %s, theirs %s\n",
			       c->acked > c->total ? "acknowledged" : "not acknowledged",
			       c->fin_rcvd ? "received" : "not received");
			return false;
		}
		if (c->acked <= c->total && (first || net_expired(rto))) {
			if (!send_segment(c, TCP_FIN | TCP_ACK, c->iss + 1 + (u32)c->total, NULL, 0, NULL, 0))
				return false;
			c->fin_sent = true;
			c->sent_max = c->total + 1;
			rto = net_deadline(RTO_US);
			first = false;
		}
		tcp_poll(c);
	}
	return true;
}
