#!/bin/sh
# Runs guests/cpuid-msr.c under ferrovm and under QEMU (-accel kvm, microvm) on this host
# and prints the unified diff of what the guest saw (QEMU first), for docs/fidelity.md.
#
#   guests/scripts/fidelity-diff.sh [CPUS] [QEMU_CPU_MODEL]   (defaults: 1, host)
#
# `-cpu host` drops arch-capabilities: on hosts whose kernel refuses to set MSR 0x10a (KVM
# with the PVM backend) QEMU 7.2 aborts otherwise; the guest sees no ARCH_CAPABILITIES
# under either VMM there.
set -eu
cd "$(dirname "$0")/../.."
cpus=${1:-1}
model=${2:-host}
[ "$model" = host ] && model=host,-arch-capabilities
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
target/release/ferrovm run --cpus "$cpus" --kernel target/guests/cpuid-msr.elf \
	>"$out/ferrovm" || [ $? -eq 1 ]
qemu-system-x86_64 -accel kvm -M microvm -nodefaults -no-user-config -nographic \
	-serial stdio -device isa-debug-exit,iobase=0xf4,iosize=4 -no-reboot -m 256 \
	-smp "$cpus" -cpu "$model" -kernel target/guests/pvh-only/cpuid-msr.elf \
	>"$out/qemu" 2>/dev/null || [ $? -eq 1 ]
diff -U0 --label "qemu -cpu $model" --label ferrovm "$out/qemu" "$out/ferrovm" || true
