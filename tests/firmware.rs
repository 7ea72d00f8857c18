//! Booting through Debian's SeaBIOS from a virtio-blk disk: the boot-sector test disk and
//! the Multiboot loader disk (guests/boot), with 1 and 4 vCPUs in both irqchip modes, a
//! snapshot and a migration while the boot sector reads the disk, a boot from a qcow2
//! image, and the errors for bad firmware and unbootable disks. Each boot takes several
//! seconds here (SeaBIOS runs in emulated ring 0), so the set is kept small.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const SEABIOS: &str = "/usr/share/seabios/bios-256k.bin";
const LIMIT: Duration = Duration::from_secs(180);

fn guests_dir() -> PathBuf {
    std::env::var_os("FERROVM_GUESTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/guests"))
}

/// A disk image built by guests/boot (relative to the guests' output directory).
fn image(name: &str) -> String {
    let path = guests_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: build the guests with `make guests`",
        path.display()
    );
    assert!(
        Path::new(SEABIOS).exists(),
        "{SEABIOS} is missing: install Debian's seabios package"
    );
    path.to_str().unwrap().to_string()
}

/// Boots `disk` (read-only: the tests share the images and run in parallel).
fn boot(disk: &str, extra: &[&str]) -> Run {
    require_kvm();
    let disk = format!("{disk},readonly");
    let mut args = vec!["run", "--disk", &disk];
    args.extend_from_slice(extra);
    ferrovm(&args, LIMIT)
}

/// Dots the boot sector printed: one per pass over the pattern sectors.
fn passes(serial: &str) -> usize {
    serial
        .lines()
        .find(|l| l.starts_with('.'))
        .map_or(0, |l| l.trim_end().len())
}

#[test]
fn boot_sector_reads_the_disk_one_vcpu() {
    let run = boot(&image("bootsect.img"), &[]);
    run.expect_status(1)
        .expect_stdout("SeaBIOS (version")
        .expect_stdout("Booting from Hard Disk...")
        .expect_stdout("bootsect: drive 00000080");
    assert_eq!(run.last_line(), "bootsect: PASS", "{}", run.stdout);
}

