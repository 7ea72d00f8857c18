/*
 * A test disk: a boot sector followed by DATA_SECTORS sectors of a known
 * pattern.
 *
 * The BIOS loads the boot sector at 0:7c00 and jumps to it with DL = the
 * boot drive. It prints a banner on COM1, checks for the INT 13h
 * extensions, then reads the data sectors PASSES times with AH=42h
 * (SECTORS_PER_READ sectors per call into 1000:0000) and checks every
 * dword against the pattern. The result goes to COM1 ("bootsect: PASS" or
 * "bootsect: FAIL ...") and to the debug-exit port: 0 on success, so that
 * the VMM exits with status 1, or one of the codes below.
 *
 * Pattern: dword j of the sector at LBA k is k * PAT_MUL + j * PAT_STEP
 * (mod 2^32), so a sector read from the wrong place, a shifted or a stale
 * buffer all show.
 *
 * Built with -DNO_SIGNATURE the sector lacks its 0x55aa signature: a BIOS
 * must refuse to boot it.
 */

#ifndef DATA_SECTORS
#define DATA_SECTORS	64
#endif
#ifndef PASSES
#define PASSES		1
#endif
#define SECTORS_PER_READ 8
#define BUF_SEG		0x1000
#define PAT_MUL		0x9e3779b1
#define PAT_STEP	0x01000193

/* Debug-exit codes (status = code * 2 + 1). */
#define EXIT_PASS	0
#define EXIT_NO_EXT	2
#define EXIT_READ	3
#define EXIT_PATTERN	4

/* Variables, in free conventional memory (the sector has no room for them). */
#define dap		0x600		/* INT 13h AH=42h disk address packet */
#define dap_count	(dap + 2)
#define dap_buffer	(dap + 4)
#define dap_lba		(dap + 8)
#define lba		0x610
#define passes_left	0x614
#define drive		0x616

#if DATA_SECTORS % SECTORS_PER_READ
#error DATA_SECTORS must be a multiple of SECTORS_PER_READ
#endif

	.code16
	.text
	.globl	_start
_start:
	cli
	xorw	%ax, %ax
	movw	%ax, %ds
	movw	%ax, %es
	movw	%ax, %ss
	movw	$0x7c00, %sp
	ljmp	$0, $1f			/* some BIOSes enter at 07c0:0000 */
1:	sti
	cld
	movb	%dl, drive

	movw	$msg_banner, %si
	call	puts
	movzbl	drive, %eax
	call	puthex32
	movw	$msg_crlf, %si
	call	puts

	/* INT 13h extensions present, with the extended disk access subset? */
	movb	$0x41, %ah
	movw	$0x55aa, %bx
	movb	drive, %dl
	int	$0x13
	jc	no_ext
	cmpw	$0xaa55, %bx
	jne	no_ext
	testb	$1, %cl
	jz	no_ext

	movw	$PASSES, passes_left
next_pass:
	movl	$1, lba
next_chunk:
	call	clear_buffer
	movw	$16, dap
	movl	$(BUF_SEG << 16), dap_buffer
	movl	lba, %eax
	movl	%eax, dap_lba
	movl	$0, dap_lba + 4
	movw	$SECTORS_PER_READ, dap_count
	movw	$dap, %si
	movb	$0x42, %ah
	movb	drive, %dl
	int	$0x13
	jc	read_failed
	call	check_chunk
	addl	$SECTORS_PER_READ, lba
	cmpl	$(DATA_SECTORS + 1), lba
	jb	next_chunk
	movb	$'.', %al
	call	putc
	decw	passes_left
	jnz	next_pass

	movw	$msg_pass, %si
	call	puts
	movb	$EXIT_PASS, %al
	jmp	exit_vm

no_ext:
	movw	$msg_no_ext, %si
	movb	$EXIT_NO_EXT, %al
	jmp	fail
read_failed:
	movw	$msg_read, %si
	movb	$EXIT_READ, %al
	jmp	fail

/* fail: print the message at SI, the LBA, and exit with code AL. */
fail:
	pushw	%si
	movw	$msg_fail, %si
	call	puts
	popw	%si
	call	puts
	pushl	%eax
	movl	lba, %eax
	call	puthex32
	movw	$msg_crlf, %si
	call	puts
	popl	%eax
	jmp	exit_vm

/* Fills the read buffer with 0xff bytes, so a read that writes nothing shows. */
clear_buffer:
	pushw	%es
	movw	$BUF_SEG, %ax
	movw	%ax, %es
	xorw	%di, %di
	movw	$(SECTORS_PER_READ * 256), %cx
	movw	$0xffff, %ax
	rep stosw
	popw	%es
	ret

/* Checks the chunk in the buffer against the pattern of the sectors from `lba`. */
check_chunk:
	pushw	%es
	movw	$BUF_SEG, %ax
	movw	%ax, %es
	xorw	%di, %di
	movl	lba, %eax
	movw	$SECTORS_PER_READ, %bx
1:	imull	$PAT_MUL, %eax, %edx
	movw	$128, %cx
2:	cmpl	%edx, %es:(%di)
	jne	3f
	addl	$PAT_STEP, %edx
	addw	$4, %di
	loop	2b
	incl	%eax
	decw	%bx
	jnz	1b
	popw	%es
	ret
3:	popw	%es
	movl	%eax, lba		/* report the sector that differs */
	movw	$msg_pattern, %si
	movb	$EXIT_PATTERN, %al
	jmp	fail

#include "rmio.inc"

msg_banner:	.asciz	"bootsect: drive "
msg_pass:	.asciz	"\r\nbootsect: PASS\r\n"
msg_fail:	.asciz	"\r\nbootsect: FAIL "
msg_no_ext:	.asciz	"no INT 13h extensions "
msg_read:	.asciz	"read error, lba "
msg_pattern:	.asciz	"bad data, lba "
msg_crlf:	.asciz	"\r\n"

	.org	510
#ifdef NO_SIGNATURE
	.word	0
#else
	.word	0xaa55
#endif

/* The data sectors, LBA 1 to DATA_SECTORS. */
	.set	k, 1
	.rept	DATA_SECTORS
	.set	j, 0
	.rept	128
	.long	(k * PAT_MUL + j * PAT_STEP) & 0xffffffff
	.set	j, j + 1
	.endr
	.set	k, k + 1
	.endr
