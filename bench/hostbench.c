/*
 * hostbench: the host side of the guest-against-host benchmark, and the same
 * harness for a Linux guest (see docs/benchmarks.md, "Guest against host").
 *
 *   hostbench tsc                      prints "tsc_hz=<Hz>" (TSC against CLOCK_MONOTONIC_RAW)
 *   hostbench work [reps] [int] [mib]  the workloads of workloads.h, exactly as the
 *                                      bare-metal guest bench-work runs them (default 3,
 *                                      100000000, 256): first touch of 4 KiB pages ("touch")
 *                                      and of memory advised MADV_HUGEPAGE ("touch-thp"),
 *                                      memmove between huge-page buffers, integer loop
 *   hostbench os [reps] [dir]          what needs an operating system: getpid, fork+wait,
 *                                      write+fsync (4 KiB to a file in dir, default /var/tmp),
 *                                      reading /dev/zero, and a sequential write of 1 MiB
 *                                      chunks with one fsync, then a read of it from disk
 *   hostbench all [reps] [dir]         tsc, work, os
 *   hostbench prime MIB                touches MIB MiB of fresh memory and frees it (the
 *                                      harness's way to start runs from the same host state)
 *
 * Output lines: "work: <name> rep=<k> units=<n> cycles=<c> check=<hex>" (as the guest's).
 * Run as PID 1 (the /init of an initramfs, see bench/linux-initramfs.sh) it mounts
 * /proc, and /dev/vda (ext4) on /mnt if the machine has that disk, else a tmpfs; runs "all"
 * with dir there, and powers the machine off.
 *
 * The counts come from the environment where a guest's emulated kernel makes the host's
 * too slow (a Linux guest's init gets the kernel command line's KEY=VALUE words):
 * HB_GETPID (10^6), HB_FORK (500), HB_FSYNC (100), HB_ZERO_MIB (256), HB_SEQ_MIB (128),
 * HB_REPS (3), HB_INT (10^8), HB_WORK_MIB (256).
 *
 * Built statically (bench/Makefile) so the same binary runs on the host and in a guest.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "workloads-host.h"

#define MIB (1024UL * 1024)

static unsigned long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC_RAW, &ts);
	return (unsigned long)ts.tv_sec * 1000000000ul + (unsigned long)ts.tv_nsec;
}

static void tsc(void)
{
	/* Best of 3 windows of 100 ms. */
	double best = 0;
	for (int i = 0; i < 3; i++) {
		unsigned long n0 = now_ns(), c0 = hb_rdtsc();
		while (now_ns() - n0 < 100000000ul)
			;
		unsigned long n1 = now_ns(), c1 = hb_rdtsc();
		double hz = (double)(c1 - c0) * 1e9 / (double)(n1 - n0);
		if (i == 0 || hz < best)
			best = hz;
	}
	printf("tsc_hz=%.0f\n", best);
	fflush(stdout);
}

static void *fresh_map(unsigned long bytes, int huge)
{
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
		       -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		exit(1);
	}
	madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
	return p;
}

static void line(const char *name, unsigned long rep, unsigned long units, unsigned long cycles,
		 unsigned long check)
{
	printf("work: %s rep=%lu units=%lu cycles=%lu check=%lx\n", name, rep, units, cycles, check);
	fflush(stdout);
}

