//! virtio-net on a tap, end to end. Each test makes its own network namespace holding a
//! tap (`ftap0`, address 10.0.2.2/24) and a host-side peer: the namespace's kernel answers
//! ARP and ICMP for 10.0.2.2, a small Python program echoes UDP on port 7777 and records
//! every RARP frame the tap carries. ferrovm runs inside the namespace (`ip netns exec`) and
//! opens the tap; the guests (net-echo, net-stress, net-hostile) drive the device from ring
//! 3 and report what they saw.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const TAP: &str = "ftap0";
const GUEST_MAC: &str = "52:54:00:12:34:56";

/// The peer: UDP echo on 10.0.2.2:7777, and one "rarp MAC at MS" line per RARP frame on the
/// tap (MS: when it came, in milliseconds of the monotonic clock).
const PEER: &str = r#"
import socket, sys, threading, time
def rarp():
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x8035))
    s.bind((sys.argv[1], 0))
    while True:
        f = s.recv(2048)
        print("rarp %s at %d" % (":".join("%02x" % b for b in f[6:12]), time.monotonic() * 1000),
              flush=True)
threading.Thread(target=rarp, daemon=True).start()
def large():
    # A datagram carrying the guest's MAC on port 7778 asks for a 60000-byte TCP segment,
    # written to the tap as one GSO frame (virtio_net_hdr: NEEDS_CSUM, GSO_TCPV4, gso_size
    # 1448), and an 8000-byte datagram (the tap's MTU is 9000 then).
    import struct
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b.bind(("10.0.2.2", 7778))
    p = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    p.setsockopt(263, 15, 1)  # SOL_PACKET, PACKET_VNET_HDR
    p.bind((sys.argv[1], 0))
    mine = bytes.fromhex(open("/sys/class/net/%s/address" % sys.argv[1]).read().strip().replace(":", ""))
    payload = bytes(i % 251 for i in range(60000))
    while True:
        data, addr = b.recvfrom(2048)
        gip = socket.inet_aton(addr[0])
        tcp = struct.pack("!HHIIBBHHH", 7778, addr[1], 1, 1, 5 << 4, 0x18, 65535, 0, 0)
        iph = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40 + len(payload), 1, 0x4000, 64, 6, 0,
                          socket.inet_aton("10.0.2.2"), gip)
        s = sum(struct.unpack("!10H", iph))
        while s >> 16:
            s = (s & 0xffff) + (s >> 16)
        iph = iph[:10] + struct.pack("!H", ~s & 0xffff) + iph[12:]
        vnet = struct.pack("<BBHHHH", 1, 1, 54, 1448, 34, 16)
        p.send(vnet + data[:6] + mine + b"\x08\x00" + iph + tcp + payload)
        b.sendto(payload[:8000], addr)
threading.Thread(target=large, daemon=True).start()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
u.bind(("10.0.2.2", 7777))
print("ready", flush=True)
while True:
    data, addr = u.recvfrom(65536)
    u.sendto(data, addr)
"#;

/// A network namespace with the tap and the peer; removed (with both) on drop.
struct Peer {
    ns: String,
    dir: PathBuf,
    child: Child,
}

impl Peer {
    fn new(name: &str, multi_queue: bool) -> Peer {
        Peer::with_mac(name, multi_queue, None)
    }

