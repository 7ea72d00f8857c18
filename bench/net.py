#!/usr/bin/env python3
"""virtio-net benchmark: ferrovm against QEMU 7.2 (virtio-net-pci on a tap, vhost off), with
a veth pair as the floor.

    bench/net.py [--rounds N] [--json FILE]

Needs root (network namespaces) and /dev/kvm; `make guests` first. A namespace holds a
multiqueue tap (10.0.2.2/24) and bench/udpecho.c echoing UDP on port 7777; the net-stress
guest (ring 3, polled queues) sends sequence-checked datagrams and reports how long its
echoes took. Workloads: latency (one datagram of 64 bytes in flight: the round trip
guest -> tap -> host stack -> echo server -> guest), throughput (1400-byte datagrams, 64 in
flight, so both directions carry the same bytes) on one queue pair and on two, and one way:
guest to host (the guest sends as fast as its queue takes them; the host counts what arrived)
and host to guest (the host sends as fast as it can; the guest counts what arrived, first to
last), with 1400-byte datagrams and with 8000-byte ones over a 9000-byte MTU that the guest
takes in mergeable receive buffers. The floor runs the same exchanges between two namespaces over a veth pair (udpecho
client, send, recv), no VM at all.

TCP workloads (bench/tcpbulk.c on the host, the net-tcp guest with the kit's TCP): bulk transfer
against a real host TCP socket over a 1500-byte MTU with 64 KiB TSO (the guest sends GSO frames
of up to 64 KiB, and takes the host's whole), both directions, every byte checked by the
receiver, timed by the receiver from its first byte to its last; the floor is the same transfer
between the two namespaces over the veth pair (TSO and GRO on, MTU 1500).
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
TCPBULK = str(ROOT / "target/bench/tcpbulk")
NS, CLIENT_NS = "fvbench-net", "fvbench-cli"
WORKLOADS = {
    "latency": {"pairs": 1, "window": 1, "size": 64, "count": 3000},
    "throughput": {"pairs": 1, "window": 64, "size": 1400, "count": 30000},
    "throughput-2q": {"pairs": 2, "window": 64, "size": 1400, "count": 30000},
    "guest-to-host": {"pairs": 1, "window": 0, "size": 1400, "count": 30000, "mode": "send"},
    "host-to-guest": {"pairs": 1, "window": 0, "size": 1400, "count": 20000, "mode": "recv"},
    # Large frames: 8000-byte datagrams over a 9000-byte MTU, each spread over several
    # mergeable receive buffers (VIRTIO_NET_F_MRG_RXBUF, 2048-byte buffers).
    "host-to-guest-8k": {"pairs": 1, "window": 0, "size": 8000, "count": 10000, "mode": "recv",
                         "mrg": 1},
    # Bulk TCP with 64 KiB TSO over a 1500-byte MTU; "count" is bytes.
    "tcp-guest-to-host": {"pairs": 1, "window": 0, "size": 1, "count": 1 << 30,
                          "mode": "tcp-send", "mtu": 1500},
    "tcp-host-to-guest": {"pairs": 1, "window": 0, "size": 1, "count": 1 << 30,
                          "mode": "tcp-recv", "mtu": 1500},
}
TCP_PORTS = {"tcp-send": "5001", "tcp-recv": "5002"}
RESULT = re.compile(r"net-stress: (\d+) echoes intact in (\d+) us")
SENT = re.compile(r"net-stress: sent (\d+) datagrams of \d+ bytes in (\d+) us, the host received (\d+)")
RECEIVED = re.compile(r"net-stress: received (\d+) of \d+ datagrams of \d+ bytes in (\d+) us")
# TCP: the host's count and time (guest to host), the guest's (host to guest).
TCP_SENT = re.compile(r"net-tcp: host says: ok (\d+) (\d+)")
TCP_RECEIVED = re.compile(r"net-tcp: received (\d+) bytes intact in (\d+) us")


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def setup():
    teardown()
    sh("ip", "netns", "add", NS)
    sh("ip", "netns", "add", CLIENT_NS)
    for ns in (NS, CLIENT_NS):
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "-n", NS, "tuntap", "add", "dev", "ftap0", "mode", "tap", "vnet_hdr", "multi_queue")
    # A queue long enough for a whole host-to-guest burst: the host outpaces any guest, and
    # the figure is how fast the guest takes frames, not how many a short queue drops.
    sh("ip", "-n", NS, "link", "set", "ftap0", "txqueuelen", "40000")
    sh("ip", "-n", NS, "link", "set", "ftap0", "mtu", "9000")
    sh("ip", "-n", NS, "addr", "add", "10.0.2.2/24", "dev", "ftap0")
    sh("ip", "-n", NS, "link", "set", "ftap0", "up")
    sh("ip", "-n", NS, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1",
       "netns", CLIENT_NS)
    sh("ip", "-n", NS, "addr", "add", "10.0.3.2/24", "dev", "veth0")
    sh("ip", "-n", CLIENT_NS, "addr", "add", "10.0.3.1/24", "dev", "veth1")
    sh("ip", "-n", NS, "link", "set", "veth0", "mtu", "9000")
    sh("ip", "-n", CLIENT_NS, "link", "set", "veth1", "mtu", "9000")
    sh("ip", "-n", NS, "link", "set", "veth0", "up")
    sh("ip", "-n", CLIENT_NS, "link", "set", "veth1", "up")
    servers = []
    for prog, mode, port in ((UDPECHO, "serve", "7777"), (UDPECHO, "sink", "7778"),
                             (UDPECHO, "blast", "7779"), (TCPBULK, "sink", TCP_PORTS["tcp-send"]),
                             (TCPBULK, "source", TCP_PORTS["tcp-recv"])):
        p = subprocess.Popen(["ip", "netns", "exec", NS, prog, mode, "0.0.0.0", port],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        servers.append(p)
    return servers


def set_mtu(mtu):
    """The tap's and the veth pair's MTU for the next workload."""
    sh("ip", "-n", NS, "link", "set", "ftap0", "mtu", str(mtu))
    sh("ip", "-n", NS, "link", "set", "veth0", "mtu", str(mtu))
    sh("ip", "-n", CLIENT_NS, "link", "set", "veth1", "mtu", str(mtu))


def teardown():
    for ns in (NS, CLIENT_NS):
        sh("ip", "netns", "del", ns, check=False)


def is_tcp(w):
    return w.get("mode", "").startswith("tcp-")


def guest_args(w):
    if is_tcp(w):
        return f"mode={w['mode'][4:]} port={TCP_PORTS[w['mode']]} bytes={w['count']}"
    args = f"pairs={w['pairs']} window={w['window']} size={w['size']} count={w['count']}"
    args += f" mode={w['mode']}" if "mode" in w else ""
    return args + (f" mrg={w['mrg']}" if "mrg" in w else "")


def vmm_cmd(vmm, w):
    guest = "net-tcp" if is_tcp(w) else "net-stress"
    if vmm == "ferrovm":
        return [FERROVM, "run", "--kernel", str(GUESTS / f"{guest}.elf"), "--memory", "256M",
                "--net", "tap=ftap0,queues=2", "--cmdline", guest_args(w)]
    # microvm with its PCIe host at ferrovm's ECAM address, as the virtio-blk bench runs it.
    return ["qemu-system-x86_64", "-accel", "kvm,kernel-irqchip=on",
            "-M", "microvm,pcie=on,acpi=on,rtc=on", "-m", "256", "-nodefaults", "-nographic",
            "-no-user-config", "-no-reboot", "-device", "isa-debug-exit,iobase=0xf4,iosize=1",
            "-serial", "stdio", "-kernel", str(GUESTS / f"pvh-only/{guest}.elf"),
            "-append", guest_args(w) + " ecam=0xe0000000 pci_assign=1",
            "-netdev", "tap,id=n0,ifname=ftap0,script=no,downscript=no,vhost=off,queues=2",
            "-device", "virtio-net-pci,netdev=n0,disable-legacy=on,mq=on,vectors=6"]


def run_vm(vmm, w):
    p = subprocess.run(["ip", "netns", "exec", NS] + vmm_cmd(vmm, w), capture_output=True,
                       text=True, timeout=300)
    return parse(vmm, w, p.returncode, p.stdout + p.stderr)


def parse(who, w, status, out):
    """(time in us, datagrams (bytes, for TCP) that arrived) from a guest's output."""
    mode = w.get("mode")
    pattern = {"send": SENT, "recv": RECEIVED, "tcp-send": TCP_SENT, "tcp-recv": TCP_RECEIVED}
    m = pattern.get(mode, RESULT).search(out)
    if status != 1 or not m:
        raise RuntimeError(f"{who}: status {status}\n{out}")
    if mode == "send":
        return int(m.group(2)), int(m.group(3))
    return int(m.group(2)), int(m.group(1))


