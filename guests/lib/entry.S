/*
 * Boot headers, 32-bit entry and the switch to long mode.
 *
 * The image boots through either
 *   - the Xen PVH entry (ELF note XEN_ELFNOTE_PHYS32_ENTRY): 32-bit flat
 *     protected mode, paging off, EBX = struct hvm_start_info *;
 *   - Multiboot v1: 32-bit flat protected mode, paging off,
 *     EAX = 0x2BADB002, EBX = struct multiboot_info *.
 * Both arrive at _start.  Everything the entry code needs (page tables,
 * GDT, TSS) is built statically by the assembler: ring-0 code is emulated
 * on this project's hosts (~1-2.5 us per instruction), so no set-up loops.
 *
 * Build with -DKIT_NO_PVH or -DKIT_NO_MULTIBOOT for single-protocol images.
 */
#include "defs.h"

/* ------------------------------------------------------------------ */
/* Multiboot v1 header: first section of .text, so within the first 8 KiB. */
#ifndef KIT_NO_MULTIBOOT
/*
 * Flags: bit 0 page-align modules, bit 1 memory info, bit 16 address fields.
 * The address fields are needed although this is an ELF: QEMU's multiboot
 * loader refuses ELF64 images ("Cannot load x86-64 image, give a 32bit one")
 * unless the header carries them, and every multiboot loader honours them.
 * scripts/check-elf.sh verifies that the file layout matches them.
 */
#define MB_FLAGS	0x00010003
	.section .multiboot, "a"
	.balign 4
	.globl multiboot_header
multiboot_header:
	.long	MB_HEADER_MAGIC
	.long	MB_FLAGS
	.long	-(MB_HEADER_MAGIC + MB_FLAGS)
	.long	multiboot_header	/* header_addr */
	.long	__image_start		/* load_addr */
	.long	__data_end		/* load_end_addr */
	.long	__image_end		/* bss_end_addr */
	.long	_start			/* entry_addr */
#endif

/* Xen PVH entry note. */
#ifndef KIT_NO_PVH
	.section .note.Xen, "a", @note
	.balign 4
	.long	4			/* namesz */
	.long	4			/* descsz */
	.long	XEN_ELFNOTE_PHYS32_ENTRY
	.asciz	"Xen"
	.balign 4
	.long	_start			/* 32-bit physical entry */
	.balign 4
#endif

/* ------------------------------------------------------------------ */
	.section .text.entry, "ax"
	.code32
	.globl _start
_start:
	cli
	cld
	/*
	 * PVH first: QEMU's microvm firmware (qboot) enters PVH kernels with
	 * EAX = 0x2BADB002 too.  A multiboot info block cannot carry the
	 * start_info magic (its first word is flags, bits 13-31 unused).
	 */
	cmpl	$PVH_START_MAGIC, (%ebx)
	jne	1f
	movl	$BOOT_PVH, boot_protocol_raw
	jmp	3f
1:	cmpl	$MB_BOOT_MAGIC, %eax
	jne	2f
	movl	$BOOT_MULTIBOOT, boot_protocol_raw
	jmp	3f
2:	movl	$BOOT_UNKNOWN, boot_protocol_raw
3:	movl	%ebx, boot_info_raw
	movl	$start64_bsp, %esi

/*
 * Shared by the BSP and (later) the APs: 32-bit flat protected mode,
 * paging off, ESI = 64-bit continuation address (below 4 GiB).
 * An AP trampoline only has to reach here from real mode with
 * KCODE32/KDATA loaded and its own continuation in ESI.
 */
	.globl enter_long_mode32
enter_long_mode32:
	movl	%cr4, %eax
	orl	$CR4_PAE, %eax
	movl	%eax, %cr4
	movl	$pml4, %eax
	movl	%eax, %cr3
	movl	$MSR_EFER, %ecx
	rdmsr
	orl	$EFER_LME, %eax
	wrmsr
	movl	%cr0, %eax
	orl	$(CR0_PG | CR0_PE), %eax
	movl	%eax, %cr0
	lgdt	gdt_ptr
	ljmp	$KCODE64, $long_entry

	.code64