    /// A peer whose tap has the MAC `mac` (two peers standing for one network share it).
    fn with_mac(name: &str, multi_queue: bool, mac: Option<&str>) -> Peer {
        require_kvm();
        let ns = format!("fvnet-{}-{name}", std::process::id());
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("net-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        tap_namespace(&ns, TAP, multi_queue, mac);
        let script = dir.join("peer.py");
        std::fs::write(&script, PEER).unwrap();
        let log = std::fs::File::create(dir.join("peer.log")).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &ns, "python3"])
            .arg(&script)
            .arg(TAP)
            .stdout(log)
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the peer");
        let peer = Peer { ns, dir, child };
        wait_until(Duration::from_secs(10), "the peer", || {
            peer.log().contains("ready")
        });
        peer
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("peer.log")).unwrap_or_default()
    }

    /// Starts ferrovm in the namespace: serial output to a file, an API socket if asked.
    fn start(&self, name: &str, args: &[&str], with_socket: bool) -> Vm {
        self.start_env(name, args, with_socket, &[])
    }

    fn start_env(&self, name: &str, args: &[&str], with_socket: bool, env: &[(&str, &str)]) -> Vm {
        let serial = self.dir.join(format!("{name}.serial"));
        let socket = self.dir.join(format!("{name}.sock"));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns, FERROVM, "run"])
            .args(args)
            .arg("--serial")
            .arg(format!("file:{}", serial.display()));
        if with_socket {
            cmd.arg("--api-socket").arg(&socket);
        }
        cmd.envs(env.iter().copied());
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start ferrovm");
        let mut vm = Vm {
            child,
            serial,
            socket: with_socket.then_some(socket),
        };
        if let Some(socket) = vm.socket.clone() {
            wait_until(Duration::from_secs(20), "the API socket", || {
                assert!(
                    vm.child.try_wait().unwrap().is_none(),
                    "ferrovm exited: {}",
                    vm.stderr()
                );
                socket.exists()
            });
        }
        vm
    }

    /// Runs `guest` with `--net net` to its end; asserts PASS; returns its output.
    fn run_guest(&self, guest_name: &str, net: &str, extra: &[&str]) -> String {
        self.run_guest_env(guest_name, net, extra, &[])
    }

    fn run_guest_env(
        &self,
        guest_name: &str,
        net: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> String {
        let kernel = guest(guest_name);
        let mut args = vec!["--kernel", kernel.to_str().unwrap(), "--net", net];
        args.extend_from_slice(extra);
        let mut vm = self.start_env(guest_name, &args, false, env);
        let (status, stderr) = vm.wait(Duration::from_secs(120));
        let out = vm.output();
        assert_eq!(
            status,
            Some(1),
            "status {status:?}\n{out}\n--- stderr\n{stderr}"
        );
        assert!(
            out.trim_end().ends_with("PASS"),
            "{out}\n--- stderr\n{stderr}"
        );
        assert!(!out.contains("FAIL"), "{out}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        if env.is_empty() {
            out
        } else {
            // What the environment asked for (a log level) shows on stderr.
            format!("{out}\n--- stderr\n{stderr}")
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Vm {
    child: Child,
    serial: PathBuf,
    socket: Option<PathBuf>,
}

impl Vm {
    fn output(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    fn stderr(&mut self) -> String {
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        err
    }

    fn ctl(&self, args: &[&str]) -> Run {
        let socket = self.socket.as_ref().unwrap().to_str().unwrap().to_string();
        let mut all = vec!["ctl", "--api-socket", &socket];
        all.extend_from_slice(args);
        ferrovm(&all, Duration::from_secs(60))
    }

    /// Waits for the VMM to exit (killing it after `limit`): its status and stderr.
    fn wait(&mut self, limit: Duration) -> (Option<i32>, String) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status.code(), self.stderr());
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("ferrovm did not finish in {limit:?}:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.kill();
    }
}

fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn net(options: &str) -> String {
    format!("tap={TAP}{options}")
}

/// ARP, UDP echo and ICMP echo with the peer, received by MSI-X interrupt (irqfd) in both
/// irqchip modes and polled, with and without mergeable receive buffers; the MAC given on
/// the command line is the guest's.
#[test]
fn echo_with_the_peer_in_both_irqchip_modes() {
    let peer = Peer::new("echo", false);
    let mac = net(&format!(",mac={GUEST_MAC}"));
    for (irqchip, irq, mrg) in [("kernel", 1, 0), ("split", 1, 1), ("kernel", 0, 0)] {
        let cmdline = format!("mac={GUEST_MAC} rounds=50 pings=5 irq={irq} mrg={mrg}");
        let out = peer.run_guest(
            "net-echo",
            &mac,
            &["--irqchip", irqchip, "--cmdline", &cmdline],
        );
        assert!(out.contains("net-echo: 50 UDP echoes"), "{out}");
        assert!(out.contains(&format!("net-echo: mac {GUEST_MAC}")), "{out}");
        assert_eq!(out.contains("net-echo: MSI-X:"), irq == 1, "{out}");
        let mergeable = if mrg == 1 { "on" } else { "off" };
        assert!(
            out.contains(&format!("mergeable receive buffers {mergeable}")),
            "{out}"
        );
    }
}

/// Mergeable receive buffers of 1530 bytes with GUEST_TSO4: a 60000-byte TCP segment the
/// host hands the tap as one GSO frame reaches the guest whole (gso_type TCPV4), spread over
/// about 40 buffers whose used entries it finds all published with the first, and so does an
/// 8000-byte datagram over a 9000-byte MTU.
#[test]
fn large_frames_spread_over_mergeable_buffers() {
    let peer = Peer::new("tso", false);
    ip(&["-n", &peer.ns, "link", "set", TAP, "mtu", "9000"]);
    let out = peer.run_guest(
        "net-echo",
        &net(""),
        &["--cmdline", "rounds=5 pings=1 tso=1"],
    );
    assert!(out.contains("net-echo: 5 UDP echoes"), "{out}");
    let tso = out
        .lines()
        .find(|l| l.contains("-byte TSO frame"))
        .unwrap_or_else(|| panic!("no TSO frame: {out}"));
    let buffers: u32 = tso
        .rsplit(" in ")
        .next()
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{tso}"));
    // 60054 bytes of frame and 12 of header in 1530-byte buffers.
    assert_eq!(buffers, 40, "{tso}");
    assert!(
        out.contains("net-echo: a 8042-byte datagram in 6 buffers"),
        "{out}"
    );
}

/// FERROVM_KERNEL_EVENTFDS=off: notifications as MMIO exits, interrupts from user space.
#[test]
fn echo_without_kernel_eventfds() {
    let peer = Peer::new("noeventfd", false);
    let out = peer.run_guest_env(
        "net-echo",
        &net(""),
        &["--cmdline", "rounds=50 irq=1"],
        &[("FERROVM_KERNEL_EVENTFDS", "off")],
    );
    assert!(out.contains("net-echo: 50 UDP echoes"), "{out}");
    assert!(out.contains("net-echo: MSI-X:"), "{out}");
}

/// Two queue pairs (IFF_MULTI_QUEUE, VIRTIO_NET_F_MQ, VQ_PAIRS_SET 2), 20000 frames of up
/// to 1400 bytes, 64 in flight per pair, every echo checked; both pairs carry frames,
/// served by one I/O thread and by one thread each.
#[test]
fn stress_on_two_queue_pairs() {
    for threads in [1, 2] {
        let peer = Peer::new("stress", true);
        let out = peer.run_guest_env(
            "net-stress",
            &net(&format!(",queues=2,iothreads={threads}")),
            &["--cmdline", "pairs=2 count=20000 window=64"],
            &[("FERROVM_LOG", "info")],
        );
        let plural = if threads == 1 { "" } else { "s" };
        let layout = format!("2 queue pairs on {threads} I/O thread{plural}");
        assert!(out.contains(&layout), "{out}");
        check_both_pairs_carried(&out);
    }
}

fn check_both_pairs_carried(out: &str) {
    assert!(out.contains("net-stress: 2 queue pairs"), "{out}");
    assert!(out.contains("20000 echoes intact"), "{out}");
    for pair in 0..2 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("net-stress: pair {pair}:")))
            .unwrap_or_else(|| panic!("no line for pair {pair}:\n{out}"));
        // "net-stress: pair P: tx N rx M, notifications ..."
        assert!(
            !line.contains(" rx 0,"),
            "pair {pair} received nothing: {line}\n{out}"
        );
    }
}

