/* Local APIC (xAPIC, MMIO) and the TSC frequency. */
#include "kit.h"

#define MSR_APIC_BASE		0x1b
#define APIC_BASE_ENABLE	(1u << 11)
#define SVR_ENABLE		(1u << 8)

/* ICR_LO fields */
#define ICR_FIXED		(0u << 8)
#define ICR_INIT		(5u << 8)
#define ICR_STARTUP		(6u << 8)
#define ICR_LOGICAL		(1u << 11)
#define ICR_BUSY		(1u << 12)
#define ICR_ASSERT		(1u << 14)
#define ICR_SELF		(1u << 18)
#define ICR_ALL_INCL		(2u << 18)
#define ICR_ALL_EXCL		(3u << 18)

static void spurious_handler(struct frame *f)
{
	(void)f;		/* no EOI for spurious interrupts */
}

void lapic_enable(void)
{
	u64 base = rdmsr(MSR_APIC_BASE);
	if (!(base & APIC_BASE_ENABLE))
		wrmsr(MSR_APIC_BASE, base | APIC_BASE_ENABLE);
	set_handler(LAPIC_SPURIOUS_VECTOR, spurious_handler);
	lapic_write(LAPIC_SVR, SVR_ENABLE | LAPIC_SPURIOUS_VECTOR);
	set_tpr(0);
}

void lapic_mask_lint0(void)
{
	lapic_write(LAPIC_LVT_LINT0, lapic_read(LAPIC_LVT_LINT0) | LAPIC_LVT_MASKED);
}

u32 lapic_id(void)
{
	return lapic_read(LAPIC_ID) >> 24;
}

void lapic_eoi(void)
{
	lapic_write(LAPIC_EOI, 0);
}

void lapic_send_icr(u32 dest_field, u32 icr_lo)
{
	/* KVM completes the send during the write, but be correct elsewhere. */
	for (unsigned i = 0; i < 100000 && (lapic_read(LAPIC_ICR_LO) & ICR_BUSY); i++)
		pause();
	lapic_write(LAPIC_ICR_HI, dest_field << 24);
	lapic_write(LAPIC_ICR_LO, icr_lo);
}

void lapic_send_ipi(u32 apic_id, u8 vector)
{
	lapic_send_icr(apic_id, ICR_ASSERT | ICR_FIXED | vector);
}

void lapic_send_ipi_logical(u8 dest_mask, u8 vector)
{
	lapic_send_icr(dest_mask, ICR_ASSERT | ICR_LOGICAL | ICR_FIXED | vector);
}

void lapic_broadcast_ipi(u8 vector, int include_self)
{
	lapic_send_icr(0, (include_self ? ICR_ALL_INCL : ICR_ALL_EXCL) | ICR_ASSERT | vector);
}

void lapic_self_ipi(u8 vector)
{
	lapic_send_icr(0, ICR_SELF | ICR_ASSERT | ICR_FIXED | vector);
}

void lapic_set_logical_id(u8 id)
{
	lapic_write(LAPIC_DFR, 0xffffffffu);	/* flat model */
	lapic_write(LAPIC_LDR, (u32)id << 24);
}

void set_tpr(u8 tpr)
{
	u64 v = tpr >> 4;
	__asm__ volatile("mov %0, %%cr8" :: "r"(v) : "memory");
}

u8 get_tpr(void)
{
	u64 v;
	__asm__ volatile("mov %%cr8, %0" : "=r"(v));
	return (u8)(v << 4);
}

static void lapic_timer(u8 vector, u32 initial_count, u32 divide_cfg, u32 mode)
{
	lapic_write(LAPIC_TIMER_INIT, 0);
	lapic_write(LAPIC_TIMER_DIV, divide_cfg);
	lapic_write(LAPIC_LVT_TIMER, mode | vector);
	lapic_write(LAPIC_TIMER_INIT, initial_count);
}

void lapic_timer_periodic(u8 vector, u32 initial_count, u32 divide_cfg)
{
	lapic_timer(vector, initial_count, divide_cfg, LAPIC_TIMER_PERIODIC);
}

void lapic_timer_oneshot(u8 vector, u32 initial_count, u32 divide_cfg)
{
	lapic_timer(vector, initial_count, divide_cfg, 0);
}

void lapic_timer_stop(void)
{
	lapic_write(LAPIC_TIMER_INIT, 0);
	lapic_write(LAPIC_LVT_TIMER, LAPIC_LVT_MASKED | LAPIC_SPURIOUS_VECTOR);
}

/* ---- TSC frequency ---- */

#define PIT_HZ		1193182u
#define PIT_CH2		0x42
#define PIT_MODE	0x43
#define PORT_B		0x61	/* bit 0: channel 2 gate, bit 1: speaker, bit 5: OUT2 */

static u64 tsc_freq;

