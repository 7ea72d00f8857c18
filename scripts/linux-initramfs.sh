#!/usr/bin/env bash
# Builds the initramfs of ferrovm's Linux test guest into OUT (default target/linux):
# Debian's busybox-static with a link for every applet, the init and /etc of
# guests/linux/rootfs, the tests of guests/linux/tests in /tests, and the vsock helper
# (guests/linux/vsock.c, static, with musl where installed). Cheap, so rebuilt every time; the archive is
# reproducible (fixed owners, times and order).
#
#   FERROVM_ROOT_PASSWORD  root's password (default ferrovm)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
GUEST=guests/linux
OUT=${1:-target/linux}
BUSYBOX=/bin/busybox
PASSWORD=${FERROVM_ROOT_PASSWORD:-ferrovm}
# A fixed salt keeps the image reproducible; this is a test guest's password.
SALT=ferrovmtestguest
EPOCH=${SOURCE_DATE_EPOCH:-0}

# The dynamically linked busybox of package `busybox` would need a libc in the image.
if [ ! -x "$BUSYBOX" ] || readelf -l "$BUSYBOX" | grep -q 'Requesting program interpreter'; then
    echo "$BUSYBOX is missing or not static: install busybox-static (scripts/install-linux-deps.sh)" >&2
    exit 1
fi

mkdir -p "$OUT"
stage=$OUT/initramfs.d
rm -rf "$stage"
mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,run,tmp,root,mnt,tests}
chmod 1777 "$stage/tmp"
chmod 0700 "$stage/root"

cp "$BUSYBOX" "$stage/bin/busybox"
for applet in $("$BUSYBOX" --list-full); do
    [ "$applet" = bin/busybox ] || ln -sf /bin/busybox "$stage/$applet"
done

cp -R "$GUEST/rootfs/." "$stage/"
cp "$GUEST"/tests/* "$stage/tests/"
chmod 0755 "$stage/init" "$stage"/tests/*

hash=$("$BUSYBOX" mkpasswd -m sha512 "$PASSWORD" "$SALT")
echo "root:$hash:19000:0:99999:7:::" > "$stage/etc/shadow"
chmod 0600 "$stage/etc/shadow"

# musl makes the helper 30 KB instead of glibc's 700 KB: the guest kernel copies every byte
# of the archive in emulated ring 0 at boot.
cc=gcc
command -v musl-gcc >/dev/null && cc=musl-gcc
"$cc" -static -Os -s -Wall -Wextra -Werror -Wl,--gc-sections \
    -o "$stage/usr/bin/vsock" "$GUEST/vsock.c"

find "$stage" -exec touch -h -d "@$EPOCH" {} +
(cd "$stage" && find . -mindepth 1 | LC_ALL=C sort \
    | cpio -o -H newc -R 0:0 --reproducible --quiet) > "$OUT/initramfs.cpio.tmp"
gzip -9 -n -c "$OUT/initramfs.cpio.tmp" > "$OUT/initramfs.cpio.gz.tmp"
mv -f "$OUT/initramfs.cpio.tmp" "$OUT/initramfs.cpio"
mv -f "$OUT/initramfs.cpio.gz.tmp" "$OUT/initramfs.cpio.gz"
echo "initramfs: $OUT/initramfs.cpio.gz ($(stat -c %s "$OUT/initramfs.cpio.gz") bytes)"