def run_floor(w):
    mode = w.get("mode")
    if is_tcp(w):
        p = sh("ip", "netns", "exec", CLIENT_NS, TCPBULK, mode[4:], "10.0.3.2", TCP_PORTS[mode],
               str(w["count"]))
        m = re.search(r"received=(\d+) us=(\d+)", p.stdout)
        return int(m.group(2)), int(m.group(1))
    if mode:
        port = "7778" if mode == "send" else "7779"
        p = sh("ip", "netns", "exec", CLIENT_NS, UDPECHO, mode, "10.0.3.2", port,
               str(w["count"]), str(w["size"]))
        m = re.search(r"received=(\d+) us=(\d+)", p.stdout)
        return int(m.group(2)), int(m.group(1))
    p = sh("ip", "netns", "exec", CLIENT_NS, UDPECHO, "client", "10.0.3.2", "7777",
           str(w["window"] * w["pairs"]), str(w["count"]), str(w["size"]))
    return int(float(re.search(r"us=(\d+)", p.stdout).group(1))), w["count"]


def figures(w, samples):
    """Medians: datagrams (echoes, for the echo workloads; bytes for TCP) per second that
    arrived, Mbit/s of payload one way, and the round trip for the latency workload."""
    rates = sorted(n / (us / 1e6) for us, n in samples)
    rate = statistics.median(rates)
    return {"per_s": rate, "min_per_s": rates[0], "max_per_s": rates[-1],
            "rtt_us": 1e6 / rate if w["window"] == 1 else None,
            "mbit": rate * w["size"] * 8 / 1e6,
            "delivered": statistics.median(n / w["count"] for _, n in samples)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "target/bench/net.json"))
    ap.add_argument("--only", nargs="*", help="run only these workloads")
    args = ap.parse_args()
    Path(UDPECHO).parent.mkdir(parents=True, exist_ok=True)
    sh("gcc", "-O2", "-Wall", "-o", UDPECHO, str(ROOT / "bench/udpecho.c"))
    sh("gcc", "-O2", "-Wall", "-o", TCPBULK, str(ROOT / "bench/tcpbulk.c"))
    servers = setup()
    results = {}
    try:
        for name, w in WORKLOADS.items():
            if args.only and name not in args.only:
                continue
            samples = {"ferrovm": [], "qemu": [], "veth": []}
            set_mtu(w.get("mtu", 9000))
            for r in range(args.rounds):
                # Alternate the order so neither VMM always runs on a warmer host.
                order = ["ferrovm", "qemu"] if r % 2 == 0 else ["qemu", "ferrovm"]
                for vmm in order:
                    samples[vmm].append(run_vm(vmm, w))
                samples["veth"].append(run_floor(w))
            results[name] = {"workload": w, "samples": samples,
                             **{k: figures(w, v) for k, v in samples.items()}}
            f, q, v = (results[name][k] for k in ("ferrovm", "qemu", "veth"))
            print(f"{name}: ferrovm {f['per_s']:.0f}/s, qemu {q['per_s']:.0f}/s, "
                  f"veth {v['per_s']:.0f}/s; ferrovm/qemu {f['per_s'] / q['per_s']:.2f}; "
                  f"delivered {f['delivered']:.3f} / {q['delivered']:.3f} / {v['delivered']:.3f}",
                  file=sys.stderr)
    finally:
        for p in servers:
            p.kill()
        teardown()
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
