/*
 * Constants shared by the loader's real-mode (loader.S) and 32-bit
 * (loader.c) halves, and by mkdisk.sh (which writes the descriptor).
 * Only #defines here: this file is included from assembly.
 */
#ifndef LOADER_H
#define LOADER_H

/*
 * The kernel descriptor at LBA 1 (little-endian):
 *   0  u32  magic "FVMK"
 *   4  u32  first LBA of the kernel image
 *   8  u32  size of the kernel image in bytes
 *   12 char command line, NUL-terminated (at most KD_CMDLINE_MAX bytes with the NUL)
 */
#define KD_MAGIC		0
#define KD_LBA			4
#define KD_BYTES		8
#define KD_CMDLINE		12
#define KD_CMDLINE_MAX		500
#define KD_MAGIC_VALUE		0x4b4d5646	/* "FVMK" */

/* Where stage 2 reads the kernel image: conventional memory, below the EBDA. */
#define KERNEL_BUF		0x20000
#define KERNEL_BUF_SIZE		0x78000		/* up to 0x98000 */

/* INT 15h E820 entries: base, length, type, ACPI 3.0 attributes. */
#define E820_ENTRY_SIZE		24
#define E820_MAX		64

#endif
