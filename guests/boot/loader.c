/*
 * The loader's 32-bit half: finds the Multiboot v1 header in the kernel
 * image stage 2 read into KERNEL_BUF, places the image (the header's
 * address fields when flag 16 is set, the ELF program headers otherwise),
 * builds the Multiboot information (memory sizes, BIOS memory map, boot
 * device, command line, loader name) and enters the kernel in 32-bit flat
 * protected mode with EAX = 0x2BADB002 and EBX = the information.
 *
 * Everything it prints goes straight to COM1; on an error it says what and
 * writes 2 to the debug-exit port.
 */
#include "loader.h"

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define MB_HEADER_MAGIC		0x1badb002
#define MB_BOOT_MAGIC		0x2badb002
#define MB_SEARCH_BYTES		8192
/* Header flags the loader honours: page-aligned modules (it loads none), memory info, address fields. */
#define MB_HF_PAGE_ALIGN	(1u << 0)
#define MB_HF_MEMINFO		(1u << 1)
#define MB_HF_AOUT_KLUDGE	(1u << 16)
#define MB_HF_REQUIRED_MASK	0xffffu
/* Information flags. */
#define MB_IF_MEM		(1u << 0)
#define MB_IF_BOOTDEV		(1u << 1)
#define MB_IF_CMDLINE		(1u << 2)
#define MB_IF_MMAP		(1u << 6)
#define MB_IF_LOADER_NAME	(1u << 9)

#define HIGH_MEMORY		0x100000u
#define E820_RAM		1

struct mb_header {
	u32 magic, flags, checksum;
	u32 header_addr, load_addr, load_end_addr, bss_end_addr, entry_addr;
};

struct mb_info {
	u32 flags;
	u32 mem_lower, mem_upper;
	u32 boot_device;
	u32 cmdline;
	u32 mods_count, mods_addr;
	u32 syms[4];
	u32 mmap_length, mmap_addr;
	u32 drives_length, drives_addr;
	u32 config_table;
	u32 boot_loader_name;
};

struct mb_mmap_entry {
	u32 size;
	u64 addr, len;
	u32 type;
} __attribute__((packed));

struct e820_entry {
	u64 addr, len;
	u32 type, attributes;
} __attribute__((packed));

/* Filled in by loader.S in real mode. */
extern struct e820_entry e820_map[E820_MAX];
extern u16 e820_count;
extern u16 conventional_kib;
extern u8 kernel_desc[512];

static struct mb_info info;
static struct mb_mmap_entry mmap[E820_MAX];
static char cmdline[KD_CMDLINE_MAX];
static const char loader_name[] = "ferrovm test loader";

/* ---- console ---- */

static inline void outb(u16 port, u8 v) { __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port)); }
static inline u8 inb(u16 port) { u8 v; __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port)); return v; }

static void putc(char c)
{
	for (int i = 0; i < 0x10000 && !(inb(0x3fd) & 0x20); i++)
		;
	outb(0x3f8, (u8)c);
}

static void puts(const char *s)
{
	for (; *s; s++) {
		if (*s == '\n')
			putc('\r');
		putc(*s);
	}
}

static void puthex(u64 v)
{
	char buf[19] = "0x";
	int n = 2;
	int shift = 60;
	while (shift > 0 && !((v >> shift) & 0xf))
		shift -= 4;
	for (; shift >= 0; shift -= 4)
		buf[n++] = "0123456789abcdef"[(v >> shift) & 0xf];
	buf[n] = 0;
	puts(buf);
}

static __attribute__((noreturn)) void die(const char *what, u64 value)
{
	puts("loader: error: ");
	puts(what);
	puts(" ");
	puthex(value);
	puts("\n");
	outb(0xf4, 2);
	for (;;)
		__asm__ volatile("cli; hlt");
}

/* ---- memory ---- */

void *memcpy(void *dst, const void *src, u32 n);
void *memset(void *dst, int c, u32 n);

void *memcpy(void *dst, const void *src, u32 n)
{
	void *d = dst;
	__asm__ volatile("rep movsb" : "+D"(d), "+S"(src), "+c"(n) : : "memory");
	return dst;
}

void *memset(void *dst, int c, u32 n)
{
	void *d = dst;
	u32 words = n / 4, bytes = n % 4;
	u32 pattern = (u8)c * 0x01010101u;
	__asm__ volatile("rep stosl" : "+D"(d), "+c"(words) : "a"(pattern) : "memory");
	__asm__ volatile("rep stosb" : "+D"(d), "+c"(bytes) : "a"(pattern) : "memory");
	return dst;
}

/* True when [addr, addr + len) is RAM in the BIOS map and lies above 1 MiB. */
static int ram_range(u64 addr, u64 len)
{
	if (addr < HIGH_MEMORY || addr + len < addr || addr + len > 0x100000000ull)
		return 0;
	for (u32 i = 0; i < e820_count; i++) {
		const struct e820_entry *e = &e820_map[i];
		if (e->type == E820_RAM && addr >= e->addr && addr + len <= e->addr + e->len)
			return 1;
	}
	return 0;
}

/* Copies `filesz` bytes of the image from `offset` to `paddr`, zeroes up to `memsz`. */
static void place(const u8 *image, u32 image_len, u64 offset, u64 filesz, u64 paddr, u64 memsz)
{
	if (filesz > memsz || offset > image_len || filesz > image_len - offset)
		die("segment outside the image, offset", offset);
	if (!ram_range(paddr, memsz))
		die("segment not in RAM above 1 MiB, address", paddr);
	memcpy((void *)(u32)paddr, image + offset, (u32)filesz);
	memset((void *)(u32)(paddr + filesz), 0, (u32)(memsz - filesz));
}

/* ---- kernel formats ---- */

static const struct mb_header *find_header(const u8 *image, u32 len, u32 *offset)
{
	u32 limit = len < MB_SEARCH_BYTES ? len : MB_SEARCH_BYTES;
	for (u32 off = 0; off + sizeof(struct mb_header) <= limit; off += 4) {
		const struct mb_header *h = (const void *)(image + off);
		if (h->magic == MB_HEADER_MAGIC && h->magic + h->flags + h->checksum == 0) {
			*offset = off;
			return h;
		}
	}
	return 0;
}

/* The Multiboot address fields: the file from the header's offset maps to header_addr. */
static u32 load_aout(const u8 *image, u32 len, const struct mb_header *h, u32 header_off)
{
	if (h->header_addr < h->load_addr || h->header_addr - h->load_addr > header_off)
		die("bad address fields, header_addr", h->header_addr);
	u32 file_off = header_off - (h->header_addr - h->load_addr);
	u32 load_end = h->load_end_addr ? h->load_end_addr : h->load_addr + (len - file_off);
	u32 bss_end = h->bss_end_addr ? h->bss_end_addr : load_end;
	if (load_end < h->load_addr || bss_end < load_end)
		die("bad address fields, load_end_addr", load_end);
	place(image, len, file_off, load_end - h->load_addr, h->load_addr, bss_end - h->load_addr);
	return h->entry_addr;
}

struct elf_ident { u8 magic[4], cls, data, version, pad[9]; };

