/* DMA memory pool (bump allocator over identity-mapped RAM) and guest-time timeouts. */
#include "kit.h"

#define MIB		(1024UL * 1024)
#define POOL_GAP	(2 * MIB)	/* left free above the image (multiboot info, cmdline) */
#define TIMEOUT_STEP_MS	10		/* largest TSC advance counted between two polls */

extern char __image_end[];

static spinlock_t pool_lock = SPINLOCK_INIT;
static u64 pool_base, pool_next;

static u64 align_up(u64 v, u64 a) { return (v + a - 1) & ~(a - 1); }

static void pool_init(void)
{
	u64 base = align_up((u64)__image_end, 2 * MIB) + POOL_GAP;
	u64 v;
	if (cmdline_find_uint("dma_base", &v))
		base = align_up(v, 4096);
	pool_base = pool_next = base;
}

void *dma_alloc(size_t size, size_t align)
{
	if (align < 16)
		align = 16;
	spin_lock(&pool_lock);
	if (!pool_base)
		pool_init();
	u64 p = align_up(pool_next, align);
	if (!ram_covers(p, size ? size : 1)) {
		spin_unlock(&pool_lock);
		fail("dma_alloc: %zu bytes at 0x%lx are not RAM (pool from 0x%lx)", size, p, pool_base);
	}
	pool_next = p + size;
	spin_unlock(&pool_lock);
	memset((void *)p, 0, size);	/* RAM may hold an earlier run's data (reset, restore) */
	return (void *)p;
}

u64 dma_pool_used(void)
{
	return pool_next - pool_base;
}

void timeout_start(struct timeout *t, u64 us)
{
	t->left = us * (tsc_hz() / 1000000);
	t->last = rdtsc();
}

bool timeout_expired(struct timeout *t)
{
	u64 now = rdtsc();
	u64 step = now - t->last;
	u64 cap = tsc_hz() / 1000 * TIMEOUT_STEP_MS;
	t->last = now;
	if ((s64)step < 0)		/* TSC went back (restore on another host) */
		step = 0;
	if (step > cap)			/* the VM was paused: count one step only */
		step = cap;
	if (step >= t->left) {
		t->left = 0;
		return true;
	}
	t->left -= step;
	return false;
}
