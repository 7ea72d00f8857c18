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

/* ==================================================================== */
/* ---- SMP / LAPIC (lib/lapic.c, lib/smp.c, lib/smp-entry.S) ---- */
/*
 * xAPIC in MMIO mode at 0xfee00000 (identity-mapped, uncached, user-
 * accessible: the MMIO-only helpers below work at CPL 0 and CPL 3).
 * Functions marked [ring 0] use CR8 or MSRs and must run at CPL 0.
 */
#define LAPIC_BASE		0xfee00000UL
#define LAPIC_ID		0x020	/* bits 31:24 */
#define LAPIC_VERSION		0x030
#define LAPIC_TPR		0x080
#define LAPIC_APR		0x090
#define LAPIC_PPR		0x0a0
#define LAPIC_EOI		0x0b0
#define LAPIC_LDR		0x0d0
#define LAPIC_DFR		0x0e0
#define LAPIC_SVR		0x0f0
#define LAPIC_ISR		0x100	/* 8 x 32 bits, stride 0x10 */
#define LAPIC_TMR		0x180
#define LAPIC_IRR		0x200
#define LAPIC_ESR		0x280
#define LAPIC_ICR_LO		0x300
#define LAPIC_ICR_HI		0x310
#define LAPIC_LVT_TIMER		0x320
#define LAPIC_LVT_LINT0		0x350
#define LAPIC_LVT_LINT1		0x360
#define LAPIC_LVT_ERROR		0x370
#define LAPIC_TIMER_INIT	0x380
#define LAPIC_TIMER_CUR		0x390
#define LAPIC_TIMER_DIV		0x3e0
#define LAPIC_SPURIOUS_VECTOR	0xff
#define LAPIC_LVT_MASKED	(1u << 16)
#define LAPIC_TIMER_PERIODIC	(1u << 17)
/* Divide-configuration register values for lapic_timer_periodic(). */
#define LAPIC_DIV_1		0xb
#define LAPIC_DIV_2		0x0
#define LAPIC_DIV_4		0x1
#define LAPIC_DIV_8		0x2
#define LAPIC_DIV_16		0x3
#define LAPIC_DIV_32		0x8
#define LAPIC_DIV_64		0x9
#define LAPIC_DIV_128		0xa

static inline u32 lapic_read(u32 reg) { return *(volatile u32 *)(LAPIC_BASE + reg); }
static inline void lapic_write(u32 reg, u32 v) { *(volatile u32 *)(LAPIC_BASE + reg) = v; }
/* IRR / ISR / TMR bit of `vector` (reg = LAPIC_IRR, LAPIC_ISR, LAPIC_TMR). */
static inline bool lapic_vector_bit(u32 reg, u8 vector)
{
	return (lapic_read(reg + 0x10 * (vector >> 5)) >> (vector & 31)) & 1;
}

/* [ring 0] APIC globally enabled (IA32_APIC_BASE), SVR software-enable with
 * spurious vector 0xff (a handler that ignores it is installed), TPR 0.
 * LVTs are left alone (KVM's BSP has LINT0 = ExtINT for PIC mode). */
void lapic_enable(void);
/* Masks LVT LINT0 (where the 8259's ExtINT arrives on the BSP): for guests
 * that enable interrupts but want nothing from the PIC (SeaBIOS leaves the
 * PIT running at 18.2 Hz through the PIC, IRQ 0 at vector 8). */
void lapic_mask_lint0(void);
u32 lapic_id(void);				/* this CPU's APIC ID (ID register 31:24) */
void lapic_eoi(void);
/* IPIs (fixed delivery, edge, assert).  Each waits for ICR idle, writes
 * ICR_HI then ICR_LO: do not send from an interrupt handler while the same
 * CPU may be in the middle of sending one. */
void lapic_send_ipi(u32 apic_id, u8 vector);		/* physical destination */
void lapic_send_ipi_logical(u8 dest_mask, u8 vector);	/* flat logical destination */
void lapic_broadcast_ipi(u8 vector, int include_self);	/* all-incl./all-excl.-self shorthand */
void lapic_self_ipi(u8 vector);				/* self shorthand */
void lapic_send_icr(u32 dest_field, u32 icr_lo);	/* raw: ICR_HI = dest << 24, ICR_LO */
/* Flat logical mode: DFR = 0xffffffff, LDR = id << 24.  `id` is the 8-bit
 * logical APIC ID itself (a bit mask in flat mode, e.g. 1 << cpu_index()). */
