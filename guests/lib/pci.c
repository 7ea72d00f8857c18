/*
 * ACPI table lookup and PCI bus 0: configuration mechanism #1 (0xcf8/0xcfc)
 * and ECAM (base from the MCFG), enumeration, BAR decoding, capabilities.
 */
#include "kit.h"

/* ---- ACPI ---- */

struct acpi_rsdp {
	char signature[8];		/* "RSD PTR " */
	u8 checksum;
	char oem_id[6];
	u8 revision;
	u32 rsdt;
	u32 length;			/* revision >= 2 */
	u64 xsdt;
	u8 ext_checksum;
	u8 reserved[3];
} __attribute__((packed));

struct acpi_mcfg_entry {
	u64 base;
	u16 segment;
	u8 bus_start, bus_end;
	u32 reserved;
} __attribute__((packed));

static u8 sum_bytes(const void *p, size_t n)
{
	const u8 *b = p;
	u8 s = 0;
	while (n--)
		s += *b++;
	return s;
}

static bool rsdp_valid(u64 addr)
{
	const struct acpi_rsdp *r = (const void *)addr;
	if (memcmp(r->signature, "RSD PTR ", 8) || sum_bytes(r, 20))
		return false;
	return r->revision < 2 || (r->length >= sizeof(*r) && r->length < 4096 &&
				   !sum_bytes(r, r->length));
}

/* Hidden from the compiler's bounds tracking: a fixed low address. */
static volatile u64 bda_ebda_addr = 0x40e;

static u64 rsdp_scan(u64 from, u64 to)
{
	for (u64 a = from; a + 20 <= to; a += 16)
		if (rsdp_valid(a))
			return a;
	return 0;
}

u64 acpi_rsdp(void)
{
	static u64 found;
	static bool done;
	if (done)
		return found;
	done = true;
	u64 a = boot_rsdp_addr();
	if (a && a < (4ULL << 30) && rsdp_valid(a))
		return found = a;
	volatile u16 *bda_ebda = (volatile u16 *)bda_ebda_addr;	/* BIOS data area word */
	u64 ebda = (u64)*bda_ebda << 4;
	if (ebda >= 0x80000 && ebda < 0xa0000 && (found = rsdp_scan(ebda, ebda + 1024)))
		return found;
	return found = rsdp_scan(0xe0000, 0x100000);
}

static const struct acpi_sdt_header *sdt_at(u64 addr)
{
	if (!addr || addr >= (4ULL << 30))
		return NULL;
	const struct acpi_sdt_header *h = (const void *)addr;
	if (h->length < sizeof(*h) || h->length > (1u << 20) || sum_bytes(h, h->length))
		return NULL;
	return h;
}

const struct acpi_sdt_header *acpi_find_table(const char sig[4])
{
	u64 rp = acpi_rsdp();
	if (!rp)
		return NULL;
	const struct acpi_rsdp *r = (const void *)rp;
	bool x = r->revision >= 2 && r->xsdt;
	const struct acpi_sdt_header *root = sdt_at(x ? r->xsdt : r->rsdt);
	if (!root)
		return NULL;
	unsigned width = x ? 8 : 4;
	unsigned n = (root->length - sizeof(*root)) / width;
	const u8 *entries = (const u8 *)(root + 1);
	for (unsigned i = 0; i < n; i++) {
		u64 a = 0;
		memcpy(&a, entries + i * width, width);
		const struct acpi_sdt_header *h = sdt_at(a);
		if (h && !memcmp(h->signature, sig, 4))
			return h;
	}
	return NULL;
}

/* ---- configuration access ---- */

static int mech = PCI_MECH_CF8;
static u64 ecam_base;
static spinlock_t cf8_lock = SPINLOCK_INIT;

bool pci_ecam_lookup(u64 *base, u8 *bus_start, u8 *bus_end)
{
	const struct acpi_sdt_header *h = acpi_find_table("MCFG");
	if (!h)
		return false;
	const u8 *p = (const u8 *)h + sizeof(*h) + 8;	/* 8 reserved bytes */
	const u8 *end = (const u8 *)h + h->length;
	for (; p + sizeof(struct acpi_mcfg_entry) <= end; p += sizeof(struct acpi_mcfg_entry)) {
		const struct acpi_mcfg_entry *e = (const void *)p;
		if (e->segment == 0 && e->bus_start == 0) {
			*base = e->base;
			*bus_start = e->bus_start;
			*bus_end = e->bus_end;
			return true;
		}
	}
	return false;
}

