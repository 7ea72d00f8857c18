#!/usr/bin/env python3
"""ferrovm benchmarks against QEMU and a raw KVM_RUN loop, measured in one run.

    bench/bench.py [--quick] [--only startup,exits,memory,migration,workloads,restore,blk,firmware,localupdate]
                   [--out target/bench/results.json]

Writes every sample to the JSON file; bench/report.py turns it into docs/benchmarks.md
and the plots. `make bench` (bench/run.sh) builds everything and runs both. Needs root
(network namespaces and tc for the 1 Gbit/s migration link) and /dev/kvm.

Every comparison is interleaved: each round runs every VMM once, in an order that
rotates from round to round, so slow drift of this shared host hits all of them alike.
"""

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ in bench/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from qmp import Qmp, QmpError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FERROVM = str(ROOT / "target/release/ferrovm")
GUESTS = ROOT / "target/guests"
RAWKVM = str(ROOT / "target/bench/rawkvm")
HOSTBENCH = str(ROOT / "target/bench/hostbench")
BLKHOST = str(ROOT / "target/bench/blkhost")
QEMU = shutil.which("qemu-system-x86_64") or "qemu-system-x86_64"
NS_SRC, NS_DST, NS_ADDR = "fvbencha", "fvbenchb", "10.214.0.2"  # bench/migration.sh's

# The QEMU command line of DESIGN.md's anchors and of the issue.
QEMU_BASE = [QEMU, "-accel", "kvm", "-nodefaults", "-nographic", "-no-user-config",
             "-device", "isa-debug-exit,iobase=0xf4,iosize=1"]

DEVNULL = subprocess.DEVNULL


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rotate(items, k):
    k %= len(items)
    return items[k:] + items[:k]


def guest(name):
    return str(GUESTS / f"{name}.elf")


def qemu_cmd(machine, kernel, append, mem_mib, serial="stdio", extra=()):
    cmd = QEMU_BASE + ["-M", machine, "-m", str(mem_mib), "-serial", serial, "-kernel", kernel]
    if append:
        cmd += ["-append", append]
    return cmd + list(extra)


def ferrovm_cmd(kernel, cmdline, mem_mib, serial="stdio", extra=()):
    cmd = [FERROVM, "run", "--kernel", kernel, "--memory", f"{mem_mib}M", "--serial", serial]
    if cmdline:
        cmd += ["--cmdline", cmdline]
    return cmd + list(extra)


def vmm_cmd(vmm, kernel, cmdline, mem_mib, serial="stdio"):
    if vmm == "ferrovm":
        return ferrovm_cmd(kernel, cmdline, mem_mib, serial)
    if vmm == "qemu-microvm":
        return qemu_cmd("microvm", kernel, cmdline, mem_mib, serial)
    if vmm == "qemu-pc":
        return qemu_cmd("pc", kernel, cmdline, mem_mib, serial)
    if vmm == "rawkvm":
        assert serial == "stdio"
        return [RAWKVM, "-m", str(mem_mib), "-c", cmdline or "", kernel]
    raise ValueError(vmm)


def prime(mib):
    """Touches `mib` MiB of fresh host memory and frees it, just before a run that allocates
    fresh memory. This machine is itself a VM whose hypervisor takes freed memory back
    (virtio-balloon free page reporting, within seconds), and a first touch of memory it
    has taken back costs several times more: without this, a run's first-touch costs
    depend on what ran before it (1 GiB loopback migrations varied 0.3-2.4 s)."""
    subprocess.run([HOSTBENCH, "prime", str(mib)], check=True)


def run_guest(cmd, timeout=300):
    """Runs a guest to its end; returns (status, console text)."""
    p = subprocess.run(cmd, stdin=DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=timeout)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


# ---------------------------------------------------------------------------------------
# machine

def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def machine_info():
    cpu = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-").strip()
    accel = {}
    try:
        accel = json.loads(sh(f"{FERROVM} accel --json"))
    except json.JSONDecodeError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": sh("uname -r"),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kvm_backend": accel.get("backend", "?"),
        "thp": sh("cat /sys/kernel/mm/transparent_hugepage/enabled"),
        "qemu": sh(f"{QEMU} --version | head -1"),
        "ferrovm_commit": commit(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "tsc_hz": tsc_hz(),
    }


def commit():
    # docs/ is report.py's output: changes there do not change what is measured.
    dirty = sh(f"git -C {ROOT} status --porcelain -- . ':!docs'")
    return sh(f"git -C {ROOT} rev-parse --short HEAD") + (" (with uncommitted changes)" if dirty else "")


def tsc_hz():
    out = subprocess.run([HOSTBENCH, "tsc"], capture_output=True, text=True, check=True).stdout
    return float(re.search(r"tsc_hz=(\d+)", out).group(1))


# ---------------------------------------------------------------------------------------
# 1. start-up

