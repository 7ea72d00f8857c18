//! Linux under ferrovm: the repository's test kernel and busybox initramfs
//! (`make linux`, guests/linux/) boot to userspace, run a test script and power off, under
//! 1, 2 and 4 vCPUs and both irqchip modes; Linux's own drivers bind ferrovm's devices;
//! poweroff, reboot and the API's Ctrl-Alt-Del end the machine; a person logs in on the
//! serial console through a real terminal.
//!
//! Each boot takes minutes on this project's hosts (guest ring 0 is emulated), so these
//! tests are not part of `make test`: `make test-linux` runs them (`--ignored`).

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::linux::*;
use common::terminal::Terminal;
use common::*;

/// `ferrovm run` arguments for the test kernel with `cpus` vCPUs under `irqchip`.
fn linux_args(cpus: u32, irqchip: &str, cmdline: &str) -> Vec<String> {
    linux_run_args(
        cpus,
        &format!("console=ttyS0 {cmdline}"),
        &["--irqchip", irqchip],
    )
}

/// Boots the test kernel to run `ferrovm.test=TEST` and power off.
fn boot(cpus: u32, irqchip: &str, test: &str, extra: &[&str]) -> Run {
    require_kvm();
    let mut args = linux_args(cpus, irqchip, &format!("ferrovm.test={test}"));
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ferrovm(&args, BOOT_LIMIT)
}

/// A scratch disk image of `mib` MiB.
fn scratch_disk(name: &str, mib: u64) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrovm-linux-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("disk.img");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(mib << 20).unwrap();
    path
}

/// Every vCPU online and running a task; Linux's virtio-pci driver bound to ferrovm's
/// virtio devices with MSI-X vectors; `/proc/interrupts` showing the MSI-X lines; the disk
/// written and read back by Linux's virtio-blk driver.
fn machine_checks(cpus: u32, irqchip: &str) {
    let disk = scratch_disk(&format!("smp{cpus}-{irqchip}"), 8);
    let disk_arg = disk.to_str().unwrap().to_string();
    let run = boot(cpus, irqchip, "machine", &["--disk", &disk_arg]);
    expect_clean_poweroff(&run);

    let cpus_line = one_marker(&run, "FERROVM-CPUS");
    assert_eq!(field(cpus_line, "processors"), Some(&*cpus.to_string()));
    let online = if cpus == 1 {
        "0".to_string()
    } else {
        format!("0-{}", cpus - 1)
    };
    assert_eq!(field(cpus_line, "online"), Some(online.as_str()));
    let ran = markers(&run, "FERROVM-CPU");
    assert_eq!(ran.len(), cpus as usize, "{ran:?}");
    for (n, line) in ran.iter().enumerate() {
        assert_eq!(field(line, "ran-on"), Some(&*n.to_string()), "{line}");
    }

    // ferrovm's bus: the host bridge and one virtio-blk function (modern virtio-pci).
    let pci = markers(&run, "FERROVM-PCI");
    let blk = pci
        .iter()
        .find(|l| field(l, "vendor") == Some("0x1af4") && field(l, "device") == Some("0x1042"))
        .unwrap_or_else(|| panic!("no virtio-blk function: {pci:?}"));
    assert_eq!(field(blk, "driver"), Some("virtio-pci"), "{blk}");
    let vectors: u32 = field(blk, "msi-vectors").unwrap().parse().unwrap();
    assert!(
        vectors >= 2,
        "virtio-blk has {vectors} MSI-X vectors: {blk}"
    );
    assert!(
        pci.iter().any(|l| field(l, "class") == Some("0x060000")),
        "no host bridge: {pci:?}"
    );
    let virtio = one_marker(&run, "FERROVM-VIRTIO");
    assert_eq!(field(virtio, "device"), Some("0x0002"), "{virtio}");
    assert_eq!(field(virtio, "driver"), Some("virtio_blk"), "{virtio}");

    let irqs = one_marker(&run, "FERROVM-INTERRUPTS");
    let msix: u32 = field(irqs, "msix").unwrap().parse().unwrap();
    assert!(msix >= 2, "PCI-MSIX lines for virtio: {irqs}");

    let blk_line = one_marker(&run, "FERROVM-BLK");
    assert_eq!(field(blk_line, "written"), field(blk_line, "read"));
    let _ = std::fs::remove_dir_all(disk.parent().unwrap());
}

#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_1_vcpu_kernel_irqchip() {
    machine_checks(1, "kernel");
}

