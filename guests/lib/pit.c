/* 8254 PIT channel 0 (IRQ 0). */
#include "kit.h"

#define PIT_CH0		0x40
#define PIT_CMD		0x43

static void pit_load(u8 mode, u16 count)
{
	outb(PIT_CMD, (u8)(0x30 | mode << 1));	/* channel 0, lobyte/hibyte, binary */
	outb(PIT_CH0, (u8)count);
	outb(PIT_CH0, (u8)(count >> 8));
}

void pit_periodic(u16 divisor)
{
	pit_load(2, divisor);
}

void pit_square_wave(u16 divisor)
{
	pit_load(3, divisor);
}

void pit_oneshot(u16 count)
{
	pit_load(0, count);
}

void pit_stop(void)
{
	pit_load(0, 1);
}

u16 pit_read_count(void)
{
	outb(PIT_CMD, 0x00);			/* latch channel 0 */
	u8 lo = inb(PIT_CH0);
	u8 hi = inb(PIT_CH0);
	return lo | (u16)hi << 8;
}

u64 pit_divisor_hz_milli(u16 divisor)
{
	u64 d = divisor ? divisor : 65536;
	return (u64)PIT_INPUT_HZ * 1000 / d;
}