def time_to_marker(cmd, marker):
    """Runs cmd to its end; returns the ns from process start to `marker` first on its
    console (None if never), the ns to its exit, its status and the whole console."""
    t0 = time.perf_counter_ns()
    p = subprocess.Popen(cmd, stdin=DEVNULL, stdout=subprocess.PIPE, stderr=DEVNULL, bufsize=0)
    fd = p.stdout.fileno()
    first, got = None, b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        got += chunk
        if first is None and marker in got:
            first = time.perf_counter_ns() - t0
    status = p.wait()
    return first, time.perf_counter_ns() - t0, status, got


def time_startup(cmd):
    """Process start -> first console byte ('!') and -> process exit, in ms."""
    first, t_exit, status, got = time_to_marker(cmd, b"!")
    if status != 1 or first is None:
        raise RuntimeError(f"{cmd[0]}: status {status}, console {got[:200]!r}")
    return first / 1e6, t_exit / 1e6


def bench_startup(cfg):
    vmms = ["rawkvm", "ferrovm", "qemu-microvm", "qemu-pc"]
    res = {v: {"first_ms": [], "exit_ms": []} for v in vmms}
    kernel = guest("bench-start")
    for r in range(cfg["startup_rounds"]):
        for v in rotate(vmms, r):
            first, ex = time_startup(vmm_cmd(v, kernel, "", 256))
            res[v]["first_ms"].append(first)
            res[v]["exit_ms"].append(ex)
        log(f"startup round {r + 1}/{cfg['startup_rounds']}: "
            + ", ".join(f"{v} {res[v]['first_ms'][-1]:.1f} ms" for v in vmms))
    return {"guest": "bench-start", "memory_mib": 256, "vmms": res}


# ---------------------------------------------------------------------------------------
# 2. exit round trips

EXIT_RE = re.compile(r"exit: ring=(\d) test=(\S+) rep=(\d+) n=(\d+) cycles=(\d+)")


def bench_exits(cfg, hz):
    vmms = ["rawkvm", "ferrovm", "qemu-microvm"]
    cmdline = f"n3={cfg['exit_n']} n0={cfg['exit_n']} reps={cfg['exit_reps']}"
    samples = []
    for r in range(cfg["exit_rounds"]):
        for v in rotate(vmms, r):
            status, out, err = run_guest(vmm_cmd(v, guest("bench-exit"), cmdline, 256))
            if status != 1 or "PASS" not in out:
                raise RuntimeError(f"bench-exit under {v}: status {status}\n{out}\n{err}")
            for m in EXIT_RE.finditer(out):
                ring, test, rep, n, cycles = m.groups()
                samples.append({"vmm": v, "round": r, "ring": int(ring), "test": test,
                                "rep": int(rep), "us": int(cycles) / int(n) / hz * 1e6})
        log(f"exits round {r + 1}/{cfg['exit_rounds']}")
    return {"guest": "bench-exit", "cmdline": cmdline, "port": "0x3ff (COM1 scratch)",
            "mmio": "0xd0000000 (unclaimed)", "samples": samples}


# ---------------------------------------------------------------------------------------
# 3. memory overhead

def wait_for(path, pattern, timeout, proc=None):
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if rx.search(Path(path).read_text(errors="replace")):
                return True
        except FileNotFoundError:
            pass
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def proc_memory(pid):
    status = Path(f"/proc/{pid}/status").read_text()
    kib = {k: int(v) for k, v in re.findall(r"^(VmRSS|RssAnon|RssFile|RssShmem):\s+(\d+) kB",
                                              status, re.M)}
    # The guest RAM mapping: the largest mapping (Size >= guest memory).
    best = (0, 0)
    size = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            a, b = line.split()[0].split("-")
            size = int(b, 16) - int(a, 16)
        elif line.startswith("Rss:") and size is not None:
            rss = int(line.split()[1])
            if size > best[0]:
                best = (size, rss)
    pss = re.search(r"^Pss:\s+(\d+) kB", Path(f"/proc/{pid}/smaps_rollup").read_text(), re.M)
    kib["guest_ram_rss"] = best[1]
    kib["Pss"] = int(pss.group(1)) if pss else 0
    return kib


def bench_memory(cfg):
    vmms = ["ferrovm", "qemu-microvm", "qemu-pc"]
    touched = cfg["memory_touch_mib"]
    cmdline = f"mib={touched} tick_ms=100"
    res = {v: [] for v in vmms}
    for r in range(cfg["memory_rounds"]):
        for v in rotate(vmms, r):
            work = tempfile.mkdtemp(prefix="fvbench-mem")
            serial = f"{work}/serial"
            p = subprocess.Popen(vmm_cmd(v, guest("migrate-idle"), cmdline, 1024, f"file:{serial}"),
                                 stdin=DEVNULL, stdout=DEVNULL, stderr=DEVNULL)
            try:
                if not wait_for(serial, r"tick 2 ok", 60, p):
                    raise RuntimeError(f"migrate-idle under {v} did not tick")
                time.sleep(0.3)
                m = proc_memory(p.pid)
            finally:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                shutil.rmtree(work, ignore_errors=True)
            res[v].append(m)
        log(f"memory round {r + 1}/{cfg['memory_rounds']}: " + ", ".join(
            f"{v} {(res[v][-1]['VmRSS'] - res[v][-1]['guest_ram_rss']) / 1024:.1f} MiB" for v in vmms))
    return {"guest": "migrate-idle", "cmdline": cmdline, "memory_mib": 1024,
            "touched_mib": touched, "vmms": res}


