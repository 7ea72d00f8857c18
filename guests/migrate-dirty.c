/*
 * migrate-dirty: keeps dirtying memory as fast as it can, for snapshot /
 * restore and live-migration tests, and checks that no write is ever lost.
 *
 * Region: "mib=" MiB (default 64) at "base=" (default 16 MiB; page-aligned,
 * above the image, inside one RAM region of the memory map, below 3 GiB where
 * the kit's identity map is cached).  Split into equal contiguous shares, one
 * per writer CPU: all vCPUs by default, "cpus=" fewer (cpus=1: the BSP only,
 * the APs are never started).
 *
 * Each writer runs in ring 3 (interrupts off, no timers: nothing but the
 * writes).  Pass 0 writes 0 into the first 8 bytes of every page of its
 * share; pass k = 1, 2, 3, ... reads each page's first u64, which must hold
 * k - 1 (written by the previous pass; k itself is tolerated), and writes k.
 * So at any moment a share holds k up to some page and k - 1 after it; a
 * page that lost a write (not transferred after it was dirtied, a stale
 * snapshot page, a reset pass counter) breaks that at the writer's next visit:
 *
 *   migrate-dirty: cpu <c> pass <k>: page <i> at 0x<addr> holds 0x<v>
 *   FAIL: page <i> holds <v>, expected <k-1> or <k>          (exit code 1)
 *
 * (<i> is the page's index in the whole region.)  The BSP prints, from ring
 * 3, every "report_ms=" ms (default 500; TSC based):
 *
 *   migrate-dirty: pass <k> <r> MiB/s
 *
 * k = the BSP's pass (0 while it fills the region; never decreases, also
 * across a snapshot/restore or a migration: it lives in guest memory and
 * registers), r = pages written by all writers since the last line x 4 KiB
 * per second.  A TSC that jumps forward (the VM was paused) only lowers one
 * line's rate; one that goes backwards restarts the interval.
 *
 * "passes=P": every writer stops after pass P; the BSP waits for the others,
 * prints a summary and PASS (exit code 0).  Without it the guest never ends.
 *
 * "mibps=R": at most R MiB/s of pages in all (R / writers each; a token
 * bucket checked every 64 pages, spinning on PAUSE in ring 3, at most 100 ms
 * of credit saved up).  Unthrottled, the pages' first cache lines stay in the
 * cache and a writer dirties hundreds of GiB/s worth of pages: only the VMM's
 * dirty-logging write faults slow it down.
 *
 * "lose=I" (self-test of the check): pass 2 leaves page I (region index)
 * unwritten, so pass 3 must fail on it.
 *
 * "wallclock=1": points KVM's wall clock MSR (MSR_KVM_WALL_CLOCK_NEW) at a page
 * of the image, as Linux's kvmclock does: restoring that MSR makes KVM write the
 * page, so a post-copy destination needs it before the guest runs.
 */
#include "kit.h"

#define PAGE		4096UL
#define MIB		(1024UL * 1024)
#define WORDS_PER_PAGE	(PAGE / 8)
#define MAP_LIMIT	(3UL << 30)	/* 3-4 GiB is mapped uncached (MMIO) */

extern char __image_end[];

struct writer {
	volatile u64 pages;	/* pages written so far (published every 64) */
	volatile u64 pass;	/* the pass in progress */
	u64 first, count;	/* share: region page indices [first, first + count) */
} __attribute__((aligned(64)));

static struct writer w[KIT_MAX_CPUS];

#define MSR_KVM_WALL_CLOCK_NEW	0x4b564d00
static u8 wall_clock[PAGE] __attribute__((aligned(PAGE)));
static u64 region_base, region_pages;
static u64 npasses;		/* 0: forever */
static unsigned nwriters;
static volatile u32 writers_done;
static u64 hz, report_cycles;
static u64 rate_pages;		/* mibps= per writer, in pages/s; 0: unthrottled */
static u64 lose_page = ~0UL;	/* lose=: pass 2 skips this page's write (self-test) */