int pci_init(int prefer)
{
	u8 s, e;
	ecam_base = 0;
	if (!pci_ecam_lookup(&ecam_base, &s, &e) || ecam_base >= (4ULL << 30))
		ecam_base = 0;
	u64 forced;
	if (cmdline_find_uint("ecam", &forced) && forced < (4ULL << 30))
		ecam_base = forced;	/* platforms without an MCFG (QEMU microvm) */
	mech = (prefer == PCI_MECH_ECAM && ecam_base) ? PCI_MECH_ECAM : PCI_MECH_CF8;
	return mech;
}

int pci_mech(void) { return mech; }
u64 pci_ecam_base(void) { return ecam_base; }

static u32 cf8_address(u16 bdf, u16 off)
{
	return 0x80000000u | (u32)bdf << 8 | (off & 0xfc);
}

u32 pci_cf8_read32(u16 bdf, u16 off)
{
	spin_lock(&cf8_lock);
	outl(PCI_CFG_ADDR_PORT, cf8_address(bdf, off));
	u32 v = inl(PCI_CFG_DATA_PORT);
	spin_unlock(&cf8_lock);
	return v;
}

void pci_cf8_write32(u16 bdf, u16 off, u32 v)
{
	spin_lock(&cf8_lock);
	outl(PCI_CFG_ADDR_PORT, cf8_address(bdf, off));
	outl(PCI_CFG_DATA_PORT, v);
	spin_unlock(&cf8_lock);
}

static volatile u8 *ecam_ptr(u16 bdf, u16 off)
{
	return (volatile u8 *)(ecam_base + ((u64)bdf << 12) + (off & 0xfff));
}

u32 pci_ecam_read32(u16 bdf, u16 off)
{
	return ecam_base ? *(volatile u32 *)ecam_ptr(bdf, off & ~3) : ~0u;
}

void pci_ecam_write32(u16 bdf, u16 off, u32 v)
{
	if (ecam_base)
		*(volatile u32 *)ecam_ptr(bdf, off & ~3) = v;
}

u32 pci_cfg_read32(u16 bdf, u16 off)
{
	return mech == PCI_MECH_ECAM ? pci_ecam_read32(bdf, off) : pci_cf8_read32(bdf, off);
}

u16 pci_cfg_read16(u16 bdf, u16 off)
{
	if (mech == PCI_MECH_ECAM)
		return *(volatile u16 *)ecam_ptr(bdf, off & ~1);
	spin_lock(&cf8_lock);
	outl(PCI_CFG_ADDR_PORT, cf8_address(bdf, off));
	u16 v = inw(PCI_CFG_DATA_PORT + (off & 2));
	spin_unlock(&cf8_lock);
	return v;
}

u8 pci_cfg_read8(u16 bdf, u16 off)
{
	if (mech == PCI_MECH_ECAM)
		return *ecam_ptr(bdf, off);
	spin_lock(&cf8_lock);
	outl(PCI_CFG_ADDR_PORT, cf8_address(bdf, off));
	u8 v = inb(PCI_CFG_DATA_PORT + (off & 3));
	spin_unlock(&cf8_lock);
	return v;
}

void pci_cfg_write32(u16 bdf, u16 off, u32 v)
{
	if (mech == PCI_MECH_ECAM)
		pci_ecam_write32(bdf, off, v);
	else
		pci_cf8_write32(bdf, off, v);
}

void pci_cfg_write16(u16 bdf, u16 off, u16 v)
{
	if (mech == PCI_MECH_ECAM) {
		*(volatile u16 *)ecam_ptr(bdf, off & ~1) = v;
		return;
	}
	spin_lock(&cf8_lock);
	outl(PCI_CFG_ADDR_PORT, cf8_address(bdf, off));
	outw(PCI_CFG_DATA_PORT + (off & 2), v);
	spin_unlock(&cf8_lock);
}

void pci_cfg_write8(u16 bdf, u16 off, u8 v)
{
	if (mech == PCI_MECH_ECAM) {
		*ecam_ptr(bdf, off) = v;
		return;
	}
	spin_lock(&cf8_lock);
	outl(PCI_CFG_ADDR_PORT, cf8_address(bdf, off));
	outb(PCI_CFG_DATA_PORT + (off & 3), v);
	spin_unlock(&cf8_lock);
}

/* ---- enumeration, BARs, capabilities ---- */

static struct pci_dev devs[PCI_MAX_DEVS];
static int ndevs;

const char *pci_bar_kind_name(u8 kind)
{
	switch (kind) {
	case PCI_BAR_IO: return "io";
	case PCI_BAR_MEM32: return "mem32";
	case PCI_BAR_MEM64: return "mem64";
	default: return "-";
	}
}