# ---------------------------------------------------------------------------------------
# 4. live migration

def ferrovm_migrate(link, guest_name, cmdline, gib, opts):
    out = subprocess.run([str(ROOT / "bench/migration.sh"), "case", link, guest_name, cmdline,
                          f"{gib}G"] + opts, capture_output=True, text=True, timeout=600).stdout
    try:
        rep = json.loads(out.strip().splitlines()[-1])["report"]
    except (json.JSONDecodeError, IndexError, KeyError):
        return {"ok": False, "error": out[-300:]}
    return {"ok": True, "total_ms": rep["total_ms"], "downtime_ms": rep["downtime_ms"],
            "bytes": rep["bytes_total"], "rounds": len(rep["rounds"]),
            "converged": rep["converged"], "throttle": rep["max_throttle_percent"]}


def stop(p):
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class QemuPair:
    """A migration's two QEMUs: the source booting `guest_name` with `cmdline`, the
    destination listening on `addr`:`port` (with `defer`, waiting for migrate-incoming), on
    loopback or across the 1 Gbit/s namespaces."""

    def __init__(self, link, gib, guest_name, cmdline, defer=False):
        self.work = tempfile.mkdtemp(prefix="fvbench-qmig")
        src_ns, dst_ns, self.addr = [], [], "127.0.0.1"
        if link == "1gbit":
            src_ns, dst_ns, self.addr = (["ip", "netns", "exec", NS_SRC],
                                         ["ip", "netns", "exec", NS_DST], NS_ADDR)
        self.port = 8600 + random.randrange(1000)
        base = QEMU_BASE + ["-M", "microvm", "-m", f"{gib}G"]
        incoming = "defer" if defer else f"tcp:{self.addr}:{self.port}"
        self.s = self.d = None
        self.dst = subprocess.Popen(dst_ns + base + [
            "-serial", f"file:{self.work}/dst.ser",
            "-qmp", f"unix:{self.work}/dst.qmp,server=on,wait=off", "-incoming", incoming],
            stdin=DEVNULL, stdout=DEVNULL, stderr=DEVNULL)
        self.src = subprocess.Popen(src_ns + base + [
            "-serial", f"file:{self.work}/src.ser",
            "-qmp", f"unix:{self.work}/src.qmp,server=on,wait=off",
            "-kernel", guest(guest_name), "-append", cmdline],
            stdin=DEVNULL, stdout=DEVNULL, stderr=DEVNULL)

    def connect(self, started):
        """Waits for the source's serial output to match `started`, then opens both QMP
        sockets (`s`, `d`) and lets the source send as fast as the link (QEMU 7.2 caps at
        128 MiB/s by default; ferrovm has no cap) with ferrovm's default downtime target.
        False if the guest did not start."""
        if not wait_for(f"{self.work}/src.ser", started, 180, self.src):
            return False
        self.s, self.d = Qmp(f"{self.work}/src.qmp"), Qmp(f"{self.work}/dst.qmp")
        self.s.cmd("migrate-set-parameters", **{"max-bandwidth": 100 << 30, "downtime-limit": 50})
        return True

    def uri(self):
        return f"tcp:{self.addr}:{self.port}"

    def end(self):
        """Quits both QEMUs, stops the processes and removes their work directory."""
        for q in (self.s, self.d):
            if q:
                try:
                    q.cmd("quit")
                except (QmpError, OSError):
                    pass
                q.close()
        stop(self.src)
        stop(self.dst)
        shutil.rmtree(self.work, ignore_errors=True)


def qemu_migration_outcome(s, max_time_s, poll_s=0.05):
    """Polls QEMU's `query-migrate` until the migration ends (cancelling it after
    `max_time_s`): (its last info, None) when completed, else (None, a failed result)."""
    deadline = time.monotonic() + max_time_s
    while True:
        info = s.cmd("query-migrate")
        if info.get("status") in ("completed", "failed", "cancelled"):
            break
        if time.monotonic() > deadline:
            s.cmd("migrate_cancel")
            return None, {"ok": False, "error": f"not done after {max_time_s} s"}
        time.sleep(poll_s)
    if info["status"] != "completed":
        return None, {"ok": False, "error": info.get("error-desc", info["status"])}
    return info, None


