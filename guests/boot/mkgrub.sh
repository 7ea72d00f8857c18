#!/bin/sh
# mkgrub.sh KERNEL OUT.img
#
# A disk that boots a Multiboot v1 KERNEL through GRUB 2 (Debian's grub-pc-bin): GRUB's
# boot.img in the MBR, core.img from LBA 1 (with biosdisk, multiboot, boot and echo, and an
# embedded configuration), the kernel from LBA 2048 (1 MiB), read by GRUB as a block list.
# No file system and no grub-install: a check of the BIOS disk path with a boot loader
# this project did not write.
set -eu

[ $# -eq 2 ] || { echo "usage: $0 KERNEL OUT.img" >&2; exit 2; }
kernel=$1 out=$2
grub=/usr/lib/grub/i386-pc
[ -f $grub/boot.img ] || { echo "$0: $grub/boot.img missing: apt-get install grub-pc-bin" >&2; exit 1; }

kernel_sectors=$(( ($(wc -c < "$kernel") + 511) / 512 ))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'echo "grub: loading the kernel"\nmultiboot (hd0)2048+%d\nboot\n' "$kernel_sectors" > "$tmp/early.cfg"
grub-mkimage -O i386-pc -o "$tmp/core.img" -c "$tmp/early.cfg" -p '(hd0)' \
	biosdisk multiboot boot echo
core_sectors=$(( ($(wc -c < "$tmp/core.img") + 511) / 512 ))
[ $((1 + core_sectors)) -le 2048 ] || { echo "$0: core.img too large" >&2; exit 1; }

rm -f "$out.tmp"
truncate -s $(( (2048 + kernel_sectors) * 512 )) "$out.tmp"
# boot.img's code and its signature; the partition table area stays empty.
dd if=$grub/boot.img of="$out.tmp" bs=446 count=1 conv=notrunc status=none
dd if=$grub/boot.img of="$out.tmp" bs=1 skip=510 seek=510 count=2 conv=notrunc status=none
# core.img at LBA 1: the defaults boot.img and diskboot.img carry expect it there.
dd if="$tmp/core.img" of="$out.tmp" bs=512 seek=1 conv=notrunc status=none
dd if="$kernel" of="$out.tmp" bs=512 seek=2048 conv=notrunc status=none
size=$(wc -c < "$out.tmp")
truncate -s $(( (size + 1048575) / 1048576 * 1048576 )) "$out.tmp"
mv "$out.tmp" "$out"
