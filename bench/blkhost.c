/*
 * blkhost: the floor of the virtio-blk benchmark — the host reading and writing the image
 * file directly, in the pattern the guest bench-blk (guests/bench-blk.c) sends its disk.
 *
 *   blkhost IMAGE [key=value ...]
 *
 * Keys as the guest's: mib=64 (region from start=0, in sectors), ms=1000 per measurement,
 * seq_bs=262144, seq_qd=4, seed=1, reps=1, fill=1, queues=1, tests=seqwrite,seqread,randread1,
 * randread32,randwrite1,randwrite32 (the default, in that order), and with queues=2
 * randread32x2, randwrite32x2 (the guest's two queues × 32: 64 threads here); direct=1
 * opens the image with O_DIRECT.
 *
 * A measurement with depth d runs d threads, each with one request in flight: pread or
 * pwrite of the request's size at the next offset of the shared sequence, until the
 * time is up. Random offsets: the guest's xorshift64* from the same seed, drawn in the
 * same order (a table of them, shared by the threads through an atomic index);
 * sequential ones: the next seq_bs block of the region, wrapping. So depth 1 is a plain
 * synchronous loop and depth 32 is 32 synchronous threads (no io_uring, no AIO).
 *
 * Output, as the guest's: "blk: test=<name> qd=<d> [queues=2 ]bs=<bytes> rep=<k> n=<requests>
 * cycles=<tsc>" per measurement, with the TSC read on the calling thread around the run.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <x86intrin.h>

#define SECTOR		512ul
#define MIB		(1024ul * 1024)
#define RAND_BS		4096u
#define MAX_DEPTH	64
#define TABLE_LEN	(1u << 22)	/* random offsets drawn ahead; wraps if a run uses more */

struct job {
	const char *key, *name;
	bool write, random;
	unsigned qd;		/* per queue; 0: seq_qd */
	unsigned queues;	/* the guest's queues: qd * queues threads */
};

static const struct job jobs[] = {
	{ "seqwrite", "seqwrite", true, false, 0, 1 },
	{ "seqread", "seqread", false, false, 0, 1 },
	{ "randread1", "randread", false, true, 1, 1 },
	{ "randread32", "randread", false, true, 32, 1 },
	{ "randwrite1", "randwrite", true, true, 1, 1 },
	{ "randwrite32", "randwrite", true, true, 32, 1 },
	{ "randread32x2", "randread", false, true, 32, 2 },
	{ "randwrite32x2", "randwrite", true, true, 32, 2 },
};

static struct {
	const char *tests;
	unsigned long start, mib, ms, seq_bs, seq_qd, seed, reps, fill, direct, queues;
} opt = { NULL, 0, 64, 1000, 262144, 4, 1, 1, 1, 0, 1 };

struct run {
	const struct job *job;
	int fd;
	uint32_t bs;
	unsigned long long deadline;
	uint64_t *table;	/* byte offsets, in request order */
	atomic_ulong next;	/* index of the next request */
	atomic_int failed;
};

static uint64_t xorshift64s(uint64_t *s)
{
	uint64_t x = *s;
	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	*s = x;
	return x * 0x2545f4914f6cdd1dull;
}

static uint64_t region_bytes(void) { return opt.mib * MIB; }

/* The byte offsets the guest's cursor yields, in order (random: from the seed). */
static void fill_table(uint64_t *table, bool random, uint32_t bs)
{
	uint64_t slots = region_bytes() / bs, rng = opt.seed, seq = 0;
	for (unsigned i = 0; i < TABLE_LEN; i++) {
		uint64_t off;
		if (random) {
			off = (xorshift64s(&rng) >> 11) % slots * bs;
		} else {
			off = seq;
			seq = seq + bs >= slots * bs ? 0 : seq + bs;
		}
		table[i] = opt.start * SECTOR + off;
	}
}

static void *aligned_buffer(size_t len, unsigned tag)
{
	void *p;
	if (posix_memalign(&p, 4096, len)) {
		perror("posix_memalign");
		exit(1);
	}
	uint64_t *w = p;
	for (size_t k = 0; k < len / 8; k++)
		w[k] = (k * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)tag << 56);
	return p;
}

static void *worker(void *arg)
{
	struct run *run = arg;
	void *buf = aligned_buffer(run->bs, (unsigned)(uintptr_t)pthread_self());
	while (__rdtsc() < run->deadline && !atomic_load(&run->failed)) {
		unsigned long i = atomic_fetch_add(&run->next, 1);
		off_t off = (off_t)run->table[i % TABLE_LEN];
		ssize_t n = run->job->write ? pwrite(run->fd, buf, run->bs, off)
					    : pread(run->fd, buf, run->bs, off);
		if (n != (ssize_t)run->bs) {
			perror(run->job->write ? "pwrite" : "pread");
			atomic_store(&run->failed, 1);
		}
	}
	free(buf);
	return NULL;
}

static unsigned long long tsc_per_ms(void)
{
	struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC_RAW, &a);
	unsigned long long c0 = __rdtsc();
	do
		clock_gettime(CLOCK_MONOTONIC_RAW, &b);
	while ((b.tv_sec - a.tv_sec) * 1000000000l + (b.tv_nsec - a.tv_nsec) < 50000000l);
	return (__rdtsc() - c0) / 50;
}