def qemu_migrate(link, guest_name, cmdline, gib, auto_converge, max_time_s, multifd=0,
                 compression=None):
    """multifd=N: QEMU's multifd with N channels (set on both sides before the stream, the
    destination through -incoming defer); compression: its multifd-compression (zstd)."""
    pair = QemuPair(link, gib, guest_name, cmdline, defer=bool(multifd))
    try:
        if not pair.connect(r"tick 1 ok|: pass [1-9]"):
            return {"ok": False, "error": "guest did not start"}
        s, d = pair.s, pair.d
        if multifd:
            extra = {"multifd-compression": compression} if compression else {}
            for q in (d, s):
                q.cmd("migrate-set-capabilities",
                      capabilities=[{"capability": "multifd", "state": True}])
                q.cmd("migrate-set-parameters", **{"multifd-channels": multifd}, **extra)
            d.cmd("migrate-incoming", uri=pair.uri())
        if auto_converge:
            s.cmd("migrate-set-capabilities",
                  capabilities=[{"capability": "auto-converge", "state": True}])
        s.cmd("migrate", uri=pair.uri())
        info, failure = qemu_migration_outcome(s, max_time_s)
        if failure:
            return failure
        resumed = d.wait_event("RESUME", 30)
        stopped = s.event_time("STOP")
        running = d.cmd("query-status").get("status") == "running"
        ram = info.get("ram", {})
        return {"ok": running, "total_ms": info["total-time"], "downtime_ms": info["downtime"],
                "guest_pause_ms": (resumed - stopped) * 1000 if resumed and stopped else None,
                "bytes": ram.get("transferred"), "rounds": ram.get("dirty-sync-count"),
                "converged": True, "throttle": info.get("cpu-throttle-percentage", 0)}
    except (QmpError, OSError) as e:
        return {"ok": False, "error": str(e)}
    finally:
        pair.end()


def bench_migration(cfg):
    subprocess.run([str(ROOT / "bench/migration.sh"), "netns-up"], check=True)
    results = []
    try:
        for case in cfg["migration_cases"]:
            link, kind, gib, runs = case["link"], case["guest"], case["gib"], case["runs"]
            if kind == "migrate-idle":
                touched = min(gib * 1024 - 128, 2900)
                cmdline = f"mib={touched}"
                fopts, auto, max_t = [], False, 300
            else:
                touched = case["mib"]
                cmdline = f"mib={touched}"
                fopts, auto, max_t = ["--auto-converge", "--max-time-s", "120"], True, 120
            for r in range(runs):
                for v in rotate(["ferrovm", "qemu"], r):
                    prime(2 * touched + 256)
                    if v == "ferrovm":
                        m = ferrovm_migrate(link, kind, cmdline, gib, fopts)
                    else:
                        m = qemu_migrate(link, kind, cmdline, gib, auto, max_t)
                    m.update({"vmm": v, "link": link, "guest": kind, "cmdline": cmdline,
                              "gib": gib, "run": r})
                    results.append(m)
                    log(f"migration {link} {kind} {cmdline} {gib} GiB {v}: "
                        + (f"{m['total_ms'] / 1000:.2f} s, downtime {m['downtime_ms']:.1f} ms"
                           if m["ok"] else f"FAILED {m.get('error')}"))
    finally:
        subprocess.run([str(ROOT / "bench/migration.sh"), "netns-down"])
    return {"results": results}


# ---------------------------------------------------------------------------------------
# 5. guest against host

WORK_RE = re.compile(r"work: (\S+) rep=(\d+) units=(\d+) cycles=(\d+) check=([0-9a-f]+)")


def bench_workloads(cfg, hz):
    reps, mib = cfg["work_reps"], cfg["work_mib"]
    mem = 64 + (2 + reps) * mib + 64
    cmdline = f"reps={reps} mib={mib}"
    samples = []
    for r in range(cfg["work_rounds"]):
        for v in rotate(["host", "ferrovm", "qemu-microvm"], r):
            prime((2 + 2 * reps) * mib + 256)
            if v == "host":
                status, out, err = run_guest([HOSTBENCH, "work", str(reps), "100000000", str(mib)])
                ok = status == 0
            else:
                status, out, err = run_guest(vmm_cmd(v, guest("bench-work"), cmdline, mem))
                ok = status == 1 and "PASS" in out
            if not ok:
                raise RuntimeError(f"workloads under {v}: status {status}\n{out}\n{err}")
            for m in WORK_RE.finditer(out):
                name, rep, units, cycles, check = m.groups()
                samples.append({"env": v, "round": r, "name": name, "rep": int(rep),
                                "units": int(units), "cycles": int(cycles), "check": check,
                                "s": int(cycles) / hz})
        log(f"workloads round {r + 1}/{cfg['work_rounds']}")
    status, out, err = run_guest([HOSTBENCH, "os", str(reps), "/var/tmp"])
    samples += work_samples(out, "host", hz)
    samples += linux_guest_samples(hz)
    return {"guest": "bench-work", "cmdline": cmdline, "memory_mib": mem, "samples": samples,
            "linux_counts": LINUX_COUNTS}


