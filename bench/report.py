#!/usr/bin/env python3
"""Renders bench/bench.py's results as docs/benchmarks.md and docs/bench-*.png.

    bench/report.py [target/bench/results.json] [docs]

Every figure is the median over its runs with the range [min-max]; every comparison is a
ratio of two medians from the same run of bench.py, with the range of the same ratio taken
round by round (each round runs every VMM once) where rounds pair up.
"""

import json
import re
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COLORS = {"ferrovm": "#d9531e", "rawkvm": "#555555", "qemu-microvm": "#3b75af",
          "qemu-pc": "#9ebcda", "qemu": "#3b75af", "host": "#555555"}
LABEL = {"ferrovm": "ferrovm", "rawkvm": "raw KVM_RUN loop", "qemu-microvm": "QEMU microvm",
         "qemu-pc": "QEMU pc (SeaBIOS)", "qemu": "QEMU microvm", "host": "host (native)"}


def med(xs):
    return statistics.median(xs)


def fig(xs, digits=1, unit=""):
    """'median [min–max]' with a unit."""
    if not xs:
        return "—"
    f = f"{{:.{digits}f}}"
    u = f" {unit}" if unit else ""
    if len(xs) == 1:
        return f"{f.format(xs[0])}{u} (1 run)"
    return f"{f.format(med(xs))}{u} [{f.format(min(xs))}–{f.format(max(xs))}]"


def ratio(a, b, per_round=None, digits=2):
    """Ratio of medians a/b, with the per-round range if given."""
    if not a or not b:
        return "—"
    r = med(a) / med(b)
    f = f"{{:.{digits}f}}"
    s = f"{f.format(r)}×"
    if per_round and len(per_round) > 1:
        s += f" [{f.format(min(per_round))}–{f.format(max(per_round))}]"
    return s


def errbars(series):
    """Median heights and asymmetric min/max error bars for matplotlib."""
    m = [med(s) if s else 0 for s in series]
    lo = [mm - min(s) if s else 0 for mm, s in zip(m, series)]
    hi = [max(s) - mm if s else 0 for mm, s in zip(m, series)]
    return m, [lo, hi]


def grouped_bars(ax, groups, series_by_vmm, vmms, ylabel, log=False, fmt="{:.1f}"):
    n = len(vmms)
    width = 0.8 / n
    for i, v in enumerate(vmms):
        data = [series_by_vmm[v][g] for g in range(len(groups))]
        m, err = errbars(data)
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, m, width, yerr=err, capsize=3, color=COLORS.get(v), label=LABEL.get(v, v))
        for b, val in zip(bars, m):
            if val:
                ax.annotate(fmt(val) if callable(fmt) else fmt.format(val), (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                            textcoords="offset points")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    top = max((max(s) for v in vmms for s in series_by_vmm[v] if s), default=1)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(top=top * 8)
    else:
        ax.set_ylim(top=top * 1.3)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=min(len(vmms), 4))


# ---------------------------------------------------------------------------------------

def startup_section(res, docs, out):
    st = res["startup"]["vmms"]
    vmms = [v for v in ("rawkvm", "ferrovm", "qemu-microvm", "qemu-pc") if v in st]
    n = len(st["ferrovm"]["first_ms"])
    out.append("## 1. Start-up: process start to the guest's first port write\n")
    out.append(
        "`bench-start` (`guests/bench-start.c`) sets up the kit (serial, TSS, IDT: a few hundred "
        "emulated ring-0 instructions), enters ring 3, and its first action there is a port "
        "write: `'!'` to the UART at 0x3f8, then 0 to the debug-exit port 0xf4, which ends "
        "the VM in every VMM here (QEMU: `-device isa-debug-exit,iobase=0xf4,iosize=1`). The "
        "harness times from just before `fork`+`exec` to the `'!'` arriving on the console "
        "pipe (**first port write**), and to the process's exit (**exit**, which adds tearing "
        "the VM down). Same ELF for all: ferrovm and the raw KVM_RUN loop (`bench/rawkvm.c`, "
        "the floor: one memory slot, one vCPU, no irqchip) boot it through the PVH note, QEMU "
        "(which tries Multiboot first) through its Multiboot header. 256 MiB of RAM, "
        f"{n} interleaved rounds.\n")
    out.append("```\n"
               "target/release/ferrovm run --kernel target/guests/bench-start.elf --memory 256M\n"
               "target/bench/rawkvm -m 256 target/guests/bench-start.elf\n"
               "qemu-system-x86_64 -M microvm|pc -accel kvm -nodefaults -nographic -no-user-config \\\n"
               "  -device isa-debug-exit,iobase=0xf4,iosize=1 -serial stdio -m 256 "
               "-kernel target/guests/bench-start.elf\n```\n")
    out.append("| VMM | to first port write | to exit | ÷ raw loop (first write) | ÷ ferrovm (first write) |")
    out.append("| --- | --- | --- | --- | --- |")
    f0 = st["ferrovm"]["first_ms"]
    r0 = st["rawkvm"]["first_ms"] if "rawkvm" in st else None
    for v in vmms:
        fm = st[v]["first_ms"]
        vs_raw = (ratio(fm, r0, [a / b for a, b in zip(fm, r0)], 1) if r0 and v != "rawkvm" else "")
        vs_f = (ratio(fm, f0, [a / b for a, b in zip(fm, f0)], 1) if v != "ferrovm" else "")
        out.append(f"| {LABEL[v]} | {fig(fm, 1, 'ms')} | {fig(st[v]['exit_ms'], 1, 'ms')} | "
                   f"{vs_raw} | {vs_f} |")
    out.append("")
    fig_, ax = plt.subplots(figsize=(7.5, 3.6))
    series = {v: [st[v]["first_ms"], st[v]["exit_ms"]] for v in vmms}
    grouped_bars(ax, ["to first port write", "to exit"], series, vmms, "ms (log scale)", log=True,
                 fmt="{:.0f}")
    ax.set_title("Start-up, bench-start guest (median, min–max)", fontsize=10)
    fig_.tight_layout()
    fig_.savefig(docs / "bench-startup.png", dpi=110)
    plt.close(fig_)
    out.append("![start-up](bench-startup.png)\n")
    return {v: med(st[v]["first_ms"]) for v in vmms}


TESTS = [("pio-out", "PIO write (OUT)"), ("pio-in", "PIO read (IN)"),
         ("mmio-write", "MMIO write"), ("mmio-read", "MMIO read"),
         ("cr8-write", "CR8 (TPR) write"), ("nop", "loop, no exit")]


def exits_section(res, docs, out):
    ex = res["exits"]
    cfg = res["config"]
    vmms = ["rawkvm", "ferrovm", "qemu-microvm"]
    samples = ex["samples"]
    rounds = sorted({s["round"] for s in samples})

    def get(v, ring, test, rnd=None):
        return [s["us"] for s in samples if s["vmm"] == v and s["ring"] == ring
                and s["test"] == test and (rnd is None or s["round"] == rnd)]

    def per_round(a, b, ring, test):
        out_ = []
        for r in rounds:
            x, y = get(a, ring, test, r), get(b, ring, test, r)
            if x and y:
                out_.append(med(x) / med(y))
        return out_

    out.append("## 2. Exit round trips to user space\n")
    out.append(
        "`bench-exit` (`guests/bench-exit.c`) times, with RDTSC, "
        f"{cfg['exit_n']} back-to-back accesses (unrolled 8 per loop iteration) per measurement: "
        "`OUTB`/`INB` on port 0x3ff (the COM1 scratch register: a device model in user space in "
        "ferrovm and QEMU) and 32-bit stores/loads at 0xd0000000 (no RAM and no device there in "
        "any of the three: an MMIO exit answered in user space, all ones on reads), from ring 3 "
        "and from ring 0, plus the same loop with NOPs (no exit) for the loop's own cost. "
        f"{cfg['exit_reps']} measurements per boot, {len(rounds)} interleaved boots under each of:\n")
    out.append(
        "- **raw KVM_RUN loop** (`bench/rawkvm.c`, the floor): loads the same PVH ELF into one "
        "memory slot, one vCPU, no irqchip, and answers each exit inline in the loop (console "
        "byte, LSR, scratch register, debug-exit; all ones for other reads);\n"
        "- **ferrovm** (default: in-kernel irqchip), `--memory 256M`;\n"
        "- **QEMU** `-M microvm` (its default split irqchip: LAPIC in the kernel, IOAPIC and PIC "
        "in user space; no interrupt is taken in these loops, so the mode does not enter the "
        "figures), `-m 256`.\n")
    out.append(
        "Per-access time in µs (TSC cycles / access / TSC rate measured on the host), "
        "median [min–max] over all measurements; ratios of medians, [range of per-boot ratios]:\n")
    out.append("| ring | access | raw loop | ferrovm | QEMU microvm | ferrovm / raw | QEMU / raw | ferrovm / QEMU |")
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for ring in (3, 0):
        for test, label in TESTS:
            r, f, q = (get(v, ring, test) for v in vmms)
            if not (r and f and q):  # CR8 writes exist in ring 0 only
                continue
            if test == "nop":  # per NOP instruction, in ns
                r, f, q = ([x * 1000 for x in xs] for xs in (r, f, q))
                out.append(f"| {ring} | {label} (per NOP) | {fig(r, 2, 'ns')} | {fig(f, 2, 'ns')} | "
                           f"{fig(q, 2, 'ns')} | | | |")
                continue
            summary[(ring, test)] = (med(r), med(f), med(q))
            out.append(f"| {ring} | {label} | {fig(r, 2, 'µs')} | {fig(f, 2, 'µs')} | {fig(q, 2, 'µs')} | "
                       f"{ratio(f, r, per_round('ferrovm', 'rawkvm', ring, test))} | "
                       f"{ratio(q, r, per_round('qemu-microvm', 'rawkvm', ring, test))} | "
                       f"{ratio(f, q, per_round('ferrovm', 'qemu-microvm', ring, test))} |")
    out.append("")
    fig_, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, ring in zip(axes, (3, 0)):
        groups = [t for t, _ in TESTS if t != "nop" and get(vmms[0], ring, t)]
        series = {v: [get(v, ring, t) for t in groups] for v in vmms}
        grouped_bars(ax, groups, series, vmms, "µs per access", fmt="{:.1f}")
        ax.set_title(f"exit round trip from ring {ring}", fontsize=10)
    fig_.suptitle("Exit round trips to user space (median, min–max)", fontsize=10)
    fig_.tight_layout()
    fig_.savefig(docs / "bench-exits.png", dpi=110)
    plt.close(fig_)
    out.append("![exits](bench-exits.png)\n")
    return summary


