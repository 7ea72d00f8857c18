#!/usr/bin/env python3
"""virtio-net benchmark: ferrovm against QEMU 7.2 (virtio-net-pci on a tap, vhost off), with
a veth pair as the floor.

    bench/net.py [--rounds N] [--json FILE]

Needs root (network namespaces) and /dev/kvm; `make guests` first. A namespace holds a
multiqueue tap (10.0.2.2/24) and bench/udpecho.c echoing UDP on port 7777; the net-stress
guest (ring 3, polled queues) sends sequence-checked datagrams and reports how long its
echoes took. Workloads: latency (one datagram of 64 bytes in flight: the round trip
guest -> tap -> host stack -> echo server -> guest), throughput (1400-byte datagrams, 64 in
flight, so both directions carry the same bytes) on one queue pair and on two. The floor runs
the same exchanges between two namespaces over a veth pair (udpecho client), no VM at all.
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUESTS = ROOT / "target/guests"
FERROVM = str(ROOT / "target/release/ferrovm")
UDPECHO = str(ROOT / "target/bench/udpecho")
NS, CLIENT_NS = "fvbench-net", "fvbench-cli"
WORKLOADS = {
    "latency": {"pairs": 1, "window": 1, "size": 64, "count": 3000},
    "throughput": {"pairs": 1, "window": 64, "size": 1400, "count": 30000},
    "throughput-2q": {"pairs": 2, "window": 64, "size": 1400, "count": 30000},
}
RESULT = re.compile(r"net-stress: (\d+) echoes intact in (\d+) us")


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def setup():
    teardown()
    sh("ip", "netns", "add", NS)
    sh("ip", "netns", "add", CLIENT_NS)
    for ns in (NS, CLIENT_NS):
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "-n", NS, "tuntap", "add", "dev", "ftap0", "mode", "tap", "vnet_hdr", "multi_queue")
    sh("ip", "-n", NS, "addr", "add", "10.0.2.2/24", "dev", "ftap0")
    sh("ip", "-n", NS, "link", "set", "ftap0", "up")
    sh("ip", "-n", NS, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1",
       "netns", CLIENT_NS)
    sh("ip", "-n", NS, "addr", "add", "10.0.3.2/24", "dev", "veth0")
    sh("ip", "-n", CLIENT_NS, "addr", "add", "10.0.3.1/24", "dev", "veth1")
    sh("ip", "-n", NS, "link", "set", "veth0", "up")
    sh("ip", "-n", CLIENT_NS, "link", "set", "veth1", "up")
    server = subprocess.Popen(["ip", "netns", "exec", NS, UDPECHO, "serve", "0.0.0.0", "7777"],
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    return server


def teardown():
    for ns in (NS, CLIENT_NS):
        sh("ip", "netns", "del", ns, check=False)


def guest_args(w):
    return f"pairs={w['pairs']} window={w['window']} size={w['size']} count={w['count']}"


def vmm_cmd(vmm, w):
    if vmm == "ferrovm":
        return [FERROVM, "run", "--kernel", str(GUESTS / "net-stress.elf"), "--memory", "256M",
                "--net", "tap=ftap0,queues=2", "--cmdline", guest_args(w)]
    # microvm with its PCIe host at ferrovm's ECAM address, as the virtio-blk bench runs it.
    return ["qemu-system-x86_64", "-accel", "kvm,kernel-irqchip=on",
            "-M", "microvm,pcie=on,acpi=on,rtc=on", "-m", "256", "-nodefaults", "-nographic",
            "-no-user-config", "-no-reboot", "-device", "isa-debug-exit,iobase=0xf4,iosize=1",
            "-serial", "stdio", "-kernel", str(GUESTS / "pvh-only/net-stress.elf"),
            "-append", guest_args(w) + " ecam=0xe0000000 pci_assign=1",
            "-netdev", "tap,id=n0,ifname=ftap0,script=no,downscript=no,vhost=off,queues=2",
            "-device", "virtio-net-pci,netdev=n0,disable-legacy=on,mq=on,vectors=6"]


def run_vm(vmm, w):
    p = subprocess.run(["ip", "netns", "exec", NS] + vmm_cmd(vmm, w), capture_output=True,
                       text=True, timeout=300)
    m = RESULT.search(p.stdout)
    if p.returncode != 1 or not m:
        raise RuntimeError(f"{vmm}: status {p.returncode}\n{p.stdout}\n{p.stderr}")
    return int(m.group(2))


def run_floor(w):
    p = sh("ip", "netns", "exec", CLIENT_NS, UDPECHO, "client", "10.0.3.2", "7777",
           str(w["window"] * w["pairs"]), str(w["count"]), str(w["size"]))
    return int(float(re.search(r"us=(\d+)", p.stdout).group(1)))


def figures(w, us):
    echoes_per_s = w["count"] / (us / 1e6)
    return {"us": us, "rtt_us": us / w["count"] if w["window"] == 1 else None,
            "echoes_per_s": echoes_per_s,
            "mbit_each_way": echoes_per_s * w["size"] * 8 / 1e6}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "target/bench/net.json"))
    args = ap.parse_args()
    Path(UDPECHO).parent.mkdir(parents=True, exist_ok=True)
    sh("gcc", "-O2", "-Wall", "-o", UDPECHO, str(ROOT / "bench/udpecho.c"))
    server = setup()
    results = {}
    try:
        for name, w in WORKLOADS.items():
            samples = {"ferrovm": [], "qemu": [], "veth": []}
            for r in range(args.rounds):
                # Alternate the order so neither VMM always runs on a warmer host.
                order = ["ferrovm", "qemu"] if r % 2 == 0 else ["qemu", "ferrovm"]
                for vmm in order:
                    samples[vmm].append(run_vm(vmm, w))
                samples["veth"].append(run_floor(w))
            results[name] = {"workload": w, "samples_us": samples,
                             **{k: figures(w, statistics.median(v)) for k, v in samples.items()}}
            f, q, v = (results[name][k] for k in ("ferrovm", "qemu", "veth"))
            print(f"{name}: ferrovm {f['echoes_per_s']:.0f}/s, qemu {q['echoes_per_s']:.0f}/s, "
                  f"veth {v['echoes_per_s']:.0f}/s; ferrovm/qemu "
                  f"{f['echoes_per_s'] / q['echoes_per_s']:.2f}", file=sys.stderr)
    finally:
        server.kill()
        teardown()
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