/// Hostile transmit chains and control commands are returned, not obeyed; a head beyond
/// the queue needs a reset; a frame longer than the receive buffers is dropped (the buffer
/// used with length 0); good echoes pass after each, and the VMM runs on.
#[test]
fn hostile_driver_leaves_the_device_working() {
    let peer = Peer::new("hostile", false);
    let out = peer.run_guest("net-hostile", &net(""), &[]);
    assert!(out.contains("good echo after the reset"), "{out}");
    assert!(
        out.contains("good echo after the small receive buffers"),
        "{out}"
    );
}

/// A snapshot mid-stream, the source killed, the restore carries the stream on: the
/// peer sees three RARP frames with the guest's MAC, spaced as QEMU spaces them (the last
/// about 200 ms after the first), the guest sees VIRTIO_NET_S_ANNOUNCE and
/// acknowledges it, and its rounds go on to the end.
#[test]
fn snapshot_and_restore_mid_stream_announce_the_guest() {
    let peer = Peer::new("snapshot", false);
    let kernel = guest("net-echo");
    let cmdline = format!("mac={GUEST_MAC} rounds=400 progress=20 pause_us=10000 irq=1");
    let mac = net(&format!(",mac={GUEST_MAC}"));
    let args = [
        "--kernel",
        kernel.to_str().unwrap(),
        "--net",
        &mac,
        "--cmdline",
        &cmdline,
    ];
    let mut source = peer.start("source", &args, true);
    wait_until(Duration::from_secs(60), "the source's rounds", || {
        source.output().contains("net-echo: 60 rounds")
    });
    let snap = peer.dir.join("vm.snap");
    source
        .ctl(&["snapshot", snap.to_str().unwrap()])
        .expect_status(0);
    source.kill();
    assert!(!peer.log().contains("rarp"), "RARP before the restore");

    let restore_args = ["--restore", snap.to_str().unwrap(), "--net", &mac];
    let mut restored = peer.start("restored", &restore_args, false);
    let (status, stderr) = restored.wait(Duration::from_secs(120));
    let out = restored.output();
    assert_eq!(status, Some(1), "{out}\n--- stderr\n{stderr}");
    assert!(out.trim_end().ends_with("PASS"), "{out}");
    assert!(!out.contains("net-echo: mac"), "booted afresh:\n{out}");
    assert!(out.contains("net-echo: 400 UDP echoes"), "{out}");
    // With its configuration interrupt (the guest checks it came).
    assert!(out.contains("net-echo: announced"), "{out}");
    let prefix = format!("rarp {GUEST_MAC} at ");
    let times: Vec<u64> = peer
        .log()
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix).and_then(|ms| ms.parse().ok()))
        .collect();
    assert!(times.len() >= 3, "RARP frames seen:\n{}", peer.log());
    let spread = times[times.len() - 1] - times[0];
    assert!(
        (150..2000).contains(&spread),
        "RARP frames {spread} ms apart from first to last:\n{}",
        peer.log()
    );
}

