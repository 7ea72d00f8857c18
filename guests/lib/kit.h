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
bool ram_covers(u64 base, u64 size);	/* [base, base+size) lies in one RAM region */

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
void fw_cfg_get(u16 key, void *buf, size_t len);	/* select and read, atomically */
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
/* The device guests' main: the local APIC on (LINT0 masked, the 8259s off), then fn(0)
 * at CPL 3 with interrupts on, then PASS.  Failures inside fn end the guest themselves. */
NORETURN void run_ring3_device_guest(ring3_fn_t fn);

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

/* ==================================================================== */
/* ---- I/O APIC, 8259 PIC, PIT, RTC (lib/ioapic.c, lib/pic.c, lib/pit.c, lib/rtc.c) ---- */
/*
 * ISA IRQ n reaches 8259 input n and I/O APIC pin n, except IRQ 0 (the
 * PIT), which reaches I/O APIC pin 2 (the MADT's interrupt source
 * override).  Everything here works at CPL 0; the I/O APIC is MMIO (user-
 * accessible) and the ports are open at CPL 3, so it works there too.
 */
#define ISA_IRQ_PIT		0
#define ISA_IRQ_COM1		4
#define ISA_IRQ_RTC		8
#define IOAPIC_PIN_PIT		2	/* ISA IRQ 0 -> GSI 2 */

/* I/O APIC: registers at IOAPIC_BASE (IOREGSEL at +0, IOWIN at +0x10). */
#define IOAPIC_BASE		0xfec00000UL
#define IOAPIC_REG_ID		0x00	/* ID in bits 27:24 */
#define IOAPIC_REG_VER		0x01	/* version 7:0, max redirection entry 23:16 */
#define IOAPIC_REG_REDTBL(pin)	(0x10 + 2 * (pin))	/* low dword; high dword at +1 */
/* Redirection entry, low dword (the destination is bits 63:56). */
#define IOAPIC_DM_FIXED		(0u << 8)
#define IOAPIC_DM_LOWEST	(1u << 8)
#define IOAPIC_DM_NMI		(4u << 8)
#define IOAPIC_DM_EXTINT	(7u << 8)
#define IOAPIC_LOGICAL		(1u << 11)	/* destination = logical (flat: CPU bit mask) */
#define IOAPIC_DELIVERY_STATUS	(1u << 12)	/* read-only */
#define IOAPIC_ACTIVE_LOW	(1u << 13)
#define IOAPIC_REMOTE_IRR	(1u << 14)	/* read-only: level interrupt accepted, no EOI yet */
#define IOAPIC_LEVEL		(1u << 15)
#define IOAPIC_MASKED		(1u << 16)
#define IOAPIC_WRITABLE		0x0001afffu	/* vector, mode, dest mode, polarity, trigger, mask */
/* Register access; each call is atomic against other CPUs (a lock) and, at
 * CPL 0, against this CPU's interrupt handlers (IF off inside). */
u32 ioapic_read(u32 reg);
void ioapic_write(u32 reg, u32 v);
u32 ioapic_id(void);				/* ID register, bits 27:24 */
u32 ioapic_version(void);			/* 0x11 (KVM), 0x20 (ICH, ferrovm split) */
unsigned ioapic_pins(void);			/* max redirection entry + 1 (24) */
u64 ioapic_get_entry(unsigned pin);
/* Writes the whole entry: masks the pin, writes the high then the low
 * dword (the low one may unmask). */
void ioapic_set_entry(unsigned pin, u64 entry);
/* Fixed delivery of `vector` to `dest` (APIC ID, or the logical set with
 * IOAPIC_LOGICAL); `flags` adds IOAPIC_LEVEL, IOAPIC_ACTIVE_LOW,
 * IOAPIC_DM_*, IOAPIC_MASKED.  Unmasked unless IOAPIC_MASKED is given. */
void ioapic_route(unsigned pin, u8 vector, u8 dest, u32 flags);
void ioapic_mask(unsigned pin);
void ioapic_unmask(unsigned pin);
void ioapic_mask_all(void);			/* every entry = masked, vector 0 (reset state) */
bool ioapic_remote_irr(unsigned pin);

/* 8259A pair (master 0x20/0x21, slave 0xa0/0xa1 on master input 2) and the
 * edge/level control registers (0x4d0/0x4d1). */
#define PIC_MASTER_CMD		0x20
#define PIC_MASTER_DATA		0x21
#define PIC_SLAVE_CMD		0xa0
#define PIC_SLAVE_DATA		0xa1
#define PIC_CASCADE_IRQ		2
#define ELCR_PORT		0x4d0
/* ICW1-ICW4: edge triggered, cascaded (slave on IR2), vector bases (multiples
 * of 8), 8086 mode, normal EOI; leaves both IMRs 0xff (all masked) and OCW3
 * reading IRR. */
