/*
 * vsock-echo: virtio-vsock streams in both directions, from ring 3.
 *
 *  1. The guest connects to host port `port=` (default 1234) and sends
 *     `bytes=` bytes (default 1 MiB, many credit windows) of a pattern; the
 *     host echoes them; the guest checks every byte that comes back, then
 *     closes (SHUTDOWN, RST).
 *  2. The guest listens on port `listen=` (default 5000); a host process
 *     connects (CONNECT 5000 on the device's socket) and sends `bytes=`
 *     bytes; the guest echoes them back and waits for the host to close.
 *
 * With `reset=1` the guest first opens a connection to `port=`, prints
 * "vsock-echo: connected, waiting for a transport reset" and waits (up to
 * `wait_s=` seconds, default 120) for VIRTIO_VSOCK_EVENT_TRANSPORT_RESET (a
 * snapshot restored, a migration); the old connection must be gone; then 1
 * and 2 run on the restored machine.  Receive completion by MSI-X unless
 * `irq=0`.
 *
 * With `bench=1` the guest only streams `bytes=` to host port `port=` (the
 * host end reads and discards) and reports the throughput once the device
 * has forwarded every byte to the host socket (its fwd_cnt, asked for with
 * CREDIT_REQUEST, equals what was sent).
 */
#include "kit.h"

#define VECTOR		0x41
#define CHUNK		8192

static struct vsock vs;
static u8 out[CHUNK], in[CHUNK];

static u8 pattern(u64 i, u32 seed)
{
	return (u8)(i ^ (i >> 8) ^ (i >> 16) ^ seed);
}

static void fill(u8 *buf, u64 at, u32 n, u32 seed)
{
	for (u32 i = 0; i < n; i++)
		buf[i] = pattern(at + i, seed);
}

static void check(const u8 *buf, u64 at, u32 n, u32 seed)
{
	for (u32 i = 0; i < n; i++)
		if (buf[i] != pattern(at + i, seed))
			fail("vsock-echo: byte %lu is 0x%02x, expected 0x%02x", at + i, buf[i],
			     pattern(at + i, seed));
}

/* Sends `total` pattern bytes and checks that the same come back. */
static void echo_through_host(struct vsock_conn *c, u64 total, u32 seed)
{
	u64 sent = 0, got = 0;
	struct timeout t;
	timeout_start(&t, 60000000);
	while (got < total) {
		if (c->state != VSOCK_ESTABLISHED)
			fail("vsock-echo: connection closed after %lu of %lu bytes back", got, total);
		if (timeout_expired(&t))
			fail("vsock-echo: %lu of %lu sent, %lu back after 60 s", sent, total, got);
		bool progress = false;
		if (sent < total) {
			u32 n = total - sent < CHUNK ? (u32)(total - sent) : CHUNK;
			fill(out, sent, n, seed);
			u32 s = vsock_send(&vs, c, out, n);
			sent += s;
			progress |= s > 0;
		}
		u32 r = vsock_recv(&vs, c, in, CHUNK);
		check(in, got, r, seed);
		got += r;
		progress |= r > 0;
		if (!progress)
			vsock_wait(&vs, 10000);
		else
			vsock_poll(&vs);
	}
}

static void guest_to_host(u32 port, u64 bytes, u32 seed)
{
	struct vsock_conn *c = vsock_connect(&vs, port, 5000000);
	if (!c)
		fail("vsock-echo: host port %u refused or did not answer", port);
	echo_through_host(c, bytes, seed);
	vsock_close(&vs, c, 5000000);
	printf("vsock-echo: guest->host port %u: %lu bytes echoed intact\n", port, bytes);
}