/// Bad `--net` values are refused with one line; vhost is not offered.
#[test]
fn bad_net_options_are_refused() {
    let kernel = guest("net-echo");
    for (value, reason) in [
        ("tap=", "tap=NAME: 1 to 15 bytes"),
        ("tap=t,queues=0", "queues=0: expected 1 to 16"),
        ("tap=t,mac=01:00:00:00:00:01", "mac=01:00:00:00:00:01"),
        ("tap=t,mac=ff:ff:ff:ff:ff:ff", "mac=ff:ff:ff:ff:ff:ff"),
        ("tap=t,mac=00:00:00:00:00:00", "mac=00:00:00:00:00:00"),
        ("tap=t,vhost=on", "vhost=on"),
        ("tap=t,iothreads=0", "iothreads=0: expected 1 to 16"),
        ("tap=t,bogus", "unknown net option"),
    ] {
        let r = ferrovm(
            &["run", "--kernel", kernel.to_str().unwrap(), "--net", value],
            Duration::from_secs(30),
        );
        r.expect_error(reason);
    }
}

/// The `virtio-drivers` crate's VirtIONetRaw over its PCI transport: ARP and UDP echoes.
#[test]
fn virtio_drivers_guest_echoes() {
    let peer = Peer::new("vd", false);
    let out = peer.run_guest("virtio-drivers-net", &net(""), &["--cmdline", "rounds=20"]);
    assert!(out.contains("vd-net: 20 UDP echoes intact"), "{out}");
}

/// Links two peers' namespaces with a veth pair: `a` gets 192.168.77.1, `b` .2.
fn link_namespaces(a: &Peer, b: &Peer) {
    ip(&[
        "-n", &a.ns, "link", "add", "mig0", "type", "veth", "peer", "name", "mig1", "netns", &b.ns,
    ]);
    ip(&["-n", &a.ns, "addr", "add", "192.168.77.1/24", "dev", "mig0"]);
    ip(&["-n", &b.ns, "addr", "add", "192.168.77.2/24", "dev", "mig1"]);
    ip(&["-n", &a.ns, "link", "set", "mig0", "up"]);
    ip(&["-n", &b.ns, "link", "set", "mig1", "up"]);
}

