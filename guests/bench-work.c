/*
 * bench-work: the guest side of the guest-against-host benchmark (bench/bench.py).
 * Runs the workloads of bench/workloads.h in ring 3 (natively on PVM hosts), the
 * same code bench/hostbench.c runs on the host:
 *
 *   touch     first touch of `mib=` MiB (default 256) of fresh RAM, one word per 4 KiB page
 *   memmove   `mib=` MiB from one buffer to another, both touched first
 *   intloop   `int=` iterations (default 100000000)
 *
 * in that order (the host program too): first touch first, so that it runs right after
 * the harness's `hostbench prime` (see bench/bench.py). *
 * `reps=` times each (default 3; every touch round uses new RAM).  Memory: the
 * buffers start at 64 MiB and need (2 + reps) * mib MiB below 3 GiB; else FAIL.
 * Output: "work: <name> rep=<k> units=<n> cycles=<c> check=<hex>" per run, PASS.
 */
#include "kit.h"
#include "../bench/workloads.h"

#define MIB		(1024UL * 1024)
#define BUF_BASE	(64 * MIB)

static u64 reps, int_n, bytes;

static u64 work(u64 arg)
{
	(void)arg;
	u8 *src = (u8 *)BUF_BASE, *dst = src + bytes, *fresh = dst + bytes;

	for (u64 r = 0; r < reps; r++) {
		u8 *p = fresh + r * bytes;
		u64 t0 = wl_rdtsc();
		u64 v = wl_touch(p, bytes, r);
		u64 c = wl_rdtsc() - t0;
		printf("work: touch rep=%lu units=%lu cycles=%lu check=%lx\n", r, bytes / WL_PAGE, c, v);
	}
	wl_touch(src, bytes, 0x1234);
	wl_touch(dst, bytes, 0);
	for (u64 r = 0; r < reps; r++) {
		u64 t0 = wl_rdtsc();
		wl_memmove(dst, src, bytes);
		u64 c = wl_rdtsc() - t0;
		printf("work: memmove rep=%lu units=%lu cycles=%lu check=%lx\n", r, bytes, c,
		       wl_sum_pages(dst, bytes));
	}
	for (u64 r = 0; r < reps; r++) {
		u64 t0 = wl_rdtsc();
		u64 v = wl_intloop(int_n, 0x9e3779b97f4a7c15ul + r);
		u64 c = wl_rdtsc() - t0;
		printf("work: intloop rep=%lu units=%lu cycles=%lu check=%lx\n", r, int_n, c, v);
	}
	return 0;
}

void guest_main(void)
{
	reps = cmdline_uint("reps", 3);
	int_n = cmdline_uint("int", 100000000);
	bytes = cmdline_uint("mib", 256) * MIB;

	u64 end = BUF_BASE + (2 + reps) * bytes;
	bool fits = false;
	for (int i = 0; i < memmap_count(); i++) {
		const struct mem_region *m = memmap_entry(i);
		if (m->type == E820_RAM && m->addr <= BUF_BASE && m->addr + m->size >= end)
			fits = true;
	}
	if (!fits || end > (3UL << 30))
		fail("bench-work: %lu MiB at 0x%lx do not fit in RAM below 3 GiB", (end - BUF_BASE) / MIB,
		     BUF_BASE);
	printf("bench-work: %lu reps, intloop %lu, buffers %lu MiB at 0x%lx\n", reps, int_n,
	       bytes / MIB, BUF_BASE);
	enter_ring3(work, 0);
	pass();
}