void pic_init(u8 master_base, u8 slave_base);
void pic_set_imr(u16 mask);			/* bits 7:0 master, 15:8 slave; 1 = masked */
u16 pic_imr(void);
void pic_unmask_irq(unsigned irq);		/* 8-15 also unmask the cascade (IRQ 2) */
void pic_mask_irq(unsigned irq);
void pic_disable(void);				/* IMR 0xffff (works uninitialised too) */
/* Specific EOI (OCW2 0x60 | ir) for `irq`: for 8-15 to the slave (irq - 8)
 * and then to the master (IR2). */
void pic_eoi(unsigned irq);
void pic_eoi_nonspecific(unsigned irq);	/* OCW2 0x20, slave too for 8-15 */
/* OCW2 "set priority" (0xc0 | ir) to the chip holding `irq`: that input gets
 * the lowest priority, the next one the highest (the reset order is IR0
 * highest, IR7 lowest). */
void pic_set_lowest_priority(unsigned irq);
u16 pic_irr(void);				/* OCW3 reads, master | slave << 8 */
u16 pic_isr(void);
u16 elcr_read(void);				/* 1 = level triggered; IRQ 0-7 | 8-15 << 8 */
void elcr_write(u16 v);

/* 8254 PIT channel 0 (ports 0x40, 0x43), binary, lobyte/hibyte.  Input clock
 * 1.193182 MHz; divisor 0 = 65536.  VMMs clamp fast periodic rates (KVM's
 * in-kernel PIT: 200 us by default; ferrovm's user-space PIT: 100 us). */
#define PIT_INPUT_HZ		1193182u
void pit_periodic(u16 divisor);			/* mode 2, rate generator */
void pit_square_wave(u16 divisor);		/* mode 3 */
void pit_oneshot(u16 count);			/* mode 0: one IRQ 0 edge after `count` ticks */
/* Mode 0 with count 1: the periodic timer stops after one last IRQ 0 edge
 * ~1 us later (mask the line first if it must not be seen). */
void pit_stop(void);
u16 pit_read_count(void);			/* counter-latch command, channel 0 */
u64 pit_divisor_hz_milli(u16 divisor);		/* programmed rate in mHz */

/* MC146818 RTC: index port 0x70 (NMI-mask bit kept 0), data port 0x71; IRQ 8
 * follows IRQF (register C bit 7) as a level: high while an enabled flag is
 * set, low once register C has been read. */
#define RTC_REG_A		0x0a	/* rate select 3:0, divider 6:4 (0x20 = 32.768 kHz) */
#define RTC_REG_B		0x0b
#define RTC_REG_C		0x0c	/* flags; reading clears them */
#define RTC_REG_D		0x0d
#define RTC_B_PIE		0x40	/* periodic interrupt enable */
#define RTC_B_AIE		0x20
#define RTC_B_UIE		0x10
#define RTC_C_IRQF		0x80
#define RTC_C_PF		0x40	/* periodic flag */
#define RTC_C_AF		0x20
#define RTC_C_UF		0x10
#define RTC_D_VRT		0x80
/* Rate select rs = 3..15 gives 32768 >> (rs - 1) Hz: 3 = 8192 Hz, 6 = 1024 Hz,
 * 15 = 2 Hz. */
#define RTC_RATE_HZ(rs)		(32768u >> ((rs) - 1))
/* Register access; each call is atomic against other CPUs and, at CPL 0,
 * against this CPU's handlers. */
u8 rtc_read(u8 reg);
void rtc_write(u8 reg, u8 v);
u8 rtc_ack(void);				/* reads register C: clears flags, drops IRQ 8 */
void rtc_periodic(unsigned rs);			/* register A = 0x20 | rs, PIE on */
void rtc_periodic_stop(void);			/* PIE off, then reads register C */
bool rtc_present(void);				/* register D reads 0x80 */
/* ---- end of I/O APIC, 8259 PIC, PIT, RTC ---- */
/* ==================================================================== */

/* ==================================================================== */
/* ---- DMA memory, ACPI, PCI, MSI-X, virtio (lib/dma.c, lib/pci.c, lib/msix.c, lib/virtio.c) ---- */
/*
 * Everything here works at CPL 0 and CPL 3 (configuration ports are open in
 * the TSS bitmap, MMIO and RAM are user-accessible): drivers run in ring 3,
 * where code is native on PVM hosts.  Single-CPU set-up unless said: the
 * CF8/CFC pair and the allocator take a lock, a virtqueue belongs to one CPU.
 */

/* Zeroed, identity-mapped RAM for rings and buffers (phys == virt), from a
 * bump pool that starts 2 MiB above the image (past what boot loaders put
 * after it; "dma_base=" overrides) and never frees.  `align` is a power of
 * two; fails the guest if the pool leaves RAM. */
void *dma_alloc(size_t size, size_t align);
u64 dma_pool_used(void);			/* bytes handed out so far */

/* A time limit that counts only time the guest saw pass: the TSC advance
 * between two polls is capped at 10 ms, so a VM paused for a snapshot or a
 * migration does not expire it.  Poll often (every few microseconds). */