/// A live migration from one namespace to another while net-stress runs on two queue
/// pairs, receiving by MSI-X interrupt: the stream goes on on the destination's tap (the two peers share an address and
/// a MAC, as one network would), every echo checked; the destination announces the guest
/// with RARP frames on its tap.
#[test]
fn migration_between_namespaces_while_stressed() {
    const PEER_MAC: &str = "02:00:00:00:00:02";
    let source_peer = Peer::with_mac("mig-src", true, Some(PEER_MAC));
    let dest_peer = Peer::with_mac("mig-dst", true, Some(PEER_MAC));
    link_namespaces(&source_peer, &dest_peer);
    let mac = net(&format!(",mac={GUEST_MAC},queues=2"));
    let listen = "tcp:192.168.77.2:47123";
    let mut dest = dest_peer.start("dest", &["--incoming", listen, "--net", &mac], true);
    let kernel = guest("net-stress");
    let args = [
        "--kernel",
        kernel.to_str().unwrap(),
        "--net",
        &mac,
        "--cmdline",
        "pairs=2 count=60000 window=4 irq=1",
    ];
    let mut source = source_peer.start("source", &args, true);
    wait_until(Duration::from_secs(30), "the stress to start", || {
        source.output().contains("net-stress: 2 queue pairs")
    });
    std::thread::sleep(Duration::from_millis(300));
    source.ctl(&["migrate", listen]).expect_status(0);
    let (status, stderr) = source.wait(Duration::from_secs(30));
    assert_eq!(status, Some(0), "source: {stderr}");
    assert!(
        !source.output().contains("PASS"),
        "the stress ended before the migration"
    );
    let (status, stderr) = dest.wait(Duration::from_secs(120));
    let out = dest.output();
    assert_eq!(status, Some(1), "{out}\n--- stderr\n{stderr}");
    assert!(out.contains("60000 echoes intact"), "{out}");
    if let Some(line) = out.lines().find(|l| l.contains("echoes intact")) {
        eprintln!("after the migration: {line}");
    }
    assert!(out.trim_end().ends_with("PASS"), "{out}");
    let rarps = dest_peer
        .log()
        .matches(&format!("rarp {GUEST_MAC}"))
        .count();
    assert!(rarps >= 3, "{rarps} RARP frames on the destination's tap");
}

/// The TCP peer: on 10.0.2.2:5001 it checks every byte of the guest's stream against the
/// pattern of net-tcp and answers "ok N US" (or "bad at OFFSET") before its FIN; on :5002 it
/// reads "N\n" and sends N bytes of the pattern, then closes. One log line per connection.
const TCP_PEER: &str = r#"
import socket, threading, time
P = 65521
pat = bytes(((i * 2654435761) & 0xffffffff) >> 16 & 0xff for i in range(P))
rep = pat * 20  # more than 1 MiB plus a period
def sink(conn):
    got, start, bad = 0, None, None
    buf = bytearray(1 << 20)
    while True:
        n = conn.recv_into(buf)
        if n == 0:
            break
        start = start or time.monotonic()
        o = got % P
        if bad is None and buf[:n] != rep[o:o + n]:
            bad = got + next(i for i in range(n) if buf[i] != rep[o + i])
        got += n
    us = int((time.monotonic() - (start or time.monotonic())) * 1e6)
    line = "ok %d %d" % (got, us) if bad is None else "bad at %d" % bad
    print("sink: " + line, flush=True)
    conn.sendall((line + "\n").encode())
    conn.close()
def source(conn):
    req = b""
    while not req.endswith(b"\n"):
        d = conn.recv(64)
        if not d:
            return
        req += d
    n, sent = int(req), 0
    while sent < n:
        k = min(1 << 20, n - sent)
        conn.sendall(rep[sent % P:sent % P + k])
        sent += k
    conn.shutdown(socket.SHUT_WR)
    while conn.recv(4096):
        pass
    print("source: sent %d" % sent, flush=True)
    conn.close()
def serve(port, fn):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.0.2.2", port))
    s.listen(4)
    while True:
        c, _ = s.accept()
        threading.Thread(target=fn, args=(c,), daemon=True).start()
