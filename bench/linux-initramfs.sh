#!/usr/bin/env bash
# Packs target/bench/hostbench (static) as /init of an initramfs (newc cpio), for running
# the guest-against-host workloads in a Linux guest (docs/benchmarks.md):
#   bench/linux-initramfs.sh [OUT.cpio]        (default target/bench/hostbench.cpio)
#   ferrovm run --kernel bzImage --initrd OUT.cpio --memory 2G --cmdline "console=ttyS0 quiet"
# As PID 1, hostbench mounts /proc and a tmpfs on /tmp, runs `all` (TSC rate, integer loop,
# memmove, first touch, getpid, fork+wait, write+fsync to /tmp) and powers the guest off.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/bench/hostbench.cpio}
make -C bench O="$PWD/target/bench" >/dev/null
python3 - target/bench/hostbench "$OUT" <<'PY'
import os, sys
src, out = sys.argv[1:3]

def entry(name, mode, data, ino):
    name_b = name.encode() + b"\0"
    hdr = "070701" + "".join(f"{v:08x}" for v in (
        ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name_b), 0))
    rec = hdr.encode() + name_b
    rec += b"\0" * (-len(rec) % 4) + data
    return rec + b"\0" * (-len(rec) % 4)

blob = entry("init", 0o100755, open(src, "rb").read(), 1)
blob += entry("TRAILER!!!", 0, b"", 0)
with open(out, "wb") as f:
    f.write(blob)
print(f"{out}: {len(blob)} bytes, /init = {src}")
PY