/// SeaBIOS boots the boot-sector disk converted to qcow2 (compressed, as cloud images are),
/// reading it through the qcow2 layer; `qemu-img check` finds it untouched.
#[test]
fn boot_sector_from_a_qcow2_image() {
    let dir = scratch("qcow2");
    let qcow2 = dir.join("bootsect.qcow2");
    let out = Command::new("qemu-img")
        .args(["convert", "-c", "-O", "qcow2", &image("bootsect.img")])
        .arg(&qcow2)
        .output()
        .expect("run qemu-img (Debian's qemu-utils)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = boot(qcow2.to_str().unwrap(), &[]);
    run.expect_status(1)
        .expect_stdout("Booting from Hard Disk...")
        .expect_stdout("bootsect: drive 00000080");
    assert_eq!(run.last_line(), "bootsect: PASS", "{}", run.stdout);
    let check = Command::new("qemu-img")
        .arg("check")
        .arg(&qcow2)
        .status()
        .unwrap();
    assert!(check.success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn boot_sector_with_four_vcpus_and_split_irqchip() {
    let run = boot(
        &image("bootsect.img"),
        &["--cpus", "4", "--irqchip", "split", "--firmware", SEABIOS],
    );
    run.expect_status(1);
    assert_eq!(run.last_line(), "bootsect: PASS", "{}", run.stdout);
}

/// The entry point an ELF64 image's header names (e_entry, at byte 24).
fn elf_entry(path: &Path) -> u64 {
    let bytes = std::fs::read(path).unwrap();
    u64::from_le_bytes(bytes[24..32].try_into().unwrap())
}

#[test]
fn multiboot_guest_from_disk_four_vcpus() {
    let run = boot(&image("disk/smp.img"), &["--cpus", "4"]);
    let entry = elf_entry(&guest("smp"));
    run.expect_status(1)
        .expect_stdout(&format!("loader: entering the kernel at {entry:#x}"))
        .expect_stdout("smp: 4 of 4 CPUs up");
    assert_eq!(run.last_line(), "PASS", "{}", run.stdout);
}

/// The ACPI tables reach the guest through the firmware's linker/loader: the kit finds the
/// RSDP SeaBIOS placed in the F-segment and through it ferrovm's MCFG in high memory.
#[test]
fn multiboot_guest_from_disk_split_irqchip_sees_the_acpi_tables() {
    let run = boot(&image("disk/pci-enum.img"), &["--irqchip", "split"]);
    run.expect_status(1)
        .expect_stdout("pci: MCFG at 0x")
        .expect_stdout("ECAM 0xe0000000 segment 0 buses 0-0")
        .expect_stdout("pci: 00:01.0 8086:7000")
        .expect_stdout("all agree");
    assert_eq!(run.last_line(), "PASS", "{}", run.stdout);
}

#[test]
fn disk_without_boot_signature_gets_the_firmware_message() {
    let run = boot(&image("bootsect-nosig.img"), &[]);
    // SeaBIOS says so, waits, and reboots: a reset ends the VM with status 0.
    run.expect_status(0)
        .expect_stdout("Boot failed: not a bootable disk")
        .expect_stdout("No bootable device.");
    assert!(!run.stdout.contains("bootsect:"), "{}", run.stdout);
}

#[test]
fn bad_firmware_is_refused_with_one_line() {
    let disk = image("bootsect.img");
    let dir = std::env::temp_dir().join(format!("ferrovm-fw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rom = std::fs::read(SEABIOS).unwrap();
    let truncated = dir.join("truncated.bin");
    std::fs::write(&truncated, &rom[..rom.len() - 1000]).unwrap();
    let cut_at_segment = dir.join("cut.bin");
    std::fs::write(&cut_at_segment, &rom[..128 << 10]).unwrap();
    let not_rom = dir.join("zeros.bin");
    std::fs::write(&not_rom, vec![0u8; 256 << 10]).unwrap();
    let cases: [(&Path, &str); 5] = [
        (Path::new("/nonexistent/bios.bin"), "cannot open"),
        (&truncated, "a whole number of 64 KiB"),
        (&cut_at_segment, "not an x86 firmware ROM"),
        (&not_rom, "not an x86 firmware ROM"),
        (Path::new("/"), "directory"),
    ];
    for (path, needle) in cases {
        let run = ferrovm(
            &["run", "--firmware", path.to_str().unwrap(), "--disk", &disk],
            Duration::from_secs(30),
        );
        run.expect_error("--firmware").expect_error(needle);
    }
    let run = ferrovm(
        &["run", "--disk", &disk, "--boot", "disk1"],
        Duration::from_secs(30),
    );
    run.expect_error("--boot disk1");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--firmware` on a FIFO used to wait in open(2) for a writer for ever; like every other
/// path option it refuses anything but a regular file at once, naming what is there.
#[test]
fn firmware_that_is_not_a_regular_file_is_refused_at_once() {
    let disk = image("bootsect.img");
    let dir = scratch("fifo");
    let fifo = dir.join("bios.fifo");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    for (path, kind) in [
        (fifo.as_path(), "a FIFO"),
        (Path::new("/dev/zero"), "a device node"),
    ] {
        let run = ferrovm(
            &["run", "--firmware", path.to_str().unwrap(), "--disk", &disk],
            Duration::from_secs(30),
        );
        run.expect_error("--firmware").expect_error(kind);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A 64 KiB ROM (the smallest `--firmware` accepts) used to panic copying 128 KiB of it below
/// 1 MiB. As a 64 KiB BIOS on a PC, it appears whole at 0xf0000: this one far-jumps from the
/// reset vector to F000:FF80, which holds its code only if the copy is there, and exits
/// through the debug-exit port.
#[test]
fn a_64_kib_rom_runs_from_its_copy_below_1_mib() {
    require_kvm();
    let disk = image("bootsect.img");
    let dir = scratch("rom64k");
    let mut rom = vec![0xf4u8; 64 << 10]; // hlt
                                          // mov al, 0x2a; out 0xf4, al
    rom[0xff80..0xff84].copy_from_slice(&[0xb0, 0x2a, 0xe6, 0xf4]);
    // jmp far f000:ff80
    rom[0xfff0..0xfff5].copy_from_slice(&[0xea, 0x80, 0xff, 0x00, 0xf0]);
    let path = dir.join("rom64k.bin");
    std::fs::write(&path, &rom).unwrap();
    let run = boot(&disk, &["--firmware", path.to_str().unwrap()]);
    run.expect_status((0x2a << 1) | 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A ferrovm process with its serial output in a file and an API socket.
struct Vm {
    child: Child,
    serial: PathBuf,
    socket: PathBuf,
}

impl Vm {
    fn start(args: &[&str], dir: &Path, name: &str) -> Vm {
        require_kvm();
        let serial = dir.join(format!("{name}.serial"));
        let socket = dir.join(format!("{name}.sock"));
        let child = Command::new(FERROVM)
            .arg("run")
            .args(args)
            .arg("--serial")
            .arg(format!("file:{}", serial.display()))
            .arg("--api-socket")
            .arg(&socket)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start ferrovm");
        Vm {
            child,
            serial,
            socket,
        }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    fn ctl(&self, args: &[&str]) -> Run {
        let socket = self.socket.to_str().unwrap().to_string();
        let mut all = vec!["ctl", "--api-socket", &socket];
        all.extend_from_slice(args);
        ferrovm(&all, Duration::from_secs(120))
    }

    fn wait_for_passes(&self, n: usize) {
        let start = Instant::now();
        while passes(&self.output()) < n {
            assert!(
                start.elapsed() < LIMIT,
                "the boot sector did not reach pass {n}:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wait(mut self) -> Option<i32> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(
                start.elapsed() < LIMIT,
                "VM did not end:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrovm-fw-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn snapshot_while_the_boot_sector_reads_the_disk() {
    let dir = scratch("snapshot");
    let disk = format!("{},readonly", image("bootsect-long.img"));
    let source = Vm::start(&["--disk", &disk], &dir, "source");
    source.wait_for_passes(3);
    let snap = dir.join("snap");
    source
        .ctl(&["snapshot", snap.to_str().unwrap()])
        .expect_status(0);
    let at_snapshot = passes(&source.output());
    assert_eq!(source.wait(), Some(1), "source");
    let restored = Vm::start(
        &["--restore", snap.to_str().unwrap(), "--disk", &disk],
        &dir,
        "restored",
    );
    let out = {
        let status = restored.wait();
        let out = std::fs::read_to_string(dir.join("restored.serial")).unwrap();
        assert_eq!(status, Some(1), "restored guest:\n{out}");
        out
    };
    assert!(out.contains("bootsect: PASS"), "{out}");
    // It went on from where the snapshot was: the remaining passes only.
    let after = passes(&out);
    assert!(
        after < 100 && after + at_snapshot >= 100,
        "{after} passes after a snapshot at pass {at_snapshot}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn migration_while_the_boot_sector_reads_the_disk() {
    let dir = scratch("migrate");
    let disk = format!("{},readonly", image("bootsect-long.img"));
    let port = 21000 + (std::process::id() % 20000) as u16;
    let listen = format!("tcp:127.0.0.1:{port}");
    let source = Vm::start(&["--disk", &disk, "--cpus", "2"], &dir, "source");
    let dest = Vm::start(
        &[
            "--incoming",
            &listen,
            "--firmware",
            SEABIOS,
            "--disk",
            &disk,
            "--cpus",
            "2",
        ],
        &dir,
        "dest",
    );
    source.wait_for_passes(3);
    source.ctl(&["migrate", &listen]).expect_status(0);
    assert_eq!(source.wait(), Some(0), "a migrated source ends with 0");
    let status = dest.wait();
    let out = std::fs::read_to_string(dir.join("dest.serial")).unwrap();
    assert_eq!(status, Some(1), "destination:\n{out}");
    assert!(out.contains("bootsect: PASS"), "{out}");
    assert!(passes(&out) < 100, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A guest booted from disk drives that disk with its own virtio driver after the firmware
/// had it: it resets the device SeaBIOS set up and uses the BAR where SeaBIOS put it.
#[test]
fn kit_guest_drives_its_boot_disk_after_the_firmware() {
    let dir = scratch("blk-rw");
    let disk = dir.join("blk-rw.img");
    let mkdisk = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../guests/boot/mkdisk.sh");
    let status = Command::new("sh")
        .arg(&mkdisk)
        .arg(image("boot/loader.bin"))
        .arg(image("boot/blk-rw.stripped"))
        .arg(&disk)
        .arg("serial=fw-disk0 capacity=2048")
        .status()
        .unwrap();
    assert!(status.success(), "mkdisk.sh");
    let spec = format!("{},serial=fw-disk0", disk.display());
    let run = ferrovm(&["run", "--disk", &spec, "--cpus", "2"], LIMIT);
    run.expect_status(1)
        .expect_stdout("loader: entering the kernel")
        .expect_stdout("blk-rw: capacity 2048 sectors (1 MiB)")
        .expect_stdout("blk-rw: read back 256 sectors in ")
        .expect_stdout("blk-rw: GET_ID \"fw-disk0\"");
    assert_eq!(run.last_line(), "PASS", "{}", run.stdout);
    let _ = std::fs::remove_dir_all(&dir);
}