static void work(unsigned long reps, unsigned long int_n, unsigned long bytes)
{
	/* Same order as the guest: first touch first (right after the harness's prime). */
	for (int huge = 0; huge <= 1; huge++) {
		for (unsigned long r = 0; r < reps; r++) {
			unsigned char *p = fresh_map(bytes, huge);
			unsigned long t0 = hb_rdtsc();
			unsigned long v = hb_touch(p, bytes, r);
			line(huge ? "touch-thp" : "touch", r, bytes / 4096, hb_rdtsc() - t0, v);
			munmap(p, bytes);
		}
	}
	/* As in the guest: two buffers, touched first.  Huge pages, as the guest has them (the
	 * kit maps its RAM with 2 MiB pages, and both VMMs back guest RAM with huge pages): with
	 * 4 KiB pages the host copy is the slower one, by TLB misses alone. */
	unsigned char *src = fresh_map(bytes, 1), *dst = fresh_map(bytes, 1);
	hb_touch(src, bytes, 0x1234);
	hb_touch(dst, bytes, 0);
	for (unsigned long r = 0; r < reps; r++) {
		unsigned long t0 = hb_rdtsc();
		hb_memmove(dst, src, bytes);
		unsigned long c = hb_rdtsc() - t0;
		line("memmove", r, bytes, c, hb_sum_pages(dst, bytes));
	}
	munmap(src, bytes);
	munmap(dst, bytes);
	for (unsigned long r = 0; r < reps; r++) {
		unsigned long t0 = hb_rdtsc();
		unsigned long v = hb_intloop(int_n, 0x9e3779b97f4a7c15ul + r);
		line("intloop", r, int_n, hb_rdtsc() - t0, v);
	}
}

static unsigned long env_ul(const char *name, unsigned long dflt)
{
	const char *v = getenv(name);
	return v && *v ? strtoul(v, NULL, 0) : dflt;
}

static int open_or_die(const char *path, int flags)
{
	int fd = open(path, flags, 0600);
	if (fd < 0) {
		fprintf(stderr, "hostbench: %s: %s\n", path, strerror(errno));
		exit(1);
	}
	return fd;
}

/* Reads of /dev/zero (the kernel's memset to user memory) and a sequential write of 1 MiB
 * chunks with one fsync, then the same file read back after dropping it from the page
 * cache: units are bytes. */
static void bulk(unsigned long reps, const char *dir)
{
	static char chunk[MIB];
	unsigned long zero = env_ul("HB_ZERO_MIB", 256), seq = env_ul("HB_SEQ_MIB", 128);
	int zfd = open_or_die("/dev/zero", O_RDONLY);
	for (unsigned long r = 0; r < reps; r++) {
		unsigned long t0 = hb_rdtsc();
		for (unsigned long i = 0; i < zero; i++)
			if (read(zfd, chunk, MIB) != (ssize_t)MIB)
				exit(1);
		line("zero-read", r, zero * MIB, hb_rdtsc() - t0, 0);
	}
	close(zfd);
	char path[4096];
	snprintf(path, sizeof(path), "%s/hostbench-seq.%d", dir, (int)getpid());
	memset(chunk, 0xa5, sizeof(chunk));
	for (unsigned long r = 0; r < reps; r++) {
		int fd = open_or_die(path, O_CREAT | O_TRUNC | O_RDWR);
		unsigned long t0 = hb_rdtsc();
		for (unsigned long i = 0; i < seq; i++)
			if (write(fd, chunk, MIB) != (ssize_t)MIB)
				exit(1);
		if (fsync(fd) != 0)
			exit(1);
		line("seq-write", r, seq * MIB, hb_rdtsc() - t0, 0);
		posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
		lseek(fd, 0, SEEK_SET);
		t0 = hb_rdtsc();
		for (unsigned long i = 0; i < seq; i++)
			if (read(fd, chunk, MIB) != (ssize_t)MIB)
				exit(1);
		line("seq-read", r, seq * MIB, hb_rdtsc() - t0, 0);
		close(fd);
		unlink(path);
	}
}

