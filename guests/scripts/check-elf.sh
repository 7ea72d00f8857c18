#!/bin/sh
# check-elf.sh IMAGE EXPECT_PVH EXPECT_MULTIBOOT
# Verifies a guest image: ELF64 x86-64, the PVH note (if expected), the
# multiboot header in the first 8 KiB (if expected) and that the file layout
# matches the header's address fields.
set -eu
img=$1 want_pvh=$2 want_mb=$3
READELF=${READELF:-readelf}
die() { echo "check-elf: $img: $*" >&2; exit 1; }

$READELF -h "$img" | grep -q 'Class:.*ELF64' || die "not ELF64"
$READELF -h "$img" | grep -q 'Machine:.*X86-64' || die "not x86-64"

entry=$($READELF -h "$img" | awk '/Entry point address/ { print $4 }')

if $READELF -nW "$img" | grep -q '^ *Xen .*0x00000012'; then
	[ "$want_pvh" = 1 ] || die "unexpected PVH note"
	$READELF -lW "$img" | grep -q '^ *NOTE ' || die "PVH note not in a PT_NOTE segment"
else
	[ "$want_pvh" = 0 ] || die "no XEN_ELFNOTE_PHYS32_ENTRY note"
fi

# Multiboot magic (little-endian 0x1BADB002) at a 4-aligned offset < 8192.
mb=$(od -A d -t x4 -v -N 8192 "$img" | awk '
	{ for (i = 2; i <= NF; i++) if ($i == "1badb002") { print $1 + 4 * (i - 2); exit } }')
if [ -n "$mb" ]; then
	[ "$want_mb" = 1 ] || die "unexpected multiboot header"
	set -- $(od -A n -t u4 -v -j "$mb" -N 32 "$img")
	[ $(( ($1 + $2 + $3) & 0xffffffff )) -eq 0 ] || die "bad multiboot checksum"
	flags=$2 header_addr=$4 load_addr=$5 load_end=$6 entry_addr=$8
	# QEMU refuses ELF64 multiboot images without the address fields.
	[ $((flags & 0x10000)) -ne 0 ] || die "multiboot header lacks the address fields (flags bit 16)"
	[ $((entry_addr)) -eq $((entry)) ] || die "multiboot entry differs from ELF entry"
	delta=$((mb - header_addr))
	# Every PT_LOAD with file contents must sit at file offset vaddr + delta.
	$READELF -lW "$img" | awk '$1 == "LOAD" { print $2, $3, $5 }' > "$img.check.tmp"
	while read -r off va fsz; do
		[ $((fsz)) -eq 0 ] && continue
		[ $((off - va)) -eq "$delta" ] ||
			{ rm -f "$img.check.tmp"; die "segment at $va is at file offset $off: layout does not match the multiboot address fields"; }
		[ $((va)) -ge "$load_addr" ] && [ $((va + fsz)) -le "$load_end" ] ||
			{ rm -f "$img.check.tmp"; die "segment at $va lies outside load_addr..load_end_addr"; }
	done < "$img.check.tmp"
	rm -f "$img.check.tmp"
else
	[ "$want_mb" = 0 ] || die "no multiboot header in the first 8 KiB"
fi