void lapic_set_logical_id(u8 id);
/* [ring 0] TPR through CR8.  Takes / returns the 8-bit TPR value
 * (0x50 = priority class 5): CR8 = tpr >> 4, get_tpr() = CR8 << 4. */
void set_tpr(u8 tpr);
u8 get_tpr(void);
/* LAPIC timer: periodic, unmasked, `vector`; divide_cfg is a LAPIC_DIV_*
 * value; writing initial_count starts it.  (KVM's timer runs at 1 GHz
 * before the divider.) */
void lapic_timer_periodic(u8 vector, u32 initial_count, u32 divide_cfg);
void lapic_timer_oneshot(u8 vector, u32 initial_count, u32 divide_cfg);
void lapic_timer_stop(void);			/* initial count 0, LVT masked */

/* TSC frequency in Hz, measured once (~10 ms) at the first call: against
 * PIT channel 2 (port 0x61 gate; channel 0 is not touched); where there is
 * none (QEMU microvm) and the hypervisor is KVM, against the LAPIC timer at
 * KVM's 1 GHz (this stops the LAPIC timer: call tsc_hz() before using it);
 * else CPUID 0x15/0x16.  Call it at CPL 0 first (port I/O, CPUID). */
u64 tsc_hz(void);
void tsc_delay_us(u64 us);			/* busy-waits on the TSC */

/* ---- SMP ---- */
/* KIT_MAX_CPUS (defs.h) CPUs at most; more vCPUs are left halted. */
/* 0 = BSP; APs 1..n-1 in the order they started.  Looks the APIC ID up in
 * the table filled at AP start-up (any ring; returns 0 before APs exist). */
unsigned cpu_index(void);
/* INIT-SIPI-SIPI (all-excluding-self shorthand) to start the other
 * cpu_count() - 1 vCPUs; waits until each reported in (timeout ~2 s);
 * returns how many started.  Each AP gets its own kernel stack, TSS (I/O
 * bitmap open, its own RSP0/IST1, so enter_ring3*() works on it) and
 * 32 KiB ring-3 stack, loads the shared GDT and IDT, enters long mode,
 * enables its LAPIC (lapic_enable()) and calls ap_main(idx) in ring 0 with
 * interrupts off.  When ap_main returns the AP counts itself in
 * smp_aps_finished() and halts with interrupts off.  Call once, from the
 * BSP at CPL 0.  The BSP's LAPIC is enabled too. */
unsigned smp_start_aps(void (*ap_main)(unsigned idx));
unsigned smp_cpus_online(void);		/* 1 + APs started */
unsigned smp_aps_finished(void);	/* APs whose ap_main returned */
u32 cpu_apic_id(unsigned idx);		/* APIC ID of CPU idx (valid once online) */

/* Spinlocks and atomics: usable at CPL 0 and CPL 3. */
typedef struct { volatile u32 v; } spinlock_t;
#define SPINLOCK_INIT { 0 }
void spin_lock(spinlock_t *l);
void spin_unlock(spinlock_t *l);
bool spin_trylock(spinlock_t *l);
static inline u32 atomic_add(volatile u32 *p, u32 v)	/* lock xadd; returns the new value */
{
	u32 old = v;
	__asm__ volatile("lock xaddl %0, %1" : "+r"(old), "+m"(*p) :: "memory");
	return old + v;
}
static inline u32 atomic_inc(volatile u32 *p) { return atomic_add(p, 1); }
static inline u32 atomic_dec(volatile u32 *p) { return atomic_add(p, (u32)-1); }
static inline u32 atomic_xchg(volatile u32 *p, u32 v)	/* returns the old value */
{
	__asm__ volatile("xchgl %0, %1" : "+r"(v), "+m"(*p) :: "memory");
	return v;
}
static inline u32 atomic_cmpxchg(volatile u32 *p, u32 old, u32 new_)	/* returns the old value */
{
	__asm__ volatile("lock cmpxchgl %2, %1" : "+a"(old), "+m"(*p) : "r"(new_) : "memory");
	return old;
}
/* Reusable barrier for `n` CPUs (any ring): all callers leave together. */
typedef struct { volatile u32 count, generation; } smp_barrier_t;
#define SMP_BARRIER_INIT { 0, 0 }
void smp_barrier_wait(smp_barrier_t *b, unsigned n);

/* The console lock printf/puts/putchar take (per call; recursive per CPU,
 * so an interrupt handler may print).  Hold it across several calls to keep
 * a multi-part line together.  No-ops until APs have been started. */
void console_lock(void);
void console_unlock(void);
/* ---- end of SMP / LAPIC ---- */
/* ==================================================================== */

#endif