static void os(unsigned long reps, const char *dir)
{
	const unsigned long n_getpid = env_ul("HB_GETPID", 1000000), n_fork = env_ul("HB_FORK", 500),
			    n_fsync = env_ul("HB_FSYNC", 100);
	for (unsigned long r = 0; r < reps; r++) {
		unsigned long t0 = hb_rdtsc(), s = 0;
		for (unsigned long i = 0; i < n_getpid; i++)
			s += (unsigned long)syscall(SYS_getpid);
		line("getpid", r, n_getpid, hb_rdtsc() - t0, s);
	}
	for (unsigned long r = 0; r < reps; r++) {
		unsigned long t0 = hb_rdtsc();
		for (unsigned long i = 0; i < n_fork; i++) {
			pid_t pid = fork();
			if (pid == 0)
				_exit(0);
			if (pid < 0 || waitpid(pid, NULL, 0) != pid) {
				perror("fork/wait");
				exit(1);
			}
		}
		line("fork-wait", r, n_fork, hb_rdtsc() - t0, 0);
	}
	char path[4096];
	snprintf(path, sizeof(path), "%s/hostbench.%d", dir, (int)getpid());
	int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
	if (fd < 0) {
		fprintf(stderr, "hostbench: %s: %s\n", path, strerror(errno));
		exit(1);
	}
	static char block[4096];
	memset(block, 0x5a, sizeof(block));
	for (unsigned long r = 0; r < reps; r++) {
		unsigned long t0 = hb_rdtsc();
		for (unsigned long i = 0; i < n_fsync; i++) {
			if (pwrite(fd, block, sizeof(block), (off_t)(i * sizeof(block))) != sizeof(block) ||
			    fsync(fd) != 0) {
				perror("write/fsync");
				exit(1);
			}
		}
		line("write-fsync", r, n_fsync, hb_rdtsc() - t0, 0);
	}
	close(fd);
	unlink(path);
	bulk(reps, dir);
}

static unsigned long arg_ul(int argc, char **argv, int i, unsigned long dflt)
{
	return argc > i ? strtoul(argv[i], NULL, 0) : dflt;
}

int main(int argc, char **argv)
{
	if (getpid() == 1) {
		/* /init of a benchmark initramfs. */
		mkdir("/proc", 0555);
		mkdir("/dev", 0755);
		mkdir("/mnt", 0755);
		mount("proc", "/proc", "proc", 0, NULL);
		mount("devtmpfs", "/dev", "devtmpfs", 0, NULL);
		const char *dir = "/mnt";
		if (mount("/dev/vda", "/mnt", "ext4", 0, NULL) != 0)
			mount("tmpfs", "/mnt", "tmpfs", 0, NULL);
		else
			printf("hostbench: /dev/vda (ext4) on /mnt\n");
		printf("hostbench: running as init\n");
		unsigned long reps = env_ul("HB_REPS", 3);
		tsc();
		work(reps, env_ul("HB_INT", 100000000), env_ul("HB_WORK_MIB", 256) * MIB);
		os(reps, dir);
		umount("/mnt");
		printf("hostbench: done\n");
		fflush(stdout);
		sync();
		reboot(RB_POWER_OFF);
		return 0;
	}
	const char *cmd = argc > 1 ? argv[1] : "all";
	if (!strcmp(cmd, "tsc")) {
		tsc();
	} else if (!strcmp(cmd, "work")) {
		work(arg_ul(argc, argv, 2, 3), arg_ul(argc, argv, 3, 100000000),
		     arg_ul(argc, argv, 4, 256) * MIB);
	} else if (!strcmp(cmd, "os")) {
		os(arg_ul(argc, argv, 2, 3), argc > 3 ? argv[3] : "/var/tmp");
	} else if (!strcmp(cmd, "prime")) {
		unsigned long bytes = arg_ul(argc, argv, 2, 1024) * MIB;
		unsigned char *p = fresh_map(bytes, 1);
		hb_touch(p, bytes, 1);
		munmap(p, bytes);
	} else if (!strcmp(cmd, "all")) {
		tsc();
		work(arg_ul(argc, argv, 2, 3), 100000000, 256 * MIB);
		os(arg_ul(argc, argv, 2, 3), argc > 3 ? argv[3] : "/var/tmp");
	} else {
		fprintf(stderr, "usage: hostbench tsc | work [reps] [int] [mib] | os [reps] [dir] | all [reps] [dir] | prime MIB\n");
		return 2;
	}
	return 0;
}
