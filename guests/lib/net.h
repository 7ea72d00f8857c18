/*
 * ferrovm guest kit: a polled virtio-net driver (lib/net.c) and the few
 * Ethernet, ARP, IPv4, UDP and ICMP helpers the network test guests share.
 * Any ring; the queues are polled (no interrupts).
 */
#ifndef KIT_NET_H
#define KIT_NET_H

#include "kit.h"

/* feature bits */
#define VIRTIO_NET_F_CSUM		0
#define VIRTIO_NET_F_GUEST_CSUM		1
#define VIRTIO_NET_F_GUEST_TSO4		7
#define VIRTIO_NET_F_HOST_TSO4		11
#define VIRTIO_NET_F_MAC		5
#define VIRTIO_NET_F_MRG_RXBUF		15
#define VIRTIO_NET_F_STATUS		16
#define VIRTIO_NET_F_CTRL_VQ		17
#define VIRTIO_NET_F_GUEST_ANNOUNCE	21
#define VIRTIO_NET_F_MQ			22
/* configuration space */
#define VIRTIO_NET_CFG_MAC		0
#define VIRTIO_NET_CFG_STATUS		6
#define VIRTIO_NET_CFG_MAX_PAIRS	8
#define VIRTIO_NET_S_LINK_UP		1
#define VIRTIO_NET_S_ANNOUNCE		2
/* control queue */
#define VIRTIO_NET_CTRL_MQ		4
#define VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET	0
#define VIRTIO_NET_CTRL_ANNOUNCE	3
#define VIRTIO_NET_CTRL_ANNOUNCE_ACK	0
#define VIRTIO_NET_OK			0
#define VIRTIO_NET_ERR			1

#define NET_HDR_LEN	12		/* virtio_net_hdr_v1 */
/* virtio_net_hdr_v1 (little endian, as on x86) */
struct net_hdr {
	u8 flags, gso_type;
	u16 hdr_len, gso_size, csum_start, csum_offset, num_buffers;
} __attribute__((packed));
#define VIRTIO_NET_HDR_F_NEEDS_CSUM	1	/* checksum from csum_start, stored at +csum_offset */
#define VIRTIO_NET_HDR_F_DATA_VALID	2	/* checksum already checked */
#define VIRTIO_NET_HDR_GSO_NONE		0
#define VIRTIO_NET_HDR_GSO_TCPV4	1
#define NET_BUF_LEN	2048		/* every receive and transmit buffer */
#define NET_MAX_PAIRS	3		/* VIRTIO_MAX_QUEUES = 8: 3 pairs + control */
#define NET_FRAME_MAX	1514

struct net_pair {
	struct virtq *rx, *tx;
	u8 *rx_bufs, *tx_bufs;		/* qsize buffers of NET_BUF_LEN each */
	u16 tx_next;			/* next transmit buffer slot */
	unsigned tx_inflight;
	u32 rx_len;			/* bytes posted per receive buffer */
	u64 rx_frames, tx_frames, rx_short;	/* rx_short: used with less than a header */
};

#define NET_VECTOR_BASE	0x40	/* configuration; queue entry e -> NET_VECTOR_BASE + e */

struct net_dev {
	struct virtio_dev vd;
	bool irq;			/* set before net_start: receive by MSI-X */
	bool irq_on;			/* MSI-X in use (the device has enough entries) */
	u32 rx_len;			/* set before net_start: receive buffer size (0: NET_BUF_LEN) */
	struct net_pair pair[NET_MAX_PAIRS];
	unsigned pairs;			/* set up */
	struct virtq *ctrl;
	u8 *ctrl_buf;
	u8 mac[6];
	u16 qsize;
};

/* virtio_init(wanted | MAC | STATUS | CTRL_VQ), `pairs` queue pairs (with
 * MQ if more than one; VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET sent), every
 * receive buffer posted, DRIVER_OK, the MAC read.  With n->irq and MSI-X:
 * the configuration change on entry 0 and queue q on entry q + 1, each to
 * vector NET_VECTOR_BASE + entry on this CPU (the caller runs with
 * interrupts on); receives then wait for their interrupt.  false and a
 * message on failure. */
bool net_start(struct net_dev *n, u64 wanted, unsigned pairs, u16 qsize);
/* Queues a frame (no header) on pair p and rings the doorbell; reclaims
 * finished transmissions first.  false if the queue stays full ~1 s. */
bool net_send(struct net_dev *n, unsigned p, const void *frame, u32 len);
/* Queues one frame on pair p as a chain of two buffers: the header `vh`
 * (num_buffers written 0) with the `hlen` bytes at `head` copied behind it
 * into the pair's own buffer, then `dlen` bytes at `data` in place (they
 * must stay as they are until the chain is reclaimed; dlen 0: no second
 * buffer).  With VIRTIO_NET_F_HOST_TSO4 and a GSO header the frame may be
 * up to 64 KiB.  Rings the doorbell (unless EVENT_IDX says the device is
 * still looking).  false if the queue stays full ~1 s. */