threading.Thread(target=serve, args=(5001, sink), daemon=True).start()
threading.Thread(target=serve, args=(5002, source), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"#;

/// A process in a peer's namespace, killed on drop.
struct Helper(Child);

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Peer {
    /// Starts the TCP peer in the namespace; its lines go to `tcp.log`.
    fn start_tcp_peer(&self) -> Helper {
        let script = self.dir.join("tcp-peer.py");
        std::fs::write(&script, TCP_PEER).unwrap();
        let log = std::fs::File::create(self.dir.join("tcp.log")).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns, "python3"])
            .arg(&script)
            .stdout(log)
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the TCP peer");
        let helper = Helper(child);
        wait_until(Duration::from_secs(10), "the TCP peer", || {
            self.tcp_log().contains("ready")
        });
        helper
    }

    fn tcp_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("tcp.log")).unwrap_or_default()
    }

    /// A counter of the tap in `/sys/class/net/ftap0/statistics` ("rx" is what the VMM
    /// wrote to the tap, one count per frame however large).
    fn tap_counter(&self, name: &str) -> u64 {
        let path = format!("/sys/class/net/{TAP}/statistics/{name}");
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns, "cat", &path])
            .output()
            .expect("read the tap's statistics");
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }
}

/// The numbers in net-tcp's line "frames out A (B GSO, largest C bytes), in D (E GSO,
/// largest F bytes); ...": [A, B, C, D, E, F].
fn tcp_frames(out: &str) -> Vec<u64> {
    let line = out
        .lines()
        .find(|l| l.starts_with("net-tcp: frames out"))
        .unwrap_or_else(|| panic!("no frames line:\n{out}"));
    line.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .take(6)
        .map(|s| s.parse().unwrap())
        .collect()
}

/// Bulk TCP with 64 KiB TSO both ways against real host sockets: the guest's 32 MiB reach
/// the host's socket intact (the host checks every byte) as GSO frames of up to 64 KiB (the
/// guest's count, and the tap's own: bytes per frame it took from the VMM far above the
/// MTU), and 32 MiB from the host's socket reach the guest intact (it checks every byte) in
/// GSO frames the tap handed over whole.
#[test]
fn tcp_with_64k_tso_both_directions() {
    const BYTES: u64 = 32 << 20;
    let peer = Peer::new("tcp", false);
    let _tcp = peer.start_tcp_peer();
    let (frames_before, bytes_before) =
        (peer.tap_counter("rx_packets"), peer.tap_counter("rx_bytes"));
    let send = format!("mode=send bytes={BYTES}");
    let out = peer.run_guest("net-tcp", &net(""), &["--cmdline", &send]);
    assert!(out.contains("TSO (segments of up to 64 KiB)"), "{out}");
    assert!(
        out.contains(&format!("net-tcp: host says: ok {BYTES} ")),
        "{out}"
    );
    assert!(
        peer.tcp_log().contains(&format!("sink: ok {BYTES} ")),
        "{}",
        peer.tcp_log()
    );
    let f = tcp_frames(&out);
    assert!(
        f[1] * 2 > f[0] && f[2] > 60000,
        "few or small GSO frames out: {f:?}\n{out}"
    );
    let frames = peer.tap_counter("rx_packets") - frames_before;
    let bytes = peer.tap_counter("rx_bytes") - bytes_before;
    assert!(
        bytes / frames > 16000,
        "the tap took {frames} frames for {bytes} bytes"
    );
    eprintln!(
        "guest to host: {}",
        out.lines().find(|l| l.contains("sent")).unwrap()
    );

    let recv = format!("mode=recv port=5002 bytes={BYTES}");
    let out = peer.run_guest("net-tcp", &net(""), &["--cmdline", &recv]);
    assert!(
        out.contains(&format!("net-tcp: received {BYTES} bytes intact")),
        "{out}"
    );
    assert!(
        peer.tcp_log().contains(&format!("source: sent {BYTES}")),
        "{}",
        peer.tcp_log()
    );
    let f = tcp_frames(&out);
    assert!(
        f[4] * 2 > f[3] && f[5] > 60000,
        "few or small GSO frames in: {f:?}\n{out}"
    );
    eprintln!(
        "host to guest: {}",
        out.lines().find(|l| l.contains("received")).unwrap()
    );
}