#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_1_vcpu_split_irqchip() {
    machine_checks(1, "split");
}

#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_2_vcpus_kernel_irqchip() {
    machine_checks(2, "kernel");
}

#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_2_vcpus_split_irqchip() {
    machine_checks(2, "split");
}

#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_4_vcpus_kernel_irqchip() {
    machine_checks(4, "kernel");
}

#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_4_vcpus_split_irqchip() {
    machine_checks(4, "split");
}

/// `reboot -f` in the guest resets the machine: ferrovm ends with status 0 after Linux's
/// restart message.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_reboot_resets_the_machine() {
    let run = boot(1, "kernel", "reboot", &[]);
    run.expect_status(0);
    assert!(
        run.stdout.contains("reboot: Restarting system"),
        "{}",
        run.stdout
    );
    assert!(
        markers(&run, "FERROVM-TEST-END").is_empty(),
        "{}",
        run.stdout
    );
}

/// A machine left running with a login prompt: the serial console in a file, the API on a
/// socket.
struct LoginMachine {
    child: std::process::Child,
    serial: PathBuf,
    socket: PathBuf,
}

impl LoginMachine {
    fn start(name: &str, cpus: u32) -> Self {
        require_kvm();
        let dir = scratch_disk(name, 1).parent().unwrap().to_path_buf();
        let serial = dir.join("serial.txt");
        let socket = dir.join("api.sock");
        let child = Command::new(FERROVM)
            .args(linux_args(cpus, "kernel", ""))
            .arg("--serial")
            .arg(format!("file:{}", serial.display()))
            .arg("--api-socket")
            .arg(&socket)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        LoginMachine {
            child,
            serial,
            socket,
        }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    fn wait_for_output(&self, needle: &str) {
        let start = Instant::now();
        while !self.output().contains(needle) {
            assert!(
                start.elapsed() < BOOT_LIMIT,
                "never saw {needle:?}: {}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn ctl(&self, args: &[&str]) -> String {
        let out = Command::new(FERROVM)
            .arg("ctl")
            .arg("--api-socket")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "ctl {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(start.elapsed() < limit, "still running: {}", self.output());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for LoginMachine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(self.serial.parent().unwrap());
    }
}

/// Firecracker's `SendCtrlAltDel` reaches Linux's keyboard driver through the i8042; init's
/// ctrlaltdel action reboots, and ferrovm ends with status 0. Meanwhile `ctl status`
/// reports the instructions ferrovm completed for the host's emulator.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_ctrl_alt_del_from_the_api_reboots() {
    let mut vm = LoginMachine::start("cad", 1);
    vm.wait_for_output("login:");
    let status = vm.ctl(&["--json", "status"]);
    let info: serde_json::Value = serde_json::from_str(&status).unwrap();
    let completions = info["instruction_completions"].as_object().unwrap();
    if std::path::Path::new("/sys/module/kvm_pvm").exists() {
        // Linux's int3 self-test runs on every boot.
        assert!(completions.contains_key("int3"), "{status}");
    }
    let human = vm.ctl(&["status"]);
    assert!(human.contains("state:   running"), "{human}");
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--unix-socket",
        ])
        .arg(&vm.socket)
        .args(["-X", "PUT", "http://localhost/actions", "-d"])
        .arg(r#"{"action_type":"SendCtrlAltDel"}"#)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "204");
    assert_eq!(vm.wait_exit(BOOT_LIMIT), Some(0));
    let text = vm.output();
    assert!(text.contains("reboot: Restarting system"), "{text}");
}

/// A person at a terminal: ferrovm runs in a tmux pane with the serial console on its
/// standard input and output; the test reads the screen and types as a person would.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_login_on_the_serial_console_through_a_terminal() {
    require_kvm();
    let mut command = vec![FERROVM.to_string()];
    command.extend(linux_args(2, "split", ""));
    let term = Terminal::start("login", &command);
    term.wait_for("ferrovm login:", BOOT_LIMIT);
    term.type_line("root");
    term.wait_for("Password:", BOOT_LIMIT);
    term.type_line("ferrovm");
    term.wait_for("root@ferrovm:~#", BOOT_LIMIT);
    term.type_line("echo product=$((6 * 7)) cpus=$(grep -c ^processor /proc/cpuinfo)");
    term.wait_for("product=42 cpus=2", BOOT_LIMIT);
    term.type_line("poweroff");
    assert_eq!(term.wait_exit(BOOT_LIMIT), "0");
}
