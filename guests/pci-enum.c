/*
 * pci-enum: finds bus 0 through both configuration mechanisms and the ACPI
 * MCFG table, and checks they agree.
 *
 *  - MCFG, found from the RSDP (the boot protocol's pointer, else the BIOS-area
 *    scan), declares ECAM for segment 0, bus 0 at 0xe0000000;
 *  - the host bridge (00:00.0) reads 8086:1237 rev 2, class 060000 through
 *    ports 0xcf8/0xcfc and through ECAM, dword, word and byte accesses alike;
 *  - every slot reads the same through both; absent ones, function 1 and
 *    bus 1 read all ones;
 *  - the host bridge has no BARs (each sizes to 0);
 *  - a write through one mechanism is read back through the other.
 *
 * The work runs at CPL 3 (ports open through the TSS bitmap, ECAM mapped
 * user-accessible).  Prints "pci: ..." lines and PASS.
 */
#include "kit.h"

#define CONFIG_ADDRESS	0xcf8
#define CONFIG_DATA	0xcfc
#define ECAM_BASE	0xe0000000UL
#define BIOS_AREA	0xe0000UL
#define BIOS_AREA_END	0x100000UL

static u32 cf8_address(u8 bus, u8 dev, u8 fn, u16 reg)
{
	return 0x80000000u | (u32)bus << 16 | (u32)dev << 11 | (u32)fn << 8 | (reg & 0xfc);
}

static u32 cf8_read(u8 bus, u8 dev, u8 fn, u16 reg, int size)
{
	outl(CONFIG_ADDRESS, cf8_address(bus, dev, fn, reg));
	u16 port = CONFIG_DATA + (reg & 3);
	switch (size) {
	case 1: return inb(port);
	case 2: return inw(port);
	default: return inl(port);
	}
}

static void cf8_write32(u8 dev, u16 reg, u32 v)
{
	outl(CONFIG_ADDRESS, cf8_address(0, dev, 0, reg));
	outl(CONFIG_DATA, v);
}

static volatile void *ecam(u8 dev, u8 fn, u16 reg)
{
	return (volatile void *)(ECAM_BASE + ((u64)dev << 15) + ((u64)fn << 12) + reg);
}

static u32 ecam_read(u8 dev, u8 fn, u16 reg, int size)
{
	switch (size) {
	case 1: return *(volatile u8 *)ecam(dev, fn, reg);
	case 2: return *(volatile u16 *)ecam(dev, fn, reg);
	default: return *(volatile u32 *)ecam(dev, fn, reg);
	}
}

static bool checksum_ok(const u8 *p, u32 len)
{
	u8 sum = 0;
	for (u32 i = 0; i < len; i++)
		sum += p[i];
	return sum == 0;
}

static u64 find_rsdp(void)
{
	if (boot_rsdp_addr())
		return boot_rsdp_addr();
	for (u64 p = BIOS_AREA; p < BIOS_AREA_END; p += 16)
		if (!memcmp((const void *)p, "RSD PTR ", 8) && checksum_ok((const u8 *)p, 20))
			return p;
	return 0;
}

/* Checks the MCFG the XSDT lists; returns its ECAM base for segment 0. */
static u64 check_mcfg(void)
{
	u64 rsdp = find_rsdp();
	if (!rsdp)
		fail("no RSDP");
	const u8 *r = (const u8 *)rsdp;
	if (r[15] < 2 || !checksum_ok(r, 36))
		fail("RSDP at 0x%lx: revision %u or checksum bad", rsdp, r[15]);
	u64 xsdt = *(const u64 *)(r + 24);
	const u8 *x = (const u8 *)xsdt;
	u32 xlen = *(const u32 *)(x + 4);
	if (memcmp(x, "XSDT", 4) || xlen < 36 || !checksum_ok(x, xlen))
		fail("XSDT at 0x%lx bad", xsdt);
	for (u32 off = 36; off + 8 <= xlen; off += 8) {
		const u8 *t = (const u8 *)*(const u64 *)(x + off);
		if (memcmp(t, "MCFG", 4))
			continue;
		u32 len = *(const u32 *)(t + 4);
		if (len < 60 || !checksum_ok(t, len))
			fail("MCFG length %u or checksum bad", len);
		u64 base = *(const u64 *)(t + 44);
		u16 segment = *(const u16 *)(t + 52);
		u8 start = t[54], end = t[55];
		printf("pci: MCFG at 0x%lx: ECAM 0x%lx segment %u buses %u-%u\n",
		       (u64)t, base, segment, start, end);
		if (base != ECAM_BASE || segment != 0 || start != 0 || end != 0)
			fail("MCFG entry does not declare 0x%lx for bus 0", ECAM_BASE);
		return base;
	}
	fail("no MCFG in the XSDT");
}