struct timeout {
	u64 last, left;				/* TSC ticks */
};
void timeout_start(struct timeout *t, u64 us);
bool timeout_expired(struct timeout *t);	/* true once `us` of guest time passed */

/* ---- ACPI ---- */
struct acpi_sdt_header {
	char signature[4];
	u32 length;
	u8 revision, checksum;
	char oem_id[6], oem_table_id[8];
	u32 oem_revision, creator_id, creator_revision;
} __attribute__((packed));
/* RSDP: the boot info's (PVH rsdp_paddr) if any, else a scan of the EBDA's
 * first KiB and 0xE0000-0xFFFFF; checksums verified.  0 if none. */
u64 acpi_rsdp(void);
/* A table by signature through the XSDT (revision >= 2) or the RSDT, its
 * checksum verified; NULL if absent. */
const struct acpi_sdt_header *acpi_find_table(const char sig[4]);

/* ---- PCI, bus 0 ---- */
#define PCI_MECH_CF8		1	/* configuration mechanism #1, ports 0xcf8/0xcfc */
#define PCI_MECH_ECAM		2	/* memory-mapped (MMCONFIG), base from the MCFG */
#define PCI_CFG_ADDR_PORT	0xcf8
#define PCI_CFG_DATA_PORT	0xcfc
#define PCI_VENDOR_ID		0x00
#define PCI_DEVICE_ID		0x02
#define PCI_COMMAND		0x04
#define PCI_STATUS		0x06
#define PCI_REVISION		0x08
#define PCI_HEADER_TYPE		0x0e
#define PCI_BAR0		0x10
#define PCI_SUBSYS_VENDOR	0x2c
#define PCI_SUBSYS_ID		0x2e
#define PCI_CAP_PTR		0x34
#define PCI_INT_LINE		0x3c
#define PCI_INT_PIN		0x3d
#define PCI_CMD_IO		0x0001
#define PCI_CMD_MEM		0x0002
#define PCI_CMD_MASTER		0x0004
#define PCI_CMD_INTX_DISABLE	0x0400
#define PCI_STATUS_CAP_LIST	0x0010
#define PCI_CAP_ID_MSI		0x05
#define PCI_CAP_ID_VNDR		0x09
#define PCI_CAP_ID_MSIX		0x11
#define PCI_BDF(bus, dev, fn)	((u16)((bus) << 8 | (dev) << 3 | (fn)))

enum pci_bar_kind { PCI_BAR_NONE, PCI_BAR_IO, PCI_BAR_MEM32, PCI_BAR_MEM64 };
struct pci_bar {
	u64 addr;		/* as programmed; 0 = unassigned */
	u64 size;		/* from sizing; 0 = not implemented */
	u8 kind;		/* enum pci_bar_kind; the upper half of a 64-bit BAR is NONE */
	bool prefetchable;
};
struct pci_dev {
	u16 bdf;
	u16 vendor, device, subsys_vendor, subsys_id;
	u8 class_code, subclass, prog_if, revision, header_type;
	u8 int_pin, int_line;
	struct pci_bar bar[6];
};
#define PCI_MAX_DEVS		64

/* Finds the ECAM base of segment 0 / bus 0 in the MCFG; false if none. */
bool pci_ecam_lookup(u64 *base, u8 *bus_start, u8 *bus_end);
/* Chooses the access mechanism for the pci_cfg_* calls: PCI_MECH_ECAM if the
 * MCFG declares one (or the command line gives "ecam=ADDR", for platforms
 * without an MCFG) and `prefer` allows it, else CF8.  Returns the one chosen.
 * pci_cfg_* without pci_init() use CF8. */
int pci_init(int prefer);
int pci_mech(void);
u64 pci_ecam_base(void);		/* 0 without an MCFG */
/* Configuration space through the chosen mechanism (CF8: offsets < 256). */
u32 pci_cfg_read32(u16 bdf, u16 off);
u16 pci_cfg_read16(u16 bdf, u16 off);
u8 pci_cfg_read8(u16 bdf, u16 off);
void pci_cfg_write32(u16 bdf, u16 off, u32 v);
void pci_cfg_write16(u16 bdf, u16 off, u16 v);
void pci_cfg_write8(u16 bdf, u16 off, u8 v);
/* One mechanism explicitly (to compare them). */
u32 pci_cf8_read32(u16 bdf, u16 off);
void pci_cf8_write32(u16 bdf, u16 off, u32 v);
u32 pci_ecam_read32(u16 bdf, u16 off);	/* needs an MCFG; ~0 otherwise */
void pci_ecam_write32(u16 bdf, u16 off, u32 v);
/* Reads the identity, class, header type, BAR, subsystem and capability
 * pointer registers of every function of the last pci_scan() through both
 * mechanisms; prints and counts the differences.  -1 if one of them is
 * missing (no ECAM, or nothing answers at 0xcf8). *functions = compared. */
