/*
 * The guest-against-host workloads, shared word for word by the bare-metal guest
 * (guests/bench-work.c, ring 3) and the host program (bench/hostbench.c), so both
 * run the same machine code shape: freestanding C, integer registers only, no libc.
 *
 *   wl_intloop   an integer loop (LCG + shift/xor chain, one dependent chain)
 *   wl_memmove   bytes from src to dst with `rep movsb` (the kernel's and glibc's
 *                large-copy primitive), here 256 MiB between two buffers
 *   wl_touch     writes one word per 4 KiB page: on fresh memory, the first-touch
 *                cost of every page (a host page fault; in a guest also whatever
 *                the hypervisor does to map the page)
 *
 * Every timed workload prints one line, in the guest and on the host alike:
 *   work: <name> rep=<k> units=<n> cycles=<tsc cycles> check=<hex>
 * <units> is what the figure is per (iterations, bytes, pages).  Cycles are TSC
 * cycles; the harness converts them with the TSC rate it measures on the host.
 */
#ifndef BENCH_WORKLOADS_H
#define BENCH_WORKLOADS_H

#define WL_PAGE 4096UL
#define WL_NOINLINE __attribute__((noinline))

typedef unsigned long wl_u64;

static inline wl_u64 wl_rdtsc(void)
{
	unsigned lo, hi;
	__asm__ volatile("lfence; rdtsc" : "=a"(lo), "=d"(hi) :: "memory");
	return ((wl_u64)hi << 32) | lo;
}

/* n iterations of one dependent integer chain; returns a checksum. */
static WL_NOINLINE wl_u64 wl_intloop(wl_u64 n, wl_u64 seed)
{
	wl_u64 x = seed, acc = 0;
	for (wl_u64 i = 0; i < n; i++) {
		x = x * 6364136223846793005ul + 1442695040888963407ul;
		acc += x >> 33;
		acc ^= acc << 7;
	}
	return acc;
}

/* Copies n bytes from src to dst (forward: the buffers must not overlap in a way that
 * needs a backward copy; the benchmark's do not overlap at all). */
static WL_NOINLINE void wl_memmove(void *dst, const void *src, wl_u64 n)
{
	__asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) :: "memory");
}

/* Writes one 8-byte word per page of [p, p + n); returns a checksum of what it wrote. */
static WL_NOINLINE wl_u64 wl_touch(void *p, wl_u64 n, wl_u64 seed)
{
	volatile wl_u64 *w = (volatile wl_u64 *)p;
	wl_u64 sum = 0;
	for (wl_u64 off = 0; off < n; off += WL_PAGE) {
		wl_u64 v = seed ^ off;
		w[off / 8] = v;
		sum += v;
	}
	return sum;
}

/* Reads the first word of every page back (a cheap check that a copy happened). */
static WL_NOINLINE wl_u64 wl_sum_pages(const void *p, wl_u64 n)
{
	const volatile wl_u64 *w = (const volatile wl_u64 *)p;
	wl_u64 sum = 0;
	for (wl_u64 off = 0; off < n; off += WL_PAGE)
		sum += w[off / 8];
	return sum;
}

#endif
