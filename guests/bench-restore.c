/*
 * bench-restore: the snapshot-restore benchmark's guest (bench/bench.py, section
 * "restore").  In ring 3 it fills "mib=" MiB (default 256) at "base=" (default 16 MiB)
 * with the pattern migrate-idle uses (every 8-byte word w of page i holds
 * (0x49444c45 << 32 | i) + w * 0x9e3779b97f4a7c15: no page is zero or like another),
 * prints
 *
 *   bench-restore: touched <N> MiB
 *
 * and then, still in ring 3, forever: reads and checks the region page by page, pass
 * after pass, and writes one byte '.' to the UART (port 0x3f8) whenever "period_us="
 * (default 200) microseconds of TSC time have gone by since the last one (checked
 * between pages).  After each complete pass:
 *
 *   <newline>bench-restore: pass <n> ok
 *
 * A page that differs ends the VM: "FAIL: page <i> ..." (exit code 1).
 *
 * Snapshotted while it runs and restored, its first port write after the resume comes
 * at most period_us after the vCPU runs again (plus the page faults of the pages it reads
 * meanwhile): the harness times process start to that byte.  The end of the first
 * complete pass after the resume says when the guest has read (and checked) all of its
 * memory.
 */
#include "kit.h"

#define PAGE		4096UL
#define MIB		(1024UL * 1024)
#define WORDS_PER_PAGE	(PAGE / 8)
#define MAP_LIMIT	(3UL << 30)

extern char __image_end[];

static u64 region_base, region_pages, period_cycles;

static inline u64 pattern(u64 page, u64 word)
{
	return ((0x49444c45UL << 32) | page) + word * 0x9e3779b97f4a7c15UL;
}

static u64 touch(u64 arg)
{
	(void)arg;
	for (u64 i = 0; i < region_pages; i++) {
		volatile u64 *p = (volatile u64 *)(region_base + i * PAGE);
		for (u64 w = 0; w < WORDS_PER_PAGE; w++)
			p[w] = pattern(i, w);
	}
	printf("bench-restore: touched %lu MiB\n", region_pages / 256);
	return 0;
}

static u64 run(u64 arg)
{
	(void)arg;
	u64 last = rdtsc();
	for (u64 pass = 1;; pass++) {
		for (u64 i = 0; i < region_pages; i++) {
			const volatile u64 *p = (const volatile u64 *)(region_base + i * PAGE);
			for (u64 w = 0; w < WORDS_PER_PAGE; w++) {
				if (p[w] != pattern(i, w)) {
					printf("\n");
					fail("page %lu at 0x%lx word %lu holds 0x%lx, expected 0x%lx", i,
					     region_base + i * PAGE, w, p[w], pattern(i, w));
				}
			}
			u64 now = rdtsc();
			if (now - last >= period_cycles) {
				outb(SERIAL_PORT, '.');
				last = now;
			}
		}
		printf("\nbench-restore: pass %lu ok\n", pass);
	}
	return 0;
}

void guest_main(void)
{
	u64 mib = cmdline_uint("mib", 256);
	u64 base = cmdline_uint("base", 16 * MIB);
	u64 period_us = cmdline_uint("period_us", 200);
	u64 size = mib * MIB;
	if (!mib || base % PAGE || base < (u64)__image_end || base + size > MAP_LIMIT ||
	    base + size < base)
		fail("region %lu MiB at 0x%lx: must be page-aligned, above the image (0x%lx) and below 0x%lx",
		     mib, base, (u64)__image_end, MAP_LIMIT);
	if (!ram_covers(base, size))
		fail("region %lu MiB at 0x%lx is not inside one RAM region (%lu MiB of RAM)", mib,
		     base, ram_bytes() / MIB);
	region_base = base;
	region_pages = size / PAGE;
	period_cycles = tsc_hz() / 1000000 * period_us;
	printf("bench-restore: region %lu MiB at 0x%lx, a byte every %lu us\n", mib, base,
	       period_us);
	enter_ring3(touch, 0);
	enter_ring3(run, 0);
}
