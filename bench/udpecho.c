/*
 * The network benchmark's host side (bench/net.py).
 *   udpecho serve IP PORT                 echo every UDP datagram back to its sender
 *   udpecho client IP PORT WINDOW COUNT SIZE
 *       the veth floor: COUNT datagrams of SIZE bytes, at most WINDOW unanswered, each
 *       answer checked; prints "echoes=N us=T" (no loss expected on a veth pair)
 *   udpecho sink IP PORT                  count datagrams; one starting with 0xffffffff is
 *       an end marker, answered with the count since the last marker (u32)
 *   udpecho blast IP PORT                 a datagram "COUNT SIZE" starts COUNT datagrams
 *       of SIZE bytes (sequence number first) back to its sender, as fast as they go
 *   udpecho send IP PORT COUNT SIZE       the floor of sink: prints "received=N us=T"
 *   udpecho recv IP PORT COUNT SIZE       the floor of blast: prints "received=N us=T"
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static double now_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv)
{
	if (argc < 4)
		return 2;
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[3])) };
	inet_pton(AF_INET, argv[2], &a.sin_addr);
	int s = socket(AF_INET, SOCK_DGRAM, 0);
	int buf = 8 << 20;
	setsockopt(s, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
	setsockopt(s, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
	static char data[65536], back[65536];
	if (!strcmp(argv[1], "serve")) {
		if (bind(s, (struct sockaddr *)&a, sizeof(a)))
			return perror("bind"), 1;
		puts("ready");
		fflush(stdout);
		for (;;) {
			struct sockaddr_in from;
			socklen_t fl = sizeof(from);
			ssize_t n = recvfrom(s, data, sizeof(data), 0, (struct sockaddr *)&from, &fl);
			if (n >= 0)
				sendto(s, data, (size_t)n, 0, (struct sockaddr *)&from, fl);
		}
	}
	if (!strcmp(argv[1], "sink") || !strcmp(argv[1], "blast")) {
		if (bind(s, (struct sockaddr *)&a, sizeof(a)))
			return perror("bind"), 1;
		puts("ready");
		fflush(stdout);
		unsigned count = 0;
		for (;;) {
			struct sockaddr_in from;
			socklen_t fl = sizeof(from);
			ssize_t n = recvfrom(s, data, sizeof(data), 0, (struct sockaddr *)&from, &fl);
			if (n < 4)
				continue;
			if (!strcmp(argv[1], "sink")) {
				unsigned first;
				memcpy(&first, data, 4);
				if (first != 0xffffffffu) {
					count++;
					continue;
				}
				sendto(s, &count, 4, 0, (struct sockaddr *)&from, fl);
				count = 0;
				continue;
			}
			data[n < 64 ? n : 63] = 0;
			unsigned total = 0, size = 0;
			if (sscanf(data, "%u %u", &total, &size) != 2 || size < 8 || size > 8972)
				continue;
			for (unsigned i = 0; i < total; i++) {
				memcpy(back, &i, 4);
				memset(back + 4, (int)(i & 0xff), size - 4);
				while (sendto(s, back, size, 0, (struct sockaddr *)&from, fl) < 0)
					;
			}
		}
	}
	if (!strcmp(argv[1], "send") || !strcmp(argv[1], "recv")) {
		if (argc < 6 || connect(s, (struct sockaddr *)&a, sizeof(a)))
			return 2;
		long count = atol(argv[4]), size = atol(argv[5]), got = 0;
		struct timeval tv = { .tv_sec = 1 };
		setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
		double start = now_us(), last = start;
		if (!strcmp(argv[1], "send")) {
			memset(data, 1, (size_t)size);
			for (long i = 0; i < count; i++)
				while (send(s, data, (size_t)size, 0) < 0)
					;
			unsigned end = 0xffffffffu, received = 0;
			send(s, &end, 4, 0);
			if (recv(s, &received, 4, 0) == 4)
				got = received;
			last = now_us();
		} else {
			snprintf(data, 64, "%ld %ld", count, size);
			send(s, data, strlen(data), 0);
			while (got < count && recv(s, back, sizeof(back), 0) > 0) {
				if (!got)
					start = now_us();
				got++;
				last = now_us();
			}
		}
		printf("received=%ld us=%.0f\n", got, last - start);
		return 0;
	}
	if (argc < 7 || connect(s, (struct sockaddr *)&a, sizeof(a)))
		return 2;
	long window = atol(argv[4]), count = atol(argv[5]), size = atol(argv[6]);
	long sent = 0, done = 0;
	double start = now_us();
	while (done < count) {
		while (sent < count && sent - done < window) {
			memcpy(data, &sent, sizeof(sent));
			memset(data + sizeof(sent), (int)(sent & 0xff), (size_t)size - sizeof(sent));
			if (send(s, data, (size_t)size, 0) != size)
				return perror("send"), 1;
			sent++;
		}
		ssize_t n = recv(s, back, sizeof(back), 0);
		long seq;
		memcpy(&seq, back, sizeof(seq));
		if (n != size || back[sizeof(seq)] != (char)(seq & 0xff))
			return fprintf(stderr, "bad echo\n"), 1;
		done++;
	}
	printf("echoes=%ld us=%.0f\n", done, now_us() - start);
	return 0;
}