bool net_send_chain(struct net_dev *n, unsigned p, const struct net_hdr *vh, const void *head,
		    u32 hlen, const void *data, u32 dlen);
/* Reclaims finished transmissions of pair p; returns how many. */
unsigned net_tx_reap(struct net_dev *n, unsigned p);
/* The next received frame of pair p (no header) copied to buf (at most
 * NET_BUF_LEN); the buffer is posted again.  Returns the frame length, 0 if
 * none arrived within timeout_us, -1 for a used buffer shorter than the
 * header (the device dropped a frame). */
int net_recv(struct net_dev *n, unsigned p, void *buf, u64 timeout_us);
/* The next received frame of pair p with mergeable receive buffers, however
 * many buffers it spans: its virtio_net_hdr_v1 and the frame copied to out
 * (at most cap bytes); every buffer posted again.  The used entries of one
 * frame must all be visible once its first is (num_buffers says how many),
 * or the guest fails.  Returns the length with the header, 0 if none arrived
 * within timeout_us, -1 for a used buffer shorter than the header. */
int net_recv_merged(struct net_dev *n, unsigned p, void *out, u32 cap, u64 timeout_us);
/* One control command; returns the ack (VIRTIO_NET_OK/ERR), or -1 on timeout. */
int net_ctrl(struct net_dev *n, u8 class, u8 cmd, const void *data, u32 len);

/* ---- frames ---- */
#define ETH_P_IP	0x0800
#define ETH_P_ARP	0x0806
#define ETH_P_RARP	0x8035
#define IPPROTO_ICMP	1
#define IPPROTO_TCP	6
#define IPPROTO_UDP	17
static inline u16 be16(u16 v) { return (u16)((v >> 8) | (v << 8)); }
static inline u32 be32(u32 v) { return __builtin_bswap32(v); }
u16 inet_csum(const void *data, u32 len);
/* Ethernet header at f: dst, src, type.  Returns 14. */
u32 eth_hdr(u8 *f, const u8 *dst, const u8 *src, u16 type);
/* ARP request (op 1) or reply (op 2) frame; returns its length (42). */
u32 arp_frame(u8 *f, u16 op, const u8 *src_mac, u32 src_ip, const u8 *dst_mac, u32 dst_ip);
/* IPv4 + UDP (checksum 0) frame; ips host order; returns the length. */
u32 udp_frame(u8 *f, const u8 *src_mac, const u8 *dst_mac, u32 src_ip, u32 dst_ip,
	      u16 sport, u16 dport, const void *payload, u32 len);
/* IPv4 + ICMP echo request; returns the length. */
u32 icmp_echo_frame(u8 *f, const u8 *src_mac, const u8 *dst_mac, u32 src_ip, u32 dst_ip,
		    u16 id, u16 seq, const void *payload, u32 len);
/* Parsed frame (pointers into it). */
struct rx_frame {
	u16 type;			/* Ethernet type */
	const u8 *src_mac;
	u16 arp_op; u32 arp_sip, arp_tip; const u8 *arp_sha;	/* ARP */
	u8 proto; u32 sip, dip;		/* IPv4 */
	u16 sport, dport;		/* UDP */
	u8 icmp_type; u16 icmp_id, icmp_seq;	/* ICMP */
	const u8 *payload; u32 payload_len;	/* UDP / ICMP data */
};
/* false if too short or malformed (bad IPv4 header checksum). */
bool parse_frame(const u8 *f, u32 len, struct rx_frame *out);
/* Answers an ARP request for `ip` (our address) found in `rx` on pair p;
 * true if it was one. */
bool net_answer_arp(struct net_dev *n, unsigned p, const struct rx_frame *rx, u32 ip);
/* ARP for `ip` from `my_ip` on pair p until a reply (retries each 200 ms);
 * the peer's MAC into mac.  false on timeout. */
bool net_resolve(struct net_dev *n, unsigned p, u32 my_ip, u32 ip, u8 *mac, u64 timeout_us);
/* Sends `payload` to peer_ip:port from my_ip:sport on pair p and waits for
 * the same bytes back from that port (answering ARP meanwhile); true if
 * they came back intact within timeout_us. */
bool net_udp_echo(struct net_dev *n, unsigned p, u32 my_ip, u32 peer_ip, const u8 *peer_mac,
		  u16 sport, u16 port, const void *payload, u32 len, u64 timeout_us);
/* A time budget on the TSC (tsc_hz() must have been called at CPL 0). */
u64 net_deadline(u64 us);
bool net_expired(u64 deadline);
/* "a.b.c.d" -> host-order address (0 if malformed). */
u32 parse_ip(const char *s, size_t len);

#endif