/* Writes all ones to a BAR register and returns what sticks, restoring it. */
static u32 bar_probe(u16 bdf, u16 off)
{
	u32 old = pci_cfg_read32(bdf, off);
	pci_cfg_write32(bdf, off, ~0u);
	u32 v = pci_cfg_read32(bdf, off);
	pci_cfg_write32(bdf, off, old);
	return v;
}

/* Decodes BAR i (and i + 1 for a 64-bit one); returns the registers used. */
static unsigned decode_bar(struct pci_dev *d, unsigned i)
{
	u16 off = PCI_BAR0 + 4 * i;
	u32 lo = pci_cfg_read32(d->bdf, off);
	struct pci_bar *b = &d->bar[i];
	*b = (struct pci_bar){ 0 };
	if (lo & 1) {
		u32 mask = bar_probe(d->bdf, off) & ~3u;
		if (mask & 0xffff)
			mask |= 0xffff0000u;	/* 16-bit I/O decoders read 0 above */
		b->kind = mask ? PCI_BAR_IO : PCI_BAR_NONE;
		b->addr = lo & ~3u;
		b->size = mask ? (u32)(~mask + 1) : 0;
		return 1;
	}
	bool is64 = ((lo >> 1) & 3) == 2 && i < 5;
	u64 mask = bar_probe(d->bdf, off) & ~0xfu;
	u64 addr = lo & ~0xfu;
	if (is64) {
		addr |= (u64)pci_cfg_read32(d->bdf, off + 4) << 32;
		mask |= (u64)bar_probe(d->bdf, off + 4) << 32;
		d->bar[i + 1] = (struct pci_bar){ 0 };
	} else if (mask) {
		mask |= 0xffffffff00000000ULL;
	}
	if (mask) {
		b->kind = is64 ? PCI_BAR_MEM64 : PCI_BAR_MEM32;
		b->size = ~mask + 1;
		b->addr = addr;
		b->prefetchable = lo & 8;
	}
	return is64 ? 2 : 1;
}

void pci_decode_bars(struct pci_dev *d)
{
	if ((d->header_type & 0x7f) != 0) {	/* bridges: not decoded */
		memset(d->bar, 0, sizeof(d->bar));
		return;
	}
	u16 cmd = pci_cfg_read16(d->bdf, PCI_COMMAND);
	pci_cfg_write16(d->bdf, PCI_COMMAND, cmd & ~(PCI_CMD_IO | PCI_CMD_MEM));
	for (unsigned i = 0; i < 6;)
		i += decode_bar(d, i);
	pci_cfg_write16(d->bdf, PCI_COMMAND, cmd);
}

static void read_function(struct pci_dev *d, u16 bdf)
{
	u32 id = pci_cfg_read32(bdf, PCI_VENDOR_ID);
	u32 cls = pci_cfg_read32(bdf, PCI_REVISION);
	u32 sub = pci_cfg_read32(bdf, PCI_SUBSYS_VENDOR);
	u32 irq = pci_cfg_read32(bdf, PCI_INT_LINE);
	*d = (struct pci_dev){
		.bdf = bdf,
		.vendor = (u16)id,
		.device = (u16)(id >> 16),
		.revision = (u8)cls,
		.prog_if = (u8)(cls >> 8),
		.subclass = (u8)(cls >> 16),
		.class_code = (u8)(cls >> 24),
		.header_type = pci_cfg_read8(bdf, PCI_HEADER_TYPE),
		.subsys_vendor = (u16)sub,
		.subsys_id = (u16)(sub >> 16),
		.int_line = (u8)irq,
		.int_pin = (u8)(irq >> 8),
	};
	pci_decode_bars(d);
}

int pci_scan(void)
{
	ndevs = 0;
	for (unsigned dev = 0; dev < 32; dev++) {
		for (unsigned fn = 0; fn < 8 && ndevs < PCI_MAX_DEVS; fn++) {
			u16 bdf = PCI_BDF(0, dev, fn);
			u16 vendor = pci_cfg_read16(bdf, PCI_VENDOR_ID);
			if (vendor == 0xffff || vendor == 0) {
				if (fn == 0)
					break;
				continue;
			}
			read_function(&devs[ndevs++], bdf);
			if (fn == 0 && !(devs[ndevs - 1].header_type & 0x80))
				break;		/* single-function device */
		}
	}
	return ndevs;
}

int pci_count(void) { return ndevs; }

struct pci_dev *pci_get(int i)
{
	return i >= 0 && i < ndevs ? &devs[i] : NULL;
}

struct pci_dev *pci_find(u16 vendor, u16 device, unsigned nth)
{
	for (int i = 0; i < ndevs; i++) {
		struct pci_dev *d = &devs[i];
		if ((vendor == 0xffff || d->vendor == vendor) &&
		    (device == 0xffff || d->device == device) && nth-- == 0)
			return d;
	}
	return NULL;
}

