/* MSI-X: capability, table and PBA through the device's BARs. */
#include "kit.h"

#define MSIX_CAP_CTRL		2
#define MSIX_CAP_TABLE		4
#define MSIX_CAP_PBA		8
#define MSIX_ENTRY_DWORDS	4
#define MSIX_ADDR_BASE		0xfee00000u

bool msix_probe(struct msix *m, struct pci_dev *d)
{
	*m = (struct msix){ .dev = d };
	u8 cap = pci_find_cap(d->bdf, PCI_CAP_ID_MSIX, 0);
	if (!cap)
		return false;
	u16 ctrl = pci_cfg_read16(d->bdf, cap + MSIX_CAP_CTRL);
	u32 table = pci_cfg_read32(d->bdf, cap + MSIX_CAP_TABLE);
	u32 pba = pci_cfg_read32(d->bdf, cap + MSIX_CAP_PBA);
	u16 n = (ctrl & 0x7ff) + 1;
	m->cap = cap;
	m->entries = n;
	m->table = pci_bar_ptr(d, table & 7, table & ~7u, (u64)n * 16);
	m->pba = pci_bar_ptr(d, pba & 7, pba & ~7u, ((u64)n + 63) / 64 * 8);
	if (!m->table || !m->pba) {
		printf("msix: %02x:%02x.%u: table (BIR %u +0x%x) or PBA (BIR %u +0x%x) not mapped\n",
		       d->bdf >> 8, (d->bdf >> 3) & 31, d->bdf & 7, table & 7, table & ~7u,
		       pba & 7, pba & ~7u);
		return false;
	}
	return true;
}

u16 msix_control(struct msix *m)
{
	return pci_cfg_read16(m->dev->bdf, m->cap + MSIX_CAP_CTRL);
}

static void set_control(struct msix *m, u16 bit, bool on)
{
	u16 c = msix_control(m);
	c = on ? (c | bit) : (c & ~bit);
	pci_cfg_write16(m->dev->bdf, m->cap + MSIX_CAP_CTRL, c);
}

void msix_enable(struct msix *m, bool on) { set_control(m, MSIX_CTRL_ENABLE, on); }
void msix_function_mask(struct msix *m, bool masked) { set_control(m, MSIX_CTRL_FUNC_MASK, masked); }

void msix_mask(struct msix *m, unsigned i, bool masked)
{
	if (i >= m->entries)
		return;
	volatile u32 *ctl = &m->table[i * MSIX_ENTRY_DWORDS + 3];
	u32 v = *ctl;
	*ctl = masked ? (v | MSIX_ENTRY_MASKED) : (v & ~MSIX_ENTRY_MASKED);
}

void msix_set(struct msix *m, unsigned i, u32 apic_id, u8 vector, bool masked)
{
	if (i >= m->entries)
		return;
	volatile u32 *e = &m->table[i * MSIX_ENTRY_DWORDS];
	msix_mask(m, i, true);
	e[0] = MSIX_ADDR_BASE | (apic_id & 0xff) << 12;	/* physical destination */
	e[1] = 0;
	e[2] = vector;					/* fixed delivery, edge */
	if (!masked)
		msix_mask(m, i, false);
}

bool msix_pending(struct msix *m, unsigned i)
{
	return i < m->entries && ((m->pba[i / 64] >> (i % 64)) & 1);
}
