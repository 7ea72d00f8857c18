/*
 * Constants shared by the guest kit's C and assembly sources.
 * Only #defines here: this file is included from .S files.
 */
#ifndef KIT_DEFS_H
#define KIT_DEFS_H

/* Where the image is linked and loaded (physical = virtual, identity map). */
#define KIT_LOAD_ADDR		0x100000

/* GDT selectors (layout also suits SYSCALL/SYSRET should a test want it). */
#define KCODE64			0x08
#define KDATA			0x10
#define UCODE32			0x1b	/* 0x18 | RPL 3, unused placeholder */
#define UDATA			0x23	/* 0x20 | RPL 3 */
#define UCODE64			0x2b	/* 0x28 | RPL 3 */
#define KCODE32			0x30	/* flat 32-bit code, for a future AP trampoline */
#define TSS_SEL			0x38	/* 16-byte 64-bit TSS descriptor */

/* Boot protocols, as recorded by the 32-bit entry code. */
#define BOOT_UNKNOWN		0
#define BOOT_PVH		1
#define BOOT_MULTIBOOT		2

#define MB_HEADER_MAGIC		0x1BADB002
#define MB_BOOT_MAGIC		0x2BADB002
#define PVH_START_MAGIC		0x336ec578
#define XEN_ELFNOTE_PHYS32_ENTRY 18

/* Ring-3 service requests: UD2 executed at CPL 3 with RAX = service number. */
#define SVC_RING3_EXIT		1	/* RDI = value returned by enter_ring3() */
#define SVC_CALL		2	/* RAX = ((u64 (*)(u64))RDI)(RSI), run at CPL 0 */
#define SVC_EXIT_VM		3	/* exit_vm(RDI) */
#define SVC_NOP			4	/* returns RAX = 0 (round-trip measurements) */

/* Debug-exit codes written to port 0xf4 (VMM status = (code << 1) | 1). */
#define DEBUG_EXIT_PORT		0xf4
#define EXIT_PASS		0
#define EXIT_FAIL		1
#define EXIT_EXCEPTION		0x7e

/* Control-register / MSR bits used by the entry code. */
#define CR0_PE			(1 << 0)
#define CR0_PG			(1 << 31)
#define CR4_PAE			(1 << 5)
#define MSR_EFER		0xc0000080
#define EFER_LME		(1 << 8)

/* Page-table entry bits. */
#define PTE_P			0x001
#define PTE_W			0x002
#define PTE_U			0x004
#define PTE_PWT			0x008
#define PTE_PCD			0x010
#define PTE_PS			0x080

#define RFLAGS_IF		0x200
#define RFLAGS_IOPL3		0x3000

/* ---- SMP / LAPIC ---- */
#define KIT_MAX_CPUS		32	/* CPUs the kit brings up at most */
#define KSTACK_SHIFT		14
#define KSTACK_SIZE		(1 << KSTACK_SHIFT)	/* kernel stack of each AP */
#define AP_USTACK_SIZE		32768	/* ring-3 stack of each AP */
#define AP_TRAMPOLINE_ADDR	0x3000	/* real-mode AP entry page (SIPI vector 0x03) */
#define TSS_SEL_CPU(i)		(TSS_SEL + 16 * (i))	/* TSS descriptor of CPU i */
#define CR0_MP			(1 << 1)
#define CR0_ET			(1 << 4)
#define CR0_NE			(1 << 5)
/* ---- end of SMP / LAPIC ---- */

#endif
