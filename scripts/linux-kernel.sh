#!/usr/bin/env bash
# Builds ferrovm's Linux test kernel from Debian's linux-source-6.12 package:
# `make tinyconfig` + guests/linux/kernel.config, with guests/linux/syscall-entry.patch
# applied. Leaves vmlinux (the ELF ferrovm boots through its PVH note), bzImage and the
# final .config in OUT (default target/linux).
#
# The result is cached outside the work tree, keyed by a hash of everything that decides
# it (the fragment, the patch, this script, the source package's version and the
# compiler), so a second build on the same machine, or CI there, only copies it.
#
#   FERROVM_LINUX_CACHE  cache directory (default $XDG_CACHE_HOME/ferrovm/linux,
#                        i.e. ~/.cache/ferrovm/linux)
#   JOBS                 parallel compile jobs (default 2)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-target/linux}
JOBS=${JOBS:-2}
PACKAGE=linux-source-6.12
TARBALL=/usr/src/$PACKAGE.tar.xz
FRAGMENT=$ROOT/guests/linux/kernel.config
PATCH=$ROOT/guests/linux/syscall-entry.patch
CACHE=${FERROVM_LINUX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrovm/linux}

if ! version=$(dpkg-query -W -f='${Version}' "$PACKAGE" 2>/dev/null) || [ ! -f "$TARBALL" ]; then
    echo "$PACKAGE is not installed ($TARBALL): run scripts/install-linux-deps.sh" >&2
    exit 1
fi

key=$( { cat "$FRAGMENT" "$PATCH" "$ROOT/scripts/linux-kernel.sh"; echo "$PACKAGE $version"; gcc --version | head -1; } \
    | sha256sum | cut -c1-16)
built=$CACHE/$key
mkdir -p "$CACHE" "$OUT"

install_outputs() {
    for f in vmlinux bzImage config; do
        cp -f "$built/$f" "$OUT/$f.tmp" && mv -f "$OUT/$f.tmp" "$OUT/$f"
    done
    echo "kernel $key: $OUT/vmlinux ($(stat -c %s "$OUT/vmlinux") bytes), $OUT/bzImage"
}

if [ -f "$built/vmlinux" ]; then
    echo "kernel $key: cached in $built"
    install_outputs
    exit 0
fi

# One kernel build at a time per cache (the source and object trees are shared).
exec 9>"$CACHE/lock"
flock 9
if [ -f "$built/vmlinux" ]; then
    install_outputs
    exit 0
fi

start=$(date +%s)
SRC=$CACHE/src/$PACKAGE
OBJ=$CACHE/obj
# The extracted source carries the version it came from and the patch applied to it: a
# new package is extracted afresh, a changed patch is swapped in place (so the object
# tree stays valid and only what the patch touches is recompiled).
if [ "$(cat "$SRC/.ferrovm-version" 2>/dev/null)" != "$version" ]; then
    echo "extracting $TARBALL ($version)"
    rm -rf "$CACHE/src" "$OBJ"
    mkdir -p "$CACHE/src"
    tar -xJf "$TARBALL" -C "$CACHE/src"
    echo "$version" > "$SRC/.ferrovm-version"
fi
if ! cmp -s "$PATCH" "$SRC/.ferrovm.patch"; then
    if [ -f "$SRC/.ferrovm.patch" ]; then
        patch -d "$SRC" -p1 -R --quiet < "$SRC/.ferrovm.patch"
        rm -f "$SRC/.ferrovm.patch"
    fi
    patch -d "$SRC" -p1 --quiet --forward < "$PATCH"
    cp "$PATCH" "$SRC/.ferrovm.patch"
fi

# The kernel's banner names no build machine.
kmake() {
    make -C "$SRC" O="$OBJ" KBUILD_BUILD_USER=ferrovm KBUILD_BUILD_HOST=ferrovm "$@"
}
# tinyconfig is allnoconfig over the kernel's tiny fragments; the project's fragment joins
# them (its own lines win), so that every symbol it does not ask for stays off instead of
# taking its default once its dependencies are met (IPv6, PnP, cpufreq, ...).
mkdir -p "$OBJ"
allconfig=$OBJ/ferrovm.allconfig
own=$(grep -oE '^(# )?CONFIG_[A-Za-z0-9_]+' "$FRAGMENT" | sed 's/^# //' | paste -sd'|')
cat "$SRC"/kernel/configs/tiny-base.config "$SRC"/kernel/configs/tiny.config \
    "$SRC"/arch/x86/configs/tiny.config | grep -vE "^(# )?($own)[= ]" > "$allconfig" || true
cat "$FRAGMENT" >> "$allconfig"
kmake -s KCONFIG_ALLCONFIG="$allconfig" allnoconfig

# Every request of the fragment must survive Kconfig's dependency resolution.
missing=0
while IFS= read -r line; do
    if [[ $line =~ ^(CONFIG_[A-Za-z0-9_]+)=(.*)$ ]]; then
        want=$line
    elif [[ $line =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
        want=$line
    else
        continue
    fi
    sym=${BASH_REMATCH[1]}
    have=$(grep -E "^($sym=|# $sym is not set)" "$OBJ/.config" || true)
    # A symbol that is off may also be absent altogether (its menu is off).
    if [ "$have" != "$want" ] && ! { [[ $want == "# "* ]] && [ -z "$have" ]; }; then
        echo "kernel config: wanted '$want', got '${have:-nothing}'" >&2
        missing=1
    fi
done < "$FRAGMENT"
[ "$missing" = 0 ] || exit 1

echo "building the kernel with $JOBS jobs in $OBJ"
kmake -j"$JOBS" vmlinux bzImage

if ! readelf -n "$OBJ/vmlinux" | grep -q 'Xen.*0x00000012'; then
    echo "kernel: $OBJ/vmlinux has no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY)" >&2
    exit 1
fi
rm -rf "$built.tmp"
mkdir -p "$built.tmp"
cp "$OBJ/vmlinux" "$built.tmp/vmlinux"
cp "$OBJ/arch/x86/boot/bzImage" "$built.tmp/bzImage"
cp "$OBJ/.config" "$built.tmp/config"
mv "$built.tmp" "$built"
echo "kernel $key built in $(( $(date +%s) - start )) s"
# Keep the three newest kernels of this cache.
ls -dt "$CACHE"/[0-9a-f]*/ | grep -E '/[0-9a-f]{16}/$' | tail -n +4 | xargs -r rm -rf
install_outputs
