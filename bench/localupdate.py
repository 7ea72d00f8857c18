#!/usr/bin/env python3
"""Local live update (`migrate unix:PATH`: guest RAM handed over as a memfd, only the state
sent) against a TCP migration on loopback of the same guest, under ferrovm and QEMU 7.2
(which has no cpr-transfer: its same-host path is a TCP migration). Guests `migrate-idle`
of 1, 4 and 8 GiB that touched most of their RAM and check it every tick.

Per run: total time and downtime (ferrovm: pause -> the destination's acknowledgement;
QEMU: the guest's pause, source STOP -> destination RESUME, its own `downtime` field kept
beside); per size the medians and the ratios to the local update. Also the
memory backends compared: time from process start to the guest's first tick (its RAM
touched: transparent huge pages for anonymous memory; shmem follows
/sys/kernel/mm/transparent_hugepage/shmem_enabled) and a TCP migration, anon and memfd.
Prints markdown tables and writes the raw results (default target/bench/localupdate.json).

    sudo bench/localupdate.py [--runs N] [--sizes 1,4,8] [--vmms ferrovm,qemu]

Needs /dev/kvm, target/release/ferrovm (FERROVM=... for another build), the guests (make
guests) and qemu-system-x86_64.
"""

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from bench import ROOT, log, prime  # noqa: E402


def touched_mib(gib):
    # As bench.py's migration cases: most of the RAM below the 3 GiB MMIO hole.
    return min(gib * 1024 - 128, 2900)


class Ferrovm:
    """A ferrovm process with its serial output, stderr and API socket in `work`."""

    def __init__(self, work, name, args):
        self.work, self.name = Path(work), name
        self.serial = self.work / f"{name}.serial"
        self.err = self.work / f"{name}.err"
        self.sock = self.work / f"{name}.sock"
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(
            [bench.FERROVM, "run", *args, "--serial", f"file:{self.serial}",
             "--api-socket", str(self.sock)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(self.err, "w"))

    def wait_serial(self, pattern, timeout=300):
        return bench.wait_for(self.serial, pattern, timeout, self.p)

    def ctl(self, *args):
        out = subprocess.run([bench.FERROVM, "ctl", "--api-socket", str(self.sock), *args],
                             capture_output=True, text=True, timeout=600)
        return out.returncode, out.stdout, out.stderr

    def ticks(self):
        text = self.serial.read_text(errors="replace") if self.serial.exists() else ""
        return [int(t) for t in re.findall(r"migrate-idle: tick (\d+) ok", text)]

    def end(self):
        if self.p.poll() is None:
            self.ctl("shutdown")
        bench.stop(self.p)


def ferrovm_case(gib, backend, link):
    """Boots a source with `backend`, times its first tick, migrates it over `link`
    (unix: a local update; tcp: loopback) and checks the guest ticks on, intact."""
    work = tempfile.mkdtemp(prefix="fvbench-lu")
    mem = f"{gib}G"
    if link == "unix":
        url = f"unix:{work}/update.sock"
    else:
        url = f"tcp:127.0.0.1:{9600 + int(time.time() * 1000) % 1000}"
    dst = Ferrovm(work, "dst", ["--incoming", url, "--memory", mem])
    src = Ferrovm(work, "src", ["--kernel", bench.guest("migrate-idle"),
                                "--cmdline", f"mib={touched_mib(gib)}", "--memory", mem,
                                "--memory-backend", backend])
    try:
        if not src.wait_serial(r"tick 1 ok"):
            return {"ok": False, "error": f"guest did not start: {src.err.read_text()[-200:]}"}
        first_tick_ms = (time.monotonic() - src.t0) * 1000
        if not bench.wait_for(dst.err, r"listening on", 60, dst.p):
            return {"ok": False, "error": f"destination: {dst.err.read_text()[-200:]}"}
        status, out, err = src.ctl("--json", "migrate", url)
        if status != 0:
            return {"ok": False, "error": err.strip()[-300:]}
        rep = json.loads(out)["report"]
        src.p.wait(30)
        last = max(src.ticks() or [0])
        if not dst.wait_serial(rf"tick {last + 2} ok", 60):
            return {"ok": False, "error": "the guest did not tick on after the migration"}
        if "FAIL" in dst.serial.read_text(errors="replace"):
            return {"ok": False, "error": "the guest found corrupted pages"}
        return {"ok": True, "first_tick_ms": first_tick_ms, "total_ms": rep["total_ms"],
                "downtime_ms": rep["downtime_ms"], "bytes": rep["bytes_total"]}
    finally:
        src.end()
        dst.end()
        shutil.rmtree(work, ignore_errors=True)


# (label, VMM, memory backend, link)
CASES = [
    ("ferrovm local update (memfd, unix:)", "ferrovm", "memfd", "unix"),
    ("ferrovm TCP loopback (anon)", "ferrovm", "anon", "tcp"),
    ("ferrovm TCP loopback (memfd)", "ferrovm", "memfd", "tcp"),
    ("QEMU 7.2 TCP loopback", "qemu", None, "tcp"),
]


def run(sizes, vmms, runs):
    results = []
    for gib in sizes:
        for r in range(runs):
            for label, vmm, backend, link in bench.rotate(CASES, r):
                if vmm not in vmms:
                    continue
                prime(2 * touched_mib(gib) + 256)
                if vmm == "ferrovm":
                    m = ferrovm_case(gib, backend, link)
                else:
                    m = as_guest_pause(bench.qemu_migrate(
                        "loopback", "migrate-idle", f"mib={touched_mib(gib)}", gib, False, 300))
                m.update({"case": label, "gib": gib, "run": r})
                results.append(m)
                log(f"{gib} GiB {label}: " + (
                    f"total {m['total_ms']:.1f} ms, downtime {m['downtime_ms']:.2f} ms"
                    if m["ok"] else f"FAILED {m.get('error')}"))
    return results


def as_guest_pause(m):
    """QEMU's `downtime` ends when its source is done, before the destination runs: the
    guest's pause (STOP to RESUME) is what ferrovm's downtime measures."""
    if m.get("ok") and m.get("guest_pause_ms") is not None and "qemu_downtime_ms" not in m:
        m["qemu_downtime_ms"] = m["downtime_ms"]
        m["downtime_ms"] = m["guest_pause_ms"]
    return m


def medians(results, gib, label, key):
    vals = [m[key] for m in results
            if m["ok"] and m["gib"] == gib and m["case"] == label and m.get(key) is not None]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def table(results, sizes):
    local = CASES[0][0]
    rows = ["| guest | case | total (median, min–max) | downtime (median, min–max) | "
            "total ÷ local | downtime ÷ local |", "|---|---|---|---|---|---|"]
    for gib in sizes:
        base_t = medians(results, gib, local, "total_ms")
        base_d = medians(results, gib, local, "downtime_ms")
        for label, *_ in CASES:
            t = medians(results, gib, label, "total_ms")
            d = medians(results, gib, label, "downtime_ms")
            if not t:
                continue
            rt = f"{t[0] / base_t[0]:.1f}×" if base_t else "–"
            rd = f"{d[0] / base_d[0]:.1f}×" if base_d else "–"
            rows.append(f"| {gib} GiB | {label} | {t[0]:.1f} ms ({t[1]:.1f}–{t[2]:.1f}) | "
                        f"{d[0]:.2f} ms ({d[1]:.2f}–{d[2]:.2f}) | {rt} | {rd} |")
    rows += ["", "| guest | backend | process start to first tick (RAM touched) |", "|---|---|---|"]
    for gib in sizes:
        for label, backend in ((CASES[1][0], "anon"), (CASES[2][0], "memfd")):
            f = medians(results, gib, label, "first_tick_ms")
            if f:
                rows.append(f"| {gib} GiB ({touched_mib(gib)} MiB touched) | {backend} | "
                            f"{f[0]:.0f} ms ({f[1]:.0f}–{f[2]:.0f}) |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", default="1,4,8")
    ap.add_argument("--vmms", default="ferrovm,qemu")
    ap.add_argument("--out", default=str(ROOT / "target/bench/localupdate.json"))
    ap.add_argument("--table-of", metavar="JSON", help="print the tables of earlier results")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.table_of:
        results = [as_guest_pause(m) for m in json.loads(Path(a.table_of).read_text())]
    else:
        results = run(sizes, a.vmms.split(","), a.runs)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(table(results, sizes))


if __name__ == "__main__":
    main()
