//! Debian under ferrovm: the Debian bookworm image (`make debian-image`,
//! guests/linux/debian/) boots to a login prompt on the serial console, directly from the
//! test kernel with 1 and 2 vCPUs and through SeaBIOS and extlinux; a person logs in
//! through a real terminal, uses the system (and the network: a ping to the host over
//! virtio-net) and powers it off; the disk is clean afterwards and holds what they wrote.
//!
//! Each boot takes minutes on this project's hosts (guest ring 0 is emulated), so these
//! tests are not part of `make test`: `make test-linux` runs them (`--ignored`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use common::linux::*;
use common::socket_console::SocketConsole;
use common::terminal::Terminal;
use common::*;

/// What every Debian boot adds to the kernel command line: the root file system on the
/// whole virtio disk, mounted read-write (the image's sysinit does not remount it).
const DEBIAN_CMDLINE: &str = "console=ttyS0 root=/dev/vda rw";

/// root's password in the image (scripts/debian-image.sh, `FERROVM_ROOT_PASSWORD`).
const PASSWORD: &str = "ferrovm";

/// A private copy of the Debian image, removed with its directory when dropped.
struct ImageCopy {
    dir: PathBuf,
    path: PathBuf,
}

impl ImageCopy {
    fn new(name: &str) -> Self {
        let image = linux_dir().join("debian.img");
        assert!(
            image.exists(),
            "{} is missing: build the Debian image with `make debian-image`",
            image.display()
        );
        let dir =
            std::env::temp_dir().join(format!("ferrovm-debian-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("debian.img");
        let status = Command::new("cp")
            .arg("--sparse=always")
            .arg(&image)
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success(), "cp {}", image.display());
        ImageCopy { dir, path }
    }

    fn arg(&self) -> String {
        self.path.to_str().unwrap().to_string()
    }

    /// `e2fsck -fn` finds the file system clean, and `debugfs` reads `file` from it.
    fn expect_clean_with(&self, file: &str) -> String {
        let fsck = Command::new("e2fsck")
            .arg("-fn")
            .arg(&self.path)
            .output()
            .unwrap();
        assert!(
            fsck.status.success(),
            "e2fsck -fn: {:?}\n{}{}",
            fsck.status,
            String::from_utf8_lossy(&fsck.stdout),
            String::from_utf8_lossy(&fsck.stderr)
        );
        debugfs_cat(&self.path, file)
    }
}

impl Drop for ImageCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The contents of `file` in the ext4 image `image`, read on the host by `debugfs`.
fn debugfs_cat(image: &Path, file: &str) -> String {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(format!("cat {file}"))
        .arg(image)
        .output()
        .unwrap();
    assert!(out.status.success(), "debugfs cat {file}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Logs in as root at the terminal's `debian login:` prompt and waits for the shell's
/// prompt; returns the index of the prompt's line. Reports how long the machine `how`
/// booted took since `start` to the login prompt, and to the shell.
fn log_in(term: &Terminal, start: Instant, how: &str) -> usize {
    let login = term.wait_for("debian login:", BOOT_LIMIT);
    let booted = start.elapsed().as_secs_f64();
    term.type_line("root");
    let password = term.wait_for_line(login, BOOT_LIMIT, "the password prompt", |l| {
        l.ends_with("Password:")
    });
    term.type_line(PASSWORD);
    let shell = term.wait_for_line(password, BOOT_LIMIT, "the shell's prompt", |l| {
        l.starts_with("root@debian:~#")
    });
    eprintln!(
        "debian, {how}: login prompt {booted:.0} s after the start, a shell {:.0} s",
        start.elapsed().as_secs_f64()
    );
    shell
}

/// Types `command` at the shell's prompt (line `prompt`) and returns the lines it printed
/// up to the next prompt, and that prompt's index. The serial console has no size, so bash
/// wraps at 80 columns by redrawing the line: the prompt and `command` must fit in 80.
fn run_command(term: &Terminal, prompt: usize, command: &str) -> (Vec<String>, usize) {
    term.type_line(command);
    let echoed = term.wait_for_line(prompt, BOOT_LIMIT, command, |l| l.ends_with(command));
    let next = term.wait_for_line(echoed + 1, BOOT_LIMIT, "the next prompt", |l| {
        l.starts_with("root@debian:~#")
    });
    let lines = term.lines();
    (lines[echoed + 1..next].to_vec(), next)
}

/// Boots the image with `cpus` vCPUs straight from the test kernel; a person logs in on the
/// serial console, looks at the system, writes a file and powers off.
fn log_in_and_use(cpus: u32) {
    require_kvm();
    let disk = ImageCopy::new(&format!("login{cpus}"));
    let mut command = vec![FERROVM.to_string()];
    command.extend(kernel_args(cpus, DEBIAN_CMDLINE));
    command.extend(["--disk".to_string(), disk.arg()]);
    let start = Instant::now();
    let term = Terminal::start(&format!("debian{cpus}"), &command);
    let mut prompt = log_in(&term, start, &format!("{cpus} vCPU(s)"));

    let (uname, next) = run_command(&term, prompt, "uname -a");
    assert!(
        uname
            .iter()
            .any(|l| l.starts_with("Linux debian 6.12") && l.ends_with("GNU/Linux")),
        "{uname:?}"
    );
    prompt = next;
    let (version, next) = run_command(&term, prompt, "cat /etc/debian_version");
    assert!(version.iter().any(|l| l.starts_with("12.")), "{version:?}");
    prompt = next;
    let (apt, next) = run_command(&term, prompt, "apt-get --version");
    assert!(apt.iter().any(|l| l.starts_with("apt 2.6")), "{apt:?}");
    prompt = next;
    let (nproc, next) = run_command(&term, prompt, "nproc");
    assert_eq!(nproc, [cpus.to_string()]);
    prompt = next;

    write_and_power_off(&term, &disk, prompt, &format!("vcpus={cpus}"));
}

/// At the shell's prompt (line `prompt`): writes a note naming `how` the machine booted to
/// /root/note.txt, `sync`s and powers off; ferrovm ends with status 0 and the host finds
/// the file system clean with the note in it.
fn write_and_power_off(term: &Terminal, disk: &ImageCopy, prompt: usize, how: &str) {
    let note = format!("{how} {}", std::process::id());
    run_command(
        term,
        prompt,
        &format!("echo '{note}' > /root/note.txt && sync"),
    );
    term.type_line("poweroff");
    assert_eq!(term.wait_exit(BOOT_LIMIT), "0");
    assert_eq!(disk.expect_clean_with("/root/note.txt").trim(), note);
}

#[test]
#[ignore = "Linux guest: make test-linux"]
fn debian_1_vcpu_login_on_the_serial_console() {
    log_in_and_use(1);
}

#[test]
#[ignore = "Linux guest: make test-linux"]
fn debian_2_vcpus_login_on_the_serial_console() {
    log_in_and_use(2);
}

/// Without `--kernel`, SeaBIOS boots the same image from its first sector: extlinux loads
/// `/boot/vmlinuz` (the test kernel's bzImage) with the command line of its
/// `extlinux.conf`, and the same login prompt comes up on the serial console.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn debian_boots_through_seabios_and_extlinux() {
    require_kvm();
    let disk = ImageCopy::new("firmware");
    let command = [FERROVM, "run", "--disk", &disk.arg(), "--memory", "256M"].map(String::from);
    let start = Instant::now();
    let term = Terminal::start("debian-bios", &command);
    let seabios = term.wait_for("SeaBIOS (version", BOOT_LIMIT);
    term.wait_for_line(seabios, BOOT_LIMIT, "the boot loader's banner", |l| {
        l.starts_with("SYSLINUX ") || l.starts_with("EXTLINUX ")
    });
    let prompt = log_in(&term, start, "SeaBIOS and extlinux");
    let (cmdline, prompt) = run_command(&term, prompt, "cat /proc/cmdline");
    assert!(
        cmdline
            .iter()
            .any(|l| l.starts_with("BOOT_IMAGE=/boot/vmlinuz root=/dev/vda rw console=ttyS0")),
        "{cmdline:?}"
    );
    write_and_power_off(&term, &disk, prompt, "firmware");
}

/// The image's static network configuration on a virtio-net device whose tap lives in a
/// network namespace of its own, the host's end at 10.0.2.2: a person logs in, pings it, and
/// moves 256 KiB over TCP both ways with bash's `/dev/tcp`: the guest's checksum of what it
/// received is the host's, and what it sends back is what the host sent.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn debian_pings_and_moves_tcp_over_virtio_net() {
    use std::io::{Read, Write};
    require_kvm();
    let ns = format!("ferrovm-debian-{}", std::process::id());
    tap_namespace(&ns, "debtap0", false, None);
    let (to_guest, from_guest) = in_namespace(&ns, || {
        let bind = |port| std::net::TcpListener::bind(("10.0.2.2", port)).unwrap();
        (bind(5001), bind(5002))
    });
    let data: Vec<u8> = (0..256u32 << 10)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let sent = data.clone();
    let sender = std::thread::spawn(move || {
        let (mut stream, _) = to_guest.accept().unwrap();
        stream.write_all(&sent).unwrap();
    });
    let receiver = std::thread::spawn(move || {
        let (mut stream, _) = from_guest.accept().unwrap();
        let mut back = Vec::new();
        stream.read_to_end(&mut back).unwrap();
        back
    });
    let disk = ImageCopy::new("net");
    let mut command = ["ip", "netns", "exec", &ns, FERROVM]
        .map(String::from)
        .to_vec();
    command.extend(kernel_args(1, DEBIAN_CMDLINE));
    command.extend(["--disk", &disk.arg(), "--net", "tap=debtap0"].map(String::from));
    let term = Terminal::start("debian-net", &command);
    let prompt = log_in(&term, Instant::now(), "virtio-net");
    let (ping, prompt) = run_command(&term, prompt, "ping -c 3 10.0.2.2");
    let (_, prompt) = run_command(&term, prompt, "cat </dev/tcp/10.0.2.2/5001 >rx.bin");
    let (sum, prompt) = run_command(&term, prompt, "sha256sum rx.bin");
    let (_, prompt) = run_command(&term, prompt, "cat rx.bin >/dev/tcp/10.0.2.2/5002");
    write_and_power_off(&term, &disk, prompt, "net");
    let _ = Command::new("ip").args(["netns", "del", &ns]).output();
    assert!(
        ping.iter()
            .any(|l| l.starts_with("3 packets transmitted, 3 received")),
        "{ping:?}"
    );
    sender.join().unwrap();
    let expected = format!("{}  rx.bin", sha256(&data));
    assert_eq!(sum, [expected], "the guest's checksum of what it received");
    assert!(
        receiver.join().unwrap() == data,
        "the guest sent back other bytes"
    );
}

/// A person logged in on `--serial socket:` with a command running: the machine is
/// live-migrated to a second ferrovm, the session goes on on the destination's socket, the
/// command finishes there with the right output, and the person powers the machine off.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn debian_session_survives_a_live_migration() {
    require_kvm();
    let disk = ImageCopy::new("migrate");
    let (source_console, dest_console) = (disk.dir.join("source.sock"), disk.dir.join("dest.sock"));
    let (source_api, dest_api) = (disk.dir.join("source.api"), disk.dir.join("dest.api"));
    let mut args = kernel_args(1, DEBIAN_CMDLINE);
    args.extend([
        "--disk".into(),
        disk.arg(),
        "--serial".into(),
        format!("socket:{}", source_console.display()),
        "--api-socket".into(),
        source_api.display().to_string(),
    ]);
    let mut source = Command::new(FERROVM).args(&args).spawn().unwrap();
    let mut console = SocketConsole::connect(&source_console);
    console.wait_for("debian login:");
    console.type_line("root");
    console.wait_for("Password:");
    console.type_line(PASSWORD);
    console.wait_for("root@debian:~#");
    console.type_line("sleep 30; echo finished-$((6 * 7))");

    let listen = format!("tcp:127.0.0.1:{}", unused_port());
    let dest_args = [
        "run",
        "--incoming",
        &listen,
        "--memory",
        "256M",
        "--disk",
        &disk.arg(),
        "--serial",
        &format!("socket:{}", dest_console.display()),
        "--api-socket",
        dest_api.to_str().unwrap(),
    ];
    let mut dest = Command::new(FERROVM).args(dest_args).spawn().unwrap();
    wait_for_path(&dest_api);
    let migrated = ferrovm(
        &[
            "ctl",
            "--api-socket",
            source_api.to_str().unwrap(),
            "migrate",
            &listen,
        ],
        std::time::Duration::from_secs(300),
    );
    migrated.expect_status(0);
    assert_eq!(
        source.wait().unwrap().code(),
        Some(0),
        "the source ends once migrated"
    );

    let mut console = SocketConsole::connect(&dest_console);
    console.wait_for("finished-42");
    console.type_line("echo still-$((7 * 6)) > /root/note.txt && sync && poweroff");
    let status = wait_child(&mut dest, BOOT_LIMIT);
    assert_eq!(status, Some(0), "the destination powers off");
    assert_eq!(disk.expect_clean_with("/root/note.txt").trim(), "still-42");
}

fn wait_for_path(path: &Path) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "{}",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
