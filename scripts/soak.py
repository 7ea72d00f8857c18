#!/usr/bin/env python3
"""`make soak`: a guest that dirties memory and checks it migrates back and forth over
loopback, with a snapshot and a restore every few hops.

    scripts/soak.py [--hops 100] [--snapshot-every 10] [--mib 32] [--out target/soak]

After every hop the script checks that the guest made progress and reported no corruption
(`migrate-dirty` verifies its own invariant after every pass), and records the receiving
VMM's resident memory and open file descriptors once the guest runs there, so that a leak
shows as a trend. It prints one line per hop and a summary, writes every figure to
OUT/soak.json, and exits 1 on the first failure (the serial logs stay in OUT).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FERROVM = str(ROOT / "target/release/ferrovm")
GUEST = str(ROOT / "target/guests/migrate-dirty.elf")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, ok, limit=60.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def last_pass(serial):
    passes = [int(l.split()[2]) for l in serial.read_text(errors="replace").splitlines()
              if l.startswith("migrate-dirty: pass ") and l.split()[2].isdigit()]
    return max(passes, default=0)


class Vmm:
    """One ferrovm process with its serial file and API socket."""

    def __init__(self, out, name, args):
        self.serial = out / f"{name}.serial"
        self.sock = out / f"{name}.sock"
        self.proc = subprocess.Popen(
            [FERROVM, "run", *args, "--serial", f"file:{self.serial}",
             "--api-socket", str(self.sock)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(f"{name}'s API socket", self.sock.exists)

    def ctl(self, *args):
        return subprocess.run([FERROVM, "ctl", "--api-socket", str(self.sock), *args],
                              capture_output=True, text=True, timeout=300)

    def figures(self):
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        rss = next(int(l.split()[1]) for l in status.splitlines() if l.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        return rss, fds

    def check(self, since):
        text = self.serial.read_text(errors="replace")
        if "FAIL" in text:
            raise RuntimeError(f"the guest reported a failure in {self.serial}")
        wait_for(f"guest progress past pass {since} in {self.serial}",
                 lambda: last_pass(self.serial) > since)
        return last_pass(self.serial)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def hop(out, vmm, index, mib):
    """Migrates `vmm`'s guest to a fresh destination; returns the destination."""
    port = free_port()
    dest = Vmm(out, f"hop{index}", ["--incoming", f"tcp:127.0.0.1:{port}",
                                    "--memory", "256M"])
    t = time.monotonic()
    r = vmm.ctl("--json", "migrate", f"tcp:127.0.0.1:{port}")
    if r.returncode != 0:
        raise RuntimeError(f"hop {index}: migration failed: {r.stderr.strip()}")
    vmm.proc.wait(timeout=60)
    return dest, time.monotonic() - t, json.loads(r.stdout)["report"]


def snapshot_and_restore(out, vmm, index):
    snap = out / "soak.snap"
    r = vmm.ctl("snapshot", str(snap))
    if r.returncode != 0:
        raise RuntimeError(f"hop {index}: snapshot failed: {r.stderr.strip()}")
    vmm.ctl("shutdown")
    vmm.proc.wait(timeout=60)
    return Vmm(out, f"restore{index}", ["--restore", str(snap)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hops", type=int, default=100)
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "target/soak"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):
        old.unlink()
    vmm = Vmm(out, "source", ["--kernel", GUEST, "--cmdline", f"mib={a.mib}",
                              "--memory", "256M"])
    passes = vmm.check(0)
    rows = []
    try:
        for i in range(1, a.hops + 1):
            vmm, seconds, report = hop(out, vmm, i, a.mib)
            passes = vmm.check(passes)
            kind = "migrate"
            if a.snapshot_every and i % a.snapshot_every == 0:
                vmm = snapshot_and_restore(out, vmm, i)
                passes = vmm.check(passes)
                kind = "migrate+snapshot"
            rss, fds = vmm.figures()
            rows.append({"hop": i, "kind": kind, "seconds": round(seconds, 3),
                         "downtime_ms": round(report["downtime_ms"], 1),
                         "rss_kib": rss, "fds": fds, "guest_pass": passes})
            print(f"hop {i:3} {kind:16} {seconds:6.2f} s  downtime {report['downtime_ms']:6.1f} ms"
                  f"  rss {rss / 1024:6.1f} MiB  fds {fds:3}  guest pass {passes}", flush=True)
    finally:
        vmm.stop()
        (out / "soak.json").write_text(json.dumps(rows, indent=1))
    rss = [r["rss_kib"] for r in rows]
    fds = [r["fds"] for r in rows]
    print(f"soak: {len(rows)} hops, guest intact; rss {min(rss) / 1024:.1f}-{max(rss) / 1024:.1f} MiB,"
          f" fds {min(fds)}-{max(fds)}; downtime max {max(r['downtime_ms'] for r in rows):.1f} ms")


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        print(f"soak: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
