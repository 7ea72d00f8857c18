/*
 * migrate-idle: touches a region once, then idles (HLT) and checks, once a
 * second, that the region still holds what it wrote.  For snapshot / restore
 * and live-migration tests of a mostly idle machine.
 *
 * Region: "mib=" MiB (default 64) at "base=" (default 16 MiB; same rules as
 * migrate-dirty).  In ring 3, every 8-byte word w of page i (region index) is
 * set to pattern(i, w) = (0x49444c45 << 32 | i) + w * 0x9e3779b97f4a7c15:
 * the first word of each page reads 0x49444c45_<index> ("IDLE" + index), the
 * rest differs per word, so no page is zero or like another.  Then:
 *
 *   migrate-idle: touched <N> MiB
 *
 * The BSP's LAPIC timer runs periodic at "tick_ms=" ms (default 1000; its
 * rate measured against the TSC, ~1 GHz under KVM); the BSP waits in
 * "sti; hlt" in ring 0, and on each wake-up enters ring 3 to verify a sample
 * of 64 pages (page j * (pages / 64) + t mod (pages / 64) for j = 0..63 at
 * tick t: the sample rotates, so every page is seen within pages / 64 ticks;
 * "verify=all": every page, every tick), whole pages, and prints
 *
 *   migrate-idle: tick <t> ok
 *
 * Any difference: up to 4 lines
 *   migrate-idle: page <i> at 0x<addr> word <w> holds 0x<v>, expected 0x<e>
 * then "FAIL: <n> of <m> pages checked at tick <t> corrupted (first page <i>)",
 * exit code 1.
 *
 * With several vCPUs (all by default, "cpus=" fewer; cpus=1 leaves the APs in
 * wait-for-SIPI), the APs are started and idle too: each runs its own periodic
 * LAPIC timer at the same rate and waits in "sti; hlt", counting its ticks.
 * An AP whose tick count has not moved for "stall=" BSP ticks (default 5; 0
 * turns the check off) and as many tick periods of TSC time fails the test:
 *   FAIL: cpu <c>: no LAPIC timer tick for <n> ticks of cpu 0
 *
 * "mix=1": a realistic memory image for compression instead: even pages are
 * all zero; in odd pages the first 256 words are pseudo-random (splitmix64 of
 * the page index and word) and the other 256 are 0x2020202020202020 (text
 * padding), so the data pages compress about 2:1.
 *
 * "ticks=T": after tick T, verify every page once more, print a summary and
 * PASS (exit code 0).  Without it the guest never ends.
 *
 * "corrupt=I" (self-test of the check): at tick 2, one bit of page I (region
 * index) is flipped; it is found at once with verify=all, else when the
 * rotating sample reaches it or by the final check.
 *
 * Pausing the VM is harmless: ticks are counted per wake-up, not from the
 * clock, and a TSC jump (either way) only affects the AP stall check's timing
 * side, which also needs the BSP's tick count to advance.
 */
#include "kit.h"

#define PAGE		4096UL
#define MIB		(1024UL * 1024)
#define WORDS_PER_PAGE	(PAGE / 8)
#define MAP_LIMIT	(3UL << 30)
#define SAMPLE		64
#define V_TIMER		0x40
#define MAX_REPORT	4

extern char __image_end[];

static u64 region_base, region_pages;
static bool verify_all;
static u64 hz, tick_cycles;
static u32 timer_count, timer_div;
static unsigned ncpus_used;
static u64 stall_limit;
static u64 corrupt_page = ~0UL;	/* corrupt=: self-test, flipped at tick 2 */

struct percpu {
	volatile u64 ticks;
	u64 seen, seen_bsp_tick, seen_tsc;	/* BSP's bookkeeping for this AP */
} __attribute__((aligned(64)));
static struct percpu cpu[KIT_MAX_CPUS];

static bool mixed;	/* mix=1 */

static inline u64 splitmix64(u64 x)
{
	x += 0x9e3779b97f4a7c15UL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9UL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebUL;
	return x ^ (x >> 31);
}

static inline u64 pattern(u64 page, u64 word)
{
	if (mixed) {
		if (page % 2 == 0)
			return 0;
		return word < WORDS_PER_PAGE / 2 ? splitmix64(page << 9 | word)
						 : 0x2020202020202020UL;
	}
	return ((0x49444c45UL << 32) | page) + word * 0x9e3779b97f4a7c15UL;
}

