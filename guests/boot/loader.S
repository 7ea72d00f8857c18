/*
 * A small BIOS boot loader for Multiboot v1 kernels: the real-mode half.
 *
 * Disk layout (written by mkdisk.sh):
 *   LBA 0        this boot sector (stage 1)
 *   LBA 1        the kernel descriptor (struct kernel_desc in loader.h)
 *   LBA 2 ...    the rest of the loader (stage 2, real-mode and 32-bit code)
 *   desc.lba ... the kernel image, desc.bytes long
 *
 * Stage 1 reads LBA 1 up to the end of the loader to 0:7e00 with INT 13h
 * AH=42h. Stage 2 reads the kernel into the buffer at KERNEL_BUF (it must
 * fit there: BIOS reads land below 1 MiB), collects the memory map with
 * INT 15h E820 and the conventional memory size with INT 12h, enables A20
 * (INT 15h AX=2401h, then the fast A20 bit of port 0x92), switches to
 * 32-bit flat protected mode and calls loader_main() (loader.c), which
 * places the kernel and enters it the Multiboot way.
 */
#include "loader.h"

#define CODE32_SEL	0x08
#define DATA32_SEL	0x10
#define SECTORS_PER_READ 64		/* 32 KiB: one step of the buffer segment */

	.code16
	.section .mbr, "ax"
	.globl	_start
_start:
	cli
	xorw	%ax, %ax
	movw	%ax, %ds
	movw	%ax, %es
	movw	%ax, %ss
	movw	$0x7c00, %sp
	ljmp	$0, $1f
1:	sti
	cld
	movb	%dl, boot_drive

	movw	$msg_stage1, %si
	call	puts

	movb	$0x41, %ah
	movw	$0x55aa, %bx
	movb	boot_drive, %dl
	int	$0x13
	jc	no_ext
	cmpw	$0xaa55, %bx
	jne	no_ext
	testb	$1, %cl
	jz	no_ext

	/* The descriptor and stage 2: LBA 1 .. to 0:7e00. */
	movw	$loader_tail_sectors, %cx
	movl	$1, %eax
	movw	$0x07e0, %bx
	call	read_sectors
	jc	read_failed
	jmp	stage2

no_ext:
	movw	$msg_no_ext, %si
	jmp	die
read_failed:
	movw	$msg_read, %si
/* die: print "loader: <message at SI>" and exit with code 2. */
die:
	pushw	%si
	movw	$msg_error, %si
	call	puts
	popw	%si
	call	puts
	movb	$2, %al
	jmp	exit_vm

/*
 * read_sectors: read CX sectors from LBA EAX to BX:0000. CF set on error.
 * At most 127 sectors (the limit some BIOSes put on one call).
 */
read_sectors:
	pushal
	movw	$16, dap
	movw	%cx, dap + 2
	movw	$0, dap + 4
	movw	%bx, dap + 6
	movl	%eax, dap + 8
	movl	$0, dap + 12
	movw	$dap, %si
	movb	$0x42, %ah
	movb	boot_drive, %dl
	int	$0x13
	popal
	ret

#include "rmio.inc"

msg_stage1:	.asciz	"loader: stage 1\r\n"
msg_error:	.asciz	"loader: error: "
msg_no_ext:	.asciz	"no INT 13h extensions\r\n"
msg_read:	.asciz	"disk read failed\r\n"

	.org	510
	.word	0xaa55

/* LBA 1: the kernel descriptor, filled in by mkdisk.sh. */
	.section .desc, "a"
	.globl	kernel_desc
kernel_desc:
	.fill	512, 1, 0

/* ------------------------------------------------------------------ */
	.section .text16, "ax"
stage2:
	movl	kernel_desc + KD_MAGIC, %eax
	cmpl	$KD_MAGIC_VALUE, %eax
	jne	bad_desc
	movl	kernel_desc + KD_BYTES, %eax
	testl	%eax, %eax
	jz	bad_desc
	cmpl	$KERNEL_BUF_SIZE, %eax
	ja	too_big

	movw	$msg_reading, %si
	call	puts
	call	puthex32
	movw	$msg_crlf, %si
	call	puts

	/* Sectors to read: ceil(bytes / 512), in chunks of SECTORS_PER_READ. */
	addl	$511, %eax
	shrl	$9, %eax
	movl	%eax, %edx			/* sectors left */
	movl	kernel_desc + KD_LBA, %eax	/* next LBA */
	movw	$(KERNEL_BUF >> 4), %bx		/* next segment */