/* BSP only: the progress line's interval. */
static u64 last_tsc, last_pages;
static u64 start_tsc;

static u64 total_pages(void)
{
	u64 t = 0;
	for (unsigned i = 0; i < nwriters; i++)
		t += w[i].pages;
	return t;
}

/* Ring 3, BSP: prints a progress line when the interval has passed. */
static void report(u64 k)
{
	u64 now = rdtsc();
	if ((s64)(now - last_tsc) < 0) {	/* TSC went backwards (restore): restart */
		last_tsc = now;
		last_pages = total_pages();
		return;
	}
	u64 dt = now - last_tsc;
	if (dt < report_cycles)
		return;
	u64 total = total_pages();
	u64 dp = total - last_pages;
	/* MiB/s = dp * 4 KiB / (dt / hz) = dp * hz / 256 / dt (no 128-bit division) */
	u64 rate = dp * (hz / 256) / dt;
	last_tsc = now;
	last_pages = total;
	printf("migrate-dirty: pass %lu %lu MiB/s\n", k, rate);
}

static NORETURN void bad_page(unsigned idx, u64 page, u64 v, u64 k)
{
	console_lock();		/* keep the detail line next to the FAIL line */
	printf("migrate-dirty: cpu %u pass %lu: page %lu at 0x%lx holds 0x%lx\n",
	       idx, k, page, region_base + page * PAGE, v);
	fail("page %lu holds %lu, expected %lu or %lu", page, v, k - 1, k);
}

/* Ring 3: token bucket for mibps=; waits until 64 more pages may be written.
 * Credit is in pages x hz; at most 100 ms of it is saved up (also over a TSC
 * jump, so a paused VM does not burst afterwards). */
static void throttle(u64 *credit, u64 *last, bool bsp, u64 k)
{
	u64 cost = 64 * hz;
	u64 cap = rate_pages * (hz / 10);
	if (cap < cost)
		cap = cost;
	for (;;) {
		u64 now = rdtsc();
		u64 el = now - *last;
		if ((s64)el < 0)
			el = 0;
		if (el > hz / 10)
			el = hz / 10;
		*last = now;
		*credit += el * rate_pages;
		if (*credit > cap)
			*credit = cap;
		if (*credit >= cost) {
			*credit -= cost;
			return;
		}
		if (bsp)
			report(k);
		pause();
	}
}

/* Ring 3, interrupts off: writer `idx` over its share. Returns its last pass. */
static u64 writer(u64 arg)
{
	unsigned idx = (unsigned)arg;
	struct writer *me = &w[idx];
	volatile u64 *p0 = (volatile u64 *)(region_base + me->first * PAGE);
	u64 n = me->count;
	bool bsp = idx == 0;
	u64 k = 0;
	u64 credit = 0, last = rdtsc();

	/* Pass 0: a known starting state (fresh RAM is zero, but do not rely on it). */
	me->pass = 0;
	for (u64 i = 0; i < n; i++) {
		p0[i * WORDS_PER_PAGE] = 0;
		if ((i & 63) == 63) {
			me->pages += 64;
			if (bsp)
				report(0);
			if (rate_pages)
				throttle(&credit, &last, bsp, 0);
		}
	}
	me->pages += n & 63;

	for (k = 1; !npasses || k <= npasses; k++) {
		me->pass = k;
		for (u64 i = 0; i < n; i++) {
			volatile u64 *p = p0 + i * WORDS_PER_PAGE;
			u64 v = *p;
			if (v != k - 1 && v != k)
				bad_page(idx, me->first + i, v, k);
			if (k != 2 || me->first + i != lose_page)
				*p = k;
			if ((i & 63) == 63) {
				me->pages += 64;
				if (bsp)
					report(k);
				if (rate_pages)
					throttle(&credit, &last, bsp, k);
			}
		}
		me->pages += n & 63;
	}
	atomic_inc(&writers_done);
	return k - 1;
}

/* Ring 3, BSP: its own share, then (passes=P) wait for the APs' writers. */
static u64 bsp_run(u64 arg)
{
	(void)arg;
	start_tsc = last_tsc = rdtsc();
	u64 k = writer(0);
	while (writers_done < nwriters) {
		pause();
		report(k);
	}
	u64 dt = rdtsc() - start_tsc;
	u64 total = total_pages();
	printf("migrate-dirty: %lu passes (+ fill) over %lu MiB by %u CPU(s): %lu pages in %lu ms, %lu MiB/s\n",
	       k, region_pages / 256, nwriters, total, dt / (hz / 1000),
	       dt ? total * (hz / 256) / dt : 0);
	return k;
}

static void ap_main(unsigned idx)
{
	if (idx < nwriters)
		enter_ring3(writer, idx);
	/* else: not a writer; returning halts it */
}

void guest_main(void)
{
	u64 mib = cmdline_uint("mib", 64);
	u64 base = cmdline_uint("base", 16 * MIB);
	u64 report_ms = cmdline_uint("report_ms", 500);
	npasses = cmdline_uint("passes", 0);
	u64 mibps = cmdline_uint("mibps", 0);
	cmdline_find_uint("lose", &lose_page);
	if (cmdline_uint("wallclock", 0)) {
		wrmsr(MSR_KVM_WALL_CLOCK_NEW, (u64)wall_clock);
		printf("migrate-dirty: wall clock at 0x%lx\n", (u64)wall_clock);
	}
	unsigned ncpus = cpu_count();
	if (ncpus > KIT_MAX_CPUS)
		ncpus = KIT_MAX_CPUS;
	u64 want = cmdline_uint("cpus", ncpus);
	if (want < 1 || want > ncpus)
		fail("cpus=%lu: between 1 and %u vCPUs", want, ncpus);
	nwriters = (unsigned)want;

	u64 size = mib * MIB;
	if (!mib || base % PAGE || base < (u64)__image_end || base + size > MAP_LIMIT ||
	    base + size < base)
		fail("region %lu MiB at 0x%lx: must be page-aligned, above the image (0x%lx) and below 0x%lx",
		     mib, base, (u64)__image_end, MAP_LIMIT);
	if (!ram_covers(base, size))
		fail("region %lu MiB at 0x%lx is not inside one RAM region (%lu MiB of RAM)",
		     mib, base, ram_bytes() / MIB);
	region_base = base;
	region_pages = size / PAGE;
	if (region_pages < nwriters)
		fail("%lu pages for %u writers", region_pages, nwriters);
	u64 share = region_pages / nwriters;
	rate_pages = mibps * 256 / nwriters;
	if (mibps && !rate_pages)
		rate_pages = 1;
	for (unsigned i = 0; i < nwriters; i++) {
		w[i].first = i * share;
		w[i].count = i == nwriters - 1 ? region_pages - i * share : share;
	}

	hz = tsc_hz();
	report_cycles = hz / 1000 * (report_ms ? report_ms : 1);
	printf("migrate-dirty: region %lu MiB at 0x%lx\n", mib, base);
	if (npasses)
		printf("migrate-dirty: %u writer CPU(s) of %u, %lu pages each, %lu passes, tsc %lu kHz\n",
		       nwriters, ncpus, share, npasses, hz / 1000);
	else
		printf("migrate-dirty: %u writer CPU(s) of %u, %lu pages each, passes unbounded, tsc %lu kHz\n",
		       nwriters, ncpus, share, hz / 1000);

	if (mibps)
		printf("migrate-dirty: throttled to %lu MiB/s (%lu pages/s per writer)\n", mibps,
		       rate_pages);
	if (lose_page != ~0UL)
		printf("migrate-dirty: self-test: pass 2 skips the write to page %lu\n", lose_page);
	if (nwriters > 1) {
		unsigned started = smp_start_aps(ap_main);
		if (started + 1 < nwriters)
			fail("%u of %u APs started", started, nwriters - 1);
	}
	enter_ring3(bsp_run, 0);
	pass();
}