int pci_compare_mechanisms(int *functions);
/* Scans bus 0 (all 32 devices; functions 1-7 of multi-function ones), decodes
 * every function's BARs (sizing with decode off, restored after) into a table;
 * returns the count.  Rescans on each call. */
int pci_scan(void);
int pci_count(void);
struct pci_dev *pci_get(int i);
struct pci_dev *pci_find(u16 vendor, u16 device, unsigned nth);	/* 0xffff: any */
void pci_decode_bars(struct pci_dev *d);
/* Sets `bits` (PCI_CMD_*) in the command register. */
void pci_enable(struct pci_dev *d, u16 bits);
/* Offset of the first capability `id` after `from` (0: the list head), 0 if
 * none.  The walk is bounded (48 entries, aligned pointers >= 0x40). */
u8 pci_find_cap(u16 bdf, u8 id, u8 from);
/* Optional: gives every unassigned (0) BAR of `d` an address, naturally
 * aligned, above the highest BAR already in [mem_base, mem_end) (memory) or
 * [io_base, io_end) (I/O), and enables decoding.  For VMMs without firmware
 * that leave BARs to the guest.  Returns how many BARs it assigned, -1 if
 * one did not fit. */
int pci_assign_bars(struct pci_dev *d, u64 mem_base, u64 mem_end, u32 io_base, u32 io_end);
/* Where a memory BAR's offset is in the identity map (NULL: I/O, not
 * assigned, past the BAR, or above 4 GiB). */
volatile void *pci_bar_ptr(const struct pci_dev *d, unsigned bar, u64 offset, u64 len);
const char *pci_bar_kind_name(u8 kind);	/* "io" "mem32" "mem64" "-" */

/* ---- MSI-X ---- */
#define MSIX_CTRL_ENABLE	0x8000
#define MSIX_CTRL_FUNC_MASK	0x4000
#define MSIX_ENTRY_MASKED	1u
struct msix {
	struct pci_dev *dev;
	u8 cap;				/* capability offset */
	u16 entries;			/* table size */
	volatile u32 *table;		/* 4 dwords per entry */
	volatile u64 *pba;
};
/* Finds the capability and maps the table and PBA through their BARs;
 * false if the device has none or a BAR is unusable.  Touches nothing. */
bool msix_probe(struct msix *m, struct pci_dev *d);
/* Entry i: address 0xfee00000 | apic_id << 12, data = vector (fixed, edge),
 * mask bit as given.  Writes address and data with the entry masked. */
void msix_set(struct msix *m, unsigned i, u32 apic_id, u8 vector, bool masked);
void msix_mask(struct msix *m, unsigned i, bool masked);	/* vector control bit 0 */
bool msix_pending(struct msix *m, unsigned i);			/* PBA bit */
void msix_enable(struct msix *m, bool on);			/* message control bit 15 */
void msix_function_mask(struct msix *m, bool masked);		/* message control bit 14 */
u16 msix_control(struct msix *m);

/* ---- virtio 1.x, modern PCI transport, split virtqueues ---- */
#define VIRTIO_PCI_VENDOR	0x1af4
#define VIRTIO_ID_NET		1
#define VIRTIO_ID_BLOCK		2
#define VIRTIO_ID_CONSOLE	3
#define VIRTIO_ID_RNG		4
/* device_status */
#define VIRTIO_S_ACKNOWLEDGE	0x01
#define VIRTIO_S_DRIVER		0x02
#define VIRTIO_S_DRIVER_OK	0x04
#define VIRTIO_S_FEATURES_OK	0x08
#define VIRTIO_S_NEEDS_RESET	0x40
#define VIRTIO_S_FAILED		0x80
/* feature bits (bit numbers) */
#define VIRTIO_F_INDIRECT_DESC	28
#define VIRTIO_F_EVENT_IDX	29
#define VIRTIO_F_VERSION_1	32
#define VIRTIO_F_ACCESS_PLATFORM 33
#define VIRTIO_F_RING_PACKED	34
#define VIRTIO_BIT(b)		(1ULL << (b))
/* vendor capability cfg_type */
#define VIRTIO_PCI_CAP_COMMON	1
#define VIRTIO_PCI_CAP_NOTIFY	2
#define VIRTIO_PCI_CAP_ISR	3
#define VIRTIO_PCI_CAP_DEVICE	4
#define VIRTIO_PCI_CAP_PCI_CFG	5
/* common configuration offsets */
#define VIRTIO_COMMON_DFSELECT	0x00
#define VIRTIO_COMMON_DF	0x04
#define VIRTIO_COMMON_GFSELECT	0x08
#define VIRTIO_COMMON_GF	0x0c
#define VIRTIO_COMMON_MSIX	0x10
#define VIRTIO_COMMON_NUMQ	0x12
#define VIRTIO_COMMON_STATUS	0x14
#define VIRTIO_COMMON_CFGGEN	0x15
#define VIRTIO_COMMON_Q_SELECT	0x16
#define VIRTIO_COMMON_Q_SIZE	0x18
#define VIRTIO_COMMON_Q_MSIX	0x1a
#define VIRTIO_COMMON_Q_ENABLE	0x1c
#define VIRTIO_COMMON_Q_NOFF	0x1e
#define VIRTIO_COMMON_Q_DESC	0x20
#define VIRTIO_COMMON_Q_AVAIL	0x28
#define VIRTIO_COMMON_Q_USED	0x30
#define VIRTIO_MSI_NO_VECTOR	0xffff
/* descriptors */
#define VIRTQ_DESC_F_NEXT	1
#define VIRTQ_DESC_F_WRITE	2
#define VIRTQ_DESC_F_INDIRECT	4
#define VIRTQ_AVAIL_F_NO_INTERRUPT 1
#define VIRTQ_USED_F_NO_NOTIFY	1