def memory_section(res, docs, out):
    mem = res["memory"]
    vmms = [v for v in ("ferrovm", "qemu-microvm", "qemu-pc") if v in mem["vmms"]]
    mib = lambda rows, f: [f(r) / 1024 for r in rows]  # noqa: E731
    over = {v: mib(mem["vmms"][v], lambda r: r["VmRSS"] - r["guest_ram_rss"]) for v in vmms}
    over_t = {v: mib(mem["vmms"][v], lambda r: r["VmRSS"] - mem["touched_mib"] * 1024) for v in vmms}
    out.append("## 3. Memory overhead: resident memory beyond the guest's\n")
    out.append(
        f"A {mem['memory_mib'] // 1024} GiB guest runs `migrate-idle {mem['cmdline']}`: it touches "
        f"{mem['touched_mib']} MiB, then idles with a timer. Once it has ticked twice the harness "
        "reads `/proc/PID/status` and `/proc/PID/smaps` of the VMM process. **Beyond guest RAM** "
        "= VmRSS minus the resident part of the guest-RAM mapping (the process's largest mapping; "
        "with transparent huge pages it also holds the guest image's 2 MiB page, so it is "
        f"slightly above {mem['touched_mib']} MiB); **beyond touched** = VmRSS minus the "
        f"{mem['touched_mib']} MiB the guest touched. RssFile is mostly the executable and shared "
        f"libraries (shared with other processes; Pss counts them shared). {len(over['ferrovm'])} "
        "interleaved rounds.\n")
    out.append("| VMM | VmRSS | guest RAM resident | beyond guest RAM | beyond touched | RssAnon | RssFile | Pss | ratio to ferrovm (beyond guest RAM) |")
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for v in vmms:
        rows = mem["vmms"][v]
        per = [a / b for a, b in zip(over[v], over["ferrovm"])]
        out.append(
            f"| {LABEL[v]} | {fig(mib(rows, lambda r: r['VmRSS']), 1, 'MiB')} | "
            f"{fig(mib(rows, lambda r: r['guest_ram_rss']), 1, 'MiB')} | **{fig(over[v], 1, 'MiB')}** | "
            f"{fig(over_t[v], 1, 'MiB')} | {fig(mib(rows, lambda r: r['RssAnon']), 1, 'MiB')} | "
            f"{fig(mib(rows, lambda r: r['RssFile']), 1, 'MiB')} | {fig(mib(rows, lambda r: r['Pss']), 1, 'MiB')} | "
            + ("1" if v == "ferrovm" else ratio(over[v], over["ferrovm"], per, 1)) + " |")
    out.append("")
    fig_, ax = plt.subplots(figsize=(6, 3.4))
    grouped_bars(ax, ["beyond guest RAM", "beyond touched"],
                 {v: [over[v], over_t[v]] for v in vmms}, vmms, "MiB", fmt="{:.1f}")
    ax.set_title(f"VMM resident memory beyond the guest's, {mem['memory_mib'] // 1024} GiB guest "
                 f"touching {mem['touched_mib']} MiB", fontsize=9)
    fig_.tight_layout()
    fig_.savefig(docs / "bench-memory.png", dpi=110)
    plt.close(fig_)
    out.append("![memory](bench-memory.png)\n")
    return {v: med(over[v]) for v in vmms}


def migration_section(res, docs, out):
    mig = res["migration"]["results"]
    cases = []
    for m in mig:
        key = (m["link"], m["guest"], m["cmdline"], m["gib"])
        if key not in cases:
            cases.append(key)
    out.append("## 4. Live migration\n")
    out.append(
        "Source and destination on this machine, over loopback and over a veth pair between two "
        "network namespaces shaped to 1 Gbit/s each way (`tc qdisc … tbf rate 1gbit`; the "
        "set-up of `bench/migration.sh`). ferrovm runs through `bench/migration.sh case` "
        "(`ferrovm ctl migrate`, defaults: no bandwidth cap, downtime target 50 ms; dirtying "
        "guests with `--auto-converge --max-time-s 120`). QEMU migrates over QMP "
        "(`bench/qmp.py`): `-M microvm`, same guest ELF via `-kernel`, destination started with "
        "`-incoming tcp:…`, `migrate-set-parameters max-bandwidth=100 GiB/s downtime-limit=50` "
        "(QEMU 7.2 caps migration at 128 MiB/s by default; ferrovm has no cap), "
        "`auto-converge` on for dirtying guests, `migrate`, then `query-migrate` until "
        "`completed`. Idle guests run `migrate-idle` touching their RAM up to 2.9 GiB (below the "
        "3 GiB MMIO hole), so 4 and 8 GiB guests send 2.9 GiB of data; dirtying guests run "
        "`migrate-dirty` (ring 3 rewrites one word of every page of the region, continuously).\n")
    out.append(
        "- **total**: ferrovm's `total_ms`; QEMU's `total-time`.\n"
        "- **downtime** as each VMM reports it: ferrovm from the pause to the destination's "
        "acknowledgement that its vCPUs run; QEMU's `downtime` stops on the source once the last "
        "data is sent, before the destination has loaded the device state and resumed.\n"
        "- **guest pause** (QEMU only, comparable to ferrovm's downtime): the source's `STOP` "
        "event to the destination's `RESUME` event (QMP event timestamps, same host clock).\n"
        "- **sent**: bytes on the wire (ferrovm `bytes_total`; QEMU `ram.transferred`).\n"
        "- **rounds**: ferrovm's pre-copy rounds including the final one; QEMU's "
        "`ram.dirty-sync-count`.\n")
    out.append(
        "Before every run the harness touches and frees twice the guest's touched memory "
        "(`hostbench prime`): this machine is a VM whose hypervisor takes freed memory back "
        "within seconds (free page reporting), and the destination's first touch of such memory "
        "is several times slower. Without it a 1 GiB loopback migration of either VMM took "
        "0.3 s or 2.4 s depending on what ran before.\n")
    out.append("| link | guest | RAM | VMM | total | downtime | guest pause | sent | rounds | ratio QEMU/ferrovm (total) |")
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    plot = {}
    summary = {}
    for key in cases:
        link, guest_, cmdline, gib = key
        rows = {v: [m for m in mig if (m["link"], m["guest"], m["cmdline"], m["gib"]) == key
                    and m["vmm"] == v] for v in ("ferrovm", "qemu")}
        ok = {v: [m for m in rows[v] if m["ok"]] for v in rows}
        tot = {v: [m["total_ms"] / 1000 for m in ok[v]] for v in rows}
        per = []
        for r in sorted({m["run"] for m in mig}):
            a = [m["total_ms"] for m in ok["qemu"] if m["run"] == r]
            b = [m["total_ms"] for m in ok["ferrovm"] if m["run"] == r]
            if a and b:
                per.append(a[0] / b[0])
        for v in ("ferrovm", "qemu"):
            failed = len(rows[v]) - len(ok[v])
            fail_note = f" ({failed} of {len(rows[v])} failed)" if failed else ""
            gp = [m["guest_pause_ms"] for m in ok[v] if m.get("guest_pause_ms") is not None]
            out.append(
                f"| {link} | `{guest_} {cmdline}` | {gib} GiB | {LABEL[v]}{fail_note} | "
                f"{fig(tot[v], 2, 's')} | {fig([m['downtime_ms'] for m in ok[v]], 1, 'ms')} | "
                + (fig(gp, 1, "ms") if v == "qemu" else "(= downtime)") + " | "
                f"{fig([m['bytes'] / 2**20 for m in ok[v]], 0, 'MiB')} | "
                f"{fig([m['rounds'] for m in ok[v]], 0)} | "
                + (ratio(tot["qemu"], tot["ferrovm"], per) if v == "qemu" else "") + " |")
        plot[key] = (tot, {v: [m["downtime_ms"] if v == "ferrovm" else (m.get("guest_pause_ms") or 0)
                               for m in ok[v]] for v in rows})
        summary[key] = {v: (med(tot[v]) if tot[v] else None) for v in rows}
        summary[key]["down"] = {v: med(plot[key][1][v]) if plot[key][1][v] else None for v in rows}
    out.append("")
    links = [lk for lk in ("loopback", "1gbit") if any(k[0] == lk for k in cases)]
    fig_, axes = plt.subplots(2, len(links), figsize=(5.5 * len(links), 6.5), squeeze=False)
    for col, lk in enumerate(links):
        keys = [k for k in cases if k[0] == lk]
        groups = [f"{k[3]} GiB\n{'idle' if k[1] == 'migrate-idle' else 'dirty ' + k[2].split('=')[1] + 'M'}"
                  for k in keys]
        grouped_bars(axes[0][col], groups, {v: [plot[k][0][v] for k in keys] for v in ("ferrovm", "qemu")},
                     ["ferrovm", "qemu"], "total (s)", fmt="{:.1f}")
        axes[0][col].set_title(f"{lk}: total time", fontsize=10)
        grouped_bars(axes[1][col], groups, {v: [plot[k][1][v] for k in keys] for v in ("ferrovm", "qemu")},
                     ["ferrovm", "qemu"], "ms", fmt="{:.1f}")
        axes[1][col].set_title(f"{lk}: guest pause (ferrovm downtime; QEMU STOP→RESUME)", fontsize=9)
    fig_.suptitle("Live migration (median, min–max)", fontsize=10)
    fig_.tight_layout()
    fig_.savefig(docs / "bench-migration.png", dpi=110)
    plt.close(fig_)
    out.append("![migration](bench-migration.png)\n")
    return summary


WORKS = [("intloop", "integer loop", "ns per iteration", 1e9),
         ("memmove", "memmove 256 MiB (rep movsb)", "GB/s", None),
         ("touch", "first touch of fresh pages", "µs per 4 KiB page", 1e6)]


