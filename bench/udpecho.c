/*
 * The network benchmark's host side (bench/net.py).
 *   udpecho serve IP PORT                 echo every UDP datagram back to its sender
 *   udpecho client IP PORT WINDOW COUNT SIZE
 *       the veth floor: COUNT datagrams of SIZE bytes, at most WINDOW unanswered, each
 *       answer checked; prints "echoes=N us=T" (no loss expected on a veth pair)
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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
