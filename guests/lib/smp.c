/* AP start-up, per-CPU state, spinlocks, barrier, console lock. */
#include "kit.h"

/* 64-bit TSS with an all-open I/O permission bitmap (as the BSP's). */
struct tss64 {
	u32 reserved0;
	u64 rsp0, rsp1, rsp2;
	u64 reserved1;
	u64 ist[7];
	u64 reserved2;
	u16 reserved3;
	u16 iomap_base;
	u8 iopb[8192];		/* zero: every port allowed */
	u8 iopb_end;		/* 0xff terminator */
} __attribute__((packed));

/* Layout known to isr.S (this_ring3_ctx). */
struct ring3_ctx {
	u64 kernel_rsp;
	u64 *rsp0_slot;
	u64 ustack_top;
};

/* Per-AP resources, [i - 1] for CPU i (ap_tss: [i], [0] unused).  isr.S
 * finds ap_ring3[i - 1] from the stack pointer's place in ap_kstacks. */
u8 ap_kstacks[KIT_MAX_CPUS - 1][KSTACK_SIZE] __attribute__((aligned(4096)));
struct ring3_ctx ap_ring3[KIT_MAX_CPUS - 1];
static u8 ap_ustacks[KIT_MAX_CPUS - 1][AP_USTACK_SIZE] __attribute__((aligned(4096)));
static u8 ap_dfstacks[KIT_MAX_CPUS - 1][4096] __attribute__((aligned(4096)));
static struct tss64 ap_tss[KIT_MAX_CPUS] __attribute__((aligned(16)));

extern u8 ap_trampoline[], ap_trampoline_end[];
extern u8 gdt[];
extern volatile u32 ap_next_idx;
NORETURN void ap_entry(unsigned idx);

static struct {
	u16 limit;
	u64 base;
} __attribute__((packed)) ap_idtr;

static void (*volatile ap_main_fn)(unsigned idx);
static volatile u32 smp_active;		/* APs may be running: cpu_index() looks up */
static volatile u32 aps_started, aps_finished;
static volatile u32 cpu_apic[KIT_MAX_CPUS];
static volatile u8 apic_to_idx[256];

unsigned cpu_index(void)
{
	if (!smp_active)
		return 0;
	return apic_to_idx[lapic_read(LAPIC_ID) >> 24];
}

u32 cpu_apic_id(unsigned idx)
{
	return idx < KIT_MAX_CPUS ? cpu_apic[idx] : 0xffffffffu;
}

unsigned smp_cpus_online(void) { return 1 + aps_started; }
unsigned smp_aps_finished(void) { return aps_finished; }

static void write_tss_desc(unsigned idx, struct tss64 *t)
{
	u64 base = (u64)t, limit = sizeof(*t) - 1;
	volatile u64 *d = (volatile u64 *)(gdt + TSS_SEL_CPU(idx));
	d[0] = (limit & 0xffff) | (base & 0xffffff) << 16 | (u64)0x89 << 40 |
	       ((limit >> 16) & 0xf) << 48 | ((base >> 24) & 0xff) << 56;
	d[1] = base >> 32;
}

NORETURN void ap_entry(unsigned idx)
{
	u8 *kstack = ap_kstacks[idx - 1];
	struct tss64 *t = &ap_tss[idx];
	struct ring3_ctx *r3 = &ap_ring3[idx - 1];

	r3->rsp0_slot = (u64 *)((u8 *)t + __builtin_offsetof(struct tss64, rsp0));
	r3->ustack_top = (u64)(ap_ustacks[idx - 1] + AP_USTACK_SIZE);

	t->rsp0 = (u64)(kstack + KSTACK_SIZE);
	t->ist[0] = (u64)(ap_dfstacks[idx - 1] + 4096);
	t->iomap_base = (u16)__builtin_offsetof(struct tss64, iopb);
	t->iopb_end = 0xff;
	write_tss_desc(idx, t);
	__asm__ volatile("ltr %w0" :: "r"((u16)TSS_SEL_CPU(idx)));
	__asm__ volatile("lidt %0" :: "m"(ap_idtr));

	lapic_enable();
	u32 id = lapic_id();
	cpu_apic[idx] = id;
	apic_to_idx[id & 0xff] = (u8)idx;
	atomic_inc(&aps_started);	/* reported in */

	ap_main_fn(idx);

	atomic_inc(&aps_finished);
	for (;;) {
		cli();
		hlt();
	}
}

#define ICR_INIT_ALL	(0x000c4500u)	/* INIT, assert, all excluding self */
#define ICR_SIPI_ALL	(0x000c4600u)	/* STARTUP, assert, all excluding self */

unsigned smp_start_aps(void (*ap_main)(unsigned idx))
{
	static bool done;
	if (done)
		return aps_started;
	done = true;

	lapic_enable();
	u32 bsp = lapic_id();
	cpu_apic[0] = bsp;
	apic_to_idx[bsp & 0xff] = 0;

	unsigned want = cpu_count();
	if (want > KIT_MAX_CPUS)
		want = KIT_MAX_CPUS;
	if (want <= 1)
		return 0;

	__asm__ volatile("sidt %0" : "=m"(ap_idtr));
	ap_main_fn = ap_main;
	memcpy((void *)AP_TRAMPOLINE_ADDR, ap_trampoline,
	       (size_t)(ap_trampoline_end - ap_trampoline));
	u64 hz = tsc_hz();
	smp_active = 1;
	barrier();

	lapic_send_icr(0, ICR_INIT_ALL);
	tsc_delay_us(1000);
	lapic_send_icr(0, ICR_SIPI_ALL | (AP_TRAMPOLINE_ADDR >> 12));
	tsc_delay_us(200);
	if (aps_started < want - 1)
		lapic_send_icr(0, ICR_SIPI_ALL | (AP_TRAMPOLINE_ADDR >> 12));

	u64 deadline = rdtsc() + 2 * hz;
	while (aps_started < want - 1 && (s64)(rdtsc() - deadline) < 0)
		pause();
	return aps_started;
}

/* ---- locks ---- */

void spin_lock(spinlock_t *l)
{
	while (atomic_xchg(&l->v, 1)) {
		while (l->v)
			pause();
	}
}

bool spin_trylock(spinlock_t *l)
{
	return atomic_xchg(&l->v, 1) == 0;
}

void spin_unlock(spinlock_t *l)
{
	barrier();
	l->v = 0;		/* a plain store releases on x86 */
	barrier();
}

void smp_barrier_wait(smp_barrier_t *b, unsigned n)
{
	u32 gen = b->generation;
	barrier();
	if (atomic_inc(&b->count) == n) {
		b->count = 0;
		barrier();
		atomic_inc(&b->generation);
	} else {
		while (b->generation == gen)
			pause();
	}
}

/* Recursive per CPU, so that a handler printing on the CPU holding it
 * nests instead of deadlocking. */
static spinlock_t console;
static volatile u32 console_owner;	/* cpu_index() + 1 */
static u32 console_depth;

void console_lock(void)
{
	if (!smp_active)
		return;
	u32 me = cpu_index() + 1;
	if (console_owner == me) {
		console_depth++;
		return;
	}
	spin_lock(&console);
	console_owner = me;
	console_depth = 1;
}

void console_unlock(void)
{
	if (!smp_active || !console_depth)
		return;
	if (--console_depth == 0) {
		console_owner = 0;
		spin_unlock(&console);
	}
}
