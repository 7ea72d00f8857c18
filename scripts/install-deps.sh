#!/usr/bin/env bash
# Installs what building and testing ferrovm needs, if it is missing: the C toolchain for
# the test guests (gcc, binutils, make), libclang for bindgen, and the Rust components for
# the checks.
set -euo pipefail

need_apt=()
command -v gcc >/dev/null || need_apt+=(gcc)
command -v ld >/dev/null || need_apt+=(binutils)
command -v make >/dev/null || need_apt+=(make)
# The userfaultfd crate generates its kernel bindings with bindgen at build time: libclang
# and the kernel's user-space headers.
ldconfig -p 2>/dev/null | grep 'libclang[-.0-9]*\.so' >/dev/null || need_apt+=(libclang-dev)
[ -e /usr/include/linux/userfaultfd.h ] || need_apt+=(linux-libc-dev)
# scripts/seccomp-profile.sh traces the VMM's threads with it.
command -v strace >/dev/null || need_apt+=(strace)
# Debian's SeaBIOS: the default firmware of `ferrovm run --disk` and tests/firmware.rs.
[ -f /usr/share/seabios/bios-256k.bin ] || need_apt+=(seabios)
# qemu-img makes and checks the qcow2 images of tests/virtio.rs and tests/firmware.rs.
command -v qemu-img >/dev/null || need_apt+=(qemu-utils)
# Go builds the firecracker-go-sdk test program (tests/go/fcsdk).
command -v go >/dev/null || [ -x /usr/local/go/bin/go ] || need_apt+=(golang-go)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "installing Debian packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}"
fi

if ! command -v cargo >/dev/null; then
    echo "cargo is missing: install Rust (stable) with rustup" >&2
    exit 1
fi
if command -v rustup >/dev/null; then
    for component in rustfmt clippy; do
        if ! rustup component list --installed 2>/dev/null | grep -q "^$component"; then
            rustup component add "$component"
        fi
    done
fi
