/*
 * Interrupt/exception entry stubs, and the ring-3 entry/return path.
 */
#include "defs.h"

	.altmacro
	.text
	.code64

/*
 * One 16-byte stub per vector: isr_stubs + 16 * vector.  Vectors without a
 * CPU-pushed error code push 0, so every frame looks the same.
 */
.macro isr_stub n
	.balign 16
	.if !(\n == 8 || (\n >= 10 && \n <= 14) || \n == 17 || \n == 21 || \n == 29 || \n == 30)
	pushq	$0
	.endif
	pushq	$\n
	jmp	isr_common
.endm

	.balign 16
	.globl isr_stubs
isr_stubs:
	.set	vec, 0
	.rept	256
	isr_stub %vec
	.set	vec, vec + 1
	.endr

/* Builds struct frame (see kit.h) and calls trap_dispatch(frame). */
isr_common:
	pushq	%rax
	pushq	%rbx
	pushq	%rcx
	pushq	%rdx
	pushq	%rsi
	pushq	%rdi
	pushq	%rbp
	pushq	%r8
	pushq	%r9
	pushq	%r10
	pushq	%r11
	pushq	%r12
	pushq	%r13
	pushq	%r14
	pushq	%r15
	movq	%rsp, %rdi
	cld
	call	trap_dispatch
	popq	%r15
	popq	%r14
	popq	%r13
	popq	%r12
	popq	%r11
	popq	%r10
	popq	%r9
	popq	%r8
	popq	%rbp
	popq	%rdi
	popq	%rsi
	popq	%rdx
	popq	%rcx
	popq	%rbx
	popq	%rax
	addq	$16, %rsp		/* vector, error code */
	iretq

/*
 * Per-CPU ring-3 context (struct ring3_ctx in smp.c):
 *   0  kernel_rsp     ring-0 context saved by enter_ring3_irq
 *   8  rsp0_slot      address of this CPU's TSS.rsp0
 *  16  ustack_top     top of this CPU's ring-3 stack
 * Found from the current stack pointer: on AP i's kernel stack
 * (ap_kstacks[i - 1], smp.c) it is ap_ring3[i - 1], anywhere else (the BSP's
 * stack) ring3_ctx_bsp.  Only valid at CPL 0 on a CPU's kernel stack.
 */
	.noaltmacro			/* macro arguments below are %registers */
.macro this_ring3_ctx reg
	movq	%rsp, \reg
	subq	$ap_kstacks, \reg
	cmpq	$((KIT_MAX_CPUS - 1) * KSTACK_SIZE), \reg
	jae	.Lctx_bsp\@
	shrq	$KSTACK_SHIFT, \reg
	leaq	(\reg, \reg, 2), \reg	/* * 24 */
	leaq	ap_ring3(, \reg, 8), \reg
	jmp	.Lctx_found\@
.Lctx_bsp\@:
	leaq	ring3_ctx_bsp(%rip), \reg
.Lctx_found\@:
.endm

/*
 * u64 enter_ring3_irq(u64 (*fn)(u64), u64 arg, bool interrupts)
 *
 * Saves the ring-0 context on the current stack, points TSS.rsp0 just below
 * it (so traps from ring 3 do not clobber the caller's frames) and IRETs to
 * ring3_entry at CPL 3 with IOPL 3.  ring3_resume() comes back here.
 * Nesting (enter_ring3 from a SVC_CALL function) is supported.
 */
	.globl enter_ring3_irq
enter_ring3_irq:
	pushq	%rbp
	pushq	%rbx
	pushq	%r12
	pushq	%r13
	pushq	%r14
	pushq	%r15
	this_ring3_ctx %rax
	movq	8(%rax), %rcx		/* &TSS.rsp0 */
	pushq	0(%rax)			/* previous kernel_rsp */
	pushq	(%rcx)			/* previous TSS.rsp0 */
	pushfq
	cli
	movq	%rsp, 0(%rax)
	movq	%rsp, (%rcx)
	movq	16(%rax), %r8		/* ring-3 stack */

	movq	%rdi, %rbx		/* fn, called by ring3_entry */
	movq	%rsi, %rdi		/* arg */
	movl	$(RFLAGS_IOPL3 | 0x2), %eax
	testb	%dl, %dl
	jz	1f
	orl	$RFLAGS_IF, %eax
1:	movl	$UDATA, %ecx
	movl	%ecx, %ds
	movl	%ecx, %es
	pushq	$UDATA			/* ss */
	pushq	%r8			/* rsp */
	pushq	%rax			/* rflags */
	pushq	$UCODE64		/* cs */
	pushq	$ring3_entry		/* rip */
	xorl	%eax, %eax
	xorl	%ecx, %ecx
	xorl	%edx, %edx
	xorl	%esi, %esi
	xorl	%ebp, %ebp
	xorl	%r8d, %r8d
	xorl	%r9d, %r9d
	xorl	%r10d, %r10d
	xorl	%r11d, %r11d
	iretq

/* Runs at CPL 3: fn(arg), then hand the result back to ring 0. */
	.globl ring3_entry
ring3_entry:
	call	*%rbx
	movq	%rax, %rdi
	movl	$SVC_RING3_EXIT, %eax
	ud2
2:	pause
	jmp	2b

/*
 * void ring3_resume(u64 value) -- called by the #UD service handler at
 * CPL 0; abandons the trap frame and returns `value` from enter_ring3_irq.
 */
	.globl ring3_resume
ring3_resume:
	movq	%rdi, %rax
	this_ring3_ctx %rsi
	movq	0(%rsi), %rsp
	movl	$KDATA, %ecx
	movl	%ecx, %ds
	movl	%ecx, %es
	movl	%ecx, %ss
	popq	%rcx			/* saved rflags, restored last */
	movq	8(%rsi), %r8
	popq	(%r8)			/* TSS.rsp0 */
	popq	0(%rsi)			/* kernel_rsp */
	popq	%r15
	popq	%r14
	popq	%r13
	popq	%r12
	popq	%rbx
	popq	%rbp
	pushq	%rcx
	popfq
	ret

	.data
	.balign 8
	.globl ring3_ctx_bsp
ring3_ctx_bsp:
	.quad	0			/* kernel_rsp */
	.quad	tss_rsp0		/* rsp0_slot */
	.quad	ring3_stack_top		/* ustack_top */

	.bss
	.balign 4096
ring3_stack:
	.skip	65536
	.globl ring3_stack_top
ring3_stack_top:
