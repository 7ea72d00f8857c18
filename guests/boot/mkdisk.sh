#!/bin/sh
# mkdisk.sh LOADER.bin KERNEL OUT.img [CMDLINE]
#
# Writes a raw disk image: the loader (boot sector, kernel descriptor
# sector, stage 2) from LBA 0, the kernel from the next 32 KiB boundary,
# and the descriptor (see loader.h) naming the kernel's LBA, size and
# command line. The image is padded to a whole MiB.
set -eu

[ $# -ge 3 ] && [ $# -le 4 ] || { echo "usage: $0 LOADER.bin KERNEL OUT.img [CMDLINE]" >&2; exit 2; }
loader=$1 kernel=$2 out=$3 cmdline=${4-}

KD_MAGIC=0x4b4d5646		# "FVMK"
KD_CMDLINE_MAX=500
KERNEL_BUF_SIZE=$((0x78000))

loader_bytes=$(wc -c < "$loader")
kernel_bytes=$(wc -c < "$kernel")
[ "$kernel_bytes" -gt 0 ] || { echo "$0: $kernel is empty" >&2; exit 1; }
[ "$kernel_bytes" -le $KERNEL_BUF_SIZE ] ||
	{ echo "$0: $kernel is $kernel_bytes bytes, more than the loader's $KERNEL_BUF_SIZE" >&2; exit 1; }
[ ${#cmdline} -lt $KD_CMDLINE_MAX ] || { echo "$0: command line too long" >&2; exit 1; }

# The kernel starts at the first 32 KiB boundary after the loader.
kernel_lba=$(( (loader_bytes + 32767) / 32768 * 64 ))

# le32 N: N as 4 little-endian bytes.
le32() {
	printf "$(printf '\\%03o\\%03o\\%03o\\%03o' $(($1 & 255)) $(($1 >> 8 & 255)) \
		$(($1 >> 16 & 255)) $(($1 >> 24 & 255)))"
}

tmp=$out.tmp
rm -f "$tmp"
dd if="$loader" of="$tmp" bs=512 conv=notrunc status=none
dd if="$kernel" of="$tmp" bs=512 seek=$kernel_lba conv=notrunc status=none
{ le32 $KD_MAGIC; le32 $kernel_lba; le32 $kernel_bytes; printf '%s\0' "$cmdline"; } |
	dd of="$tmp" bs=1 seek=512 conv=notrunc status=none
size=$(wc -c < "$tmp")
truncate -s $(( (size + 1048575) / 1048576 * 1048576 )) "$tmp"
mv "$tmp" "$out"