def workloads_section(res, docs, out):
    wl = res["workloads"]
    samples = wl["samples"]
    envs = ["host", "ferrovm", "qemu-microvm"]
    rounds = sorted({s["round"] for s in samples if s["env"] != "host" or s["name"] in ("intloop",)})

    def vals(env, name, rnd=None):
        xs = []
        for s in samples:
            if s["env"] == env and s["name"] == name and (rnd is None or s["round"] == rnd):
                xs.append(s["s"])
        return xs

    def per_unit(env, name, scale, rnd=None):
        xs = [s for s in samples if s["env"] == env and s["name"] == name
              and (rnd is None or s["round"] == rnd)]
        if scale is None:  # throughput
            return [s["units"] / s["s"] / 1e9 for s in xs]
        return [s["s"] / s["units"] * scale for s in xs]

    out.append("## 5. Guest against host\n")
    out.append(
        "The workloads of `bench/workloads.h` — freestanding C shared word for word — run in "
        "ring 3 of the bare-metal guest `bench-work` (`guests/bench-work.c`; ring 3 runs "
        "natively on this PVM host) and natively on the host (`bench/hostbench.c`, the same "
        "header compiled with the guests' code-generation flags), timed with RDTSC in both: "
        f"an integer loop (10^8 iterations of one dependent LCG/xor chain), a 256 MiB memmove "
        "between two buffers touched beforehand (`rep movsb`), and the first touch of 256 MiB "
        "of fresh memory, one write per 4 KiB page (new memory each repetition). Guest: "
        f"{wl['memory_mib']} MiB of RAM, `{wl['cmdline']}`, under ferrovm and QEMU microvm. "
        "Page sizes matter here: the guest maps its RAM with 2 MiB pages and both VMMs back "
        "guest RAM with transparent huge pages, so the host's memmove buffers are advised "
        "`MADV_HUGEPAGE` too, and its first touch is measured both ways — 4 KiB pages (a "
        "program that does not ask for huge pages) and `MADV_HUGEPAGE` (like the VMMs' guest "
        "RAM; the ratios of the summary use this one). Each run is preceded by "
        f"`hostbench prime` (see §4) and starts with the first touch. {res['config']['work_reps']} "
        f"repetitions per run, {len(rounds)} interleaved rounds; ratios > 1 mean the guest is "
        "slower.\n")
    out.append("| workload | host | ferrovm guest | QEMU guest | ferrovm / host | QEMU / host | ferrovm / QEMU |")
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for name, label, unit, scale in WORKS:
        h, f, q = (per_unit(e, name, scale) for e in envs)
        inv = scale is None  # throughput: ratio of times = inverse ratio of rates
        def rr(a, b, a_env, b_env):  # noqa: E306
            per = []
            for r in rounds:
                x, y = per_unit(a_env, name, scale, r), per_unit(b_env, name, scale, r)
                if x and y:
                    per.append(med(y) / med(x) if inv else med(x) / med(y))
            if inv:
                return ratio(b, a, per)
            return ratio(a, b, per)
        if name == "touch":  # against host memory with huge pages, as both VMMs back guest RAM
            summary[name] = med(f) / med(per_unit("host", "touch-thp", scale))
        else:
            summary[name] = (med(f) / med(h)) if not inv else (med(h) / med(f))
        digits = 3 if name == "intloop" else 2
        out.append(f"| {label} ({unit}) | {fig(h, digits)} | {fig(f, digits)} | {fig(q, digits)} | "
                   f"{rr(f, h, 'ferrovm', 'host')} | {rr(q, h, 'qemu-microvm', 'host')} | "
                   f"{rr(f, q, 'ferrovm', 'qemu-microvm')} |")
        if name == "touch":
            ht = per_unit("host", "touch-thp", scale)
            out.append(f"| first touch, host memory advised MADV_HUGEPAGE like both VMMs' guest RAM "
                       f"(µs per 4 KiB page) | {fig(ht, 2)} | | | {ratio(f, ht)} | {ratio(q, ht)} | |")
    out.append("")
    out.append("For memmove the ratios compare times (host GB/s ÷ guest GB/s).\n")
    os_rows = [("getpid", "getpid", 1e9, "ns per call"), ("fork-wait", "fork + wait", 1e6, "µs per call"),
               ("write-fsync", "4 KiB write + fsync", 1e6, "µs per call"),
               ("zero-read", "read /dev/zero, 1 MiB reads", None, "GB/s"),
               ("seq-write", "sequential write, 1 MiB chunks, then fsync", None, "GB/s"),
               ("seq-read", "sequential read of it, not cached", None, "GB/s")]
    linux = any(s["env"] == "linux" for s in samples)
    if linux:
        counts = res["workloads"].get("linux_counts", {})
        out.append("What needs an operating system: the same program (`bench/hostbench.c`, static) on "
                   "the host (`hostbench os 3 /var/tmp`) and as `/init` of the repository's Linux test "
                   "guest under ferrovm (guests/linux; 1 vCPU, 1 GiB, files on an ext4 virtio-blk "
                   "disk; counts " + ", ".join(f"`{k}={v}`" for k, v in counts.items()) + "; "
                   "figures per call or per byte). Every system call, page fault and copy of the "
                   "guest kernel runs in this host's emulated guest ring 0 (1–2.5 µs per "
                   "instruction), so the guest's rows measure that emulation, not what a guest "
                   "costs on VT-x / AMD-V (see [Guest against host on a hardware-virtualization "
                   "host](#guest-against-host-on-a-hardware-virtualization-host)):\n")
        out.append("| workload | host | ferrovm Linux guest | guest / host |")
        out.append("| --- | --- | --- | --- |")
    else:
        out.append("What needs an operating system (host only here, `hostbench os 3 /var/tmp`; see "
                   "[Guest against host on a hardware-virtualization host](#guest-against-host-on-a-hardware-virtualization-host)):\n")
        out.append("| workload | host |")
        out.append("| --- | --- |")
    for n, l, scale, unit in os_rows:
        xs = per_unit("host", n, scale)
        if not linux:
            if xs:
                out.append(f"| {l} | {fig(xs, 1)} {unit} |")
            continue
        gs = per_unit("linux", n, scale)
        slower = "—"
        if gs and xs:  # guest time over host time
            slower = f"{(med(gs) / med(xs)) if scale else (med(xs) / med(gs)):.1f}×"
        digits = 2 if scale is None else 1
        out.append(f"| {l} ({unit}) | {fig(xs, digits)} | {fig(gs, digits)} | {slower} |")
    out.append("")
    fig_, ax = plt.subplots(figsize=(6.5, 3.6))
    groups = ["integer loop", "memmove 256 MiB", "first touch\n(host: huge pages)"]
    envs_g = ["ferrovm", "qemu-microvm"]
    width = 0.8 / len(envs_g)
    for i, e in enumerate(envs_g):
        heights, lo, hi = [], [], []
        for name, _, _, scale in WORKS:
            host_name = "touch-thp" if name == "touch" else name
            g, h = per_unit(e, name, scale), per_unit("host", host_name, scale)
            r = med(h) / med(g) if scale is None else med(g) / med(h)  # guest time / host time
            per = []
            for rnd in rounds:
                x, y = per_unit(e, name, scale, rnd), per_unit("host", host_name, scale, rnd)
                if x and y:
                    per.append(med(y) / med(x) if scale is None else med(x) / med(y))
            heights.append(r)
            lo.append(max(r - min(per), 0) if per else 0)
            hi.append(max(max(per) - r, 0) if per else 0)
        xs = [g + (i - (len(envs_g) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, heights, width, yerr=[lo, hi], capsize=3, color=COLORS[e], label=LABEL[e])
        for bar_, val in zip(bars, heights):
            ax.annotate(f"{val:.2f}", (bar_.get_x() + bar_.get_width() / 2, bar_.get_height()),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel("guest time / host time")
    ax.set_ylim(0, 1.6)
    ax.axhline(1, color="black", lw=0.8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set_title("Guest (ring 3) against host: ratio of medians, per-round range", fontsize=9)
    fig_.tight_layout()
    fig_.savefig(docs / "bench-workloads.png", dpi=110)
    plt.close(fig_)
    out.append("![guest against host](bench-workloads.png)\n")
    return summary


RESTORE_MODES = ["eager", "lazy", "lazy+verify"]


def restore_section(res, docs, out):
    rs = res["restore"]
    samples = rs["samples"]
    sizes = sorted({x["touched_mib"] for x in samples})
    rounds = len({x["round"] for x in samples})
    out.append("## 6. Snapshot restore: process start to the guest's first port write\n")
    out.append(
        f"A {rs['memory_mib'] // 1024} GiB guest running `bench-restore` (`guests/bench-restore.c`: "
        "ring 3 fills N MiB with a pattern, then reads and checks them page by page, pass after "
        "pass, writing one byte to the UART whenever 200 µs have gone by) is snapshotted while "
        "it runs (`ctl snapshot`), then restored again and again with `ferrovm run --restore "
        "FILE --serial stdio`. The harness times from just before `fork`+`exec` to the first "
        "console byte, the guest's first port write after the resume (**guest running**), and to "
        "the end of its first complete pass after the resume (**all memory read**: every "
        "touched page read and checked once, so page faults that a lazy restore defers are "
        "paid by then). Modes:\n")
    out.append(
        "- **eager** (`--restore-eager`): every page copied from the file into anonymous guest "
        "RAM and checked against its CRC before the vCPUs start — what restoring a version 1 "
        "snapshot (a stream) did;\n"
        "- **lazy** (the default): verify on fault — guest RAM registered with a userfaultfd; "
        "each page read from the file and checked against its CRC before it is installed, "
        "when the guest first touches it or when the prefetcher reaches it;\n"
        "- **lazy+verify** (`--restore-verify`): every page checked against its CRC before "
        "the vCPUs start, then served on fault as in lazy.\n")
    out.append(
        "**warm**: the file is in the page cache (read once just before, as after a recent "
        "snapshot); **cold**: evicted first (`posix_fadvise(POSIX_FADV_DONTNEED)`), so pages "
        "come from the disk (a virtio disk of this VM, itself cached by its host). Before every "
        f"run the harness primes fresh memory (`hostbench prime`, see §4). {rounds} rounds, "
        "every mode once per round in a rotating order.\n")
    out.append("| touched | cache | mode | guest running | all memory read | guest running: ÷ lazy |")
    out.append("| --- | --- | --- | --- | --- | --- |")
    summary = {}
    plot = {}
    for mib in sizes:
        for cache in ("warm", "cold"):
            sel = {m: [x for x in samples if (x["touched_mib"], x["cache"], x["mode"]) == (mib, cache, m)]
                   for m in RESTORE_MODES}
            lazy = [x["first_ms"] for x in sel["lazy"]]
            for m in RESTORE_MODES:
                f = [x["first_ms"] for x in sel[m]]
                a = [x["all_read_ms"] for x in sel[m]]
                if not f:
                    continue
                per = [x["first_ms"] / y["first_ms"] for x in sel[m] for y in sel["lazy"]
                       if x["round"] == y["round"]]
                out.append(f"| {mib} MiB | {cache} | {m} | {fig(f, 1, 'ms')} | {fig(a, 0, 'ms')} | "
                           + (ratio(f, lazy, per, 1) if m != "lazy" else "") + " |")
                summary[(mib, cache, m)] = (med(f), med(a))
                plot[(mib, cache, m)] = (f, a)
    out.append("")
    out.append("The snapshots (`ctl snapshot` while the guest ran; the file is sparse):\n")
    out.append("| touched | guest paused | written | file length | on disk |")
    out.append("| --- | --- | --- | --- | --- |")
    for mib in sizes:
        sn = rs["snapshots"][str(mib)] if str(mib) in rs["snapshots"] else rs["snapshots"][mib]
        out.append(f"| {mib} MiB | {sn['paused_ms']:.0f} ms | {sn['bytes'] / 2**20:.0f} MiB | "
                   f"{sn['file_bytes'] / 2**20:.0f} MiB | {sn['allocated_bytes'] / 2**20:.0f} MiB |")
    out.append("")
    out.append(f"Measured {rs['measured']} (ferrovm {rs['ferrovm_commit']}).\n")
    groups = [f"{mib} MiB {cache}" for mib in sizes for cache in ("warm", "cold")]
    keys = [(mib, cache) for mib in sizes for cache in ("warm", "cold")]
    fig_, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, i, title in ((axes[0], 0, "guest running (first port write)"),
                         (axes[1], 1, "all memory read once")):
        grouped_bars(ax, groups, {m: [plot.get((k[0], k[1], m), ([], []))[i] for k in keys]
                                  for m in RESTORE_MODES},
                     RESTORE_MODES, "ms (log scale)", log=True, fmt="{:.0f}")
        ax.set_title(f"{title}, from process start", fontsize=10)
    fig_.suptitle(f"Snapshot restore of a {rs['memory_mib'] // 1024} GiB guest (median, min–max)",
                  fontsize=10)
    fig_.tight_layout()
    fig_.savefig(docs / "bench-restore.png", dpi=110)
    plt.close(fig_)
    out.append("![restore](bench-restore.png)\n")
    return summary


# (test, in flight per queue (None: the sequential depth), queues)
BLK_TESTS = [("randread", 1, 1), ("randread", 32, 1), ("randwrite", 1, 1), ("randwrite", 32, 1),
             ("randread", 32, 2), ("randwrite", 32, 2), ("seqread", None, 1), ("seqwrite", None, 1)]
BLK_ENVS = ["host", "ferrovm", "qemu"]


class BlkSamples:
    """The blk section's samples, selected by (env, test, in flight per queue, queues)."""

    def __init__(self, bk):
        self.samples = bk["samples"]
        self.seq_qd = bk["args"]["seq_qd"]
        self.rounds = sorted({x["round"] for x in self.samples})

    def pick(self, env, test, qd, nq, rnd=None):
        qd = self.seq_qd if qd is None else qd
        return [x for x in self.samples if x["env"] == env and x["test"] == test and x["qd"] == qd
                and x.get("queues", 1) == nq and (rnd is None or x["round"] == rnd)]

    def sel(self, env, test, qd, nq, key, rnd=None):
        return [x[key] for x in self.pick(env, test, qd, nq, rnd)]

    def per_round(self, a, b, test, qd, nq, key):
        """Ratio a / b of the medians of each round."""
        xs = []
        for r in self.rounds:
            x, y = self.sel(a, test, qd, nq, key, r), self.sel(b, test, qd, nq, key, r)
            if x and y:
                xs.append(med(x) / med(y))
        return xs


def blk_label(args, test, qd, nq):
    if qd is None:
        return f"{test} {args['seq_bs'] // 1024} KiB, depth {args['seq_qd']}"
    if nq > 1:
        return f"{test} 4 KiB, {nq} queues × {qd}"
    return f"{test} 4 KiB, depth {qd}"


def blk_intro(bk, out):
    """What section 7 measures, and how."""
    args = bk["args"]
    seq_qd = args["seq_qd"]
    rounds = sorted({x["round"] for x in bk["samples"]})
    out.append("## 7. virtio-blk: 4 KiB random IOPS, sequential MB/s\n")
    out.append(
        "`bench-blk` (`guests/bench-blk.c`) drives the disk with the guest kit's virtio driver "
        "(`guests/lib/virtio.c`, `blk.c`) in ring 3 with interrupts on: one queue, indirect "
        "descriptors and event index negotiated, VIRTIO_BLK_F_FLUSH negotiated (so neither VMM "
        "writes through), completion by MSI-X. A measurement keeps its depth of requests in "
        "flight — it waits for the used ring (the kit's `virtq_wait`: arm the interrupt with "
        f"`used_event`, re-check, then wait{' in `sti; hlt`' if bk.get('wait') == 'hlt' else ''} "
        "for the MSI-X handler), reaps every completion and submits one new request for each, "
        f"for {args['ms']} ms of TSC time, then drains. 4 KiB requests go to random 4 KiB-aligned "
        "offsets of the region (xorshift64* with a fixed seed: the same offsets in the same "
        f"order under every VMM); sequential requests are {args['seq_bs'] // 1024} KiB, "
        f"{seq_qd} in flight, in order through the region, wrapping. The region is the first "
        f"{args['mib']} MiB of a {bk['image_gib']} GiB raw image whose every block was written "
        "when it was made; each run first writes the whole region once and flushes, so the "
        "measured blocks are allocated and in the host's page cache (write-back caching in "
        "both VMMs; the harness `fsync`s the image before every run so no run inherits "
        "another's writeback). Order in each run: seqwrite, seqread, randread depth 1 then 32, "
        "randwrite depth 1 then 32.\n")
    out.append(
        "- **ferrovm**: `--disk IMG,cache=writeback`: one I/O thread per queue, woken by the "
        "doorbell's ioeventfd, preadv/pwritev straight into guest memory, completion through "
        "an irqfd.\n"
        "- **QEMU** 7.2: `-M microvm,pcie=on` with `-accel kvm,kernel-irqchip=on`, the same "
        "guest ELF by PVH (`ecam=0xe0000000 pci_assign=1`: microvm has no MCFG and no firmware "
        "to place BARs), `-device virtio-blk-pci,disable-legacy=on,num-queues=1` on "
        "`-drive format=raw,cache=writeback,aio=threads`. Why microvm and not q35: it has "
        "ferrovm's layout (ECAM at 0xe0000000, the same 32-bit BAR window) and no firmware, "
        "and both end up on the same virtio-blk-pci code; `kernel-irqchip=on` because "
        "microvm's default is the split irqchip, ferrovm's the in-kernel one (MSI-X goes "
        "through irqfd and the in-kernel LAPIC either way).\n"
        "- **host floor**: `bench/blkhost.c` reads and writes the same image file directly in "
        "the same pattern (same offsets, same sizes): depth d = d threads, each with one "
        "synchronous `pread`/`pwrite` in flight (no io_uring); it fills the region the same way "
        "first.\n")
    out.append("```")
    for env in ("ferrovm", "qemu", "host"):
        out.append(bk["commands"][env])
    out.append("```\n")
    if "ferrovm-x2" in bk["commands"]:
        out.append(
            "The two-queue rows come from a second run per round and VMM, on the region the "
            "first one wrote: `queues=2` (VIRTIO_BLK_F_MQ), 32 requests in flight on each of two "
            "queues, both driven by the guest's first vCPU, whose wait arms both queues' "
            "interrupts and ends with either. Both VMMs get two vCPUs (the second is never "
            "started, as the recorded runs had them) and a two-queue device: "
            "ferrovm serves each queue on its own I/O thread, QEMU both on its main loop with "
            "its thread pool; the floor runs 64 threads.\n")
        out.append("```")
        for env in ("ferrovm", "qemu", "host"):
            out.append(bk["commands"][f"{env}-x2"])
        out.append("```\n")
    out.append(
        f"{len(rounds)} interleaved rounds (ferrovm, QEMU, host, in an order rotating between "
        "rounds), one measurement of each kind per run. Throughput: IOPS for 4 KiB requests, "
        "MB/s (10^6 bytes) for sequential ones, median [min–max]; ratios of medians with "
        "[min–max] of the per-round ratios; above 1 means more throughput than the "
        "denominator.\n")


def blk_plot(docs, bs, args, out):
    seq_qd = args["seq_qd"]
    sel = bs.sel
    fig_, axes = plt.subplots(1, 2, figsize=(12.5, 4), gridspec_kw={"width_ratios": [2.4, 1]})
    rand = [t for t in BLK_TESTS if t[1] is not None and sel("ferrovm", *t, "iops")]
    seq = [t for t in BLK_TESTS if t[1] is None]
    grouped_bars(axes[0], [f"{t}\nQD{q}" + (f"×{n}" if n > 1 else "") for t, q, n in rand],
                 {e: [sel(e, *t, "iops") for t in rand] for e in BLK_ENVS}, BLK_ENVS,
                 "IOPS (log scale)", log=True, fmt=lambda v: f"{v / 1000:.3g}k" if v >= 1000 else f"{v:.0f}")
    axes[0].set_title("4 KiB random requests (QD32×2: two queues)", fontsize=10)
    grouped_bars(axes[1], [f"{t} {args['seq_bs'] // 1024}K\nQD{seq_qd}" for t, _, _ in seq],
                 {e: [sel(e, *t, "mbps") for t in seq] for e in BLK_ENVS}, BLK_ENVS,
                 "MB/s", fmt="{:.0f}")
    axes[1].set_title("sequential", fontsize=10)
    fig_.suptitle("virtio-blk, bench-blk guest, write-back cache (median, min–max)", fontsize=10)
    fig_.tight_layout()
    fig_.savefig(docs / "bench-blk.png", dpi=110)
    plt.close(fig_)
    out.append("![virtio-blk](bench-blk.png)\n")


def blk_section(res, docs, out):
    bk = res["blk"]
    args = bk["args"]
    bs = BlkSamples(bk)
    samples, sel, pick, per_round = bs.samples, bs.sel, bs.pick, bs.per_round
    seq_qd = args["seq_qd"]

    def label(test, qd, nq):
        return blk_label(args, test, qd, nq)

    blk_intro(bk, out)
    out.append("| requests | host floor | ferrovm | QEMU microvm | ferrovm / QEMU | ferrovm ÷ floor | QEMU ÷ floor |")
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for test, qd, nq in BLK_TESTS:
        key = "mbps" if qd is None else "iops"
        unit = "MB/s" if qd is None else "IOPS"
        h, f, q = (sel(e, test, qd, nq, key) for e in BLK_ENVS)
        if not (f and q):
            continue
        summary[(test, qd, nq)] = {e: med(x) for e, x in zip(BLK_ENVS, (h, f, q)) if x}
        out.append(f"| {label(test, qd, nq)} | {fig(h, 0, unit)} | {fig(f, 0, unit)} | "
                   f"{fig(q, 0, unit)} | {ratio(f, q, per_round('ferrovm', 'qemu', test, qd, nq, key))} | "
                   f"{ratio(f, h, per_round('ferrovm', 'host', test, qd, nq, key), 3)} | "
                   f"{ratio(q, h, per_round('qemu', 'host', test, qd, nq, key), 3)} |")
    out.append("")
    out.append(
        "Time per request: at depth 1 the latency of one request as the guest sees it "
        "(submit, doorbell, completion, interrupt, reap); at depth d, d × elapsed time / "
        "requests (the mean time a request spends in flight, by Little's law). Below 1 in "
        "ferrovm / QEMU means ferrovm is faster. Interrupts and doorbells per request are the "
        "guest's counts (MSI-X interrupts taken, doorbell writes), medians over the rounds:\n")
    out.append("| requests | host floor | ferrovm | QEMU microvm | ferrovm / QEMU | interrupts per request: ferrovm / QEMU | doorbells per request: ferrovm / QEMU |")
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    for test, qd, nq in BLK_TESTS:
        depth = (seq_qd if qd is None else qd) * nq
        lat = {e: [u * depth for u in sel(e, test, qd, nq, "us")] for e in BLK_ENVS}
        if not (lat["ferrovm"] and lat["qemu"]):
            continue
        per = per_round("ferrovm", "qemu", test, qd, nq, "us")

        def rate(env, what):
            xs = [x[what] / x["n"] for x in pick(env, test, qd, nq) if what in x and x["n"]]
            return f"{med(xs):.2f}" if xs else "—"
        out.append(f"| {label(test, qd, nq)} | {fig(lat['host'], 1, 'µs')} | {fig(lat['ferrovm'], 1, 'µs')} | "
                   f"{fig(lat['qemu'], 1, 'µs')} | {ratio(lat['ferrovm'], lat['qemu'], per)} | "
                   f"{rate('ferrovm', 'irqs')} / {rate('qemu', 'irqs')} | "
                   f"{rate('ferrovm', 'kicks')} / {rate('qemu', 'kicks')} |")
        if qd == 1:
            summary[(test, qd, nq)]["us"] = {e: med(lat[e]) for e in BLK_ENVS if lat[e]}
    out.append("")
    loads = sorted({(x["env"], x["round"], x.get("queues", 1)): x["loadavg"]  # one per run
                    for x in samples if "loadavg" in x}.values())
    load_note = (f" The host's 1-minute load average before the runs was {med(loads):.1f} "
                 f"[{loads[0]:.1f}–{loads[-1]:.1f}] on its {res['machine']['nproc']} CPUs (other work "
                 "shares it): every thread competes for CPU time, which is what the wide ranges show."
                 if loads else "")
    out.append(f"Measured {bk['measured']} (ferrovm {bk['ferrovm_commit']}; TSC "
               f"{res['machine']['tsc_hz'] / 1e6:.0f} MHz; {res['machine']['qemu']}).{load_note}\n")
    blk_plot(docs, bs, args, out)
    return summary


def machine_block(res, out):
    m = res["machine"]
    out.append("## The machine\n")
    out.append("| | |\n| --- | --- |")
    out.append(f"| CPUs | {m['nproc']} × {m['cpu']} (a VM itself, shared with other work) |")
    out.append(f"| memory | {m['memory_gib']} GiB |")
    out.append(f"| kernel | Linux {m['kernel']} |")
    out.append(f"| KVM | `{m['kvm_backend']}`: KVM with the **PVM** backend (pagetable-based virtual machine), nested — "
                "guest ring 3 runs natively, guest ring 0 is executed by instruction emulation; no VT-x/AMD-V |")
    out.append(f"| TSC | {m['tsc_hz'] / 1e6:.0f} MHz (measured) |")
    out.append(f"| transparent huge pages | `{m['thp']}` |")
    out.append(f"| QEMU | {m['qemu']} (Debian `qemu-system-x86`) |")
    out.append(f"| ferrovm | commit {m['ferrovm_commit']}, release build |")
    out.append(f"| measured | {m['date']}; the whole run took {res.get('seconds', 0) / 60:.0f} min |")
    out.append("")


def startup_rows(res, s_start, rows):
    f = s_start["ferrovm"]
    raw = s_start.get("rawkvm")
    rows.append(f"| process start to first port write | {f:.1f} ms" + (f" ({f / raw:.1f}× floor)" if raw else "")
                + f" | microvm {s_start['qemu-microvm']:.0f} ms ({s_start['qemu-microvm'] / f:.1f}× ferrovm); "
                f"pc {s_start['qemu-pc'] / 1000:.2f} s ({s_start['qemu-pc'] / f:.0f}× ferrovm) | "
                + (f"raw loop {raw:.1f} ms" if raw else "") + " | ≤ 10 ms |")


def exits_rows(res, s_exit, rows):
    for (ring, test), label in (((0, "pio-out"), "PIO write, ring 0"), ((3, "pio-out"), "PIO write, ring 3"),
                                 ((0, "mmio-read"), "MMIO read, ring 0"), ((3, "mmio-read"), "MMIO read, ring 3")):
        r, f, q = s_exit[(ring, test)]
        rows.append(f"| exit round trip: {label} | {f:.2f} µs ({f / r:.2f}× floor) | {q:.2f} µs ({q / r:.2f}× floor) | "
                    f"raw loop {r:.2f} µs | within 10% of the raw loop" + ("; below QEMU" if "MMIO" in label else "") + " |")
    if (0, "cr8-write") in s_exit:
        r, f, q = s_exit[(0, "cr8-write")]
        rows.append(f"| CR8 (TPR) write, ring 0 | {f:.2f} µs ({f / r:.2f}× floor) | {q:.2f} µs ({q / r:.2f}× floor) | "
                    f"raw loop {r:.2f} µs | measured (DESIGN.md problem 2; no exit where the TPR is shadowed) |")


def memory_rows(res, s_mem, rows):
    rows.append(f"| VMM memory beyond guest RAM (1 GiB guest) | {s_mem['ferrovm']:.1f} MiB | "
                f"microvm {s_mem.get('qemu-microvm', 0):.1f} MiB ({s_mem.get('qemu-microvm', 0) / s_mem['ferrovm']:.1f}× ferrovm); "
                f"pc {s_mem.get('qemu-pc', 0):.1f} MiB | | < 8 MiB |")


def migration_rows(res, s_mig, rows):
    for key, v in s_mig.items():
        link, guest_, cmdline, gib = key
        if not (v["ferrovm"] and v["qemu"]):
            continue
        kind = "idle" if guest_ == "migrate-idle" else f"dirtying {cmdline.split('=')[1]} MiB"
        rows.append(f"| migration {link}, {gib} GiB {kind}: total / guest pause (ferrovm: its downtime) | "
                    f"{v['ferrovm']:.2f} s / {v['down']['ferrovm']:.1f} ms | "
                    f"{v['qemu']:.2f} s / {v['down']['qemu']:.1f} ms | QEMU/ferrovm total {v['qemu'] / v['ferrovm']:.2f}× | "
                    + ("downtime < 50 ms; ≥ 2× QEMU's throughput" if link == "loopback" else
                       "wire time of the touched pages + 5%") + " |")


def workloads_rows(res, s_work, rows):
    rows.append(f"| guest (ring 3) / host time: integer loop, memmove, first touch (host with huge pages) | "
                f"{s_work['intloop']:.2f}×, {s_work['memmove']:.2f}×, {s_work['touch']:.2f}× | see §5 | host = 1 | — |")


def restore_rows(res, s_rest, rows):
    mib = max(k[0] for k in s_rest)
    lazy, eager = s_rest.get((mib, "warm", "lazy")), s_rest.get((mib, "warm", "eager"))
    if lazy and eager:
        rows.append(f"| snapshot restore, {res['restore']['memory_mib'] // 1024} GiB guest with {mib} MiB "
                    f"touched (file in the page cache): process start to the guest's first port write "
                    f"after the resume | {lazy[0]:.1f} ms (eager: {eager[0]:.0f} ms, "
                    f"{eager[0] / lazy[0]:.0f}×) | — | | < 50 ms (memory loaded lazily) |")

def blk_rows(res, s_blk, rows):
    r1, r32 = s_blk.get(("randread", 1, 1)), s_blk.get(("randread", 32, 1))
    w1, w32 = s_blk.get(("randwrite", 1, 1)), s_blk.get(("randwrite", 32, 1))
    if r32 and w32:
        rows.append(f"| virtio-blk 4 KiB random IOPS at depth 32, read / write | "
                    f"{r32['ferrovm']:.0f} / {w32['ferrovm']:.0f} ({r32['ferrovm'] / r32['qemu']:.2f}× / "
                    f"{w32['ferrovm'] / w32['qemu']:.2f}× QEMU) | {r32['qemu']:.0f} / {w32['qemu']:.0f} | "
                    f"host {r32['host']:.0f} / {w32['host']:.0f} | at least QEMU's |")
    if r1 and w1 and "us" in r1 and "us" in w1:
        rows.append(f"| virtio-blk 4 KiB latency at depth 1, read / write | "
                    f"{r1['us']['ferrovm']:.0f} / {w1['us']['ferrovm']:.0f} µs "
                    f"({r1['us']['ferrovm'] / r1['us']['qemu']:.2f}× / {w1['us']['ferrovm'] / w1['us']['qemu']:.2f}× QEMU) | "
                    f"{r1['us']['qemu']:.0f} / {w1['us']['qemu']:.0f} µs | "
                    f"host {r1['us']['host']:.1f} / {w1['us']['host']:.1f} µs | within 10% of QEMU's |")
    r2, w2 = s_blk.get(("randread", 32, 2)), s_blk.get(("randwrite", 32, 2))
    if r2 and w2:
        rows.append(f"| virtio-blk 4 KiB random IOPS, 2 queues × 32, read / write | "
                    f"{r2['ferrovm']:.0f} / {w2['ferrovm']:.0f} ({r2['ferrovm'] / r2['qemu']:.2f}× / "
                    f"{w2['ferrovm'] / w2['qemu']:.2f}× QEMU) | {r2['qemu']:.0f} / {w2['qemu']:.0f} | "
                    f"host {r2['host']:.0f} / {w2['host']:.0f} | — |")
    sr, sw = s_blk.get(("seqread", None, 1)), s_blk.get(("seqwrite", None, 1))
    if sr and sw:
        rows.append(f"| virtio-blk sequential read / write | {sr['ferrovm']:.0f} / {sw['ferrovm']:.0f} MB/s "
                    f"({sr['ferrovm'] / sr['qemu']:.2f}× / {sw['ferrovm'] / sw['qemu']:.2f}× QEMU) | "
                    f"{sr['qemu']:.0f} / {sw['qemu']:.0f} MB/s | host {sr['host']:.0f} / {sw['host']:.0f} MB/s | — |")


NET_LABELS = {
    "latency": "round trip: 64-byte echo, 1 in flight",
    "throughput": "echoes: 1400 bytes, 64 in flight, 1 queue pair",
    "throughput-2q": "echoes: 1400 bytes, 64 in flight per pair, 2 pairs",
    "guest-to-host": "guest to host: 1400-byte datagrams, one way",
    "host-to-guest": "host to guest: 1400-byte datagrams, one way",
    "host-to-guest-8k": "host to guest: 8000-byte datagrams (9000-byte MTU, mergeable buffers), one way",
    "tcp-guest-to-host": "TCP guest to host: 64 KiB TSO, 1500-byte MTU",
    "tcp-host-to-guest": "TCP host to guest: 64 KiB TSO (GSO frames taken whole), 1500-byte MTU",
}


def is_tcp_workload(r):
    return r["workload"].get("mode", "").startswith("tcp-")


def net_tcp_table(tcp, out, summary):
    """The TCP rows of section 9: Mbit/s of payload, from (time in µs, bytes) samples."""
    mib = max(r["workload"]["count"] for r in tcp.values()) >> 20
    out.append(f"TCP bulk transfer (the net-tcp guest, the kit's TCP in ring 3, against "
               f"`bench/tcpbulk.c` on the host; {mib} MiB each way, every byte checked by the "
               "receiver, which times its first byte to its last; QEMU as above, the guest "
               "negotiating CSUM, HOST_TSO4, GUEST_CSUM, GUEST_TSO4 and MRG_RXBUF with both), "
               "Mbit/s of payload:\n")
    out.append("| workload | ferrovm | QEMU | veth floor | ferrovm/QEMU |")
    out.append("| --- | --- | --- | --- | --- |")
    for name, r in tcp.items():
        rates = {k: [n * 8 / us for us, n in r["samples"][k]] for k in ("ferrovm", "qemu", "veth")}
        per_round = [a / b for a, b in zip(rates["ferrovm"], rates["qemu"])]
        out.append(f"| {NET_LABELS.get(name, name)} | {fig(rates['ferrovm'], 0)} | {fig(rates['qemu'], 0)} | "
                   f"{fig(rates['veth'], 0)} | {ratio(rates['ferrovm'], rates['qemu'], per_round)} |")
        summary[name] = {k: med(v) for k, v in rates.items()}
    out.append("")


def net_rates(samples):
    """Datagrams (echoes) per second of each round: (time in µs, how many arrived)."""
    return [n / (us / 1e6) for us, n in samples]


def net_section(res, docs, out):
    """Section 9 from bench/net.py's results (res["net"], target/bench/net.json)."""
    net = res["net"]
    rounds = max(len(r["samples"]["ferrovm"]) for r in net.values())
    out.append("## 9. virtio-net: UDP and TCP through a tap\n")
    out.append(
        "`bench/net.py` (run by `make bench` after `bench.py`): a network namespace holds a "
        "multiqueue tap (10.0.2.2/24, MTU 9000, its queue long enough for a whole burst) and "
        "`bench/udpecho.c` (an echo server, a counting sink, a blaster). The net-stress guest "
        "(ring 3, polled queues, the kit's driver) checks every datagram it gets. Echo workloads "
        "are full guest → tap → host stack → server → guest round trips; one-way workloads count "
        "what arrived at the far end (the guest sends as fast as its queue takes frames; the host "
        "sends a burst and the guest times first to last). The 8000-byte datagrams fit the tap's "
        "9000-byte MTU, so each is one frame, which the guest takes in four 2 KiB mergeable "
        "receive buffers (VIRTIO_NET_F_MRG_RXBUF). ferrovm: `--net tap=ftap0,queues=2` (on this "
        "host's 2 CPUs with one vCPU both pairs share one I/O thread, the default). QEMU 7.2: "
        "microvm with its PCIe host as in §7, `-netdev tap,vhost=off,queues=2 -device "
        "virtio-net-pci,disable-legacy=on,mq=on`, the same guest, linked with its code at the "
        "same addresses as the image ferrovm boots (PVH only: QEMU would take the multiboot "
        "header; see docs/networking.md on why the layout must match). The floor runs the same "
        "exchanges between two namespaces over a veth pair (MTU 9000), no VM. Datagrams (or "
        f"echoes) per second, median of {rounds} interleaved rounds [min–max]; ferrovm/QEMU as the "
        f"ratio of medians [min–max of the per-round ratios]. Measured {res.get('net_date', '—')} "
        "on the machine above, which other work shares: the spread is wide.\n")
    out.append("| workload | ferrovm | QEMU | veth floor | ferrovm/QEMU | ferrovm / QEMU / floor |")
    out.append("| --- | --- | --- | --- | --- | --- |")
    summary = {}
    lost = []
    tcp = {n: r for n, r in net.items() if is_tcp_workload(r)}
    for name, r in net.items():
        if name in tcp:
            continue
        w = r["workload"]
        rates = {k: net_rates(r["samples"][k]) for k in ("ferrovm", "qemu", "veth")}
        per_round = [a / b for a, b in zip(rates["ferrovm"], rates["qemu"])]
        meds = {k: med(v) for k, v in rates.items()}
        if w["window"] == 1:
            last = " / ".join(f"{1e6 / meds[k]:.0f}" for k in rates) + " µs round trip"
        else:
            way = " each way" if "mode" not in w else ""
            last = " / ".join(f"{meds[k] * w['size'] * 8 / 1e6:.0f}" for k in rates) + f" Mbit/s of payload{way}"
        out.append(f"| {NET_LABELS.get(name, name)} | {fig(rates['ferrovm'], 0)} | {fig(rates['qemu'], 0)} | "
                   f"{fig(rates['veth'], 0)} | {ratio(rates['ferrovm'], rates['qemu'], per_round)} | {last} |")
        lost += [f"{k} {r[k]['delivered']:.3f} in {name}" for k in rates if r[k]["delivered"] < 1]
        summary[name] = meds
    out.append("")
    out.append("Delivered: " + ("everything in every run." if not lost else
                                "median fraction below 1 for " + ", ".join(lost) + ".") + "\n")
    if tcp:
        net_tcp_table(tcp, out, summary)
    out.append(
        "- Both VMMs serve the queues in user space (QEMU without vhost, which this host lacks): "
        "ferrovm on I/O threads (one per queue pair, no more than the CPUs the vCPUs leave), "
        "QEMU on its main loop. ferrovm writes each "
        "transmitted frame with one writev(2) straight from guest memory, and leaves a receive "
        "queue's notifications off while it still holds buffers.\n"
        "- A frame larger than one receive buffer takes as many as it needs; their used entries "
        "are published together (one move of the used index). When the guest has posted fewer "
        "buffers than the frame needs, the frame waits and the device looks again 50 µs later "
        "rather than asking a guest that is still draining the ring for a notification (an "
        "exit) per frame; see docs/networking.md.\n"
        "- The floor is faster still: on this host every guest exit is emulated by PVM (5–25 µs, "
        "§2), and a polled guest still pays one per transmitted frame or batch.\n"
        "- With two queue pairs on this 2-CPU host, a thread per pair beside the polling vCPU "
        "measured 0.78–0.87× QEMU's echo rate and one thread for both 0.93–1.00×; one thread is "
        "the default here (see docs/networking.md).\n"
        "- TCP guest to host: each 64 KiB segment leaves the guest as one GSO frame (a "
        "two-buffer chain, headers then data straight from guest memory) that the device writes "
        "to the tap with one writev(2), and the host's stack takes it whole: the receiving socket "
        "bounds both VMMs. The veth floor runs both ends' TCP stacks on the same two CPUs, so "
        "it can come out below them.\n"
        "- TCP host to guest: the tap hands over 64 KiB GSO frames, which the device spreads "
        "over about 33 mergeable 2 KiB receive buffers, published together; the guest copies "
        "and checks every byte and acknowledges once per batch of frames it finds. The guest "
        "is the bottleneck under both VMMs (busy 97 % of the time): both run it at the same "
        "speed since its code sits at the same addresses in both images (a 32-byte shift of "
        "its byte-wise compare once made this row 0.70× or 1.36× depending on the link).\n")
    return summary


def net_rows(res, s_net, rows):
    lat = s_net.get("latency")
    if lat:
        rows.append(f"| virtio-net UDP echo round trip (64 bytes, 1 in flight) | {1e6 / lat['ferrovm']:.0f} µs "
                    f"({lat['qemu'] / lat['ferrovm']:.2f}× QEMU) | {1e6 / lat['qemu']:.0f} µs | "
                    f"veth {1e6 / lat['veth']:.0f} µs | within 10% of QEMU's |")
    def joined(names, k):
        return " / ".join(f"{s_net[n][k]:.0f}" for n in names)

    def ratios(names):
        return " / ".join(f"{s_net[n]['ferrovm'] / s_net[n]['qemu']:.2f}×" for n in names)
    names = [n for n in ("throughput", "throughput-2q", "guest-to-host", "host-to-guest", "host-to-guest-8k")
             if n in s_net]
    if names:
        rows.append(f"| virtio-net datagrams per s: {', '.join(names)} | {joined(names, 'ferrovm')} "
                    f"({ratios(names)} QEMU) | {joined(names, 'qemu')} | veth {joined(names, 'veth')} | "
                    "at least QEMU's |")
    tcp = [n for n in ("tcp-guest-to-host", "tcp-host-to-guest") if n in s_net]
    if tcp:
        rows.append(f"| virtio-net TCP Mbit/s, 64 KiB TSO: guest to host / host to guest | "
                    f"{joined(tcp, 'ferrovm')} ({ratios(tcp)} QEMU) | {joined(tcp, 'qemu')} | "
                    f"veth {joined(tcp, 'veth')} | at least QEMU's |")


def firmware_section(res, docs, out):
    fw = res["firmware"]
    v = fw["vmms"]
    f, q = v["ferrovm"]["bootsector_s"], v["qemu-pc"]["bootsector_s"]
    per_round = [b / a for a, b in zip(f, q)]
    out.append("## 8. Firmware boot: process start to the boot sector\n")
    out.append(
        "Debian's SeaBIOS (`" + fw["firmware"] + "`) boots `target/guests/" + fw["disk"] + "` "
        "(`guests/boot/bootsect.S`) from a modern virtio-blk PCI disk, 256 MiB of RAM. The "
        "harness times from just before `fork`+`exec` to the boot sector's first line "
        "(`bootsect: drive 00000080`, written straight to COM1) arriving on the console pipe, "
        "and to the process's exit after the boot sector has read and checked 64 sectors "
        "through INT 13h and written to debug-exit. All of SeaBIOS runs in emulated ring 0 "
        "here; about half of it is one byte-by-byte `memset` in its `startBoot()`, and the figures grow with the load of this shared host. "
        f"{len(f)} interleaved rounds; measured {fw['measured']}, ferrovm commit {fw['ferrovm_commit']}.\n")
    out.append("```\n"
               "target/release/ferrovm run --disk target/guests/bootsect.img,readonly --memory 256M \\\n"
               "  --firmware /usr/share/seabios/bios-256k.bin\n"
               "qemu-system-x86_64 -M pc -accel kvm -nodefaults -nographic -no-user-config -m 256 \\\n"
               "  -device isa-debug-exit,iobase=0xf4,iosize=1 -serial stdio \\\n"
               "  -bios /usr/share/seabios/bios-256k.bin \\\n"
               "  -drive file=target/guests/bootsect.img,if=none,id=d,format=raw,readonly=on \\\n"
               "  -device virtio-blk-pci,drive=d,disable-legacy=on\n"
               "```\n")
    out.append("| VMM | to the boot sector | to exit | ÷ ferrovm (boot sector) |")
    out.append("| --- | --- | --- | --- |")
    out.append(f"| ferrovm | {fig(f, 2, 's')} | {fig(v['ferrovm']['exit_s'], 2, 's')} |  |")
    out.append(f"| QEMU pc | {fig(q, 2, 's')} | {fig(v['qemu-pc']['exit_s'], 2, 's')} | "
               f"{ratio(q, f, per_round)} |")
    out.append("")
    return {"ferrovm": med(f), "qemu-pc": med(q)}


def firmware_rows(res, s_fw, rows):
    rows.append(f"| SeaBIOS from a virtio-blk disk: process start to the boot sector | "
                f"{s_fw['ferrovm']:.2f} s | pc {s_fw['qemu-pc']:.2f} s "
                f"({s_fw['qemu-pc'] / s_fw['ferrovm']:.2f}× ferrovm) | | — |")


def localupdate_section(res, docs, out):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import localupdate  # noqa: E402
    lu = res["localupdate"]
    results, sizes = lu["results"], lu["sizes"]
    runs = 1 + max((m["run"] for m in results), default=0)
    out.append("## 11. Local live update: a new ferrovm on the same host\n")
    out.append(
        "`ctl migrate unix:PATH` to a new ferrovm started with `--incoming unix:PATH` "
        "(docs/migration.md, \"Local update\"): guest RAM, a memfd, is handed over as a file "
        "descriptor and only the device and vCPU state is sent. Against a TCP migration on "
        "loopback of the same guest: ferrovm's (anonymous RAM, the default, and memfd) and QEMU "
        "7.2's (it has no cpr-transfer, so its same-host path is a TCP migration; microvm, "
        "no bandwidth cap, downtime limit 50 ms). Guest `migrate-idle` with most of its RAM "
        f"touched below the MMIO hole, 1 vCPU; {runs} run(s) per case, interleaved "
        "(`bench/localupdate.py`). Total: the whole migration as the source reports it (the "
        "local update's includes the new process building its VM and devices on the RAM "
        "handed over); downtime: ferrovm's pause to the destination's acknowledgement, "
        "QEMU's guest pause (source `STOP` to destination `RESUME`; its own `downtime` field "
        "ends before the destination runs). Ratios: each case's median over the local "
        "update's." + (f" Recorded {lu['date']}." if lu.get("date") else "") + "\n")
    out.append(localupdate.table(results, sizes) + "\n")
    local = localupdate.CASES[0][0]
    flat = [(gib, localupdate.medians(results, gib, local, "total_ms"),
             localupdate.medians(results, gib, local, "downtime_ms")) for gib in sizes]
    flat = [(g, t, d) for g, t, d in flat if t and d]
    if flat:
        out.append(
            f"The local update sends the same {state_kib(results, local):.0f} KiB (the state) "
            "whatever the RAM size: medians "
            + ", ".join(f"{g} GiB {t[0]:.1f} ms total / {d[0]:.2f} ms downtime" for g, t, d in flat)
            + f"; the worst run of all took {max(t[2] for _, t, _ in flat):.1f} ms total and "
            f"{max(d[2] for _, _, d in flat):.2f} ms of downtime. What is left in the downtime "
            "is the pause of the vCPUs and devices, the state's save and restore, and the new "
            "process starting its vCPU threads, all of which compete for this 2-CPU host's "
            "CPUs with whatever else runs (the spread of the runs).\n")
    out.append(
        "The second table is the memory backends' cost: from process start to the guest's "
        "first tick, which it prints once it has written all its pages. Anonymous RAM is "
        "advised for transparent huge pages; a memfd is shared memory, which follows "
        "`/sys/kernel/mm/transparent_hugepage/shmem_enabled` (`never` here), so its pages are "
        "4 KiB and first touches cost more: `anon` stays the default, and `--memory-backend "
        "memfd` is what a guest to be updated in place is started with.\n")
    figures = {}
    for gib in sizes:
        local_t = localupdate.medians(results, gib, localupdate.CASES[0][0], "total_ms")
        local_d = localupdate.medians(results, gib, localupdate.CASES[0][0], "downtime_ms")
        tcp = {label: (localupdate.medians(results, gib, label, "total_ms"),
                       localupdate.medians(results, gib, label, "downtime_ms"))
               for label, *_ in localupdate.CASES[1:]}
        if local_t and local_d:
            figures[gib] = (local_t[0], local_d[0], tcp)
    return figures


def state_kib(results, label):
    sent = [m["bytes"] for m in results if m["ok"] and m["case"] == label and m.get("bytes")]
    return statistics.median(sent) / 1024 if sent else 0


def localupdate_rows(res, figures, rows):
    for gib, (total, down, tcp) in figures.items():
        qemu_t, qemu_d = tcp["QEMU 7.2 TCP loopback"]
        ours_t, _ = tcp["ferrovm TCP loopback (anon)"]
        qemu = (f"TCP loopback {qemu_t[0]:.0f} ms / {qemu_d[0]:.1f} ms "
                f"({qemu_t[0] / total:.0f}× / {qemu_d[0] / down:.1f}× the update)"
                if qemu_t and qemu_d else "–")
        ours = f"ferrovm TCP loopback total {ours_t[0]:.0f} ms" if ours_t else ""
        rows.append(f"| local update (memfd over unix:), {gib} GiB idle: total / downtime | "
                    f"{total:.1f} ms / {down:.2f} ms | {qemu} | {ours} | "
                    "downtime < 10 ms, total < 100 ms, flat in RAM size |")


# key in results.json, heading in benchmarks.md, renderer, summary rows, their first cells
SECTIONS = [
    ("startup", "## 1. ", startup_section, startup_rows, ("| process start",)),
    ("exits", "## 2. ", exits_section, exits_rows, ("| exit round trip", "| CR8")),
    ("memory", "## 3. ", memory_section, memory_rows, ("| VMM memory",)),
    ("migration", "## 4. ", migration_section, migration_rows, ("| migration ",)),
    ("workloads", "## 5. ", workloads_section, workloads_rows, ("| guest (ring 3)",)),
    ("restore", "## 6. ", restore_section, restore_rows, ("| snapshot restore",)),
    ("blk", "## 7. ", blk_section, blk_rows, ("| virtio-blk",)),
    ("firmware", "## 8. ", firmware_section, firmware_rows, ("| SeaBIOS",)),
    # bench/net.py's results (target/bench/net.json); §10 is measured by hand: kept as it is.
    ("net", "## 9. ", net_section, net_rows, ("| virtio-net",)),
    ("vsock", "## 10. ", None, None, ("| virtio-vsock",)),
    ("localupdate", "## 11. ", localupdate_section, localupdate_rows, ("| local update",)),
]


def old_page(path):
    """What the existing page shows, for sections the results do not hold (a rerun of some
    sections without the results.json of the run that measured the others): its numbered
    sections by heading number ("## 4. "), its machine block and its summary rows."""
    page = {"sections": {}, "machine": [], "rows": [], "rounds": {}}
    if not path.exists():
        return page
    page["rounds"] = old_rounds(path.read_text())
    blocks, current = {}, None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            current = line
            blocks[current] = []
        if current:
            blocks[current].append(line)
    for heading, lines in blocks.items():
        number = heading.split(" ")[1]
        if number[:-1].isdigit() and number.endswith("."):
            page["sections"][f"## {number} "] = lines
        elif heading == "## The machine":
            page["machine"] = lines
        elif heading == "## Summary against the targets":
            page["rows"] = [x for x in lines[1:] if x.startswith("| ")
                            and not x.startswith(("| figure |", "| --- |"))]
    return page


ROUNDS_SUFFIX = {"startup": " for start-up", "exits": " for exits", "memory": " for memory",
                 "workloads": " for the workloads", "restore": " for restore",
                 "blk": " for virtio-blk", "firmware": " for firmware boot",
                 "net": " for virtio-net", "localupdate": " for local update"}


def and_list(items):
    return ", ".join(items[:-1]) + ", and " + items[-1] if len(items) > 1 else "".join(items)


def old_rounds(text):
    """The "Rounds here: ..." phrases of an existing page, by section key."""
    m = re.search(r"Rounds here[^:]*: (.*?), to keep `make bench`", text)
    found = {}
    for phrase in (m.group(1).split(", ") if m else []):
        phrase = phrase.removeprefix("and ")
        if phrase.startswith("for migration"):
            found["migration"] = phrase
        for key, suffix in ROUNDS_SUFFIX.items():
            if phrase.endswith(suffix):
                found[key] = phrase
    return found


def rounds_phrases(res, kept=(), old=None):
    """How many rounds each section ran: this run's, or the page's for kept sections."""
    c = res["config"]
    phrases = {
        "startup": lambda: f"{c['startup_rounds']} for start-up",
        "exits": lambda: f"{c['exit_rounds']} boots × {c['exit_reps']} for exits",
        "memory": lambda: f"{c['memory_rounds']} for memory",
        "workloads": lambda: f"{c['work_rounds']} × {c['work_reps']} for the workloads",
        "restore": lambda: f"{c['restore_rounds']} for restore",
        "blk": lambda: f"{c['blk_rounds']} for virtio-blk",
        "firmware": lambda: f"{c['firmware_rounds']} for firmware boot",
        "localupdate": lambda: f"{c['localupdate_runs']} for local update",
        "net": lambda: f"{len(next(iter(res['net'].values()))['samples']['ferrovm'])} for virtio-net",
        "migration": lambda: "for migration " + "; ".join(
            f"{m['runs']} run{'s' if m['runs'] > 1 else ''} for {m['link']} "
            + (f"idle {m['gib']} GiB" if m["guest"] == "migrate-idle" else f"dirtying {m['mib']} MiB")
            for m in c["migration_cases"]),
    }
    old = old or {}
    return [phrase() if key in res else old[key] for key, phrase in phrases.items()
            if key in res or (key in kept and key in old)]


def main():
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "target/bench/results.json"
    docs = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "docs"
    res = json.loads(results.read_text())
    net = results.with_name("net.json")
    if net.exists():
        res["net"] = json.loads(net.read_text())
        res["net_date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(net.stat().st_mtime))
    old = old_page(docs / "benchmarks.md")
    body, rows, kept = [], [], []
    for key, heading, render, summarize, prefixes in SECTIONS:
        if key in res and render:
            figures = render(res, docs, body)
            if figures:
                summarize(res, figures, rows)
        elif heading in old["sections"]:
            # Not in these results: keep what the page showed (see old_page).
            kept.append(key)
            body.extend(old["sections"][heading])
            rows.extend(r for r in old["rows"] if r.startswith(prefixes))

    head = ["# Benchmarks\n"]
    head.append(
        "ferrovm side by side with QEMU and with a raw KVM_RUN loop (the floor the kernel "
        "allows), measured in one run of `make bench` on one machine. Every figure is the "
        "median over its runs with [min–max]; every comparison is a ratio of two medians from "
        "the same run, with [min–max] of the same ratio taken round by round where rounds pair "
        "up. Runs are interleaved: each round runs every VMM once, in an order that rotates "
        "between rounds. The performance targets are in `../shared/DESIGN.md`.\n")
    if res.get("quick"):
        which = "These figures" if not kept else "The figures of the sections measured in this run"
        head.append(f"**{which} come from `bench/bench.py --quick` (a smoke test: few rounds).**\n")
    if kept and old["machine"]:
        # The kept sections were measured on the machine the page describes; the sections
        # measured now carry their own date, commit and TSC rate.
        head.extend(old["machine"])
    else:
        machine_block(res, head)
    head.append("## Summary against the targets\n")
    head.append("| figure | ferrovm | QEMU | floor / reference | target (DESIGN.md) |")
    head.append("| --- | --- | --- | --- | --- |")
    head.extend(rows)
    head.append("")
    if kept:
        print(f"kept from the previous {docs / 'benchmarks.md'} (no results for them): {', '.join(kept)}")

    tail = ["## Guest against host on a hardware-virtualization host\n"]
    tail.append(
        "On this PVM host an unmodified Linux kernel does not boot (DESIGN.md), so the "
        "operating-system workloads run on the host only. On a VT-x / AMD-V host, run the same "
        "harness in a Linux guest:\n")
    tail.append(
        "1. `make -C bench` builds `target/bench/hostbench`, statically linked: it runs "
        "unchanged in any x86-64 Linux guest.\n"
        "2. On the host: `target/bench/hostbench all 3 /var/tmp` — TSC rate, the three shared "
        "workloads (integer loop, memmove, first touch, plus first touch with huge pages) and "
        "the OS workloads: `getpid` (10^6 raw syscalls), `fork`+`wait` (500 children that exit "
        "at once), 4 KiB `pwrite`+`fsync` (100, to a file in the directory given).\n"
        "3. In the guest, either copy the binary into a running Linux guest and run the same "
        "command (with the directory on the guest's disk), or boot it as the guest's init: "
        "`bench/linux-initramfs.sh target/bench/hostbench.cpio` packs it as `/init` of an "
        "initramfs, and\n\n"
        "   ```\n"
        "   target/release/ferrovm run --kernel bzImage --initrd target/bench/hostbench.cpio \\\n"
        "       --memory 2G --cmdline \"console=ttyS0 quiet\"\n"
        "   ```\n\n"
        "   runs everything (as PID 1 it mounts `/proc` and a tmpfs on `/tmp`, writes to `/tmp`, "
        "so `fsync` there measures tmpfs, not a disk) and powers the guest off.\n"
        "4. Both print the same `work: <name> rep=<k> units=<n> cycles=<c>` lines with their own "
        "`tsc_hz=`; divide guest by host per workload (cycles / units / tsc_hz).\n")
    tail.append("## How to rerun\n")
    tail.append(
        "```\n"
        "sudo make bench            # builds ferrovm, the guests and bench/'s C programs; installs\n"
        "                           # qemu-system-x86 and python3-matplotlib if missing; runs\n"
        "                           # bench/bench.py, then bench/report.py -> docs/benchmarks.md\n"
        "sudo make bench BENCH_ARGS=--quick     # a smoke test: few rounds, about 2 minutes\n"
        "sudo bench/run.sh --only exits,memory  # remeasure some sections, keep the others\n"
        "sudo bench/run.sh --only blk --set blk_rounds=3   # any setting of config() in bench.py\n"
        "sudo bench/run.sh --only net          # §9 alone: bench/net.py -> target/bench/net.json\n"
        "/usr/bin/python3 bench/report.py       # re-render from target/bench/results.json\n"
        "                                       # (any python3 with matplotlib)\n"
        "```\n")
    tail.append(
        "`--only` merges into an existing `target/bench/results.json`. Without one (a fresh "
        "checkout), `report.py` renders the sections it has results for and keeps the other "
        "numbered sections, their summary rows and the machine block from the existing "
        "`docs/benchmarks.md` word for word (it says which on its output); sections measured "
        "that way state their own date, commit and TSC rate.\n")
    tail.append(
        "Needs root (network namespaces and `tc` for the 1 Gbit/s link) and `/dev/kvm`. Every "
        "sample is kept in `target/bench/results.json`. Rounds here: "
        + and_list(rounds_phrases(res, kept, old["rounds"])) + ", to keep `make bench` under 20 minutes on this "
        "2-CPU machine.\n")
    tail.append("## Files\n")
    tail.append(
        "| path | what |\n| --- | --- |\n"
        "| `bench/run.sh` | `make bench`: dependencies, builds, `bench.py`, `report.py` |\n"
        "| `bench/bench.py` | runs every measurement, writes `target/bench/results.json` |\n"
        "| `bench/report.py` | this page and `docs/bench-*.png` from the results |\n"
        "| `bench/rawkvm.c` | the raw KVM_RUN loop (the floor) |\n"
        "| `bench/hostbench.c`, `bench/workloads.h`, `bench/workloads-host.c` | host side of guest against host; `prime` |\n"
        "| `bench/qmp.py` | minimal QMP client for QEMU's migration |\n"
        "| `bench/migration.sh` | ferrovm migration cases (also its own table, docs/migration.md) |\n"
        "| `bench/localupdate.py` | §11: local update against TCP migration on loopback, memory backends |\n"
        "| `bench/linux-initramfs.sh` | `hostbench` as the `/init` of an initramfs |\n"
        "| `bench/blkhost.c` | the host floor of the virtio-blk benchmark |\n"
        "| `bench/net.py`, `bench/udpecho.c`, `bench/tcpbulk.c` | the virtio-net benchmark (`target/bench/net.json`) and its host side (UDP, TCP) |\n"
        "| `guests/bench-start.c`, `guests/bench-exit.c`, `guests/bench-work.c`, `guests/bench-restore.c`, "
        "`guests/bench-blk.c` | the benchmark guests |\n")
    text = "\n".join(head + body + tail)
    notes = ROOT / "bench/notes.md"
    if notes.exists():
        # Hand-written reading of the figures (kept in bench/, spliced in before "How to rerun").
        text = text.replace("## Guest against host on a hardware-virtualization host\n",
                            notes.read_text().rstrip() + "\n\n## Guest against host on a hardware-virtualization host\n", 1)
    (docs / "benchmarks.md").write_text(text.rstrip() + "\n")
    print(f"wrote {docs / 'benchmarks.md'} and plots")


if __name__ == "__main__":
    main()
