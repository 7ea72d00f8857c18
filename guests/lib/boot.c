/* Boot information: PVH start_info or multiboot info, command line, memory map. */
#include "kit.h"

extern u32 boot_protocol_raw, boot_info_raw;

struct hvm_start_info {
	u32 magic;
	u32 version;
	u32 flags;
	u32 nr_modules;
	u64 modlist_paddr;
	u64 cmdline_paddr;
	u64 rsdp_paddr;
	u64 memmap_paddr;	/* version >= 1 */
	u32 memmap_entries;
	u32 reserved;
};

struct hvm_memmap_table_entry {
	u64 addr;
	u64 size;
	u32 type;
	u32 reserved;
};

struct multiboot_info {
	u32 flags;
	u32 mem_lower;		/* KiB, flags bit 0 */
	u32 mem_upper;
	u32 boot_device;
	u32 cmdline;		/* flags bit 2 */
	u32 mods_count;
	u32 mods_addr;
	u32 syms[4];
	u32 mmap_length;	/* flags bit 6 */
	u32 mmap_addr;
};

struct multiboot_mmap_entry {
	u32 size;		/* not counting this field */
	u64 addr;
	u64 len;
	u32 type;
} __attribute__((packed));

#define MAX_REGIONS 128
static struct mem_region regions[MAX_REGIONS];
static int nregions;
static const char *cmdline_raw = "";
static const char *cmdline_user = "";
static u64 rsdp;

void boot_info_init(void);

static void add_region(u64 addr, u64 size, u32 type)
{
	if (nregions < MAX_REGIONS)
		regions[nregions++] = (struct mem_region){ addr, size, type };
}

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n'; }

/* QEMU and GRUB put the image's path first in a multiboot command line. */
static const char *skip_image_name(const char *s)
{
	const char *p = s;
	bool slash = false;
	while (*p && !is_space(*p)) {
		if (*p == '/')
			slash = true;
		p++;
	}
	size_t n = p - s;
	if (!slash && !(n >= 4 && !strncmp(p - 4, ".elf", 4)))
		return s;
	while (is_space(*p))
		p++;
	return p;
}

void boot_info_init(void)
{
	u64 info = boot_info_raw;

	if (boot_protocol_raw == BOOT_PVH) {
		const struct hvm_start_info *si = (const void *)info;
		if (si->cmdline_paddr)
			cmdline_raw = (const char *)si->cmdline_paddr;
		cmdline_user = cmdline_raw;
		rsdp = si->rsdp_paddr;
		if (si->version >= 1 && si->memmap_paddr) {
			const struct hvm_memmap_table_entry *e = (const void *)si->memmap_paddr;
			for (u32 i = 0; i < si->memmap_entries; i++)
				add_region(e[i].addr, e[i].size, e[i].type);
		}
	} else if (boot_protocol_raw == BOOT_MULTIBOOT) {
		const struct multiboot_info *mi = (const void *)info;
		if ((mi->flags & (1 << 2)) && mi->cmdline)
			cmdline_raw = (const char *)(u64)mi->cmdline;
		cmdline_user = skip_image_name(cmdline_raw);
		if (mi->flags & (1 << 6)) {
			u64 p = mi->mmap_addr, end = p + mi->mmap_length;
			while (p + sizeof(struct multiboot_mmap_entry) <= end) {
				const struct multiboot_mmap_entry *e = (const void *)p;
				add_region(e->addr, e->len, e->type);
				p += (u64)e->size + 4;
			}
		} else if (mi->flags & (1 << 0)) {
			add_region(0, (u64)mi->mem_lower << 10, E820_RAM);
			add_region(0x100000, (u64)mi->mem_upper << 10, E820_RAM);
		}
	}
}

int boot_protocol(void) { return (int)boot_protocol_raw; }

const char *boot_protocol_name(void)
{
	switch (boot_protocol_raw) {
	case BOOT_PVH: return "pvh";
	case BOOT_MULTIBOOT: return "multiboot";
	default: return "unknown";
	}
}

u64 boot_info_addr(void) { return boot_info_raw; }
u64 boot_rsdp_addr(void) { return rsdp; }
const char *cmdline(void) { return cmdline_user; }
const char *boot_cmdline_raw(void) { return cmdline_raw; }
int memmap_count(void) { return nregions; }

const struct mem_region *memmap_entry(int i)
{
	return i >= 0 && i < nregions ? &regions[i] : NULL;
}

u64 ram_bytes(void)
{
	u64 sum = 0;
	for (int i = 0; i < nregions; i++)
		if (regions[i].type == E820_RAM)
			sum += regions[i].size;
	return sum;
}

bool ram_covers(u64 base, u64 size)
{
	for (int i = 0; i < nregions; i++) {
		const struct mem_region *r = &regions[i];
		if (r->type == E820_RAM && r->addr <= base && base + size <= r->addr + r->size)
			return true;
	}
	return false;
}

bool parse_uint(const char *s, u64 *out, const char **end)
{
	u64 v = 0;
	unsigned base = 10;
	const char *p = s;
	if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X')) {
		base = 16;
		p += 2;
	}
	const char *digits = p;
	for (;; p++) {
		unsigned d;
		if (*p >= '0' && *p <= '9')
			d = *p - '0';
		else if (base == 16 && *p >= 'a' && *p <= 'f')
			d = *p - 'a' + 10;
		else if (base == 16 && *p >= 'A' && *p <= 'F')
			d = *p - 'A' + 10;
		else
			break;
		v = v * base + d;
	}
	if (p == digits)
		return false;
	*out = v;
	if (end)
		*end = p;
	return true;
}

/* Calls fn on each whitespace-separated token until it returns true. */
static const char *find_token(bool (*match)(const char *tok, size_t n, const void *ctx),
			      const void *ctx, size_t *toklen)
{
	const char *p = cmdline_user;
	for (;;) {
		while (is_space(*p))
			p++;
		if (!*p)
			return NULL;
		const char *t = p;
		while (*p && !is_space(*p))
			p++;
		if (match(t, p - t, ctx)) {
			if (toklen)
				*toklen = p - t;
			return t;
		}
	}
}

static bool match_key(const char *t, size_t n, const void *ctx)
{
	const char *key = ctx;
	size_t k = strlen(key);
	return n >= k && !strncmp(t, key, k) && (n == k || t[k] == '=');
}

static bool match_number(const char *t, size_t n, const void *ctx)
{
	(void)ctx;
	u64 v;
	const char *end;
	return parse_uint(t, &v, &end) && (size_t)(end - t) == n;
}

const char *cmdline_arg(const char *key, size_t *len)
{
	size_t n;
	const char *t = find_token(match_key, key, &n);
	if (!t)
		return NULL;
	size_t k = strlen(key);
	if (n == k) {
		if (len)
			*len = 0;
		return "";
	}
	if (len)
		*len = n - k - 1;
	return t + k + 1;
}

bool cmdline_find_uint(const char *key, u64 *out)
{
	const char *v;
	size_t n;
	if (key) {
		v = cmdline_arg(key, &n);
	} else {
		v = find_token(match_number, NULL, &n);
	}
	if (!v)
		return false;
	const char *end;
	return parse_uint(v, out, &end) && (size_t)(end - v) == n;
}

u64 cmdline_uint(const char *key, u64 dflt)
{
	u64 v;
	return cmdline_find_uint(key, &v) ? v : dflt;
}