long_entry:
	movl	$KDATA, %eax
	movl	%eax, %ds
	movl	%eax, %es
	movl	%eax, %ss
	xorl	%eax, %eax
	movl	%eax, %fs
	movl	%eax, %gs
	movl	%esi, %esi		/* upper halves are undefined after the switch */
	jmp	*%rsi

start64_bsp:
	movq	$kstack_top, %rsp
	xorl	%ebp, %ebp
	call	kit_main		/* does not return */
4:	cli
	hlt
	jmp	4b

/* ------------------------------------------------------------------ */
	.section .data
	.balign 4
	.globl boot_protocol_raw, boot_info_raw
boot_protocol_raw:	.long 0
boot_info_raw:		.long 0

/*
 * Identity map of the first 4 GiB with 2 MiB pages, all user-accessible
 * (U/S set at every level) and writable.  The 3-4 GiB window (MMIO: LAPIC,
 * IOAPIC, ...) is mapped uncached.
 */
#define PDE_FLAGS	(PTE_P | PTE_W | PTE_U | PTE_PS)
	.section .data.pagetables, "aw"
	.balign 4096
	.globl pml4, pdpt, pd
pml4:
	.quad	pdpt + (PTE_P | PTE_W | PTE_U)
	.fill	511, 8, 0
pdpt:
	.quad	pd + 0x0000 + (PTE_P | PTE_W | PTE_U)
	.quad	pd + 0x1000 + (PTE_P | PTE_W | PTE_U)
	.quad	pd + 0x2000 + (PTE_P | PTE_W | PTE_U)
	.quad	pd + 0x3000 + (PTE_P | PTE_W | PTE_U)
	.fill	508, 8, 0
pd:
	.set	i, 0
	.rept	1536
	.quad	(i << 21) | PDE_FLAGS
	.set	i, i + 1
	.endr
	.rept	512
	.quad	(i << 21) | PDE_FLAGS | PTE_PCD | PTE_PWT
	.set	i, i + 1
	.endr

/* GDT: the same table serves the 32-bit entry and long mode. */
	.section .data
	.balign 16
	.globl gdt, gdt_tss_desc, gdt_ptr
gdt:
	.quad	0
	.quad	0x00af9a000000ffff	/* 0x08 kernel code, 64-bit */
	.quad	0x00cf92000000ffff	/* 0x10 kernel data */
	.quad	0x00cffa000000ffff	/* 0x18 user code, 32-bit (unused) */
	.quad	0x00cff2000000ffff	/* 0x20 user data */
	.quad	0x00affa000000ffff	/* 0x28 user code, 64-bit */
	.quad	0x00cf9a000000ffff	/* 0x30 kernel code, 32-bit */
gdt_tss_desc:
	.quad	0, 0			/* 0x38 TSS, base filled in by cpu_init() */
	.globl	gdt_ap_tss_desc
gdt_ap_tss_desc:			/* TSS_SEL_CPU(i), i = 1.., filled in by each AP */
	.fill	2 * (KIT_MAX_CPUS - 1), 8, 0
gdt_end:
	.globl	GDT_LIMIT		/* for the AP trampoline's own GDT pointer */
	.set	GDT_LIMIT, gdt_end - gdt - 1
	.balign 8
	.word	0, 0, 0			/* so that the base below is 8-byte aligned */
gdt_ptr:
	.word	gdt_end - gdt - 1
	.quad	gdt

/*
 * 64-bit TSS.  The I/O permission bitmap allows every port: ring-3 port
 * I/O on this project's hosts does not honour RFLAGS.IOPL.
 */
	.balign 16
	.globl tss, tss_rsp0, tss_end
tss:
	.long	0
tss_rsp0:
	.quad	kstack_top		/* rsp0 */
	.quad	0, 0			/* rsp1, rsp2 */
	.quad	0
	.quad	df_stack_top		/* ist1: #DF, #NMI, #MC */
	.quad	0, 0, 0, 0, 0, 0	/* ist2-7 */
	.quad	0
	.word	0
	.word	tss_iopb - tss		/* I/O map base */
tss_iopb:
	.fill	8192, 1, 0		/* all 65536 ports allowed */
	.byte	0xff			/* terminator */
tss_end:

/* ------------------------------------------------------------------ */
	.section .bss
	.balign 4096
	.globl kstack_top
kstack:
	.skip	16384
kstack_top:
df_stack:
	.skip	4096
df_stack_top:
