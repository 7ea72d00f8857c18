#!/usr/bin/env python3
"""Migration speed against QEMU 7.2 in one run (docs/benchmarks.md, "Migration speed").

    sudo bench/migspeed.py [--runs N] [--sizes 1,2,4,8]

Interleaved rounds, each runs every case once under ferrovm and under QEMU (multifd with 4
channels; on the 1 Gbit/s link also multifd-compression zstd). Cases:
  - loopback, idle guests of 1/2/4/8 GiB (`migrate-idle`, up to 2.9 GiB touched);
  - a veth pair between two namespaces shaped to 1 Gbit/s (bench/migration.sh's set-up),
    1 and 4 GiB guests with a realistic image (`migrate-idle mix=1`: half the pages zero,
    the rest compressible about 2:1).
Prints one JSON line per run and a markdown table (medians, ratios of medians).
"""
import argparse
import json
import statistics
import subprocess
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import bench  # noqa: E402


def cases(sizes):
    out = []
    for gib in sizes:
        touch = min(gib * 1024 - 128, 2900)
        out.append(("loopback", gib, f"mib={touch}"))
    for gib in (1, 4):
        touch = min(gib * 1024 - 128, 2900)
        out.append(("1gbit", gib, f"mib={touch} mix=1"))
    return out


def run_ferrovm(link, gib, cmdline):
    bench.prime(2 * gib * 1024)
    return bench.ferrovm_migrate(link, "migrate-idle", cmdline, gib, [])


def run_qemu(link, gib, cmdline):
    bench.prime(2 * gib * 1024)
    comp = "zstd" if link == "1gbit" else None
    return bench.qemu_migrate(link, "migrate-idle", cmdline, gib, False, 300, multifd=4,
                              compression=comp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,4,8")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    subprocess.run([str(bench.ROOT / "bench/migration.sh"), "netns-up"], check=True)
    results = {}
    try:
        for r in range(args.runs):
            for link, gib, cmdline in cases(sizes):
                order = [("ferrovm", run_ferrovm), ("qemu", run_qemu)]
                if r % 2:
                    order.reverse()
                for name, fn in order:
                    m = fn(link, gib, cmdline)
                    print(json.dumps({"link": link, "gib": gib, "cmdline": cmdline,
                                      "vmm": name, **m}), flush=True)
                    results.setdefault((link, gib, cmdline, name), []).append(m)
    finally:
        subprocess.run([str(bench.ROOT / "bench/migration.sh"), "netns-down"])
    table(results, sizes)


def med(ms, key):
    v = [m[key] for m in ms if m.get("ok") and m.get(key) is not None]
    return statistics.median(v) if v else None


def table(results, sizes):
    print("| link | guest | RAM | ferrovm total | QEMU total | ferrovm/QEMU | ferrovm downtime "
          "| QEMU guest pause | ferrovm sent | QEMU sent |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for link, gib, cmdline in cases(sizes):
        f = results.get((link, gib, cmdline, "ferrovm"), [])
        q = results.get((link, gib, cmdline, "qemu"), [])
        ft, qt = med(f, "total_ms"), med(q, "total_ms")
        ratio = f"{ft / qt:.2f}×" if ft and qt else "—"
        fmt = (lambda v, d=0, u="": f"{v:.{d}f}{u}" if v is not None else "failed")
        mib = (lambda v: f"{v / 2**20:.0f} MiB" if v else "—")
        print(f"| {link} | `migrate-idle {cmdline}` | {gib} GiB | {fmt(ft and ft / 1000, 2, ' s')} "
              f"| {fmt(qt and qt / 1000, 2, ' s')} | {ratio} | {fmt(med(f, 'downtime_ms'), 1, ' ms')} "
              f"| {fmt(med(q, 'guest_pause_ms'), 1, ' ms')} | {mib(med(f, 'bytes'))} "
              f"| {mib(med(q, 'bytes'))} |")


if __name__ == "__main__":
    main()
