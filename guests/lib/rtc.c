/* MC146818 RTC (index port 0x70, data port 0x71, IRQ 8). */
#include "kit.h"

#define RTC_INDEX	0x70
#define RTC_DATA	0x71

/*
 * The index/data pair is a two-step access: serialised between CPUs by a
 * lock and, at CPL 0, against this CPU's interrupt handlers (IF off).  A
 * handler that reads register C must not interrupt ring-3 code on the same
 * CPU that is in the middle of an RTC access.
 */
static spinlock_t rtc_lock = SPINLOCK_INIT;

static u64 rtc_enter(void)
{
	u64 flags = read_rflags();
	if (cpl() == 0)
		cli();
	spin_lock(&rtc_lock);
	return flags;
}

static void rtc_leave(u64 flags)
{
	spin_unlock(&rtc_lock);
	if (cpl() == 0 && (flags & RFLAGS_IF))
		sti();
}

u8 rtc_read(u8 reg)
{
	u64 f = rtc_enter();
	outb(RTC_INDEX, reg & 0x7f);
	u8 v = inb(RTC_DATA);
	rtc_leave(f);
	return v;
}

void rtc_write(u8 reg, u8 v)
{
	u64 f = rtc_enter();
	outb(RTC_INDEX, reg & 0x7f);
	outb(RTC_DATA, v);
	rtc_leave(f);
}

u8 rtc_ack(void)
{
	return rtc_read(RTC_REG_C);
}

void rtc_periodic(unsigned rs)
{
	rtc_write(RTC_REG_A, (u8)(0x20 | (rs & 0x0f)));	/* 32.768 kHz time base, rate */
	rtc_write(RTC_REG_B, rtc_read(RTC_REG_B) | RTC_B_PIE);
}

void rtc_periodic_stop(void)
{
	rtc_write(RTC_REG_B, rtc_read(RTC_REG_B) & ~RTC_B_PIE);
	(void)rtc_ack();
}

bool rtc_present(void)
{
	/* Register D bit 7 (valid RAM and time) reads 1 and the rest 0 on an
	 * MC146818; a missing device reads 0xff. */
	return rtc_read(RTC_REG_D) == RTC_D_VRT;
}
