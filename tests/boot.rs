//! Boots the test guests under the real accelerator and checks what they observed, and
//! feeds `ferrovm run` bad input.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
fn hello_prints_banner_and_resets() {
    let run = run_guest("hello", &["--cmdline", "greeting=hi", "--memory", "256M"]);
    run.expect_status(0)
        .expect_stdout("ferrovm hello: 1 vCPU(s), 256 MiB RAM")
        .expect_stdout("greeting=hi");
}

#[test]
fn hello_sees_vcpus_and_memory_above_the_pci_hole() {
    let run = run_guest("hello", &["--cpus", "2", "--memory", "5G"]);
    run.expect_status(0)
        .expect_stdout("ferrovm hello: 2 vCPU(s), 5120 MiB RAM");
}

#[test]
fn large_guest_memory_is_not_reserved_up_front() {
    // 16 GiB of guest RAM on a host with 24 GiB: only touched pages may become resident.
    let run = run_guest("hello", &["--memory", "16G"]);
    run.expect_status(0);
    assert!(
        run.max_rss_kib < 64 * 1024,
        "ferrovm used {} KiB resident for an idle 16 GiB guest",
        run.max_rss_kib
    );
}

#[test]
fn exit_code_reaches_the_process_status() {
    for (code, status) in [("0", 1), ("7", 15), ("100", 201)] {
        let run = run_guest("exit-code", &["--cmdline", code]);
        run.expect_status(status)
            .expect_stdout(&format!("exit-code: {code}"));
    }
}

#[test]
fn fault_is_reported_by_the_guest_handler() {
    let run = run_guest("fault", &[]);
    // The kit's exception handler exits with 0x7e: status (0x7e << 1) | 1.
    run.expect_status(0xfd);
    let expected_rip = run
        .stdout
        .lines()
        .find_map(|l| l.split("expecting #GP at rip=").nth(1))
        .expect("fault guest announces the faulting RIP")
        .trim()
        .to_string();
    run.expect_stdout("vector=13")
        .expect_stdout(&format!("rip={expected_rip}"));
}

#[test]
fn ring3_checksum_passes() {
    let run = run_guest("ring3", &[]);
    run.expect_status(1).expect_stdout("ring3 checksum=0x");
    assert_eq!(run.last_line(), "PASS");
}

#[test]
fn serial_to_a_file_and_to_nothing() {
    let dir = tempdir();
    let log = dir.join("serial.log");
    let spec = format!("file:{}", log.display());
    let run = run_guest("exit-code", &["--cmdline", "3", "--serial", &spec]);
    run.expect_status(7);
    assert!(!run.stdout.contains("exit-code"), "serial went to stdout");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("exit-code: 3"), "{text}");

    let run = run_guest("exit-code", &["--cmdline", "3", "--serial", "none"]);
    run.expect_status(7);
    assert!(run.stdout.is_empty(), "{}", run.stdout);
}

#[test]
fn sigterm_ends_the_vm_cleanly() {
    require_kvm();
    let kernel = guest("idle");
    let run = ferrovm_with(
        &["run", "--kernel", kernel.to_str().unwrap()],
        Duration::from_secs(60),
        |pid| {
            std::thread::sleep(Duration::from_millis(1500));
            // SAFETY: pid is the child just started.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        },
    );
    run.expect_status(128 + libc::SIGTERM);
}

#[test]
fn triple_fault_is_a_vmm_error_naming_rip() {
    let run = run_guest("triple-fault", &[]);
    run.expect_error("triple fault");
    assert!(run.stderr.contains("RIP 0x"), "{}", run.stderr);
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ferrovm-test-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn bad_run(args: &[&str]) -> Run {
    ferrovm(args, Duration::from_secs(30))
}

#[test]
fn bad_kernels_are_refused_with_one_line() {
    let dir = tempdir();
    let missing = dir.join("missing.elf");
    bad_run(&["run", "--kernel", missing.to_str().unwrap()]).expect_error("missing.elf");
    bad_run(&["run", "--kernel", dir.to_str().unwrap()]).expect_error("directory");

    let empty = dir.join("empty.elf");
    std::fs::write(&empty, b"").unwrap();
    bad_run(&["run", "--kernel", empty.to_str().unwrap()]).expect_error("empty");

    let hello = std::fs::read(guest("hello")).unwrap();
    let truncated = dir.join("truncated.elf");
    std::fs::write(&truncated, &hello[..hello.len().min(200)]).unwrap();
    bad_run(&["run", "--kernel", truncated.to_str().unwrap()]).expect_error("truncated.elf");

    let mut arm = hello.clone();
    arm[18] = 0xb7; // e_machine = EM_AARCH64
    arm[19] = 0;
    let arm_path = dir.join("arm.elf");
    std::fs::write(&arm_path, &arm).unwrap();
    bad_run(&["run", "--kernel", arm_path.to_str().unwrap()]).expect_error("machine");

    let junk = dir.join("junk.bin");
    std::fs::write(&junk, vec![0x5a; 4096]).unwrap();
    bad_run(&["run", "--kernel", junk.to_str().unwrap()]).expect_error("junk.bin");

    let big = dir.join("big.elf");
    let mut data = hello.clone();
    data.resize(5 << 20, 0);
    std::fs::write(&big, &data).unwrap();
    bad_run(&["run", "--kernel", big.to_str().unwrap(), "--memory", "4M"]).expect_error("larger");
}

#[test]
fn bad_options_are_refused_with_one_line() {
    let hello = guest("hello");
    let k = hello.to_str().unwrap();
    bad_run(&["run", "--kernel", k, "--memory", "0"]).expect_error("--memory");
    bad_run(&["run", "--kernel", k, "--memory", "64T"]).expect_error("larger than this host");
    bad_run(&["run", "--kernel", k, "--memory", "lots"]).expect_error("--memory");
    bad_run(&["run", "--kernel", k, "--cpus", "0"]).expect_error("--cpus");
    bad_run(&["run", "--kernel", k, "--cpus", "100000"]).expect_error("--cpus");
    bad_run(&["run", "--kernel", k, "--bogus"]).expect_error("--bogus");
    bad_run(&["run", "--kernel", k, "--serial", "tcp:1"]).expect_error("--serial");
    bad_run(&["run", "--kernel", k, "--disk", "/dev/null"])
        .expect_error("--disk /dev/null: not a regular file or a block device");
    bad_run(&["run", "--kernel", k, "--net", "tap=t0,mtu=9000"]).expect_error("unknown net option");
    bad_run(&["run", "--kernel", k, "--accel", "bhyve"]).expect_error("/dev/vmm");
    bad_run(&["frobnicate"]).expect_error("frobnicate");
}

/// An ELF marked EM_386 (32-bit x86) used to boot through its PVH note as if it were x86-64.
/// Only a Multiboot kernel, entered in 32-bit protected mode, may be 32-bit x86: the same
/// guest with a Multiboot header and no PVH note boots.
#[test]
fn an_elf_for_32_bit_x86_is_refused_unless_multiboot() {
    let dir = tempdir();
    let as_i386 = |variant: &str| {
        let path = guest("hello")
            .parent()
            .unwrap()
            .join(variant)
            .join("hello.elf");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[18..20].copy_from_slice(&3u16.to_le_bytes()); // e_machine = EM_386
        let out = dir.join(format!("{variant}-i386.elf"));
        std::fs::write(&out, &bytes).unwrap();
        out
    };
    let pvh = as_i386("pvh-only");
    bad_run(&["run", "--kernel", pvh.to_str().unwrap()])
        .expect_error("pvh-only-i386.elf")
        .expect_error("e_machine 3 (32-bit x86), not x86-64 (62)");
    let multiboot = as_i386("multiboot-only");
    let run = ferrovm(
        &["run", "--kernel", multiboot.to_str().unwrap()],
        Duration::from_secs(120),
    );
    run.expect_status(0).expect_stdout("boot: multiboot");
}

/// Options of the form `KEY=VALUE,...` refuse a key given twice (the last one used to win
/// silently), naming the key.
#[test]
fn a_key_given_twice_is_refused() {
    let kernel = guest("hello");
    let k = kernel.to_str().unwrap();
    let dir = tempdir();
    let image = dir.join("twice.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let i = image.to_str().unwrap();
    let socket = dir.join("v.sock");
    let s = socket.to_str().unwrap();
    for (option, value, key) in [
        ("--disk", format!("{i},cache=none,cache=writeback"), "cache"),
        ("--disk", format!("{i},serial=a,serial=b"), "serial"),
        ("--disk", format!("{i},queues=1,queues=2"), "queues"),
        ("--disk", format!("{i},readonly,ro"), "readonly"),
        ("--net", "tap=t0,tap=t1".to_string(), "tap"),
        (
            "--net",
            "tap=t0,mac=02:00:00:00:00:01,mac=02:00:00:00:00:02".to_string(),
            "mac",
        ),
        ("--vsock", format!("cid=3,cid=4,socket={s}"), "cid"),
        ("--vsock", format!("cid=3,socket={s},socket={s}"), "socket"),
    ] {
        bad_run(&["run", "--kernel", k, option, &value])
            .expect_error(&format!("{option} {value}"))
            .expect_error(&format!("{key} is given twice"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sizes and counts are parsed strictly and checked up front: `--memory 512B` used to mean
/// 512 MiB, `--initrd /dev/zero` was read as an empty initrd, and more vCPUs than the
/// firmware tables can describe were accepted.
#[test]
fn sizes_counts_and_files_are_checked_strictly() {
    let kernel = guest("hello");
    let k = kernel.to_str().unwrap();
    bad_run(&["run", "--kernel", k, "--memory", "512B"])
        .expect_error("--memory 512B: a guest needs at least 2 MiB of RAM");
    for unclear in ["512MB", "1Gi", "2 G", "512m5"] {
        bad_run(&["run", "--kernel", k, "--memory", unclear])
            .expect_error(&format!("--memory {unclear}: expected a size"));
    }
    bad_run(&["run", "--kernel", k, "--memory", "4098K"])
        .expect_error("must be a multiple of 4 KiB");
    bad_run(&["run", "--kernel", k, "--cpus", "255"]).expect_error("--cpus 255: at most 254 vCPUs");
    bad_run(&["run", "--kernel", k, "--initrd", "/dev/zero"])
        .expect_error("initrd must be a regular file; this is a device node");
    // Units that mean what they say.
    let run = run_guest("hello", &["--memory", "262144KiB"]);
    run.expect_status(0)
        .expect_stdout("ferrovm hello: 1 vCPU(s), 256 MiB RAM");
}

/// A command line may begin with a dash (it used to be taken for an unknown option).
#[test]
fn a_command_line_may_begin_with_a_dash() {
    let run = run_guest("hello", &["--cmdline", "-v greeting=dash"]);
    run.expect_status(0)
        .expect_stdout("cmdline: -v greeting=dash");
}

#[test]
fn accel_reports_capabilities() {
    require_kvm();
    let run = ferrovm(&["accel"], Duration::from_secs(30));
    run.expect_status(0)
        .expect_stdout("accelerator:")
        .expect_stdout("TPR shadowing:")
        .expect_stdout("irqfd:                     yes")
        .expect_stdout("ioeventfd:                 yes");
    let run = ferrovm(&["accel", "--json"], Duration::from_secs(30));
    run.expect_status(0);
    let line = run.stdout.trim();
    assert!(line.starts_with('{') && line.ends_with('}') && !line.contains('\n'));
    for key in [
        "\"irqchip_split\"",
        "\"msi_injection\"",
        "\"max_vcpus\"",
        "\"tpr_shadow\"",
        "\"irqfd\":true",
        "\"ioeventfd\":true",
    ] {
        assert!(line.contains(key), "{key} missing from {line}");
    }
}

#[test]
fn both_boot_protocols_see_the_same_machine() {
    require_kvm();
    let pvh = guest("bootinfo");
    let multiboot = pvh.parent().unwrap().join("multiboot-only/bootinfo.elf");
    let mut maps = Vec::new();
    for (kernel, protocol) in [(pvh, "pvh"), (multiboot, "multiboot")] {
        let run = ferrovm(
            &[
                "run",
                "--kernel",
                kernel.to_str().unwrap(),
                "--cmdline",
                "a=b",
                "--memory",
                "4G",
                "--cpus",
                "3",
            ],
            Duration::from_secs(60),
        );
        run.expect_status(1)
            .expect_stdout(&format!("protocol={protocol}"))
            .expect_stdout("cmdline: a=b")
            .expect_stdout("cpus: 3")
            // RAM below the EBDA, from 1 MiB to the MMIO hole at 3 GiB, and 1 GiB above 4 GiB.
            .expect_stdout("addr=0x0000000000000000 size=0x000000000009fc00 type=1")
            .expect_stdout("addr=0x0000000000100000 size=0x00000000bff00000 type=1")
            .expect_stdout("addr=0x0000000100000000 size=0x0000000040000000 type=1");
        if protocol == "pvh" {
            run.expect_stdout("rsdp=0xe0000");
        }
        let map: Vec<String> = run
            .stdout
            .lines()
            .filter(|l| l.trim_start().starts_with("addr=") && l.ends_with("type=1"))
            .map(str::to_string)
            .collect();
        maps.push(map);
    }
    assert_eq!(maps[0], maps[1], "the RAM map differs between protocols");
}

/// A tiny Multiboot kernel as test suites build them for QEMU's `-kernel`: linked at
/// `link_addr` (below 1 MiB), it prints the command line it was given and exits through the
/// debug-exit port with `code`, written as a `width`-byte value whose low byte is `code`.
fn tiny_multiboot_kernel(dir: &std::path::Path, link_addr: u32, width: u8, code: u8) -> String {
    let source = dir.join(format!("mb-{link_addr:x}-{width}.S"));
    let out_instruction = match width {
        1 => "outb %al, %dx",
        2 => "outw %ax, %dx",
        _ => "outl %eax, %dx",
    };
    std::fs::write(
        &source,
        format!(
            r#"	.text
	.code32
	.globl _start
	.align 4
	.long 0x1BADB002, 0x00000003, -(0x1BADB002 + 0x00000003)
_start:
	cmp $0x2BADB002, %eax
	jne fail
	testl $4, (%ebx)
	jz fail
	mov 16(%ebx), %esi
	mov $0x3f8, %dx
1:	movb (%esi), %al
	test %al, %al
	jz 2f
	outb %al, %dx
	inc %esi
	jmp 1b
2:	movb $'\n', %al
	outb %al, %dx
	mov $0xf4, %dx
	mov ${wide}, %eax
	{out_instruction}
	hlt
fail:	mov $0xf4, %dx
	mov $0x99, %al
	outb %al, %dx
	hlt
"#,
            wide = 0x1234_5600u32 | u32::from(code),
        ),
    )
    .unwrap();
    let object = source.with_extension("o");
    let elf = source.with_extension("elf");
    let gcc = std::process::Command::new("gcc")
        .args(["-m32", "-c", "-o"])
        .arg(&object)
        .arg(&source)
        .status()
        .expect("gcc (the guests need it too)");
    assert!(gcc.success());
    let ld = std::process::Command::new("ld")
        .args(["-m", "elf_i386", "-N", "-e", "_start", "--build-id=none"])
        .arg(format!("-Ttext={link_addr:#x}"))
        .arg("-o")
        .arg(&elf)
        .arg(&object)
        .output()
        .expect("ld");
    assert!(
        ld.status.success(),
        "{}",
        String::from_utf8_lossy(&ld.stderr)
    );
    elf.to_str().unwrap().to_string()
}

/// Test kernels built for QEMU's `-kernel` run unchanged: linked at 0x8000 (they used to be
/// refused for overlapping the boot structures), given "KERNEL-PATH ARGS" as their Multiboot
/// command line, exiting with a 1-, 2- or 4-byte write to isa-debug-exit's port 0xf4 (wider
/// writes used to be ignored), with a command line that begins with a dash.
#[test]
fn qemu_style_multiboot_kernels_run_unchanged() {
    require_kvm();
    let dir = tempdir();
    for (link, width, code) in [(0x8000u32, 4u8, 5u8), (0x8000, 2, 6), (0x10_0000, 1, 7)] {
        let kernel = tiny_multiboot_kernel(&dir, link, width, code);
        let run = ferrovm(
            &[
                "run",
                "--kernel",
                &kernel,
                "--cmdline",
                "-v a=1",
                "--memory",
                "32M",
            ],
            Duration::from_secs(60),
        );
        run.expect_status(i32::from(code) << 1 | 1)
            .expect_stdout(&format!("{kernel} -v a=1"));
    }
}

/// The image ferrovm boots and the PVH-only one QEMU is given in the benchmarks hold their
/// code at the same addresses: otherwise a hot loop shifted across a 32-byte boundary runs
/// at another speed, and a comparison of the two VMMs measures the link instead.
#[test]
fn every_variant_of_a_guest_has_the_same_code_layout() {
    let symbols = |path: &Path| {
        let out = Command::new("nm")
            .arg("-n")
            .arg(path)
            .output()
            .expect("run nm");
        assert!(out.status.success(), "nm {}", path.display());
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.ends_with(" multiboot_header"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    for name in [
        "net-tcp",
        "net-stress",
        "bench-work",
        "bench-exit",
        "bench-blk",
    ] {
        let full = guest(name);
        let pvh = full
            .parent()
            .unwrap()
            .join("pvh-only")
            .join(format!("{name}.elf"));
        let (a, b) = (symbols(&full), symbols(&pvh));
        assert!(
            a.iter().any(|l| l.ends_with(" memcmp")),
            "{name}: no symbols"
        );
        assert_eq!(a, b, "{name}: the pvh-only variant's layout differs");
    }
}