1:	movw	$SECTORS_PER_READ, %cx
	cmpl	$SECTORS_PER_READ, %edx
	jae	2f
	movw	%dx, %cx
2:	call	read_sectors
	jc	read_failed
	movzwl	%cx, %ecx
	addl	%ecx, %eax
	subl	%ecx, %edx
	addw	$(SECTORS_PER_READ * 512 / 16), %bx
	testl	%edx, %edx
	jnz	1b

	call	read_e820
	int	$0x12				/* KiB below the EBDA */
	movw	%ax, conventional_kib
	call	enable_a20
	jmp	enter_protected_mode

bad_desc:
	movw	$msg_bad_desc, %si
	jmp	die
too_big:
	movw	$msg_too_big, %si
	jmp	die

/*
 * read_e820: the BIOS memory map into e820_map (entries of E820_ENTRY_SIZE
 * bytes), e820_count entries.
 */
read_e820:
	pushal
	movw	$0, e820_count
	xorl	%ebx, %ebx
	movw	$e820_map, %di
1:	movl	$0xe820, %eax
	movl	$E820_ENTRY_SIZE, %ecx
	movl	$0x534d4150, %edx		/* "SMAP" */
	movl	$1, 20(%di)			/* ACPI 3 attributes: valid unless cleared */
	int	$0x15
	jc	2f
	cmpl	$0x534d4150, %eax
	jne	2f
	incw	e820_count
	addw	$E820_ENTRY_SIZE, %di
	testl	%ebx, %ebx
	jz	2f
	cmpw	$E820_MAX, e820_count
	jb	1b
2:	popal
	ret

/* enable_a20: ask the BIOS; also set the fast A20 bit of port 0x92 (never bit 0: reset). */
enable_a20:
	movw	$0x2401, %ax
	int	$0x15
	inb	$0x92, %al
	testb	$2, %al
	jnz	1f
	orb	$2, %al
	andb	$0xfe, %al
	outb	%al, $0x92
1:	ret

enter_protected_mode:
	cli
	lgdtl	gdt_ptr
	movl	%cr0, %eax
	orl	$1, %eax
	movl	%eax, %cr0
	ljmpl	$CODE32_SEL, $pm32

	.code32
pm32:
	movl	$DATA32_SEL, %eax
	movl	%eax, %ds
	movl	%eax, %es
	movl	%eax, %fs
	movl	%eax, %gs
	movl	%eax, %ss
	movl	$0x7c00, %esp
	movl	$__bss_start, %edi
	movl	$__bss_end, %ecx
	subl	%edi, %ecx
	xorl	%eax, %eax
	rep stosb
	movzbl	boot_drive, %eax
	pushl	%eax
	call	loader_main			/* does not return */
1:	cli
	hlt
	jmp	1b

	.section .rodata
msg_reading:	.asciz	"loader: reading the kernel, bytes "
msg_bad_desc:	.asciz	"no kernel descriptor at LBA 1\r\n"
msg_too_big:	.asciz	"kernel larger than the load buffer\r\n"
msg_crlf:	.asciz	"\r\n"

	.balign	8
gdt:
	.quad	0
	.quad	0x00cf9a000000ffff		/* 0x08: flat 32-bit code */
	.quad	0x00cf92000000ffff		/* 0x10: flat data */
gdt_end:
gdt_ptr:
	.word	gdt_end - gdt - 1
	.long	gdt

/*
 * Written in real mode, read by loader.c; not part of the image, and not
 * cleared with .bss.
 */
	.section .rmdata, "aw", @nobits
	.balign	8
	.globl	e820_map, e820_count, conventional_kib, boot_drive
e820_map:	.skip	E820_MAX * E820_ENTRY_SIZE
e820_count:	.skip	2
conventional_kib: .skip	2
boot_drive:	.skip	1
	.balign	16
dap:		.skip	16