static void timer_handler(struct frame *f)
{
	(void)f;
	cpu[cpu_index()].ticks++;
	lapic_eoi();
}

/* Ring 3: fills the region. */
static u64 touch(u64 arg)
{
	(void)arg;
	for (u64 i = 0; i < region_pages; i++) {
		volatile u64 *p = (volatile u64 *)(region_base + i * PAGE);
		for (u64 wd = 0; wd < WORDS_PER_PAGE; wd++)
			p[wd] = pattern(i, wd);
	}
	printf("migrate-idle: touched %lu MiB\n", region_pages / 256);
	return 0;
}

/* Ring 3: checks one page; reports its first bad word (up to MAX_REPORT pages). */
static bool check_page(u64 i, u64 *nbad, u64 *first_bad)
{
	const volatile u64 *p = (const volatile u64 *)(region_base + i * PAGE);
	for (u64 wd = 0; wd < WORDS_PER_PAGE; wd++) {
		u64 v = p[wd], e = pattern(i, wd);
		if (v == e)
			continue;
		if (*nbad == 0)
			*first_bad = i;
		if (*nbad < MAX_REPORT)
			printf("migrate-idle: page %lu at 0x%lx word %lu holds 0x%lx, expected 0x%lx\n",
			       i, region_base + i * PAGE, wd, v, e);
		(*nbad)++;
		return false;
	}
	return true;
}

static void verify(u64 t, bool all)
{
	u64 nbad = 0, first_bad = 0, checked = 0;
	if (all || region_pages <= SAMPLE) {
		for (u64 i = 0; i < region_pages; i++, checked++)
			check_page(i, &nbad, &first_bad);
	} else {
		u64 stride = region_pages / SAMPLE, off = t % stride;
		for (u64 j = 0; j < SAMPLE; j++, checked++)
			check_page(j * stride + off, &nbad, &first_bad);
	}
	if (nbad)
		fail("%lu of %lu pages checked at tick %lu corrupted (first page %lu)",
		     nbad, checked, t, first_bad);
}

/* Ring 3: the APs' timers still tick? */
static void check_aps(u64 t)
{
	u64 now = rdtsc();
	for (unsigned c = 1; c < ncpus_used; c++) {
		struct percpu *pc = &cpu[c];
		u64 v = pc->ticks;
		if (v != pc->seen || (s64)(now - pc->seen_tsc) < 0) {
			pc->seen = v;
			pc->seen_bsp_tick = t;
			pc->seen_tsc = now;
			continue;
		}
		if (stall_limit && t - pc->seen_bsp_tick >= stall_limit &&
		    now - pc->seen_tsc >= stall_limit * tick_cycles)
			fail("cpu %u: no LAPIC timer tick for %lu ticks of cpu 0", c,
			     t - pc->seen_bsp_tick);
	}
}

static u64 on_tick(u64 t)
{
	if (t == 2 && corrupt_page < region_pages) {
		printf("migrate-idle: self-test: flipping word 7 of page %lu\n", corrupt_page);
		*(volatile u64 *)(region_base + corrupt_page * PAGE + 7 * 8) ^= 1UL << 20;
	}
	verify(t, verify_all);
	check_aps(t);
	printf("migrate-idle: tick %lu ok\n", t);
	return 0;
}

static u64 final_check(u64 t)
{
	verify(t, true);
	printf("migrate-idle: %lu ticks, all %lu pages verified", t, region_pages);
	for (unsigned c = 1; c < ncpus_used; c++)
		printf("%s cpu %u %lu", c == 1 ? "; AP ticks:" : ",", c, cpu[c].ticks);
	printf("\n");
	return 0;
}

/* Ring 3: LAPIC timer rate in Hz, against the TSC (masked timer, divide 1, ~20 ms). */
static u64 measure_lapic(u64 arg)
{
	(void)arg;
	lapic_write(LAPIC_LVT_TIMER, LAPIC_LVT_MASKED | V_TIMER);
	lapic_write(LAPIC_TIMER_DIV, LAPIC_DIV_1);
	lapic_write(LAPIC_TIMER_INIT, 0xffffffffu);
	u64 a0 = rdtsc();
	u32 c0 = lapic_read(LAPIC_TIMER_CUR);
	u64 a1 = rdtsc();
	while (rdtsc() - a1 < hz / 50)
		pause();
	u64 b0 = rdtsc();
	u32 c1 = lapic_read(LAPIC_TIMER_CUR);
	u64 b1 = rdtsc();
	lapic_write(LAPIC_TIMER_INIT, 0);
	u64 dt = (b0 / 2 + b1 / 2) - (a0 / 2 + a1 / 2);
	if (c1 >= c0 || !dt)
		return 0;
	return (u64)(c0 - c1) * hz / dt;
}

static void wait_tick(unsigned idx)
{
	u64 seen = cpu[idx].ticks;
	while (cpu[idx].ticks == seen)
		__asm__ volatile("sti; hlt; cli" ::: "memory");
}

static void ap_main(unsigned idx)
{
	if (idx >= ncpus_used)
		return;		/* halts */
	lapic_timer_periodic(V_TIMER, timer_count, timer_div);
	for (;;)
		wait_tick(idx);
}

void guest_main(void)
{
	u64 mib = cmdline_uint("mib", 64);
	mixed = cmdline_uint("mix", 0) != 0;
	u64 base = cmdline_uint("base", 16 * MIB);
	u64 max_ticks = cmdline_uint("ticks", 0);
	u64 tick_ms = cmdline_uint("tick_ms", 1000);
	stall_limit = cmdline_uint("stall", 5);
	cmdline_find_uint("corrupt", &corrupt_page);
	size_t len;
	const char *v = cmdline_arg("verify", &len);
	verify_all = v && len == 3 && !strncmp(v, "all", 3);
	unsigned ncpus = cpu_count();
	if (ncpus > KIT_MAX_CPUS)
		ncpus = KIT_MAX_CPUS;
	u64 want = cmdline_uint("cpus", ncpus);
	if (want < 1 || want > ncpus)
		fail("cpus=%lu: between 1 and %u vCPUs", want, ncpus);
	ncpus_used = (unsigned)want;
	if (!tick_ms)
		fail("tick_ms=0");

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

	hz = tsc_hz();		/* before the LAPIC timer is used (see kit.h) */
	tick_cycles = hz / 1000 * tick_ms;
	printf("migrate-idle: region %lu MiB at 0x%lx\n", mib, base);
	enter_ring3(touch, 0);

	set_handler(V_TIMER, timer_handler);
	lapic_enable();
	lapic_mask_lint0();	/* nothing from the 8259 */
	u64 lapic_hz = enter_ring3(measure_lapic, 0);
	if (!lapic_hz)
		fail("LAPIC timer does not count down");
	static const u32 divs[] = { LAPIC_DIV_1, LAPIC_DIV_2, LAPIC_DIV_4, LAPIC_DIV_8,
				    LAPIC_DIV_16, LAPIC_DIV_32, LAPIC_DIV_64, LAPIC_DIV_128 };
	u64 count = lapic_hz / 1000 * tick_ms;
	unsigned d = 0;
	while (count > 0xffffffffUL && d + 1 < ARRAY_SIZE(divs)) {
		count >>= 1;
		d++;
	}
	if (count > 0xffffffffUL)
		count = 0xffffffffUL;
	if (!count)
		count = 1;
	timer_count = (u32)count;
	timer_div = divs[d];
	printf("migrate-idle: %u CPU(s) idle, tick every %lu ms (LAPIC %lu kHz, count %u / %u), verify %s, tsc %lu kHz\n",
	       ncpus_used, tick_ms, lapic_hz / 1000, timer_count, 1u << d,
	       verify_all ? "all pages" : "64 pages", hz / 1000);

	if (ncpus_used > 1) {
		unsigned started = smp_start_aps(ap_main);
		if (started + 1 < ncpus_used)
			fail("%u of %u APs started", started, ncpus_used - 1);
	}
	lapic_timer_periodic(V_TIMER, timer_count, timer_div);
	for (u64 t = 1;; t++) {
		wait_tick(0);
		enter_ring3(on_tick, t);
		if (max_ticks && t >= max_ticks) {
			lapic_timer_stop();
			enter_ring3(final_check, t);
			pass();
		}
	}
}
