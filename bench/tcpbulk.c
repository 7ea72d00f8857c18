/*
 * The TCP half of the network benchmark's host side (bench/net.py), speaking the net-tcp
 * guest's protocol: the stream is byte o = pattern(o mod 65521), pattern(i) = bits 16-23
 * of i * 2654435761 (32-bit), checked on every byte by the receiver.
 *   tcpbulk sink IP PORT        for each connection: read to EOF, checking; answer
 *                               "ok N US" (N bytes, US from the first byte to EOF) or
 *                               "bad at OFFSET", then close
 *   tcpbulk source IP PORT      for each connection: read "N\n", send N bytes, shut down
 *                               the sending side, read to EOF
 *   tcpbulk send IP PORT N      the floor of sink: prints "received=N us=T" (the sink's
 *                               own count and time)
 *   tcpbulk recv IP PORT N      the floor of source: prints "received=N us=T" (first to
 *                               last byte)
 * The servers print "ready" once listening.
 */
#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define PERIOD 65521u
#define CHUNK (1 << 20)

static unsigned char pattern[PERIOD + CHUNK];

static double now_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* Offset of the first wrong byte of buf (stream offset `at`), or -1. */
static long long check(const unsigned char *buf, size_t n, unsigned long long at)
{
	const unsigned char *want = pattern + at % PERIOD;
	if (memcmp(buf, want, n) == 0)
		return -1;
	for (size_t i = 0; i < n; i++)
		if (buf[i] != want[i])
			return (long long)(at + i);
	return -1;
}

static int write_all(int s, const void *p, size_t n)
{
	while (n) {
		ssize_t k = write(s, p, n);
		if (k <= 0)
			return -1;
		p = (const char *)p + k;
		n -= (size_t)k;
	}
	return 0;
}

/* Reads to EOF, checking; the count, the first wrong offset (or -1) and the time. */
static unsigned long long drain(int c, long long *bad, double *us)
{
	static unsigned char buf[CHUNK];
	unsigned long long got = 0;
	double first = 0, last = 0;
	*bad = -1;
	for (;;) {
		ssize_t n = read(c, buf, sizeof(buf));
		if (n <= 0)
			break;
		last = now_us();
		if (!got)
			first = last;
		if (*bad < 0)
			*bad = check(buf, (size_t)n, got);
		got += (unsigned long long)n;
	}
	*us = last - first;
	return got;
}

static void serve_sink(int c)
{
	long long bad;
	double us;
	unsigned long long got = drain(c, &bad, &us);
	char line[64];
	int n = bad < 0 ? snprintf(line, sizeof(line), "ok %llu %.0f\n", got, us)
			: snprintf(line, sizeof(line), "bad at %lld\n", bad);
	write_all(c, line, (size_t)n);
	fprintf(stderr, "tcpbulk sink: %s", line);
}

/* Sends n bytes of the stream from offset 0. */
static int send_stream(int s, unsigned long long n)
{
	for (unsigned long long sent = 0; sent < n;) {
		size_t k = n - sent < CHUNK ? (size_t)(n - sent) : CHUNK;
		if (write_all(s, pattern + sent % PERIOD, k))
			return -1;
		sent += k;
	}
	return 0;
}

static void serve_source(int c)
{
	char req[32];
	size_t len = 0;
	while (len + 1 < sizeof(req)) {
		ssize_t k = read(c, req + len, 1);
		if (k <= 0)
			return;
		if (req[len++] == '\n')
			break;
	}
	req[len] = 0;
	unsigned long long n = strtoull(req, NULL, 10);
	if (send_stream(c, n) == 0)
		shutdown(c, SHUT_WR);
	char tail[256];
	while (read(c, tail, sizeof(tail)) > 0)
		;
}

static int server(struct sockaddr_in *a, void (*serve)(int))
{
	int s = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(s, (struct sockaddr *)a, sizeof(*a)) || listen(s, 8)) {
		perror("tcpbulk: bind/listen");
		return 1;
	}
	printf("ready\n");
	fflush(stdout);
	for (;;) {
		int c = accept(s, NULL, NULL);
		if (c < 0)
			continue;
		serve(c);
		close(c);
	}
}

static int client(struct sockaddr_in *a, int sending, unsigned long long n)
{
	int s = socket(AF_INET, SOCK_STREAM, 0);
	if (connect(s, (struct sockaddr *)a, sizeof(*a))) {
		perror("tcpbulk: connect");
		return 1;
	}
	if (sending) {
		if (send_stream(s, n))
			return 1;
		shutdown(s, SHUT_WR);
		char line[64] = { 0 };
		ssize_t k = read(s, line, sizeof(line) - 1);
		unsigned long long got;
		double us;
		if (k <= 0 || sscanf(line, "ok %llu %lf", &got, &us) != 2) {
			fprintf(stderr, "tcpbulk: the sink says %s\n", line);
			return 1;
		}
		printf("received=%llu us=%.0f\n", got, us);
		return 0;
	}
	char req[32];
	int len = snprintf(req, sizeof(req), "%llu\n", n);
	write_all(s, req, (size_t)len);
	long long bad;
	double us;
	unsigned long long got = drain(s, &bad, &us);
	if (bad >= 0 || got != n) {
		fprintf(stderr, "tcpbulk: %llu of %llu bytes, first wrong at %lld\n", got, n, bad);
		return 1;
	}
	printf("received=%llu us=%.0f\n", got, us);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 4)
		return 2;
	for (unsigned i = 0; i < sizeof(pattern); i++)
		pattern[i] = (unsigned char)(((uint32_t)(i % PERIOD) * 2654435761u) >> 16);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[3])) };
	inet_pton(AF_INET, argv[2], &a.sin_addr);
	if (!strcmp(argv[1], "sink"))
		return server(&a, serve_sink);
	if (!strcmp(argv[1], "source"))
		return server(&a, serve_source);
	if (argc < 5)
		return 2;
	unsigned long long n = strtoull(argv[4], NULL, 10);
	if (!strcmp(argv[1], "send"))
		return client(&a, 1, n);
	if (!strcmp(argv[1], "recv"))
		return client(&a, 0, n);
	return 2;
}