def work_samples(out, env, hz, round_=0):
    samples = []
    for m in WORK_RE.finditer(out):
        name, rep, units, cycles, check = m.groups()
        samples.append({"env": env, "round": round_, "name": name, "rep": int(rep),
                        "units": int(units), "cycles": int(cycles), "check": check,
                        "s": int(cycles) / hz})
    return samples


# What hostbench does as the Linux guest's init: system calls cost tens of microseconds in
# this host's emulated guest ring 0, so fewer of them than on the host (figures are per call).
LINUX_COUNTS = {"HB_REPS": 3, "HB_GETPID": 20000, "HB_FORK": 50, "HB_FSYNC": 50,
                "HB_ZERO_MIB": 256, "HB_SEQ_MIB": 128, "HB_WORK_MIB": 64}


def linux_guest_samples(hz):
    """hostbench as /init of the repository's Linux test guest (`make linux`) under ferrovm,
    on an ext4 disk of its own: the OS workloads in a real kernel. None without the kernel."""
    kernel = ROOT / "target/linux/vmlinux"
    if not kernel.exists():
        log("workloads: no Linux test guest (make linux): the Linux column is left out")
        return []
    work = tempfile.mkdtemp(prefix="fvbench-linux")
    try:
        cpio, disk = f"{work}/hostbench.cpio", f"{work}/disk.img"
        subprocess.run([str(ROOT / "bench/linux-initramfs.sh"), cpio], check=True,
                       stdout=DEVNULL)
        subprocess.run(["mkfs.ext4", "-q", "-F", disk, "1G"], check=True)
        words = " ".join(f"{k}={v}" for k, v in LINUX_COUNTS.items())
        cmdline = f"console=ttyS0 quiet nmi_watchdog=0 tsc=reliable {words}"
        cmd = ferrovm_cmd(str(kernel), cmdline, 1024, extra=["--initrd", cpio, "--disk", disk])
        status, out, err = run_guest(cmd, timeout=3600)
        if status != 0 or "hostbench: done" not in out:
            raise RuntimeError(f"hostbench in the Linux guest: status {status}\n{out}\n{err}")
        log("workloads: Linux guest done")
        return work_samples(out, "linux", hz)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# 6. snapshot restore

RESTORE_MODES = {"eager": ["--restore-eager"], "lazy": [], "lazy+verify": ["--restore-verify"]}


def make_snapshot(path, mib, mem_mib):
    """Boots bench-restore touching `mib` MiB, snapshots it while it runs; the snapshot's
    figures (ctl's JSON reply)."""
    work = tempfile.mkdtemp(prefix="fvbench-snap")
    serial, sock = f"{work}/serial", f"{work}/api.sock"
    p = subprocess.Popen(ferrovm_cmd(guest("bench-restore"), f"mib={mib}", mem_mib, f"file:{serial}",
                                     ["--api-socket", sock]),
                         stdin=DEVNULL, stdout=DEVNULL, stderr=DEVNULL)
    try:
        if not wait_for(serial, r"pass 1 ok", 120, p):
            raise RuntimeError("bench-restore did not start")
        out = subprocess.run([FERROVM, "ctl", "--api-socket", sock, "--json", "snapshot", path],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"snapshot failed: {out.stderr}")
        return json.loads(out.stdout)
    finally:
        stop(p)
        shutil.rmtree(work, ignore_errors=True)