/*
 * Reads a down-counter bracketed by two RDTSCs, several times, and keeps the
 * narrowest bracket: a vCPU descheduled in the middle of a read (common on a
 * loaded host) then costs nothing but a retry.
 */
static void sample(u32 (*rd)(void), u64 *tsc, u32 *count)
{
	u64 best = ~0ull;
	for (int i = 0; i < 5; i++) {
		u64 a = rdtsc();
		u32 c = rd();
		u64 b = rdtsc();
		if (b - a < best) {
			best = b - a;
			*tsc = a + (b - a) / 2;
			*count = c;
		}
	}
}

/* TSC cycles per second, measured over `span` ticks (of `hz` per second) of
 * the down-counter `rd` (`mask`: its width); 0 if it does not count. */
static u64 tsc_vs_counter(u32 (*rd)(void), u32 mask, u32 span, u64 hz)
{
	u64 t0 = 0, t1 = 0;
	u32 c0 = 0, c1 = 0, c = 0;
	sample(rd, &t0, &c0);
	unsigned i;
	for (i = 0; i < 100000; i++) {
		c = rd();
		if (((c0 - c) & mask) >= span)
			break;
	}
	if (i == 100000)
		return 0;
	sample(rd, &t1, &c1);
	u32 ticks = (c0 - c1) & mask;
	if (ticks < span || ticks > mask / 8 * 7)	/* wrapped (a very long stall) */
		return 0;
	return (t1 - t0) * hz / ticks;
}

/* PIT channel 2: gate on (port 0x61 bit 0), mode 0, count 0xffff; read
 * back with the latch command.  0 if there is no working channel 2 (QEMU's
 * microvm has no port 0x61: the count then does not move). */
static u32 pit2_read(void)
{
	outb(PIT_MODE, 0x80);			/* latch channel 2 */
	u8 lo = inb(PIT_CH2);
	u8 hi = inb(PIT_CH2);
	return lo | (u32)hi << 8;
}

static u64 tsc_hz_pit(void)
{
	u8 b = inb(PORT_B);
	outb(PORT_B, (u8)((b & ~0x02) | 0x01));	/* gate on, speaker off */
	outb(PIT_MODE, 0xb0);			/* ch 2, lobyte/hibyte, mode 0, binary */
	outb(PIT_CH2, 0xff);
	outb(PIT_CH2, 0xff);
	u64 hz = tsc_vs_counter(pit2_read, 0xffff, PIT_HZ / 100, PIT_HZ);	/* 10 ms */
	outb(PORT_B, b);
	return hz;
}

static bool hypervisor_is_kvm(void)
{
	if (!(cpuid(1, 0).ecx & (1u << 31)))
		return false;
	struct cpuid_regs r = cpuid(0x40000000, 0);
	return r.ebx == 0x4b4d564b && r.ecx == 0x564b4d56 && r.edx == 0x4d;	/* "KVMKVMKVM" */
}

static u32 lapic_timer_read(void)
{
	return lapic_read(LAPIC_TIMER_CUR);
}

/* KVM's (and QEMU's) APIC timer counts at 1 GHz before the divider.  Uses
 * (and stops) the LAPIC timer, masked. */
static u64 tsc_hz_lapic_kvm(void)
{
	lapic_write(LAPIC_TIMER_INIT, 0);
	lapic_write(LAPIC_LVT_TIMER, LAPIC_LVT_MASKED | LAPIC_SPURIOUS_VECTOR);
	lapic_write(LAPIC_TIMER_DIV, LAPIC_DIV_1);
	lapic_write(LAPIC_TIMER_INIT, 0xffffffffu);
	u64 hz = tsc_vs_counter(lapic_timer_read, 0xffffffffu, 10000000, 1000000000);	/* 10 ms */
	lapic_write(LAPIC_TIMER_INIT, 0);
	return hz;
}

u64 tsc_hz(void)
{
	if (tsc_freq)
		return tsc_freq;
	u64 hz = 0;
	for (int i = 0; i < 2 && !hz; i++)	/* a second try after a wrap */
		hz = tsc_hz_pit();
	if (!hz && hypervisor_is_kvm())
		for (int i = 0; i < 2 && !hz; i++)
			hz = tsc_hz_lapic_kvm();
	if (!hz) {
		u32 max = cpuid(0, 0).eax;
		if (max >= 0x15) {
			struct cpuid_regs r = cpuid(0x15, 0);
			if (r.eax && r.ebx && r.ecx)
				hz = (u64)r.ecx * r.ebx / r.eax;
		}
		if (!hz && max >= 0x16)
			hz = (u64)(cpuid(0x16, 0).eax & 0xffff) * 1000000;
		if (!hz)
			hz = 2000000000;	/* a guess beats dividing by zero */
	}
	tsc_freq = hz;
	return hz;
}

void tsc_delay_us(u64 us)
{
	u64 end = rdtsc() + us * (tsc_hz() / 1000000);
	while ((s64)(rdtsc() - end) < 0)
		pause();
}