static void check_host_bridge(void)
{
	u32 id_cf8 = cf8_read(0, 0, 0, 0, 4), id_ecam = ecam_read(0, 0, 0, 4);
	u32 class_cf8 = cf8_read(0, 0, 0, 8, 4), class_ecam = ecam_read(0, 0, 8, 4);
	printf("pci: 00:00.0 id %08x / %08x class %08x / %08x\n",
	       id_cf8, id_ecam, class_cf8, class_ecam);
	if (id_cf8 != 0x12378086 || id_ecam != id_cf8)
		fail("host bridge IDs: CF8 %08x, ECAM %08x", id_cf8, id_ecam);
	if (class_cf8 != 0x06000002 || class_ecam != class_cf8)
		fail("host bridge class/revision: CF8 %08x, ECAM %08x", class_cf8, class_ecam);
	/* Sub-dword accesses at their offsets. */
	if (cf8_read(0, 0, 0, 2, 2) != 0x1237 || ecam_read(0, 0, 2, 2) != 0x1237 ||
	    cf8_read(0, 0, 0, 0xb, 1) != 0x06 || ecam_read(0, 0, 0xb, 1) != 0x06)
		fail("sub-dword reads of the host bridge disagree");
	for (int bar = 0; bar < 6; bar++) {
		u16 reg = 0x10 + 4 * bar;
		u32 saved = cf8_read(0, 0, 0, reg, 4);
		cf8_write32(0, reg, 0xffffffff);
		u32 mask = cf8_read(0, 0, 0, reg, 4);
		cf8_write32(0, reg, saved);
		if (mask != 0)
			fail("host bridge BAR %d sizes to %08x", bar, mask);
	}
	printf("pci: host bridge has no BARs\n");
}

static void check_slots(void)
{
	int present = 0, absent = 0;
	for (u8 dev = 0; dev < 32; dev++) {
		u32 a = cf8_read(0, dev, 0, 0, 4), b = ecam_read(dev, 0, 0, 4);
		if (a != b)
			fail("slot %u: CF8 %08x, ECAM %08x", dev, a, b);
		if (a == 0xffffffff) {
			absent++;
			if (cf8_read(0, dev, 0, 0x3c, 1) != 0xff || ecam_read(dev, 0, 0x100, 4) != 0xffffffff)
				fail("absent slot %u answers", dev);
			continue;
		}
		present++;
		printf("pci: 00:%02x.0 %04x:%04x\n", dev, a & 0xffff, a >> 16);
	}
	if (!absent)
		fail("no absent slot to check");
	if (cf8_read(0, 0, 1, 0, 4) != 0xffffffff || ecam_read(0, 1, 0, 4) != 0xffffffff)
		fail("function 00:00.1 answers");
	if (cf8_read(1, 0, 0, 0, 4) != 0xffffffff)
		fail("bus 1 answers");
	/* The enable bit off: the data port reads nothing. */
	outl(CONFIG_ADDRESS, 0);
	if (inl(CONFIG_DATA) != 0xffffffff)
		fail("config data answers with the enable bit clear");
	printf("pci: %d present, %d absent, all agree\n", present, absent);
}

static void check_write_paths(void)
{
	u8 saved = cf8_read(0, 0, 0, 0x3c, 1);
	*(volatile u8 *)ecam(0, 0, 0x3c) = 0x5a;
	u8 via_cf8 = cf8_read(0, 0, 0, 0x3c, 1);
	outl(CONFIG_ADDRESS, cf8_address(0, 0, 0, 0x3c));
	outb(CONFIG_DATA, 0xa5);
	u8 via_ecam = ecam_read(0, 0, 0x3c, 1);
	outb(CONFIG_DATA, saved);
	if (via_cf8 != 0x5a || via_ecam != 0xa5)
		fail("interrupt line: ECAM write read %02x through CF8, CF8 write read %02x through ECAM",
		     via_cf8, via_ecam);
	printf("pci: writes through either mechanism are seen by the other\n");
}

static u64 enumerate(u64 arg)
{
	(void)arg;
	check_mcfg();
	check_host_bridge();
	check_slots();
	check_write_paths();
	return 0;
}

void guest_main(void)
{
	enter_ring3(enumerate, 0);
	pass();
}