void pci_enable(struct pci_dev *d, u16 bits)
{
	u16 cmd = pci_cfg_read16(d->bdf, PCI_COMMAND);
	if ((cmd & bits) != bits)
		pci_cfg_write16(d->bdf, PCI_COMMAND, cmd | bits);
}

u8 pci_find_cap(u16 bdf, u8 id, u8 from)
{
	if (!(pci_cfg_read16(bdf, PCI_STATUS) & PCI_STATUS_CAP_LIST))
		return 0;
	u8 p = from ? pci_cfg_read8(bdf, from + 1) : pci_cfg_read8(bdf, PCI_CAP_PTR);
	for (int n = 0; n < 48 && p >= 0x40; n++) {
		p &= 0xfc;
		if (pci_cfg_read8(bdf, p) == id)
			return p;
		p = pci_cfg_read8(bdf, p + 1);
	}
	return 0;
}

/* Highest end of the BARs of every function that lie in [lo, hi). */
static u64 used_top(u8 kind_io, u64 lo, u64 hi)
{
	u64 top = lo;
	for (int i = 0; i < ndevs; i++) {
		for (int b = 0; b < 6; b++) {
			const struct pci_bar *bar = &devs[i].bar[b];
			if (!bar->size || !bar->addr || (bar->kind == PCI_BAR_IO) != kind_io)
				continue;
			if (bar->addr >= lo && bar->addr < hi && bar->addr + bar->size > top)
				top = bar->addr + bar->size;
		}
	}
	return top;
}

int pci_assign_bars(struct pci_dev *d, u64 mem_base, u64 mem_end, u32 io_base, u32 io_end)
{
	int assigned = 0;
	u16 cmd = pci_cfg_read16(d->bdf, PCI_COMMAND);
	for (unsigned i = 0; i < 6; i++) {
		struct pci_bar *b = &d->bar[i];
		if (!b->size || b->addr)
			continue;
		bool io = b->kind == PCI_BAR_IO;
		u64 lo = io ? io_base : mem_base, hi = io ? io_end : mem_end;
		u64 a = (used_top(io, lo, hi) + b->size - 1) & ~(b->size - 1);
		if (a + b->size > hi || a + b->size < a)
			return -1;
		pci_cfg_write16(d->bdf, PCI_COMMAND, cmd & ~(PCI_CMD_IO | PCI_CMD_MEM));
		pci_cfg_write32(d->bdf, PCI_BAR0 + 4 * i, (u32)a | (io ? 1 : 0));
		if (b->kind == PCI_BAR_MEM64)
			pci_cfg_write32(d->bdf, PCI_BAR0 + 4 * i + 4, (u32)(a >> 32));
		b->addr = a;
		assigned++;
		cmd |= io ? PCI_CMD_IO : PCI_CMD_MEM;
	}
	pci_cfg_write16(d->bdf, PCI_COMMAND, cmd);
	return assigned;
}

volatile void *pci_bar_ptr(const struct pci_dev *d, unsigned bar, u64 offset, u64 len)
{
	if (bar >= 6)
		return NULL;
	const struct pci_bar *b = &d->bar[bar];
	if (b->kind != PCI_BAR_MEM32 && b->kind != PCI_BAR_MEM64)
		return NULL;
	if (!b->addr || offset > b->size || len > b->size - offset)
		return NULL;
	u64 a = b->addr + offset;
	if (a + len > (4ULL << 30))
		return NULL;
	return (volatile void *)a;
}

int pci_compare_mechanisms(int *functions)
{
	static const u16 regs[] = { 0x00, 0x08, 0x0c, 0x10, 0x14, 0x18, 0x1c, 0x20, 0x24, 0x2c, 0x34 };
	if (!ecam_base || (pci_cf8_read32(PCI_BDF(0, 0, 0), 0) & 0xffff) == 0xffff)
		return -1;
	int bad = 0;
	*functions = ndevs;
	for (int i = 0; i < ndevs; i++) {
		for (unsigned r = 0; r < ARRAY_SIZE(regs); r++) {
			u32 a = pci_cf8_read32(devs[i].bdf, regs[r]);
			u32 b = pci_ecam_read32(devs[i].bdf, regs[r]);
			if (a != b) {
				printf("pci: 00:%02x.%u register 0x%02x: CF8 0x%08x, ECAM 0x%08x\n",
				       (devs[i].bdf >> 3) & 31, devs[i].bdf & 7, regs[r], a, b);
				bad++;
			}
		}
	}
	return bad;
}