struct virtq_desc { u64 addr; u32 len; u16 flags, next; };
struct virtq_avail { u16 flags, idx; u16 ring[]; };	/* then used_event */
struct virtq_used_elem { u32 id, len; };
struct virtq_used { u16 flags, idx; struct virtq_used_elem ring[]; };	/* then avail_event */

/* A buffer of a chain: device-readable ones first, then device-writable. */
struct vbuf { void *addr; u32 len; };

#define VIRTIO_MAX_QUEUES	8
#define VIRTQ_INDIRECT_MAX	32	/* entries per indirect table */
struct virtio_dev;
struct virtq {
	struct virtio_dev *vdev;
	u16 index, size;
	volatile struct virtq_desc *desc;
	volatile struct virtq_avail *avail;
	volatile struct virtq_used *used;
	volatile u16 *notify;		/* this queue's doorbell */
	u16 msix_entry;			/* VIRTIO_MSI_NO_VECTOR: polled */
	u8 vector;			/* IDT vector bound with virtq_bind_irq() */
	bool event_idx, indirect;	/* negotiated */
	bool use_indirect;		/* virtq_use_indirect(); on if negotiated */
	u16 free_head, num_free;
	u16 avail_idx;			/* next avail->idx to publish */
	u16 kicked_idx;			/* avail_idx at the last doorbell */
	u16 last_used;			/* used->idx consumed so far */
	struct virtq_desc *itables;	/* size x VIRTQ_INDIRECT_MAX */
	void **tokens;			/* per head */
	u16 *chain_len;			/* per head: descriptors in the ring */
	volatile u32 irqs;		/* counted by the MSI-X handler */
	u32 irqs_seen;
	u64 kicks, completions, waits_irq, missed_irqs;
};
struct virtio_dev {
	struct pci_dev *pci;
	u32 type;			/* VIRTIO_ID_* */
	volatile u8 *common, *isr, *device_cfg;
	u32 device_cfg_len;
	volatile u8 *notify_base;
	u32 notify_mult, notify_len;
	u64 device_features, features;	/* offered, negotiated */
	u16 num_queues;			/* the device's */
	struct msix msix;
	bool has_msix, msix_on;
	struct virtq *vq[VIRTIO_MAX_QUEUES];
	volatile u32 config_irqs;
};

/* The device type of a virtio PCI function (modern 0x1040 + type or
 * transitional 0x1000-0x103f by subsystem ID), 0 if not virtio. */
u32 virtio_pci_type(const struct pci_dev *d);
/* The nth virtio PCI function of `type` after pci_scan(); NULL if none. */
struct pci_dev *virtio_find(u32 type, unsigned nth);
/* The usual start of a test guest (any ring): pci_init() (ECAM unless the
 * command line says "pci=cf8"), pci_scan(), with "pci_assign=1" every
 * unassigned BAR placed by pci_assign_bars() in the ferrovm windows
 * (memory [0xc0000000, 0xe0000000), I/O [0xc000, 0x10000)), with "wait=hlt"
 * virtio_wait_halt(true), then the nth function of `type` probed; prints
 * one line about it.  false and a
 * message if there is none or the probe fails. */
bool virtio_open(struct virtio_dev *vd, u32 type, unsigned nth);
/* pci_assign_bars() for every function of the last pci_scan(), in the ferrovm
 * windows above; prints what it assigned. */
void pci_assign_unassigned(void);
/* Finds the vendor capabilities, maps them through their BARs (BARs must
 * be assigned; see pci_assign_bars), enables memory decode and bus
 * mastering, probes MSI-X.  Does not touch the device status.  false and a
 * message if a required capability is missing or out of its BAR. */
bool virtio_probe(struct virtio_dev *vd, struct pci_dev *pd);
/* Writes 0 to device_status and waits until it reads back 0 (~1 s at most);
 * forgets the queues (their memory is not reused). */
