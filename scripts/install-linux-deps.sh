#!/usr/bin/env bash
# Installs what `make linux` and `make debian-image` need, if it is missing: Debian's kernel
# source package, the kernel's build tools (flex, bison, bc, libelf for objtool, OpenSSL
# headers, lz4 for the bzImage payload), busybox-static, cpio and musl-tools for the
# initramfs, and debootstrap and extlinux for the Debian image.
set -euo pipefail

need_apt=()
[ -f /usr/src/linux-source-6.12.tar.xz ] || need_apt+=(linux-source-6.12)
command -v flex >/dev/null || need_apt+=(flex)
command -v bison >/dev/null || need_apt+=(bison)
command -v bc >/dev/null || need_apt+=(bc)
command -v lz4 >/dev/null || need_apt+=(lz4)
command -v cpio >/dev/null || need_apt+=(cpio)
command -v xz >/dev/null || need_apt+=(xz-utils)
command -v gcc >/dev/null || need_apt+=(gcc)
command -v make >/dev/null || need_apt+=(make)
[ -e /usr/include/gelf.h ] || need_apt+=(libelf-dev)
[ -e /usr/include/openssl/ssl.h ] || need_apt+=(libssl-dev)
# The vsock helper is linked statically against musl (small), glibc's libc.a otherwise.
command -v musl-gcc >/dev/null || need_apt+=(musl-tools)
[ -e /usr/lib/x86_64-linux-gnu/libc.a ] || need_apt+=(libc6-dev)
# busybox-static replaces the dynamically linked `busybox` package.
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' \
    || need_apt+=(busybox-static)
# The Debian image: debootstrap makes its root from Debian's packages, extlinux (with
# syslinux-common's modules) makes it bootable by firmware; mkfs.ext4 comes with e2fsprogs.
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
command -v extlinux >/dev/null || need_apt+=(extlinux)
[ -d /usr/lib/syslinux/modules/bios ] || need_apt+=(syslinux-common)
# What the Linux boot tests drive the guest and check its results with: a terminal (tmux) a
# person's login is typed into, curl for the API, e2fsprogs for the guest's filesystems.
command -v tmux >/dev/null || need_apt+=(tmux)
command -v curl >/dev/null || need_apt+=(curl)
command -v e2fsck >/dev/null || need_apt+=(e2fsprogs)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "installing Debian packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}"
fi
