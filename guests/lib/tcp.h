/*
 * ferrovm guest kit: a minimal TCP (IPv4) for bulk transfer against a real
 * host TCP socket over the kit's polled virtio-net driver (lib/net.c).
 *
 * One connection, opened by the guest: handshake with MSS and window
 * scaling, cumulative ACKs, a sender that honours the peer's window and
 * sends segments of up to 64 KiB as GSO frames (VIRTIO_NET_HDR_GSO_TCPV4,
 * checksum left to the device) when VIRTIO_NET_F_HOST_TSO4 is negotiated,
 * a receiver that takes the host's GSO frames whole (mergeable buffers)
 * and checks checksums the header does not vouch for, FIN both ways.  No
 * SACK, no timestamps, no congestion control: loss is not expected on a
 * tap, but it is survived (go-back-N after 200 ms without progress; an
 * out-of-order segment is answered with a duplicate ACK), and a connection
 * that stops moving fails the guest with a line saying where it stood.
 * Any ring; tsc_hz() must have been called at CPL 0.
 */
#ifndef KIT_TCP_H
#define KIT_TCP_H

#include "net.h"

#define TCP_FIN	0x01
#define TCP_SYN	0x02
#define TCP_RST	0x04
#define TCP_PSH	0x08
#define TCP_ACK	0x10

/* Pointer to `len` bytes of the outgoing stream from `offset` (stable
 * until they are acknowledged). */
typedef const u8 *(*tcp_source_fn)(void *ctx, u64 offset, u32 len);
/* In-order bytes of the incoming stream from `offset`. */
typedef void (*tcp_sink_fn)(void *ctx, u64 offset, const u8 *data, u32 len);

struct tcp_conn {
	struct net_dev *n;
	unsigned pair;
	u32 my_ip, peer_ip;		/* host order */
	u8 peer_mac[6];
	u16 sport, dport;
	tcp_sink_fn sink;		/* set before tcp_connect; NULL discards */
	void *sink_ctx;
	/* send side: stream offsets, sequence = iss + 1 + offset */
	u32 iss;
	u64 acked, sent, sent_max;	/* acknowledged, next to send, highest sent */
	u64 total;			/* offset of our FIN once closing */
	bool established;
	u64 wnd;			/* peer's window (scaled) */
	u8 snd_wscale;			/* peer's shift */
	u16 mss;			/* peer's MSS */
	u32 max_seg;			/* bytes per segment: mss, or up to 64 KiB with TSO */
	bool fin_sent;
	/* receive side */
	u32 irs;			/* peer's initial sequence */
	u64 received;			/* in-order bytes taken */
	bool fin_rcvd;
	u64 acked_rcv;			/* `received` at our last ACK */
	bool ack_now;
	/* offloads negotiated */
	bool tso, csum;
	/* counters */
	u64 rx_frames, rx_gso_frames, rx_largest, rx_bad_csum, rx_ooo;
	u64 tx_segments, tx_gso_segments, tx_largest, retransmits;
	u8 *frame;			/* receive scratch (one whole frame) */
};

/* Fills in the offloads from the device's negotiated features, ARPs for
 * the peer, opens the connection (SYN with MSS `my_mss` and window scale
 * 7).  false and a message on timeout or RST. */
bool tcp_connect(struct tcp_conn *c, u16 my_mss, u64 timeout_us);
/* Sends stream bytes [sent, upto) from `src` as the window allows and
 * waits until they are all acknowledged; fails the guest (with a line
 * saying how far it got) when nothing moves for stall_us. */
void tcp_send_all(struct tcp_conn *c, u64 upto, tcp_source_fn src, void *ctx, u64 stall_us);
/* Takes every received frame waiting (answering ARP, acknowledging);
 * returns how many frames it took. */
unsigned tcp_poll(struct tcp_conn *c);
/* Sends our FIN (after everything sent is acknowledged) and waits until
 * it is acknowledged and the peer's FIN has come; false on timeout. */
bool tcp_close(struct tcp_conn *c, u64 timeout_us);

#endif