def drop_cache(path):
    """Evicts the file from the page cache (it was written and fsynced, so it is clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def time_restore(path, extra):
    """Process start -> the first console byte (the restored guest's first port write after
    the resume), and -> the end of its first complete pass over its memory after the resume
    (the second `pass` line: the first ends the pass the snapshot interrupted), in ms."""
    cmd = [FERROVM, "run", "--restore", path, "--serial", "stdio"] + extra
    t0 = time.perf_counter_ns()
    p = subprocess.Popen(cmd, stdin=DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         bufsize=0)
    fd = p.stdout.fileno()
    first, passes, got = None, [], b""
    try:
        while len(passes) < 2:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            now = time.perf_counter_ns()
            if first is None:
                first = now
            got += chunk
            while len(passes) < min(got.count(b" ok\n"), 2):
                passes.append(now)
    finally:
        stop(p)
    err = p.stderr.read().decode(errors="replace")
    if first is None or len(passes) < 2 or b"FAIL" in got:
        raise RuntimeError(f"restore {extra}: {got[-300:]!r} {err[-300:]}")
    return (first - t0) / 1e6, (passes[1] - t0) / 1e6


def bench_restore(cfg):
    mem_mib = cfg["restore_mem_mib"]
    work = Path(tempfile.mkdtemp(prefix="fvbench-restore", dir=ROOT / "target/bench"))
    snaps, samples = {}, []
    try:
        for mib in cfg["restore_touch_mib"]:
            path = str(work / f"{mib}.snap")
            prime(2 * mib + 256)
            snaps[mib] = make_snapshot(path, mib, mem_mib)
            st = os.stat(path)
            snaps[mib]["allocated_bytes"] = st.st_blocks * 512
            log(f"restore: snapshot of {mib} MiB: paused {snaps[mib]['paused_ms']:.0f} ms, "
                f"{snaps[mib]['bytes'] / 2**20:.0f} MiB written, file {st.st_size / 2**20:.0f} MiB "
                f"({st.st_blocks * 512 / 2**20:.0f} MiB on disk)")
        modes = list(RESTORE_MODES)
        for r in range(cfg["restore_rounds"]):
            for mib in cfg["restore_touch_mib"]:
                path = str(work / f"{mib}.snap")
                for cache in ("warm", "cold"):
                    for mode in rotate(modes, r):
                        prime(mib + 256)
                        if cache == "cold":
                            drop_cache(path)
                        else:
                            # Warm: the whole file in the page cache, as after a recent snapshot.
                            with open(path, "rb") as f:
                                while f.read(8 << 20):
                                    pass
                        first, full = time_restore(path, RESTORE_MODES[mode])
                        samples.append({"round": r, "touched_mib": mib, "cache": cache, "mode": mode,
                                        "first_ms": first, "all_read_ms": full})
                log(f"restore round {r + 1}/{cfg['restore_rounds']}, {mib} MiB: " + ", ".join(
                    f"{x['cache']} {x['mode']} {x['first_ms']:.1f}/{x['all_read_ms']:.0f} ms"
                    for x in samples if x["round"] == r and x["touched_mib"] == mib))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"guest": "bench-restore", "memory_mib": mem_mib, "snapshots": snaps,
            "samples": samples, "measured": time.strftime("%Y-%m-%d %H:%M %Z"),
            "ferrovm_commit": commit()}


# ---------------------------------------------------------------------------------------
# 7. virtio-blk

BLK_RE = re.compile(r"blk: test=(\S+) qd=(\d+)(?: queues=(\d+))? bs=(\d+) rep=(\d+) n=(\d+) "
                    r"cycles=(\d+)(?: irqs=(\d+) kicks=(\d+) waits=(\d+))?")
BLK_ENVS = ["ferrovm", "qemu", "host"]


def blk_image(path, gib):
    """A raw image of `gib` GiB, every block written (nothing sparse), synced; kept between
    runs of the harness when its size is right."""
    size = gib << 30
    if path.exists() and path.stat().st_size == size:
        return
    block = bytearray(os.urandom(1 << 20))
    with open(path, "wb") as f:
        for i in range(size >> 20):
            block[:8] = i.to_bytes(8, "little")
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def sync_file(path):
    """Writes back the image's dirty pages, so that no run starts with another's writeback
    pending; its pages stay in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def blk_args(cfg, queues=1):
    args = {"mib": cfg["blk_mib"], "ms": cfg["blk_ms"], "seq_bs": cfg["blk_seq_bs"],
            "seq_qd": cfg["blk_seq_qd"], "seed": 1}
    if queues > 1:  # the extra run: 2 queues x 32, on the region the main run wrote
        args.update(queues=2, tests="randread32x2,randwrite32x2", fill=0)
    return args


def blk_cmd(env, img, cfg, queues=1):
    args = " ".join(f"{k}={v}" for k, v in blk_args(cfg, queues).items())
    guest_args = args + (f" wait={cfg['blk_wait']}" if cfg["blk_wait"] else "")
    # The two-queue runs have two vCPUs under both VMMs, as the recorded runs had them. The
    # guest drives both queues from its first vCPU; the second stays in its wait for
    # start-up.
    cpus = str(queues)
    if env == "ferrovm":
        return ferrovm_cmd(guest("bench-blk"), guest_args, 256,
                           extra=["--cpus", cpus, "--disk", f"{img},cache=writeback,queues={queues}"])
    if env == "qemu":
        # microvm with its PCIe host: ferrovm's layout (ECAM at 0xe0000000, the same 32-bit BAR
        # window), no firmware; no MCFG and BARs left unassigned, hence ecam= and pci_assign=1.
        # kernel-irqchip=on: microvm's default is split; ferrovm's is in-kernel.
        return [QEMU, "-accel", "kvm,kernel-irqchip=on", "-M", "microvm,pcie=on,acpi=on,rtc=on",
                "-m", "256", "-smp", cpus, "-nodefaults", "-nographic", "-no-user-config",
                "-no-reboot", "-device", "isa-debug-exit,iobase=0xf4,iosize=1", "-serial", "stdio",
                "-kernel", str(GUESTS / "pvh-only/bench-blk.elf"),
                "-append", guest_args + " ecam=0xe0000000 pci_assign=1",
                "-drive", f"file={img},format=raw,if=none,id=d0,cache=writeback,aio=threads",
                "-device", f"virtio-blk-pci,drive=d0,disable-legacy=on,num-queues={queues}"]
    return [BLKHOST, str(img)] + args.split()


