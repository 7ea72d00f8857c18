//! The PCI platform as a guest finds it: bus 0 through configuration mechanism #1 and
//! ECAM, the MCFG table, and the ECAM window reserved in the memory map.

mod common;

use common::*;

/// The guest's summary lines, common to every configuration.
fn expect_enumerated(run: &Run) {
    run.expect_status(1)
        .expect_stdout("pci: MCFG at 0x")
        .expect_stdout("ECAM 0xe0000000 segment 0 buses 0-0")
        .expect_stdout("pci: 00:00.0 id 12378086 / 12378086 class 06000002 / 06000002")
        .expect_stdout("pci: host bridge has no BARs")
        .expect_stdout("pci: 00:00.0 8086:1237")
        .expect_stdout("pci: 1 present, 31 absent, all agree")
        .expect_stdout("pci: writes through either mechanism are seen by the other");
    assert_eq!(run.last_line(), "PASS");
}

#[test]
fn host_bridge_through_cf8_ecam_and_mcfg() {
    expect_enumerated(&run_guest("pci-enum", &[]));
}

/// Multiboot hands over no RSDP pointer: the guest finds it by the BIOS-area scan.
#[test]
fn mcfg_found_by_bios_area_scan() {
    expect_enumerated(&run_guest("multiboot-only/pci-enum", &[]));
}

#[test]
fn same_bus_with_split_irqchip_and_ram_above_4g() {
    let run = run_guest(
        "pci-enum",
        &["--irqchip", "split", "--memory", "5G", "--cpus", "2"],
    );
    expect_enumerated(&run);
}

#[test]
fn ecam_is_reserved_in_the_memory_map() {
    for guest in ["bootinfo", "multiboot-only/bootinfo"] {
        let run = run_guest(guest, &["--memory", "5G"]);
        run.expect_status(1)
            .expect_stdout("addr=0x00000000e0000000 size=0x0000000000100000 type=2");
        // The 32-bit BAR window [3 GiB, 0xe0000000) is left out of the map.
        assert!(
            !run.stdout.contains("addr=0x00000000c0000000"),
            "{}",
            run.stdout
        );
    }
}