bool virtio_reset(struct virtio_dev *vd);
/* Reset, ACKNOWLEDGE, DRIVER, features = offered & (wanted | VERSION_1),
 * FEATURES_OK, checks FEATURES_OK stayed set.  false (FAILED set) if the
 * device refuses or lacks VERSION_1. */
bool virtio_init(struct virtio_dev *vd, u64 wanted);
/* Sets up queue `index` (size 0: the device's maximum, else at most that),
 * its rings from dma_alloc, MSI-X entry `msix_entry` (VIRTIO_MSI_NO_VECTOR:
 * none; the device must accept it) and enables it.  NULL and a message on
 * failure.  The queue uses INDIRECT_DESC / EVENT_IDX if negotiated. */
struct virtq *virtio_queue_setup(struct virtio_dev *vd, u16 index, u16 size, u16 msix_entry);
void virtio_driver_ok(struct virtio_dev *vd);
u8 virtio_status(struct virtio_dev *vd);
void virtio_set_status(struct virtio_dev *vd, u8 status);
static inline bool virtio_has(const struct virtio_dev *vd, unsigned bit)
{
	return (vd->features >> bit) & 1;
}
u8 virtio_isr(struct virtio_dev *vd);		/* reads (and clears) the ISR status */
/* MSI-X: enable the function with every entry masked, the configuration
 * change vector to `config_entry`; then route entries with
 * virtio_msix_route().  false if the device has no MSI-X or refuses the
 * config vector. */
bool virtio_msix_enable(struct virtio_dev *vd, u16 config_entry);
void virtio_msix_route(struct virtio_dev *vd, u16 entry, u32 apic_id, u8 vector);
/* Installs a handler for IDT `vector` that counts q->irqs and sends EOI.
 * Call at CPL 0 or 3 before interrupts can arrive. */
void virtq_bind_irq(struct virtq *q, u8 vector);
/* The same for the configuration-change interrupt (counts vd->config_irqs). */
void virtio_bind_config_irq(struct virtio_dev *vd, u8 vector);
/* Device configuration space (little endian); 64-bit reads retry until
 * config_generation is stable. */
u8 virtio_cfg_read8(struct virtio_dev *vd, u32 off);
u16 virtio_cfg_read16(struct virtio_dev *vd, u32 off);
u32 virtio_cfg_read32(struct virtio_dev *vd, u32 off);
u64 virtio_cfg_read64(struct virtio_dev *vd, u32 off);
void virtio_cfg_write8(struct virtio_dev *vd, u32 off, u8 v);

/* Queues a chain of n_out device-readable then n_in device-writable buffers;
 * `token` comes back from virtq_get().  Uses an indirect table when the
 * queue has them and the chain has more than one buffer (up to
 * VIRTQ_INDIRECT_MAX), else ring descriptors.  Returns the head, or -1 if
 * there is no room.  Does not notify. */
int virtq_add(struct virtq *q, const struct vbuf *bufs, unsigned n_out, unsigned n_in, void *token);
/* Forces ring descriptors (false) or allows indirect tables (true). */
void virtq_use_indirect(struct virtq *q, bool on);
/* Publishes what was added: rings the doorbell unless the device asked not
 * to be notified (VIRTQ_USED_F_NO_NOTIFY, or avail_event with EVENT_IDX).
 * Returns whether it notified. */
bool virtq_kick(struct virtq *q);
void virtq_notify(struct virtq *q);		/* the doorbell, unconditionally */
/* Takes the next used element: its token (NULL if none) and written length;
 * returns the chain's descriptors to the free list. */
void *virtq_get(struct virtq *q, u32 *len);
bool virtq_has_used(struct virtq *q);
/* Asks for an interrupt at the next used element (clears NO_INTERRUPT or sets
 * used_event), or for none (polling). */
void virtq_irq_enable(struct virtq *q, bool on);
/* Waits until a used element is there.  A queue with an MSI-X entry and a
 * bound vector waits for the interrupt (arming it first); a completion seen
 * without its interrupt after 1 s counts in q->missed_irqs.  Returns 1 when
 * something is used, 0 on timeout, -1 if the device set NEEDS_RESET. */
int virtq_wait(struct virtq *q, u64 timeout_us);
/* Interrupt-driven waits of this CPU's queues spin in ring 3 (PAUSE; the
 * default) or, with `on`, halt in ring 0 ("sti; hlt", bounded by a ~2 ms
 * LAPIC one-shot on vector 0xef), leaving the host CPU to the VMM's I/O
 * threads: for more vCPUs than free host CPUs.  Global; call before waits. */
void virtio_wait_halt(bool on);
/* virtq_add, virtq_kick and virtq_wait for one chain until it is used:
 * 1 (written length in *len), 0 on timeout, -1 if the device set
 * NEEDS_RESET.  Fails the guest if another chain completes first. */
int virtq_sync(struct virtq *q, const struct vbuf *bufs, unsigned n_out, unsigned n_in, u32 *len,
	       u64 timeout_us);
