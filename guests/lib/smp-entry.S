/*
 * AP start-up: the real-mode trampoline (copied to AP_TRAMPOLINE_ADDR by
 * smp_start_aps(), entered by SIPI with CS = AP_TRAMPOLINE_ADDR >> 4,
 * IP = 0) and the 64-bit AP entry.
 *
 * real mode -> lgdt (the kit's GDT) -> CR0.PE -> KCODE32 -> enter_long_mode32
 * (entry.S: PAE, the static page tables, EFER.LME, paging) -> ap_start64.
 */
#include "defs.h"

	.text
	.code16
	.globl ap_trampoline, ap_trampoline_end
ap_trampoline:
	cli
	cld
	movw	%cs, %ax
	movw	%ax, %ds
	lgdtl	tr_gdt_ptr - ap_trampoline
	/* A fixed CR0: after INIT it has CD and NW set, which we do not want. */
	movl	$(CR0_PE | CR0_MP | CR0_ET | CR0_NE), %eax
	movl	%eax, %cr0
	ljmpl	$KCODE32, $(AP_TRAMPOLINE_ADDR + tr_pm32 - ap_trampoline)

	.code32
tr_pm32:
	movl	$KDATA, %eax
	movl	%eax, %ds
	movl	%eax, %es
	movl	%eax, %ss
	movl	$ap_start64, %esi
	movl	$enter_long_mode32, %eax
	jmp	*%eax

	.balign 4
	.word	0
tr_gdt_ptr:				/* 6-byte form: limit, 32-bit base */
	.word	GDT_LIMIT
	.long	gdt
ap_trampoline_end:

/*
 * 64-bit AP entry, no stack yet: take the next CPU index (1, 2, ...),
 * switch to that CPU's kernel stack and call ap_entry(idx) (smp.c).
 */
	.code64
	.globl ap_start64
ap_start64:
	movl	$1, %eax
	lock xaddl %eax, ap_next_idx(%rip)
	cmpl	$KIT_MAX_CPUS, %eax
	jae	2f
	movl	%eax, %edi
	movq	%rdi, %rsp
	shlq	$KSTACK_SHIFT, %rsp
	leaq	ap_kstacks(%rip), %rcx	/* CPU i's stack is ap_kstacks[i - 1] */
	addq	%rcx, %rsp
	xorl	%ebp, %ebp
	call	ap_entry		/* does not return */
2:	cli				/* beyond KIT_MAX_CPUS: stay halted */
	hlt
	jmp	2b

	.data
	.balign 4
	.globl ap_next_idx
ap_next_idx:
	.long	1