/* ELF32 or ELF64: every PT_LOAD at its physical address; the entry point. */
static u32 load_elf(const u8 *image, u32 len)
{
	const struct elf_ident *id = (const void *)image;
	if (len < 64 || id->magic[0] != 0x7f || id->magic[1] != 'E' || id->magic[2] != 'L' ||
	    id->magic[3] != 'F' || id->data != 1)
		die("neither the address fields nor a little-endian ELF, first bytes",
		    *(const u32 *)image);
	int is64 = id->cls == 2;
	u64 entry, phoff;
	u32 phentsize, phnum;
	if (is64) {
		entry = *(const u64 *)(image + 24);
		phoff = *(const u64 *)(image + 32);
		phentsize = *(const u16 *)(image + 54);
		phnum = *(const u16 *)(image + 56);
	} else {
		entry = *(const u32 *)(image + 24);
		phoff = *(const u32 *)(image + 28);
		phentsize = *(const u16 *)(image + 42);
		phnum = *(const u16 *)(image + 44);
	}
	if (phentsize < (is64 ? 56u : 32u) || phoff > len || (u64)phnum * phentsize > len - phoff)
		die("bad ELF program headers, offset", phoff);
	for (u32 i = 0; i < phnum; i++) {
		const u8 *ph = image + phoff + i * phentsize;
		if (*(const u32 *)ph != 1)	/* PT_LOAD */
			continue;
		if (is64)
			place(image, len, *(const u64 *)(ph + 8), *(const u64 *)(ph + 32),
			      *(const u64 *)(ph + 24), *(const u64 *)(ph + 40));
		else
			place(image, len, *(const u32 *)(ph + 4), *(const u32 *)(ph + 16),
			      *(const u32 *)(ph + 12), *(const u32 *)(ph + 20));
	}
	if (entry >= 0x100000000ull)
		die("entry point above 4 GiB", entry);
	return (u32)entry;
}

/* ---- Multiboot information ---- */

static void build_info(u8 drive)
{
	u32 n = e820_count <= E820_MAX ? e820_count : E820_MAX;
	u64 upper = 0;
	for (u32 i = 0; i < n; i++) {
		const struct e820_entry *e = &e820_map[i];
		mmap[i] = (struct mb_mmap_entry){ 20, e->addr, e->len, e->type };
		if (e->type == E820_RAM && e->addr <= HIGH_MEMORY && e->addr + e->len > HIGH_MEMORY)
			upper = (e->addr + e->len - HIGH_MEMORY) >> 10;
	}
	const char *src = (const char *)kernel_desc + KD_CMDLINE;
	u32 i = 0;
	for (; i + 1 < KD_CMDLINE_MAX && src[i]; i++)
		cmdline[i] = src[i];
	cmdline[i] = 0;

	info.flags = MB_IF_MEM | MB_IF_BOOTDEV | MB_IF_CMDLINE | MB_IF_MMAP | MB_IF_LOADER_NAME;
	info.mem_lower = conventional_kib;
	info.mem_upper = upper > 0xffffffffu ? 0xffffffffu : (u32)upper;
	info.boot_device = ((u32)drive << 24) | 0xffffff;
	info.cmdline = (u32)cmdline;
	info.mmap_addr = (u32)mmap;
	info.mmap_length = n * sizeof(struct mb_mmap_entry);
	info.boot_loader_name = (u32)loader_name;
}

void __attribute__((noreturn, used)) loader_main(u32 drive);

void loader_main(u32 drive)
{
	const u8 *image = (const u8 *)KERNEL_BUF;
	u32 len = *(const u32 *)(kernel_desc + KD_BYTES);
	u32 header_off;
	const struct mb_header *h = find_header(image, len, &header_off);
	if (!h)
		die("no Multiboot header in the first 8 KiB of the kernel, size", len);
	u32 unsupported = h->flags & MB_HF_REQUIRED_MASK & ~(MB_HF_PAGE_ALIGN | MB_HF_MEMINFO);
	if (unsupported)
		die("the kernel requires Multiboot features this loader lacks, flags", unsupported);
	if (!e820_count)
		die("the BIOS gave no E820 memory map, entries", 0);

	u32 entry = (h->flags & MB_HF_AOUT_KLUDGE) ? load_aout(image, len, h, header_off)
						   : load_elf(image, len);
	build_info((u8)drive);
	puts("loader: entering the kernel at ");
	puthex(entry);
	puts("\n");
	__asm__ volatile("jmp *%2" : : "a"(MB_BOOT_MAGIC), "b"(&info), "r"(entry) : "memory");
	__builtin_unreachable();
}