def blk_run(env, img, cfg, queues, rnd, hz):
    sync_file(img)
    load = os.getloadavg()[0]
    status, out, err = run_guest(blk_cmd(env, img, cfg, queues))
    ok = status == 0 if env == "host" else (status == 1 and "PASS" in out)
    if not ok:
        raise RuntimeError(f"bench-blk under {env}: status {status}\n{out}\n{err}")
    samples = []
    for m in BLK_RE.finditer(out):
        test, qd, nq, bs, rep, n, cycles, irqs, kicks, waits = m.groups()
        s = int(cycles) / hz
        sample = {"env": env, "round": rnd, "test": test, "qd": int(qd), "queues": int(nq or 1),
                  "bs": int(bs), "rep": int(rep), "n": int(n), "s": s, "iops": int(n) / s,
                  "us": s / int(n) * 1e6, "mbps": int(n) * int(bs) / s / 1e6}
        if irqs is not None:
            sample.update(irqs=int(irqs), kicks=int(kicks), waits=int(waits))
        sample["loadavg"] = load  # this shared host's 1-minute load average before the run
        samples.append(sample)
    return samples


def bench_blk(cfg, hz):
    img = ROOT / "target/bench/blk.img"
    blk_image(img, cfg["blk_image_gib"])
    runs = [1, 2] if cfg["blk_two_queues"] else [1]
    samples = []
    for r in range(cfg["blk_rounds"]):
        for env in rotate(BLK_ENVS, r):
            for queues in runs:
                samples += blk_run(env, img, cfg, queues, r, hz)
        log(f"blk round {r + 1}/{cfg['blk_rounds']}: " + ", ".join(
            f"{x['env']} {x['test']}{x['qd']}{'x2' if x['queues'] > 1 else ''} {x['iops']:.0f}"
            for x in samples if x["round"] == r and x["test"] == "randwrite" and x["qd"] > 1))
    show = lambda c: shlex.join([os.path.basename(QEMU) if x == QEMU else str(x) for x in c])  # noqa: E731
    return {"guest": "bench-blk", "args": blk_args(cfg), "wait": cfg["blk_wait"],
            "image_gib": cfg["blk_image_gib"], "memory_mib": 256,
            "commands": {f"{env}{'' if q == 1 else '-x2'}": show(blk_cmd(env, "IMG", cfg, q)).replace(str(ROOT) + "/", "")
                         for env in BLK_ENVS for q in runs},
            "samples": samples, "measured": time.strftime("%Y-%m-%d %H:%M %Z"),
            "ferrovm_commit": commit()}


# ---------------------------------------------------------------------------------------
# 8. firmware boot

SEABIOS = "/usr/share/seabios/bios-256k.bin"


def firmware_cmd(vmm, disk):
    if vmm == "ferrovm":
        return [FERROVM, "run", "--disk", f"{disk},readonly", "--memory", "256M",
                "--firmware", SEABIOS]
    return QEMU_BASE + ["-M", "pc", "-m", "256", "-serial", "stdio", "-bios", SEABIOS,
                        "-drive", f"file={disk},if=none,id=d,format=raw,readonly=on",
                        "-device", "virtio-blk-pci,drive=d,disable-legacy=on"]


def time_to_bootsector(cmd):
    """Process start -> the boot sector's first line on the console, and -> exit, in s."""
    first, t_exit, status, got = time_to_marker(cmd, b"bootsect:")
    if status != 1 or first is None or b"bootsect: PASS" not in got:
        raise RuntimeError(f"{cmd[0]}: status {status}, console {got[-300:]!r}")
    return first / 1e9, t_exit / 1e9


def bench_firmware(cfg):
    vmms = ["ferrovm", "qemu-pc"]
    disk = str(GUESTS / "bootsect.img")
    res = {v: {"bootsector_s": [], "exit_s": []} for v in vmms}
    for r in range(cfg["firmware_rounds"]):
        for v in rotate(vmms, r):
            first, ex = time_to_bootsector(firmware_cmd(v, disk))
            res[v]["bootsector_s"].append(first)
            res[v]["exit_s"].append(ex)
        log(f"firmware round {r + 1}/{cfg['firmware_rounds']}: "
            + ", ".join(f"{v} {res[v]['bootsector_s'][-1]:.2f} s" for v in vmms))
    return {"disk": "bootsect.img", "firmware": SEABIOS, "memory_mib": 256, "vmms": res,
            "measured": time.strftime("%Y-%m-%d %H:%M %Z"), "ferrovm_commit": commit()}