/* Echoes what the host sends until it has sent `total` and closed. */
static void host_to_guest(u32 port, u64 total)
{
	printf("vsock-echo: listening on port %u\n", port);
	struct vsock_conn *c = vsock_accept(&vs, port, 60000000);
	if (!c)
		fail("vsock-echo: nobody connected to port %u", port);
	u64 got = 0, echoed = 0;
	u32 have = 0;
	struct timeout t;
	timeout_start(&t, 60000000);
	while (echoed < total || (c->state == VSOCK_ESTABLISHED && !c->peer_shutdown)) {
		if (timeout_expired(&t))
			fail("vsock-echo: %lu of %lu bytes in, %lu echoed after 60 s", got, total, echoed);
		if (c->state != VSOCK_ESTABLISHED && echoed < total)
			fail("vsock-echo: connection closed after %lu of %lu bytes", echoed, total);
		bool progress = false;
		if (!have) {
			have = vsock_recv(&vs, c, in, CHUNK);
			got += have;
			progress |= have > 0;
		}
		if (have) {
			u32 s = vsock_send(&vs, c, in, have);
			if (s && s < have)
				memmove(in, in + s, have - s);
			have -= s;
			echoed += s;
			progress |= s > 0;
		}
		if (!progress)
			vsock_wait(&vs, 10000);
	}
	if (got != total)
		fail("vsock-echo: the host sent %lu bytes, expected %lu", got, total);
	vsock_close(&vs, c, 5000000);
	printf("vsock-echo: host->guest port %u: %lu bytes echoed back\n", port, total);
}

static void wait_for_reset(u32 port, u64 wait_s)
{
	struct vsock_conn *c = vsock_connect(&vs, port, 5000000);
	if (!c)
		fail("vsock-echo: host port %u refused or did not answer", port);
	echo_through_host(c, 4096, 7);
	printf("vsock-echo: connected, waiting for a transport reset\n");
	struct timeout t;
	timeout_start(&t, wait_s * 1000000);
	while (!vs.transport_resets) {
		if (timeout_expired(&t))
			fail("vsock-echo: no transport reset within %lu s", wait_s);
		vsock_wait(&vs, 100000);
	}
	if (c->state != VSOCK_CLOSED || !c->was_reset)
		fail("vsock-echo: the old connection survived the transport reset");
	c->state = VSOCK_FREE;
	printf("vsock-echo: transport reset seen (%u), old connection gone, cid %lu\n",
	       vs.transport_resets, vs.cid);
}

/* Streams `total` bytes to the host; prints the rate. */
static void bench(u32 port, u64 total)
{
	struct vsock_conn *c = vsock_connect(&vs, port, 5000000);
	if (!c)
		fail("vsock-echo: host port %u refused or did not answer", port);
	fill(out, 0, CHUNK, 0x11);
	u64 t0 = rdtsc(), sent = 0;
	struct timeout t;
	timeout_start(&t, 120000000);
	while (sent < total || c->peer_fwd_cnt != c->tx_cnt) {
		if (timeout_expired(&t) || c->state != VSOCK_ESTABLISHED)
			fail("vsock-echo: bench stalled at %lu of %lu bytes", sent, total);
		if (sent < total) {
			u32 n = total - sent < CHUNK ? (u32)(total - sent) : CHUNK;
			u32 s = vsock_send(&vs, c, out, n);
			sent += s;
			if (s) {
				vsock_poll(&vs);
				continue;
			}
		} else {
			vsock_send_ctl(&vs, c, VSOCK_OP_CREDIT_REQUEST, 0);
		}
		vsock_wait(&vs, 1000);
	}
	u64 us = (rdtsc() - t0) * 1000000 / tsc_hz();
	printf("vsock-echo: bench: %lu bytes guest->host in %lu us: %lu MiB/s\n", total, us,
	       us ? total * 1000000 / us >> 20 : 0);
	vsock_close(&vs, c, 5000000);
}

static u64 work(u64 arg)
{
	(void)arg;
	u32 port = (u32)cmdline_uint("port", 1234);
	u32 listen = (u32)cmdline_uint("listen", 5000);
	u64 bytes = cmdline_uint("bytes", 1 << 20);
	if (!vsock_open(&vs, cmdline_uint("irq", 1), VECTOR))
		fail("vsock-echo: no usable virtio-vsock device");
	if (cmdline_uint("bench", 0)) {
		bench(port, bytes);
		return 0;
	}
	if (cmdline_uint("reset", 0))
		wait_for_reset(port, cmdline_uint("wait_s", 120));
	u64 t0 = rdtsc();
	guest_to_host(port, bytes, 0x5a);
	u64 us = (rdtsc() - t0) * 1000000 / tsc_hz();
	printf("vsock-echo: guest->host->guest %lu bytes in %lu us (%lu KiB/s each way)\n", bytes,
	       us, us ? bytes * 1000000 / us / 1024 : 0);
	host_to_guest(listen, bytes);
	printf("vsock-echo: done (%lu packets in, %lu out)\n", vs.rx_packets, vs.tx_packets);
	return 0;
}

void guest_main(void)
{
	run_ring3_device_guest(work);
}