/* Raw ring access for tests that build chains by hand: the descriptor
 * table, and publishing a head without the free list (virtq_add's
 * bookkeeping is bypassed: reset the device before using virtq_add again). */
void virtq_publish_raw(struct virtq *q, u16 head);
bool virtq_get_raw(struct virtq *q, struct virtq_used_elem *e);

/* ---- virtio-blk (lib/blk.c) ---- */
#define VIRTIO_BLK_F_SIZE_MAX	1
#define VIRTIO_BLK_F_SEG_MAX	2
#define VIRTIO_BLK_F_GEOMETRY	4
#define VIRTIO_BLK_F_RO		5
#define VIRTIO_BLK_F_BLK_SIZE	6
#define VIRTIO_BLK_F_FLUSH	9
#define VIRTIO_BLK_F_TOPOLOGY	10
#define VIRTIO_BLK_F_CONFIG_WCE	11
#define VIRTIO_BLK_F_MQ		12
#define VIRTIO_BLK_F_DISCARD	13
#define VIRTIO_BLK_F_WRITE_ZEROES 14
#define VIRTIO_BLK_T_IN		0
#define VIRTIO_BLK_T_OUT	1
#define VIRTIO_BLK_T_FLUSH	4
#define VIRTIO_BLK_T_GET_ID	8
#define VIRTIO_BLK_T_DISCARD	11
#define VIRTIO_BLK_T_WRITE_ZEROES 13
#define VIRTIO_BLK_S_OK		0
#define VIRTIO_BLK_S_IOERR	1
#define VIRTIO_BLK_S_UNSUPP	2
#define VIRTIO_BLK_ID_BYTES	20
#define VIRTIO_BLK_WZ_UNMAP	1	/* write-zeroes segment flag */
/* configuration space offsets */
#define VIRTIO_BLK_CFG_CAPACITY		0
#define VIRTIO_BLK_CFG_SIZE_MAX		8
#define VIRTIO_BLK_CFG_SEG_MAX		12
#define VIRTIO_BLK_CFG_BLK_SIZE		20
#define VIRTIO_BLK_CFG_NUM_QUEUES	34
#define VIRTIO_BLK_CFG_MAX_DISCARD_SECTORS 36
#define VIRTIO_BLK_CFG_MAX_DISCARD_SEG	40
#define VIRTIO_BLK_CFG_DISCARD_ALIGN	44
#define VIRTIO_BLK_CFG_MAX_WZ_SECTORS	48
#define VIRTIO_BLK_CFG_MAX_WZ_SEG	52
#define VIRTIO_BLK_CFG_WZ_MAY_UNMAP	56
#define BLK_SECTOR		512

struct virtio_blk_hdr { u32 type, reserved; u64 sector; };
struct virtio_blk_range { u64 sector; u32 num_sectors, flags; };	/* DISCARD, WRITE_ZEROES */
/* One request: lives in DMA memory (blk_req_alloc) while in flight. */
struct blk_req {
	struct virtio_blk_hdr hdr;
	struct virtio_blk_range range;
	volatile u8 status;		/* 0xff until the device writes it */
	bool done;
	u32 used_len;			/* from the used element */
	u64 tag;			/* the caller's */
};
struct blk_req *blk_req_alloc(unsigned n);	/* n zeroed requests */
/* Queues one request (does not kick): header (device-readable), data split
 * into `segs` descriptors (>= 1; device-writable for IN and GET_ID,
 * readable otherwise; none if len is 0, and for DISCARD / WRITE_ZEROES the
 * data is r->range, filled here from sector and len), status byte.
 * Returns the head or -1 if the queue is full. */
int blk_submit(struct virtq *q, struct blk_req *r, u32 type, u64 sector, void *data, u32 len,
	       unsigned segs);
/* Collects finished requests from the used ring (marks them done); returns
 * how many. */
unsigned blk_reap(struct virtq *q);
/* Submits, kicks, waits up to `timeout_us`: the status byte, or -1 on
 * timeout, -2 if the device set NEEDS_RESET. */
int blk_sync(struct virtq *q, u32 type, u64 sector, void *data, u32 len, unsigned segs,
	     u64 timeout_us);
const char *blk_status_name(int status);	/* "OK" "IOERR" "UNSUPP" "timeout" ... */
/* A started virtio-blk device. */
struct blk_dev {
	struct virtio_dev vd;
	struct virtq *q[VIRTIO_MAX_QUEUES];
	unsigned nq;
	u64 capacity;			/* sectors */
	bool irq;			/* queues complete by MSI-X */
};
/* virtio_init(wanted), then with MSI-X (if `irq` and the device has it)
 * entry 0 = configuration changes -> `vector` on this CPU and queue i ->
 * entry i + 1 -> `vector` + 1 + i on APIC ID apic_ids[i] (NULL: this CPU);
 * `nq` queues (fewer if the device has fewer) of at most `qsize` (0: the
 * device's maximum); DRIVER_OK; reads the capacity.  Prints nothing on
 * success; false with a message on failure.  Call again after a reset. */
