#!/usr/bin/env bash
# Runs a test guest under QEMU (q35, KVM) with virtio-pci devices, for developing the
# virtio guests against a second implementation.  Prints the QEMU command line, then the
# guest's console; exits with QEMU's status (debug-exit: (code << 1) | 1, so PASS = 1).
#
#   guests/scripts/qemu-run.sh [options] IMAGE.elf [guest command line ...]
#     -m MIB        RAM (256)
#     -c N          vCPUs (1)
#     -d IMG        a raw virtio-blk disk (created, 64 MiB, if missing; repeatable)
#     -q N          num-queues of the disks (2)
#     -s SERIAL     serial of the disks (ferrovm-disk0, ferrovm-disk1, ...)
#     -o            disks read-only
#     -D MODE       discard= of the disks (unmap; "ignore" keeps data)
#     -r            a virtio-rng-pci device
#     -C FILE       a virtio console (virtio-serial-pci + virtconsole) written to FILE
#     -L            transitional devices (disable-legacy=off; default modern only)
#     -M MACHINE    q35 (default) or pc
#     -t SECONDS    time limit (60)
#     -x ARG        one more QEMU argument (repeatable)
set -euo pipefail

mem=256 cpus=1 queues=2 serial="" ro=0 discard=unmap rng=0 console="" disable_legacy=on
machine=q35 limit=60
disks=() extra=()
while getopts "m:c:d:q:s:oD:rC:LM:t:x:" opt; do
	case $opt in
	m) mem=$OPTARG ;;
	c) cpus=$OPTARG ;;
	d) disks+=("$OPTARG") ;;
	q) queues=$OPTARG ;;
	s) serial=$OPTARG ;;
	o) ro=1 ;;
	D) discard=$OPTARG ;;
	r) rng=1 ;;
	C) console=$OPTARG ;;
	L) disable_legacy=off ;;
	M) machine=$OPTARG ;;
	t) limit=$OPTARG ;;
	x) extra+=("$OPTARG") ;;
	*) sed -n '2,20p' "$0" >&2; exit 2 ;;
	esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { sed -n '2,20p' "$0" >&2; exit 2; }
image=$1
shift
append="$*"

args=(qemu-system-x86_64 -M "$machine" -accel kvm -m "$mem" -smp "$cpus"
	-nodefaults -no-user-config -nographic -serial stdio -no-reboot
	-device isa-debug-exit,iobase=0xf4,iosize=4
	-kernel "$image" -append "$append")
i=0
for d in "${disks[@]}"; do
	[ -e "$d" ] || truncate -s 64M "$d"
	s=${serial:-ferrovm-disk$i}
	[ -n "$serial" ] && [ $i -gt 0 ] && s=$serial$i
	ro_opt=""
	[ $ro = 1 ] && ro_opt=",readonly=on"
	args+=(-drive "file=$d,if=none,id=d$i,format=raw,cache=writeback,discard=$discard$ro_opt"
		-device "virtio-blk-pci,drive=d$i,disable-legacy=$disable_legacy,serial=$s,num-queues=$queues")
	i=$((i + 1))
done
[ $rng = 1 ] && args+=(-device "virtio-rng-pci,disable-legacy=$disable_legacy")
if [ -n "$console" ]; then
	args+=(-chardev "file,id=vc0,path=$console"
		-device "virtio-serial-pci,disable-legacy=$disable_legacy,max_ports=1"
		-device "virtconsole,chardev=vc0")
fi
args+=("${extra[@]}")

printf '%q ' "${args[@]}"
echo
status=0
timeout "$limit" "${args[@]}" || status=$?
exit $status