static void measure(int fd, const struct job *job, unsigned long rep, uint64_t *table,
		    unsigned long long per_ms)
{
	unsigned qd = job->qd ? job->qd : (unsigned)opt.seq_qd;
	struct run run = { .job = job, .fd = fd, .table = table };
	run.bs = job->random ? RAND_BS : (uint32_t)opt.seq_bs;
	fill_table(table, job->random, run.bs);
	unsigned nthreads = qd * job->queues;
	pthread_t threads[MAX_DEPTH];
	unsigned long long t0 = __rdtsc();
	run.deadline = t0 + opt.ms * per_ms;
	for (unsigned i = 0; i < nthreads; i++)
		if (pthread_create(&threads[i], NULL, worker, &run)) {
			perror("pthread_create");
			exit(1);
		}
	for (unsigned i = 0; i < nthreads; i++)
		pthread_join(threads[i], NULL);
	unsigned long long cycles = __rdtsc() - t0;
	if (atomic_load(&run.failed))
		exit(1);
	/* Every index drawn was one completed request. */
	unsigned long n = atomic_load(&run.next);
	printf("blk: test=%s qd=%u%s bs=%u rep=%lu n=%lu cycles=%llu\n", job->name, qd,
	       job->queues > 1 ? " queues=2" : "", run.bs, rep, n, cycles);
	fflush(stdout);
}

static bool wanted(const struct job *job)
{
	const char *key = job->key;
	if (job->queues > opt.queues)
		return false;
	if (!opt.tests)
		return true;
	size_t k = strlen(key);
	for (const char *p = opt.tests; *p;) {
		const char *e = strchrnul(p, ',');
		if ((size_t)(e - p) == k && !strncmp(p, key, k))
			return true;
		p = *e ? e + 1 : e;
	}
	return false;
}

/* Writes the region once with seq_bs writes, then fdatasync (as the guest's fill + FLUSH). */
static void fill_region(int fd)
{
	void *buf = aligned_buffer(opt.seq_bs, 0);
	for (uint64_t off = 0; off < region_bytes(); off += opt.seq_bs)
		if (pwrite(fd, buf, opt.seq_bs, (off_t)(opt.start * SECTOR + off)) != (ssize_t)opt.seq_bs) {
			perror("fill: pwrite");
			exit(1);
		}
	if (fdatasync(fd)) {
		perror("fdatasync");
		exit(1);
	}
	free(buf);
}

static void parse(int argc, char **argv)
{
	static const struct { const char *key; unsigned long *val; } keys[] = {
		{ "start", &opt.start }, { "mib", &opt.mib }, { "ms", &opt.ms },
		{ "seq_bs", &opt.seq_bs }, { "seq_qd", &opt.seq_qd }, { "seed", &opt.seed },
		{ "reps", &opt.reps }, { "fill", &opt.fill }, { "direct", &opt.direct },
		{ "queues", &opt.queues },
	};
	for (int i = 2; i < argc; i++) {
		char *eq = strchr(argv[i], '=');
		bool known = false;
		if (eq && !strncmp(argv[i], "tests=", 6)) {
			opt.tests = eq + 1;
			continue;
		}
		for (size_t k = 0; eq && k < sizeof(keys) / sizeof(keys[0]); k++)
			if ((size_t)(eq - argv[i]) == strlen(keys[k].key) &&
			    !strncmp(argv[i], keys[k].key, (size_t)(eq - argv[i]))) {
				*keys[k].val = strtoul(eq + 1, NULL, 0);
				known = true;
			}
		if (!known) {
			fprintf(stderr, "blkhost: unknown argument %s\n", argv[i]);
			exit(2);
		}
	}
	if (opt.seq_bs < RAND_BS || opt.seq_bs % RAND_BS || !opt.seq_qd || opt.seq_qd > MAX_DEPTH ||
	    !opt.seed || !opt.mib || region_bytes() % opt.seq_bs) {
		fprintf(stderr, "blkhost: seq_bs a multiple of 4096 dividing the region, seq_qd 1-%d, "
			"seed and mib non-zero\n", MAX_DEPTH);
		exit(2);
	}
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: blkhost IMAGE [key=value ...]\n");
		return 2;
	}
	parse(argc, argv);
	int fd = open(argv[1], O_RDWR | (opt.direct ? O_DIRECT : 0));
	if (fd < 0) {
		perror(argv[1]);
		return 1;
	}
	off_t size = lseek(fd, 0, SEEK_END);
	if (size < (off_t)(opt.start * SECTOR + region_bytes())) {
		fprintf(stderr, "blkhost: the region does not fit %s (%lld bytes)\n", argv[1],
			(long long)size);
		return 1;
	}
	uint64_t *table = malloc(sizeof(uint64_t) * TABLE_LEN);
	if (!table) {
		perror("malloc");
		return 1;
	}
	unsigned long long per_ms = tsc_per_ms();
	if (opt.fill)
		fill_region(fd);
	for (unsigned long rep = 0; rep < opt.reps; rep++)
		for (size_t j = 0; j < sizeof(jobs) / sizeof(jobs[0]); j++)
			if (wanted(&jobs[j]))
				measure(fd, &jobs[j], rep, table, per_ms);
	if (fdatasync(fd)) {
		perror("fdatasync");
		return 1;
	}
	close(fd);
	return 0;
}
