/*
 * vsock: pipes stdin and stdout through an AF_VSOCK stream socket (busybox has no vsock
 * support). Part of ferrovm's Linux test guest; built with gcc -static.
 *
 *   vsock connect CID PORT    connect to CID:PORT (the host is CID 2)
 *   vsock listen PORT         accept one connection on PORT
 *
 * Copies stdin to the socket until stdin ends (then shuts the socket's write side), and
 * the socket to stdout until the peer closes. Exit status 0, or 1 with one line on
 * stderr naming what failed.
 *
 * Built with musl (musl-gcc) where it is installed: 30 KB instead of glibc's 700 KB, and
 * every byte of the initramfs is copied by emulated ring 0 at boot on this project's hosts.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#if __has_include(<linux/vm_sockets.h>)
#include <linux/vm_sockets.h>
#else
/* musl ships no kernel headers: the kernel's stable ABI of <linux/vm_sockets.h>. */
#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif
#define VMADDR_CID_ANY (-1U)
struct sockaddr_vm {
	sa_family_t svm_family;
	unsigned short svm_reserved1;
	unsigned int svm_port;
	unsigned int svm_cid;
	unsigned char svm_flags;
	unsigned char svm_zero[sizeof(struct sockaddr) - sizeof(sa_family_t) -
			       sizeof(unsigned short) - 2 * sizeof(unsigned int) - 1];
};
#endif

static void die(const char *what)
{
	fprintf(stderr, "vsock: %s: %s\n", what, strerror(errno));
	exit(1);
}

static unsigned int number(const char *s, const char *what)
{
	char *end;
	unsigned long v;

	errno = 0;
	v = strtoul(s, &end, 0);
	if (errno || *s == '\0' || *end != '\0' || v > 0xffffffffUL) {
		fprintf(stderr, "vsock: bad %s '%s'\n", what, s);
		exit(1);
	}
	return (unsigned int)v;
}

/* Writes all of buf, or exits. */
static void write_all(int fd, const char *buf, size_t len, const char *what)
{
	while (len > 0) {
		ssize_t n = write(fd, buf, len);

		if (n < 0) {
			if (errno == EINTR)
				continue;
			die(what);
		}
		buf += n;
		len -= (size_t)n;
	}
}

static void pump(int sock)
{
	struct pollfd fds[2] = {
		{ .fd = STDIN_FILENO, .events = POLLIN },
		{ .fd = sock, .events = POLLIN },
	};
	char buf[65536];

	for (;;) {
		if (poll(fds, 2, -1) < 0) {
			if (errno == EINTR)
				continue;
			die("poll");
		}
		if (fds[0].revents) {
			ssize_t n = read(STDIN_FILENO, buf, sizeof(buf));

			if (n < 0 && errno != EINTR)
				die("read stdin");
			if (n == 0) {
				/* stdin ended: tell the peer, keep reading its answer. */
				shutdown(sock, SHUT_WR);
				fds[0].fd = -1;
			} else if (n > 0) {
				write_all(sock, buf, (size_t)n, "write socket");
			}
		}
		if (fds[1].revents) {
			ssize_t n = read(sock, buf, sizeof(buf));

			if (n < 0 && errno != EINTR)
				die("read socket");
			if (n == 0)
				return;
			if (n > 0)
				write_all(STDOUT_FILENO, buf, (size_t)n, "write stdout");
		}
	}
}

static void usage(void)
{
	fprintf(stderr, "usage: vsock connect CID PORT | vsock listen PORT\n");
	exit(2);
}

int main(int argc, char **argv)
{
	struct sockaddr_vm addr = { .svm_family = AF_VSOCK };
	int sock;

	if (argc < 2)
		usage();
	sock = socket(AF_VSOCK, SOCK_STREAM, 0);
	if (sock < 0)
		die("socket(AF_VSOCK)");

	if (strcmp(argv[1], "connect") == 0 && argc == 4) {
		addr.svm_cid = number(argv[2], "CID");
		addr.svm_port = number(argv[3], "port");
		if (connect(sock, (struct sockaddr *)&addr, sizeof(addr)) < 0)
			die("connect");
		pump(sock);
	} else if (strcmp(argv[1], "listen") == 0 && argc == 3) {
		int conn;

		addr.svm_cid = VMADDR_CID_ANY;
		addr.svm_port = number(argv[2], "port");
		if (bind(sock, (struct sockaddr *)&addr, sizeof(addr)) < 0)
			die("bind");
		if (listen(sock, 1) < 0)
			die("listen");
		conn = accept(sock, NULL, NULL);
		if (conn < 0)
			die("accept");
		close(sock);
		pump(conn);
	} else {
		usage();
	}
	return 0;
}
