#!/usr/bin/env bash
# `make bench`: everything the benchmarks need, then bench/bench.py and bench/report.py.
#   bench/run.sh [--quick] [bench.py options...]
# Needs root (network namespaces, tc; apt-get for missing packages) and /dev/kvm.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "bench: needs root (network namespaces and tc for the 1 Gbit/s link, apt-get)" >&2
    exit 1
fi
if [ ! -c /dev/kvm ]; then
    echo "bench: /dev/kvm is missing" >&2
    exit 1
fi

apt_updated=0
apt_install() {
    if [ $apt_updated = 0 ]; then
        apt-get update -qq
        apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# QEMU: Debian's qemu-system-x86.
command -v qemu-system-x86_64 >/dev/null || apt_install qemu-system-x86
# SeaBIOS for the firmware-boot figures (QEMU's own copy comes from the same package).
[ -f /usr/share/seabios/bios-256k.bin ] || apt_install seabios
command -v tc >/dev/null || apt_install iproute2
command -v gcc >/dev/null || apt_install gcc libc6-dev make

# A Python 3 with matplotlib: the one on PATH, else Debian's, else install Debian's package.
PYTHON=""
for p in python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c "import matplotlib" 2>/dev/null; then
        PYTHON=$p
        break
    fi
done
if [ -z "$PYTHON" ]; then
    apt_install python3-matplotlib
    PYTHON=/usr/bin/python3
fi

make -C bench O="$PWD/target/bench" >/dev/null
"$PYTHON" bench/bench.py "$@"
# virtio-net (section 9): bench/net.py in its own namespaces, into target/bench/net.json; left
# out when --only names other sections only (bench.py itself ignores the name "net").
args=" $* "
if [[ "$args" != *" --only"* ]] || [[ "$args" == *net* ]]; then
    rounds=3
    [[ "$args" == *" --quick "* ]] && rounds=1
    "$PYTHON" bench/net.py --rounds "$rounds" --json target/bench/net.json >/dev/null
fi
"$PYTHON" bench/report.py target/bench/results.json docs
