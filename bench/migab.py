#!/usr/bin/env python3
"""A/B of ferrovm's loopback migration with stage timings and CPU time per side, against
QEMU 7.2 multifd in the same run (docs/migration.md, "Where the time goes").

    sudo bench/migab.py [--runs N] [--gib 1] [--mib 896] [--variants a,b,qemu]
                        [--bin VARIANT=PATH]... [--env VARIANT:NAME=VALUE]...
                        [--connections N] [--conn VARIANT=N]

Each variant other than `qemu` is a ferrovm build (--bin; default target/release/ferrovm)
with environment variables of its own on both sides (--env), e.g. two builds:
`--variants old,new --bin old=/tmp/ferrovm-old`, or one switch:
`--variants on,off --env off:FERROVM_MIGRATION_POPULATE=off`. `qemu` is bench.py's QEMU
multifd run (4 channels). Rounds alternate the order of the variants. Every run primes the
host memory (`hostbench prime`, as bench.py does) and holds /tmp/ferrovm-bench.lock (flock)
so that benchmarks on this machine never overlap. Prints one JSON line per run (total,
source `report.stages`, the destination's `stages` from its log, CPU per process from
`perf stat -e task-clock` and /proc), then the figures per variant.
MIGAB_PERF=FILE also records `perf record -a` around each migration.
"""
import argparse
import fcntl
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import bench  # noqa: E402

LOCK = "/tmp/ferrovm-bench.lock"
PERF_OUT = os.environ.get("MIGAB_PERF")  # perf record -a around each migration
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid):
    """User + system CPU seconds of a process (its threads, living and ended)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def run_ferrovm(gib, mib, var_env, connections, binary):
    work = tempfile.mkdtemp(prefix="fvmigab")
    port = 7600 + int.from_bytes(os.urandom(2), "little") % 1000
    env = dict(os.environ, FERROVM_LOG="info")
    dst = subprocess.Popen([binary, "run", "--incoming", f"tcp:127.0.0.1:{port}",
                            "--memory", f"{gib}G", "--serial", f"file:{work}/dst.serial",
                            "--api-socket", f"{work}/dst.sock"],
                           env={**env, **var_env}, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=open(f"{work}/dst.err", "w"))
    src = subprocess.Popen([binary, "run", "--kernel", bench.guest("migrate-idle"),
                            "--cmdline", f"mib={mib}", "--memory", f"{gib}G",
                            "--serial", f"file:{work}/src.serial",
                            "--api-socket", f"{work}/src.sock"],
                           env={**env, **var_env}, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=open(f"{work}/src.err", "w"))
    out = ""
    try:
        if not bench.wait_for(f"{work}/src.serial", r"tick 1 ok", 180, src):
            return {"ok": False, "error": "guest did not start"}
        perf = None
        if PERF_OUT:
            perf = subprocess.Popen(["perf", "record", "-a", "-q", "-o", PERF_OUT],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        stats = [subprocess.Popen(["perf", "stat", "-e", "task-clock", "-x,", "-p", str(p.pid)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for p in (src, dst)]
        time.sleep(0.3)
        c0 = (cpu_s(src.pid), cpu_s(dst.pid))
        opts = ["--connections", str(connections)] if connections else []
        out = subprocess.run([binary, "ctl", "--api-socket", f"{work}/src.sock",
                              "--json", "migrate", f"tcp:127.0.0.1:{port}"] + opts,
                             capture_output=True, text=True, timeout=300).stdout
        c1 = (cpu_s(src.pid), cpu_s(dst.pid))
        if perf:
            perf.send_signal(2)
            perf.wait()
        task_ms = []
        for st in stats:
            st.send_signal(2)
            err = st.communicate()[1]
            task_ms.append(float(err.strip().splitlines()[-1].split(",")[0]))
        rep = json.loads(out.strip().splitlines()[-1])["report"]
        time.sleep(0.2)
        m = re.search(r"migration received: (\{.*\})", open(f"{work}/dst.err").read())
        got = json.loads(m.group(1)) if m else {}
        st = rep["stages"]
        return {"ok": True, "total_ms": rep["total_ms"], "downtime_ms": rep["downtime_ms"],
                "src_cpu_s": round(c1[0] - c0[0], 2), "dst_cpu_s": round(c1[1] - c0[1], 2),
                "src_task_ms": round(task_ms[0]), "dst_task_ms": round(task_ms[1]),
                "src": {k: st[k] for k in st}, "dst": got.get("stages", {}),
                "bytes": rep["bytes_total"]}
    except (json.JSONDecodeError, IndexError, KeyError, OSError) as e:
        return {"ok": False, "error": f"{e}: {out[-300:]}"}
    finally:
        for p in (src, dst):
            if p.poll() is None:
                p.kill()
                p.wait()
        subprocess.run(["rm", "-rf", work])


def run_qemu(gib, mib):
    return bench.qemu_migrate("loopback", "migrate-idle", f"mib={mib}", gib, False, 300,
                              multifd=4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gib", type=int, default=1)
    ap.add_argument("--mib", type=int, default=896)
    ap.add_argument("--variants", default="ferrovm,qemu")
    ap.add_argument("--env", action="append", default=[],
                    help="VARIANT:NAME=VALUE, set on both sides of the variant's runs")
    ap.add_argument("--connections", type=int, default=0)
    ap.add_argument("--conn", action="append", default=[],
                    help="VARIANT=N: --connections N for that variant's migrations")
    ap.add_argument("--bin", action="append", default=[],
                    help="VARIANT=PATH: the ferrovm binary of a variant (A/B of two builds)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    envs = {}
    for e in args.env:
        v, kv = e.split(":", 1)
        envs.setdefault(v, {}).update([kv.split("=", 1)])
    binaries = dict(e.split("=", 1) for e in args.bin)
    conns = {v: int(n) for v, n in (e.split("=", 1) for e in args.conn)}
    results = {}
    for r in range(args.runs):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            with open(LOCK, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                bench.prime(2 * args.mib + 256)
                load = os.getloadavg()[0]
                if v == "qemu":
                    m = run_qemu(args.gib, args.mib)
                else:
                    m = run_ferrovm(args.gib, args.mib, envs.get(v, {}),
                                    conns.get(v, args.connections),
                                    binaries.get(v, bench.FERROVM))
            m.update(variant=v, run=r, load=round(load, 2),
                     utc=time.strftime("%H:%M:%S", time.gmtime()))
            print(json.dumps(m), flush=True)
            results.setdefault(v, []).append(m)
    for v, ms in results.items():
        ok = [m for m in ms if m.get("ok")]
        if not ok:
            print(f"{v}: no successful run")
            continue
        tot = sorted(m["total_ms"] for m in ok)
        line = f"{v}: total ms {tot} median {statistics.median(tot):.0f}"
        if "src_task_ms" in ok[0]:
            for k in ("src_task_ms", "dst_task_ms"):
                line += f"; {k} {sorted(m[k] for m in ok)}"
            for side, key in (("src", "inspect_ms"), ("src", "write_ms"), ("dst", "populate_ms"),
                              ("dst", "read_ms"), ("dst", "crc_ms")):
                vals = sorted(round(m[side][key]) for m in ok if key in m[side])
                line += f"; {side} {key} {vals[0]}-{vals[-1]}" if vals else ""
        print(line)


if __name__ == "__main__":
    main()