# ---------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------
# 11. local live update (bench/localupdate.py)

def bench_localupdate(cfg):
    import localupdate  # imports this module: loaded only when the section runs
    results = localupdate.run(cfg["localupdate_sizes"], ["ferrovm", "qemu"],
                              cfg["localupdate_runs"])
    return {"results": results, "sizes": cfg["localupdate_sizes"],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def config(quick):
    cfg = {
        "startup_rounds": 10,
        "exit_rounds": 6, "exit_n": 4000, "exit_reps": 3,
        "memory_rounds": 5, "memory_touch_mib": 256,
        "work_rounds": 3, "work_reps": 3, "work_mib": 256,
        "restore_rounds": 5, "restore_mem_mib": 1024, "restore_touch_mib": [256, 896],
        "blk_rounds": 6, "blk_ms": 1000, "blk_mib": 256, "blk_seq_bs": 262144, "blk_seq_qd": 4,
        "blk_image_gib": 1, "blk_wait": "hlt", "blk_two_queues": True,
        "firmware_rounds": 5,
        "localupdate_runs": 2, "localupdate_sizes": [1, 4, 8],
        "migration_cases": (
            [{"link": "loopback", "guest": "migrate-idle", "gib": g, "runs": 5} for g in (1, 2, 4, 8)]
            + [{"link": "loopback", "guest": "migrate-dirty", "gib": 2, "mib": 256, "runs": 2}]
            + [{"link": "loopback", "guest": "migrate-dirty", "gib": 2, "mib": 1024, "runs": 2}]
            + [{"link": "1gbit", "guest": "migrate-idle", "gib": g, "runs": 3} for g in (1, 2, 4, 8)]
            + [{"link": "1gbit", "guest": "migrate-dirty", "gib": 2, "mib": 256, "runs": 2}]
        ),
    }
    if quick:
        cfg.update({
            "startup_rounds": 3, "exit_rounds": 2, "exit_n": 2000, "exit_reps": 2,
            "memory_rounds": 2, "work_rounds": 1, "work_reps": 2,
            "restore_rounds": 2, "restore_touch_mib": [896],
            "blk_rounds": 2, "blk_ms": 300, "firmware_rounds": 1,
            "localupdate_runs": 1, "localupdate_sizes": [1],
            "migration_cases": [
                {"link": "loopback", "guest": "migrate-idle", "gib": 1, "runs": 1},
                {"link": "1gbit", "guest": "migrate-idle", "gib": 1, "runs": 1},
            ],
        })
    return cfg


ALL_SECTIONS = "startup,exits,memory,migration,workloads,restore,blk,firmware,localupdate"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and cases (a smoke test)")
    ap.add_argument("--only", default=ALL_SECTIONS)
    ap.add_argument("--out", default=str(ROOT / "target/bench/results.json"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override one setting of config(), e.g. --set blk_rounds=3")
    args = ap.parse_args()
    only = set(args.only.split(","))
    cfg = config(args.quick)
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in cfg:
            ap.error(f"--set {key}: no such setting ({', '.join(sorted(cfg))})")
        cfg[key] = json.loads(value)
    out = Path(args.out)
    # Keep sections measured earlier when only some are rerun; then the machine block and the
    # total time stay those of the earlier run, and the rerun sections carry their own date.
    partial = out.exists() and only != set(ALL_SECTIONS.split(","))
    results = json.loads(out.read_text()) if partial else {}
    if not partial or "machine" not in results:
        results["machine"] = machine_info()
    results["config"] = {**results.get("config", {}), **cfg}
    results["quick"] = args.quick
    hz = results["machine"].get("tsc_hz") or tsc_hz()
    log(f"TSC {hz / 1e6:.0f} MHz; {results['machine']['qemu']}")
    t0 = time.monotonic()
    steps = [("startup", lambda: bench_startup(cfg)), ("exits", lambda: bench_exits(cfg, hz)),
             ("memory", lambda: bench_memory(cfg)), ("workloads", lambda: bench_workloads(cfg, hz)),
             ("migration", lambda: bench_migration(cfg)), ("restore", lambda: bench_restore(cfg)),
             ("blk", lambda: bench_blk(cfg, hz)), ("firmware", lambda: bench_firmware(cfg)),
             ("localupdate", lambda: bench_localupdate(cfg))]
    for name, fn in steps:
        if name in only:
            t = time.monotonic()
            results[name] = fn()
            results[name]["seconds"] = round(time.monotonic() - t, 1)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
            log(f"{name} done in {results[name]['seconds']:.0f} s")
    if not partial:
        results["seconds"] = round(time.monotonic() - t0, 1)
    out.write_text(json.dumps(results, indent=1))
    log(f"all done in {results['seconds']:.0f} s -> {out}")


if __name__ == "__main__":
    main()
