/*
 * ferrovm guest kit: the API test guests are written against.
 *
 * A guest is one C file defining `void guest_main(void)`.  It runs at CPL 0
 * in long mode with the first 4 GiB identity-mapped, interrupts disabled,
 * serial, GDT/TSS and IDT ready.  Returning from guest_main() means pass().
 * See guests/README.md.
 */
#ifndef KIT_H
#define KIT_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "defs.h"
#include "x86.h"

#define NORETURN __attribute__((noreturn))
#define PRINTF_LIKE(f, a) __attribute__((format(printf, f, a)))
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

/* Defined by each guest. */
void guest_main(void);

/* ---- console: 16550 UART at 0x3f8 (polls LSR.THRE before each byte) ---- */
#define SERIAL_PORT 0x3f8
void serial_putc(char c);
void serial_write(const char *s, size_t n);
int putchar(int c);
int puts(const char *s);				/* appends '\n' */
/* %d %i %u %x %X %o %p %s %c %%; flags - 0 + space #; width (or *);
 * precision for %s; length modifiers hh h l ll z j t. */
int printf(const char *fmt, ...) PRINTF_LIKE(1, 2);
int vprintf(const char *fmt, va_list ap);
int snprintf(char *buf, size_t size, const char *fmt, ...) PRINTF_LIKE(3, 4);
int vsnprintf(char *buf, size_t size, const char *fmt, va_list ap);

/* ---- ending the VM ---- */
/* Writes `code` to the debug-exit port 0xf4: the VMM exits with
 * status (code << 1) | 1.  Works at CPL 0 and CPL 3. */
NORETURN void exit_vm(u8 code);
NORETURN void pass(void);				/* "PASS", code 0 */
NORETURN void fail(const char *fmt, ...) PRINTF_LIKE(1, 2); /* "FAIL: ...", code 1 */
NORETURN void fail_code(u8 code, const char *fmt, ...) PRINTF_LIKE(2, 3);
void i8042_reset(void);		/* 0xFE to port 0x64; returns only if no reset happened */
NORETURN void halt_forever(void);

/* ---- boot information ---- */
struct mem_region {
	u64 addr;
	u64 size;
	u32 type;		/* e820 types: 1 RAM, 2 reserved, 3 ACPI, 4 NVS, ... */
};
#define E820_RAM 1
int boot_protocol(void);		/* BOOT_PVH, BOOT_MULTIBOOT, BOOT_UNKNOWN */
const char *boot_protocol_name(void);	/* "pvh", "multiboot", "unknown" */
u64 boot_info_addr(void);		/* hvm_start_info / multiboot_info address */
u64 boot_rsdp_addr(void);		/* PVH rsdp_paddr, 0 if none */
/* The kernel command line ("" if none).  With multiboot, a leading word that
 * names the kernel image (contains '/' or ends in ".elf", as QEMU and GRUB
 * prepend) is skipped; boot_cmdline_raw() keeps it. */
const char *cmdline(void);
const char *boot_cmdline_raw(void);
int memmap_count(void);
const struct mem_region *memmap_entry(int i);
u64 ram_bytes(void);			/* sum of type-1 regions */

/* Parses a decimal or 0x-prefixed hex number at s; false if no digits. */
bool parse_uint(const char *s, u64 *out, const char **end);
/* key != NULL: finds the token "key=NUM"; key == NULL: the first token that
 * is entirely a number.  false if not found or malformed. */
bool cmdline_find_uint(const char *key, u64 *out);
u64 cmdline_uint(const char *key, u64 dflt);
/* Value of "key=VALUE" (up to the next space, *len set) or NULL; for a bare
 * "key" token returns a pointer to "" (len 0). */
const char *cmdline_arg(const char *key, size_t *len);

/* ---- fw_cfg (QEMU-compatible, ports 0x510/0x511) ---- */
#define FW_CFG_PORT_SEL		0x510
#define FW_CFG_PORT_DATA	0x511
#define FW_CFG_SIGNATURE	0x00
#define FW_CFG_ID		0x01
#define FW_CFG_NB_CPUS		0x05
#define FW_CFG_MAX_CPUS		0x0f
bool fw_cfg_present(void);		/* signature "QEMU" */
void fw_cfg_select(u16 key);
void fw_cfg_read(void *buf, size_t len);
unsigned cpu_count(void);		/* FW_CFG_NB_CPUS, 1 without fw_cfg */

/* ---- traps ---- */
/* The register frame built by the common interrupt stub. */
struct frame {
	u64 r15, r14, r13, r12, r11, r10, r9, r8;
	u64 rbp, rdi, rsi, rdx, rcx, rbx, rax;
	u64 vector, error;
	u64 rip, cs, rflags, rsp, ss;	/* pushed by the CPU */
};
typedef void (*trap_handler_t)(struct frame *f);
/* Installs a C handler for `vector` (0-255).  For 32-255 this also installs
 * the IDT gate (interrupt gate, DPL 0).  For 0-31 it overrides the default
 * fatal report (ring-3 service requests are still served first).  The handler
 * may edit the frame (e.g. f->rip); it must send any EOI itself.
 * NULL restores the default. */
void set_handler(unsigned vector, trap_handler_t h);
const char *exception_name(unsigned vector);	/* "#GP", ... */
/* Prints EXCEPTION ..., FAIL: ... and exits with EXIT_EXCEPTION (0x7e). */
NORETURN void fatal_trap(struct frame *f);

/* ---- ring 3 ---- */
typedef u64 (*ring3_fn_t)(u64 arg);
/* Runs fn(arg) at CPL 3 (IOPL 3, all ports allowed by the TSS bitmap,
 * interrupts as requested, own 64 KiB stack) and returns its result. */
u64 enter_ring3_irq(ring3_fn_t fn, u64 arg, bool interrupts);
static inline u64 enter_ring3(ring3_fn_t fn, u64 arg) { return enter_ring3_irq(fn, arg, false); }

/* Issues a ring-3 service request (UD2 with RAX = nr, RDI = a, RSI = b);
 * returns RAX as set by the service.  Only meaningful at CPL 3. */
static inline u64 ring3_service(u64 nr, u64 a, u64 b)
{
	__asm__ volatile("ud2" : "+a"(nr) : "D"(a), "S"(b) : "memory");
	return nr;
}
/* Runs fn(arg) at CPL 0 (interrupts off) from either ring; returns its value. */
u64 ring0_call(u64 (*fn)(u64), u64 arg);

/* ---- strings ---- */
void *memset(void *d, int c, size_t n);
void *memcpy(void *restrict d, const void *restrict s, size_t n);
void *memmove(void *d, const void *s, size_t n);
int memcmp(const void *a, const void *b, size_t n);
size_t strlen(const char *s);
int strcmp(const char *a, const char *b);
int strncmp(const char *a, const char *b, size_t n);

#endif