bool blk_start(struct blk_dev *b, u64 wanted, unsigned nq, u16 qsize, bool irq,
	       const u32 *apic_ids, u8 vector);
/* ---- virtio-vsock (lib/vsock.c): stream sockets, ring-3 driver ---- */
#define VIRTIO_ID_VSOCK		19
#define VSOCK_HOST_CID		2
#define VSOCK_TYPE_STREAM	1
#define VSOCK_OP_REQUEST	1
#define VSOCK_OP_RESPONSE	2
#define VSOCK_OP_RST		3
#define VSOCK_OP_SHUTDOWN	4
#define VSOCK_OP_RW		5
#define VSOCK_OP_CREDIT_UPDATE	6
#define VSOCK_OP_CREDIT_REQUEST	7
#define VSOCK_SHUTDOWN_BOTH	3
#define VSOCK_EVENT_TRANSPORT_RESET 0
#define VSOCK_BUF_ALLOC		(64u << 10)	/* the guest's receive window per connection */
#define VSOCK_PKT_PAYLOAD	4096		/* payload per packet, both ways */
#define VSOCK_MAX_CONNS		4
#define VSOCK_RX_BUFS		64
#define VSOCK_TX_SLOTS		64

struct vsock_hdr {
	u64 src_cid, dst_cid;
	u32 src_port, dst_port, len;
	u16 type, op;
	u32 flags, buf_alloc, fwd_cnt;
} __attribute__((packed));

enum vsock_state { VSOCK_FREE, VSOCK_CONNECTING, VSOCK_ESTABLISHED, VSOCK_CLOSED };

struct vsock_conn {
	enum vsock_state state;
	u32 local_port, peer_port;
	u32 peer_buf_alloc, peer_fwd_cnt, tx_cnt;	/* our sending credit */
	u32 fwd_cnt, reported_fwd_cnt;			/* what we consumed */
	u8 *rxbuf;					/* VSOCK_BUF_ALLOC ring */
	u32 rx_head, rx_len;
	bool peer_shutdown, was_reset, pending_accept;
};

struct vsock {
	struct virtio_dev vd;
	struct virtq *rx, *tx, *ev;
	u64 cid;
	u8 *tx_slots;
	u16 tx_free[VSOCK_TX_SLOTS], tx_nfree;
	struct vsock_conn conns[VSOCK_MAX_CONNS];
	u32 listen_port;			/* 0: not listening */
	u32 next_port;
	u32 transport_resets;			/* TRANSPORT_RESET events seen */
	u32 rsts_unmatched;			/* RSTs for no connection of ours */
	u64 rx_packets, tx_packets;
};

/* Finds and starts the first virtio-vsock function (rx buffers and event
 * buffers posted).  irq: MSI-X completion for the receive queue (entry 1,
 * vector `vector`).  false and a message on failure. */
bool vsock_open(struct vsock *vs, bool irq, u8 vector);
/* Handles everything the device returned; refills buffers.  Returns whether
 * anything happened. */
bool vsock_poll(struct vsock *vs);
/* vsock_poll, and if nothing happened waits (up to `us`) for the receive
 * queue. */
void vsock_wait(struct vsock *vs, u64 us);
/* Connects to host port `port`; NULL if refused (RST) or timed out. */
struct vsock_conn *vsock_connect(struct vsock *vs, u32 port, u64 timeout_us);
/* Accepts the next REQUEST for `port` (answers others with RST). */
struct vsock_conn *vsock_accept(struct vsock *vs, u32 port, u64 timeout_us);
/* Sends what the peer's credit allows of buf (non-blocking); bytes sent. */
u32 vsock_send(struct vsock *vs, struct vsock_conn *c, const void *buf, u32 len);
/* Takes received bytes (non-blocking); bytes taken.  Tells the device about
 * consumed bytes once a quarter of the window is free again. */
u32 vsock_recv(struct vsock *vs, struct vsock_conn *c, void *buf, u32 len);
/* SHUTDOWN of both directions, then waits (bounded) for the RST; frees c. */
void vsock_close(struct vsock *vs, struct vsock_conn *c, u64 timeout_us);
/* Queues one raw packet (header as given, payload of hdr->len bytes unless
 * `payload_len` differs): for hostile tests.  false if the ring is full. */
bool vsock_send_raw(struct vsock *vs, const struct vsock_hdr *h, const void *payload,
		    u32 payload_len);
/* Queues a chain built by hand (hostile tests); a transmit slot is its
 * token.  false if the ring is full. */
bool vsock_send_chain(struct vsock *vs, const struct vbuf *bufs, unsigned n_out, unsigned n_in);
/* Sends a control packet for c (credit fields filled in). */
bool vsock_send_ctl(struct vsock *vs, struct vsock_conn *c, u16 op, u32 flags);

/* ---- end of DMA, ACPI, PCI, MSI-X, virtio ---- */
/* ==================================================================== */

#endif
