/* The 8259A pair (master 0x20/0x21, slave 0xa0/0xa1) and the ELCR. */
#include "kit.h"

#define ICW1_ICW4	0x01
#define ICW1_INIT	0x10
#define ICW4_8086	0x01
#define OCW2_EOI	0x20
#define OCW2_SPECIFIC	0x40
#define OCW3_READ_IRR	0x0a
#define OCW3_READ_ISR	0x0b

void pic_init(u8 master_base, u8 slave_base)
{
	outb(PIC_MASTER_CMD, ICW1_INIT | ICW1_ICW4);	/* edge, cascade, ICW4 follows */
	outb(PIC_SLAVE_CMD, ICW1_INIT | ICW1_ICW4);
	outb(PIC_MASTER_DATA, master_base);		/* ICW2: vector base */
	outb(PIC_SLAVE_DATA, slave_base);
	outb(PIC_MASTER_DATA, 1u << PIC_CASCADE_IRQ);	/* ICW3: slave on IR2 */
	outb(PIC_SLAVE_DATA, PIC_CASCADE_IRQ);		/* ICW3: slave identity */
	outb(PIC_MASTER_DATA, ICW4_8086);		/* ICW4: 8086, normal EOI */
	outb(PIC_SLAVE_DATA, ICW4_8086);
	pic_set_imr(0xffff);
	outb(PIC_MASTER_CMD, OCW3_READ_IRR);
	outb(PIC_SLAVE_CMD, OCW3_READ_IRR);
}

void pic_set_imr(u16 mask)
{
	outb(PIC_MASTER_DATA, (u8)mask);
	outb(PIC_SLAVE_DATA, (u8)(mask >> 8));
}

u16 pic_imr(void)
{
	return inb(PIC_MASTER_DATA) | (u16)inb(PIC_SLAVE_DATA) << 8;
}

void pic_unmask_irq(unsigned irq)
{
	u16 m = pic_imr() & ~(1u << (irq & 15));
	if (irq >= 8)
		m &= ~(1u << PIC_CASCADE_IRQ);
	pic_set_imr(m);
}

void pic_mask_irq(unsigned irq)
{
	pic_set_imr(pic_imr() | 1u << (irq & 15));
}

void pic_disable(void)
{
	pic_set_imr(0xffff);
}

void pic_eoi(unsigned irq)
{
	if (irq >= 8) {
		outb(PIC_SLAVE_CMD, OCW2_EOI | OCW2_SPECIFIC | (irq & 7));
		irq = PIC_CASCADE_IRQ;
	}
	outb(PIC_MASTER_CMD, OCW2_EOI | OCW2_SPECIFIC | (irq & 7));
}

void pic_set_lowest_priority(unsigned irq)
{
	u8 ocw2 = (u8)(0xc0 | (irq & 7));		/* OCW2 "set priority" */
	outb(irq >= 8 ? PIC_SLAVE_CMD : PIC_MASTER_CMD, ocw2);
}

void pic_eoi_nonspecific(unsigned irq)
{
	if (irq >= 8)
		outb(PIC_SLAVE_CMD, OCW2_EOI);
	outb(PIC_MASTER_CMD, OCW2_EOI);
}

static u16 pic_read_reg(u8 ocw3)
{
	outb(PIC_MASTER_CMD, ocw3);
	outb(PIC_SLAVE_CMD, ocw3);
	u16 v = inb(PIC_MASTER_CMD) | (u16)inb(PIC_SLAVE_CMD) << 8;
	if (ocw3 != OCW3_READ_IRR) {
		outb(PIC_MASTER_CMD, OCW3_READ_IRR);
		outb(PIC_SLAVE_CMD, OCW3_READ_IRR);
	}
	return v;
}

u16 pic_irr(void)
{
	return pic_read_reg(OCW3_READ_IRR);
}

u16 pic_isr(void)
{
	return pic_read_reg(OCW3_READ_ISR);
}

u16 elcr_read(void)
{
	return inb(ELCR_PORT) | (u16)inb(ELCR_PORT + 1) << 8;
}

void elcr_write(u16 v)
{
	outb(ELCR_PORT, (u8)v);
	outb(ELCR_PORT + 1, (u8)(v >> 8));
}
