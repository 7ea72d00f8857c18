#!/usr/bin/env bash
# Builds ferrovm's Debian test image, OUT/debian.img (default target/linux): a 1 GiB ext4
# file system, unpartitioned (root=/dev/vda), holding a Debian bookworm root made by
# debootstrap from Debian's packages, with sysvinit, login prompts on ttyS0 and hvc0, root's
# password, iproute2 and a static network configuration, and extlinux in its boot sector
# so that firmware (SeaBIOS) boots it too. guests/linux/debian/README.md describes it.
#
# The image is cached outside the work tree, keyed by a hash of what decides it (this
# script, guests/linux/debian/, the test kernel it carries for firmware boots, the suite,
# mirror and password): a second build only copies it.
#
#   FERROVM_DEBIAN_CACHE     cache directory (default $XDG_CACHE_HOME/ferrovm/debian)
#   FERROVM_DEBIAN_MIRROR    the Debian mirror (default http://deb.debian.org/debian)
#   FERROVM_ROOT_PASSWORD    root's password (default ferrovm)
#
# Needs root (debootstrap's chroot, a loop mount for extlinux), debootstrap, extlinux and
# e2fsprogs (scripts/install-linux-deps.sh), and the test kernel (scripts/linux-kernel.sh).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=${1:-target/linux}
FILES=$ROOT/guests/linux/debian
SUITE=bookworm
MIRROR=${FERROVM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PASSWORD=${FERROVM_ROOT_PASSWORD:-ferrovm}
# A fixed salt keeps the image's inputs (and its cache key) the same from run to run; this
# is a test guest's password.
SALT=ferrovmtestguest
SIZE=1G
# On top of debootstrap's minbase (Priority: required, and apt): sysvinit as PID 1 and the
# tools the tests and a person use.
PACKAGES=sysvinit-core,procps,iproute2,iputils-ping,netbase
CACHE=${FERROVM_DEBIAN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrovm/debian}
KERNEL=$OUT/bzImage

for tool in debootstrap extlinux mkfs.ext4 e2fsck losetup busybox; do
    if ! command -v "$tool" >/dev/null; then
        echo "$tool is missing: run scripts/install-linux-deps.sh" >&2
        exit 1
    fi
done
if [ ! -f "$KERNEL" ]; then
    echo "$KERNEL is missing: build the test kernel first (make linux)" >&2
    exit 1
fi
if [ "$(id -u)" != 0 ]; then
    echo "building the Debian image needs root (debootstrap's chroot, a loop mount)" >&2
    exit 1
fi

key=$( { cat "$ROOT/scripts/debian-image.sh" "$FILES"/*; sha256sum < "$KERNEL"; echo "$SUITE $MIRROR $PASSWORD $SIZE $PACKAGES"; } \
    | sha256sum | cut -c1-16)
built=$CACHE/$key
mkdir -p "$CACHE" "$OUT"

install_image() {
    cp --sparse=always -f "$built/debian.img" "$OUT/debian.img.tmp"
    mv -f "$OUT/debian.img.tmp" "$OUT/debian.img"
    echo "debian image $key: $OUT/debian.img ($(du -h --apparent-size "$OUT/debian.img" | cut -f1)," \
        "$(du -h "$OUT/debian.img" | cut -f1) used)"
}

# Copies the cached image, if there is one, and ends.
use_cached() {
    [ -f "$built/debian.img" ] || return 0
    echo "debian image $key: cached in $built"
    install_image
    exit 0
}

use_cached
# One build at a time per cache; one that ended while this one waited is used as it is.
exec 9>"$CACHE/lock"
flock 9
use_cached

start=$(date +%s)
work=$CACHE/work
target=$work/root
mnt=$work/mnt
cleanup() {
    for m in "$mnt" "$target/proc" "$target/sys" "$target/dev/pts"; do
        mountpoint -q "$m" 2>/dev/null && umount -l "$m"
    done
    rm -rf "$work"
}
trap cleanup EXIT
cleanup
mkdir -p "$target" "$mnt"

echo "debootstrap $SUITE from $MIRROR"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$target" "$MIRROR"

# The configuration of guests/linux/debian.
install -m 0644 "$FILES/inittab" "$target/etc/inittab"
mkdir -p "$target/etc/inittab.d"
install -m 0755 "$FILES/sysinit" "$target/usr/local/sbin/ferrovm-sysinit"
install -m 0755 "$FILES/shutdown" "$target/usr/local/sbin/ferrovm-shutdown"
install -m 0755 "$FILES/console-getty" "$target/usr/local/sbin/console-getty"
install -D -m 0644 "$FILES/network" "$target/etc/ferrovm/network"
install -m 0644 "$FILES/fstab" "$target/etc/fstab"
install -m 0644 "$FILES/hostname" "$target/etc/hostname"
install -m 0644 "$FILES/hosts" "$target/etc/hosts"
hash=$(busybox mkpasswd -m sha512 "$PASSWORD" "$SALT")
chroot "$target" usermod -p "$hash" root
# The kernel and extlinux's configuration, for firmware boots.
install -D -m 0644 "$KERNEL" "$target/boot/vmlinuz"
install -D -m 0644 "$FILES/extlinux.conf" "$target/boot/extlinux/extlinux.conf"
# What debootstrap leaves that a booted system does not need.
rm -rf "$target"/var/cache/apt/archives/*.deb "$target"/var/lib/apt/lists/* "$target"/debootstrap

img=$work/debian.img
mkfs.ext4 -q -L debian -d "$target" "$img" "$SIZE"
# extlinux writes its boot sector and ldlinux.sys into a mounted file system.
mount -o loop "$img" "$mnt"
extlinux --install "$mnt/boot/extlinux" >/dev/null
umount "$mnt"
e2fsck -fn "$img" >/dev/null

mkdir -p "$built.tmp"
mv "$img" "$built.tmp/debian.img"
rm -rf "$built"
mv "$built.tmp" "$built"
echo "debian image $key built in $(( $(date +%s) - start )) s"
# Keep the two newest images of this cache.
ls -dt "$CACHE"/[0-9a-f]*/ | grep -E '/[0-9a-f]{16}/$' | tail -n +3 | xargs -r rm -rf
install_image
