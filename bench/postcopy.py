#!/usr/bin/env python3
"""Post-copy against pre-copy with auto-converge, for a guest that dirties memory faster than
any link: `migrate-dirty mib=1024` rewrites 1 GiB at full speed, in a 2 GiB machine. On
loopback and over bench/migration.sh's 1 Gbit/s veth pair, under ferrovm and QEMU 7.2.

Per run: total time, downtime (source pause -> destination running), time to full residency
(post-copy: pause -> every page on the destination), pages fetched on demand against
streamed (ferrovm), and the largest throttle the guest got. Prints a markdown table and
writes the raw results as JSON (default target/bench/postcopy.json).

    sudo bench/postcopy.py [--runs N] [--links loopback,1gbit] [--vmms ferrovm,qemu]

Needs root (namespaces, tc), /dev/kvm, target/release/ferrovm (FERROVM=... for another
build), the guests (make guests) and qemu-system-x86_64.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from bench import ROOT, log, prime  # noqa: E402
from qmp import QmpError  # noqa: E402

CMDLINE = "mib=1024"
MEMORY_GIB = 2
MAX_TIME_S = 120


def ferrovm_case(link, opts):
    """One migration through bench/migration.sh's `case`: the whole JSON report."""
    env = dict(os.environ)
    env.setdefault("FERROVM", bench.FERROVM)
    out = subprocess.run([str(ROOT / "bench/migration.sh"), "case", link, "migrate-dirty",
                          CMDLINE, f"{MEMORY_GIB}G"] + opts, capture_output=True, text=True,
                         timeout=900, env=env).stdout
    try:
        rep = json.loads(out.strip().splitlines()[-1])["report"]
    except (json.JSONDecodeError, IndexError, KeyError):
        return {"ok": False, "error": out[-300:]}
    pc = rep.get("postcopy") or {}
    return {"ok": True, "total_ms": rep["total_ms"], "downtime_ms": rep["downtime_ms"],
            "residency_ms": pc.get("time_to_residency_ms", rep["total_ms"]),
            "on_demand": pc.get("pages_on_demand"), "streamed": pc.get("pages_streamed"),
            "bytes": rep["bytes_total"], "rounds": len(rep["rounds"]),
            "throttle": rep["max_throttle_percent"]}


def qemu_case(link, postcopy):
    """QEMU 7.2: pre-copy with auto-converge, or post-copy (postcopy-ram, switched with
    migrate-start-postcopy once the first pass is under way)."""
    pair = bench.QemuPair(link, MEMORY_GIB, "migrate-dirty", CMDLINE)
    try:
        if not pair.connect(r": pass [1-9]"):
            return {"ok": False, "error": "guest did not start"}
        s, d = pair.s, pair.d
        caps = [{"capability": "postcopy-ram" if postcopy else "auto-converge",
                 "state": True}]
        if postcopy:
            d.cmd("migrate-set-capabilities", capabilities=caps)
        s.cmd("migrate-set-capabilities", capabilities=caps)
        s.cmd("migrate", uri=pair.uri())
        if postcopy:
            time.sleep(0.05)
            s.cmd("migrate-start-postcopy")
        info, failure = bench.qemu_migration_outcome(s, MAX_TIME_S, poll_s=0.02)
        if failure:
            return failure
        # QEMU's own `downtime` is not meaningful after a switch to post-copy: measure the
        # guest's pause as the source's STOP to the destination's RESUME.
        resumed = d.wait_event("RESUME", 30)
        stopped = s.event_time("STOP")
        downtime = (resumed - stopped) * 1000 if resumed and stopped else info["downtime"]
        running = d.cmd("query-status").get("status") == "running"
        ram = info.get("ram", {})
        return {"ok": running, "total_ms": info["total-time"], "downtime_ms": downtime,
                "residency_ms": info["total-time"], "on_demand": None, "streamed": None,
                "bytes": ram.get("transferred"), "rounds": ram.get("dirty-sync-count"),
                "throttle": info.get("cpu-throttle-percentage", 0)}
    except (QmpError, OSError) as e:
        return {"ok": False, "error": str(e)}
    finally:
        pair.end()


MODES = {
    "pre-copy + auto-converge": (["--auto-converge", "--max-time-s", str(MAX_TIME_S)], False),
    "post-copy at once": (["--post-copy"], True),
    "post-copy after 2 rounds": (["--post-copy-after-rounds", "2"], True),
}


def run(links, vmms, runs):
    results = []
    for link in links:
        for mode, (fopts, postcopy) in MODES.items():
            for vmm in vmms:
                if vmm == "qemu" and mode == "post-copy after 2 rounds":
                    continue  # QEMU's switch is by hand, not by rounds
                for r in range(runs):
                    prime(2 * 1024 + 512)
                    m = ferrovm_case(link, fopts) if vmm == "ferrovm" else qemu_case(link,
                                                                                       postcopy)
                    m.update({"vmm": vmm, "link": link, "mode": mode, "run": r})
                    results.append(m)
                    log(f"{link} {mode} {vmm}: " + (
                        f"total {m['total_ms'] / 1000:.2f} s, downtime {m['downtime_ms']:.1f} ms"
                        if m["ok"] else f"FAILED {m.get('error')}"))
    return results


def table(results):
    rows = ["| link | mode | VMM | total | downtime | full residency | on demand / streamed "
            "pages | max throttle |", "|---|---|---|---|---|---|---|---|"]
    for m in results:
        if not m["ok"]:
            rows.append(f"| {m['link']} | {m['mode']} | {m['vmm']} | failed: "
                        f"{m.get('error', '')[:60]} | | | | |")
            continue
        split = (f"{m['on_demand']} / {m['streamed']}" if m.get("on_demand") is not None
                 else "–")
        rows.append(f"| {m['link']} | {m['mode']} | {m['vmm']} | {m['total_ms'] / 1000:.2f} s "
                    f"| {m['downtime_ms']:.1f} ms | {m['residency_ms'] / 1000:.2f} s | {split} "
                    f"| {m['throttle']} % |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--links", default="loopback,1gbit")
    ap.add_argument("--vmms", default="ferrovm,qemu")
    ap.add_argument("--out", default=str(ROOT / "target/bench/postcopy.json"))
    a = ap.parse_args()
    links = a.links.split(",")
    if "1gbit" in links:
        subprocess.run([str(ROOT / "bench/migration.sh"), "netns-up"], check=True)
    try:
        results = run(links, a.vmms.split(","), a.runs)
    finally:
        if "1gbit" in links:
            subprocess.run([str(ROOT / "bench/migration.sh"), "netns-down"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
