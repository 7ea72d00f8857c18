/* I/O APIC (MMIO at 0xfec00000): redirection table access. */
#include "kit.h"

#define IOREGSEL	0x00
#define IOWIN		0x10

static spinlock_t ioapic_lock = SPINLOCK_INIT;

/*
 * IOREGSEL/IOWIN is a two-step access: serialise it between CPUs (the
 * lock) and, at CPL 0, against interrupt handlers on this CPU (IF off).
 * At CPL 3 interrupts cannot be disabled: a handler that uses the I/O
 * APIC must not interrupt ring-3 code that does.
 */
static u64 ioapic_enter(void)
{
	u64 flags = read_rflags();
	if (cpl() == 0)
		cli();
	spin_lock(&ioapic_lock);
	return flags;
}

static void ioapic_leave(u64 flags)
{
	spin_unlock(&ioapic_lock);
	if (cpl() == 0 && (flags & RFLAGS_IF))
		sti();
}

static inline volatile u32 *ioapic_reg(u32 off)
{
	return (volatile u32 *)(IOAPIC_BASE + off);
}

u32 ioapic_read(u32 reg)
{
	u64 f = ioapic_enter();
	*ioapic_reg(IOREGSEL) = reg;
	u32 v = *ioapic_reg(IOWIN);
	ioapic_leave(f);
	return v;
}

void ioapic_write(u32 reg, u32 v)
{
	u64 f = ioapic_enter();
	*ioapic_reg(IOREGSEL) = reg;
	*ioapic_reg(IOWIN) = v;
	ioapic_leave(f);
}

u32 ioapic_id(void)
{
	return (ioapic_read(IOAPIC_REG_ID) >> 24) & 0xff;
}

u32 ioapic_version(void)
{
	return ioapic_read(IOAPIC_REG_VER) & 0xff;
}

unsigned ioapic_pins(void)
{
	return ((ioapic_read(IOAPIC_REG_VER) >> 16) & 0xff) + 1;
}

u64 ioapic_get_entry(unsigned pin)
{
	u64 f = ioapic_enter();
	*ioapic_reg(IOREGSEL) = IOAPIC_REG_REDTBL(pin);
	u32 lo = *ioapic_reg(IOWIN);
	*ioapic_reg(IOREGSEL) = IOAPIC_REG_REDTBL(pin) + 1;
	u32 hi = *ioapic_reg(IOWIN);
	ioapic_leave(f);
	return (u64)hi << 32 | lo;
}

/* Masks first, writes the high half, then the low half (which may unmask):
 * the pin is never live with a half-written entry. */
void ioapic_set_entry(unsigned pin, u64 e)
{
	u64 f = ioapic_enter();
	*ioapic_reg(IOREGSEL) = IOAPIC_REG_REDTBL(pin);
	*ioapic_reg(IOWIN) = IOAPIC_MASKED;
	*ioapic_reg(IOREGSEL) = IOAPIC_REG_REDTBL(pin) + 1;
	*ioapic_reg(IOWIN) = (u32)(e >> 32);
	*ioapic_reg(IOREGSEL) = IOAPIC_REG_REDTBL(pin);
	*ioapic_reg(IOWIN) = (u32)e;
	ioapic_leave(f);
}

void ioapic_route(unsigned pin, u8 vector, u8 dest, u32 flags)
{
	ioapic_set_entry(pin, (u64)dest << 56 | (flags & IOAPIC_WRITABLE) | vector);
}

static void ioapic_update_low(unsigned pin, u32 clear, u32 set)
{
	u64 f = ioapic_enter();
	*ioapic_reg(IOREGSEL) = IOAPIC_REG_REDTBL(pin);
	u32 lo = *ioapic_reg(IOWIN);
	*ioapic_reg(IOWIN) = ((lo & ~clear) | set) & IOAPIC_WRITABLE;
	ioapic_leave(f);
}

void ioapic_mask(unsigned pin)
{
	ioapic_update_low(pin, 0, IOAPIC_MASKED);
}

void ioapic_unmask(unsigned pin)
{
	ioapic_update_low(pin, IOAPIC_MASKED, 0);
}

void ioapic_mask_all(void)
{
	unsigned n = ioapic_pins();
	for (unsigned pin = 0; pin < n; pin++)
		ioapic_set_entry(pin, IOAPIC_MASKED);
}

bool ioapic_remote_irr(unsigned pin)
{
	return (ioapic_read(IOAPIC_REG_REDTBL(pin)) & IOAPIC_REMOTE_IRR) != 0;
}
