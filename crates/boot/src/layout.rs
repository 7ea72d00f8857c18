//! Guest physical memory layout for x86-64 guests.
//!
//! ```text
//! 0x0000_0000 ┬ real-mode IVT + BIOS data area (left zero)
//! 0x0000_0500 │ GDT (5 entries, see `gdt`)
//! 0x0000_7000 │ boot information page: Linux zero page (`boot_params`),
//!             │   PVH `hvm_start_info` or Multiboot info (one protocol per boot)
//! 0x0000_8000 │ boot stack page (initial ESP = 0x8ff0)
//! 0x0000_9000 │ memory map for PVH / Multiboot (up to 4 KiB)
//! 0x0000_a000 │ module list (initrd) and boot-loader strings (up to 4 KiB)
//! 0x0000_b000 │ reserved for boot page tables (later)
//! 0x0002_0000 │ kernel command line (at most 64 KiB including the NUL)
//! 0x0009_fc00 ┼ EBDA, VGA hole, BIOS ROM area: reserved in e820
//! 0x000e_0000 │   ACPI tables: RSDP first, then XSDT, FADT, FACS, DSDT, MADT (64 KiB)
//! 0x000f_0000 │   Intel MP table: floating pointer, then configuration table (64 KiB)
//! 0x0010_0000 ┼ RAM: kernel, initrd (high, page aligned)
//! low RAM end ┤ = min(mem_size, 3 GiB)
//! 0xc000_0000 ┼ 32-bit PCI/MMIO hole: 0xc0000000-0xdfffffff PCI BAR window,
//!             │   0xe0000000 PCI ECAM (bus 0, 1 MiB, reserved in e820),
//!             │   IOAPIC 0xfec00000, LAPIC 0xfee00000
//! 0x1_0000_0000 RAM above 4 GiB when mem_size > 3 GiB
//! 64-bit PCI  ┼ 64 GiB BAR window from the first 1 GiB boundary at or above the end of RAM
//! ```
//!
//! Port I/O for PCI: configuration mechanism #1 at 0xcf8-0xcff, I/O BARs in
//! `[0xc000, 0x10000)`.

use vm_memory::GuestAddress;

/// 1 MiB: start of "high" memory; kernels and their segments are loaded at or above it.
pub const HIMEM_START: u64 = 0x10_0000;
/// Start of the Extended BIOS Data Area; RAM below it is usable conventional memory.
pub const EBDA_START: u64 = 0x9_fc00;

/// Start of the 32-bit PCI/MMIO hole (3 GiB).
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
/// Size of the 32-bit PCI/MMIO hole (1 GiB, up to 4 GiB).
pub const MMIO_HOLE_SIZE: u64 = 0x4000_0000;
/// First address above the MMIO hole (4 GiB), where RAM beyond 3 GiB is placed.
pub const HIGH_RAM_START: u64 = MMIO_HOLE_START + MMIO_HOLE_SIZE;
/// IOAPIC MMIO page (inside the hole).
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// Size reserved for the IOAPIC in the e820 map.
pub const IOAPIC_SIZE: u64 = 0x1000;
/// Local APIC MMIO page (inside the hole).
pub const LAPIC_START: u64 = 0xfee0_0000;
/// Size reserved for the local APIC in the e820 map.
pub const LAPIC_SIZE: u64 = 0x1000;

/// PCI ECAM (memory-mapped configuration) for bus 0, declared in the MCFG table.
pub const PCI_ECAM_START: u64 = 0xe000_0000;
/// One bus's worth of ECAM: 32 devices x 8 functions x 4 KiB.
pub const PCI_ECAM_SIZE: u64 = 0x10_0000;
/// 32-bit PCI BAR window: the start of the MMIO hole up to ECAM.
pub const PCI_MMIO32_START: u64 = MMIO_HOLE_START;
/// Size of the 32-bit PCI BAR window.
pub const PCI_MMIO32_SIZE: u64 = PCI_ECAM_START - PCI_MMIO32_START;
/// Size of the 64-bit PCI BAR window (see [`pci_mmio64_start`]).
pub const PCI_MMIO64_SIZE: u64 = 64 << 30;
/// Alignment of the 64-bit PCI BAR window.
pub const PCI_MMIO64_ALIGN: u64 = 1 << 30;
/// PCI I/O BAR window.
pub const PCI_IO_START: u64 = 0xc000;
/// Size of the PCI I/O BAR window (up to the end of the 16-bit port space).
pub const PCI_IO_SIZE: u64 = 0x1_0000 - PCI_IO_START;
/// First port of PCI configuration mechanism #1 (address at 0xcf8, data at 0xcfc-0xcff).
pub const PCI_CONFIG_PORT: u64 = 0xcf8;
/// Ports taken by configuration mechanism #1.
pub const PCI_CONFIG_PORTS: u64 = 8;

/// Start of the 64-bit PCI BAR window for `mem_size` bytes of RAM: the first 1 GiB
/// boundary at or above both 4 GiB and the end of RAM.
pub fn pci_mmio64_start(mem_size: u64) -> u64 {
    ram_end(mem_size)
        .max(HIGH_RAM_START)
        .next_multiple_of(PCI_MMIO64_ALIGN)
}

/// Global descriptor table used for the 32-bit protected-mode entry.
pub const GDT_ADDR: u64 = 0x500;
/// Boot information page: Linux zero page, PVH `hvm_start_info` or Multiboot info.
pub const BOOT_INFO_ADDR: u64 = 0x7000;
/// Linux zero page (`boot_params`, 4 KiB).
pub const ZERO_PAGE_ADDR: u64 = BOOT_INFO_ADDR;
/// PVH `hvm_start_info`.
pub const PVH_START_INFO_ADDR: u64 = BOOT_INFO_ADDR;
/// Multiboot v1 information structure.
pub const MULTIBOOT_INFO_ADDR: u64 = BOOT_INFO_ADDR;
/// Bottom of the boot stack page.
pub const BOOT_STACK_START: u64 = 0x8000;
/// Initial stack pointer handed to the kernel (top of the boot stack page, 16-byte aligned).
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// PVH memory map table / Multiboot memory map.
pub const MEMMAP_ADDR: u64 = 0x9000;
/// Maximum size of the memory map area.
pub const MEMMAP_MAX_SIZE: u64 = 0x1000;
/// PVH module list / Multiboot module list, followed by boot-loader strings.
pub const MODLIST_ADDR: u64 = 0xa000;
/// Maximum size of the module-list area.
pub const MODLIST_MAX_SIZE: u64 = 0x1000;
/// Kernel command line.
pub const CMDLINE_ADDR: u64 = 0x2_0000;
/// Maximum size of the kernel command line including its terminating NUL.
pub const CMDLINE_MAX_SIZE: u64 = 0x1_0000;

/// Start of the ACPI table area, inside the reserved BIOS area; the RSDP is its first
/// structure (16-byte aligned, where Linux's and other OSes' legacy scan of
/// `[0xe0000, 0x100000)` finds it even without a boot-protocol RSDP pointer).
pub const ACPI_START: u64 = 0xe_0000;
/// Size of the ACPI table area.
pub const ACPI_SIZE: u64 = 0x1_0000;
/// Guest-physical address of the ACPI RSDP.
pub const RSDP_ADDR: u64 = ACPI_START;
/// Start of the Intel MP table area (floating pointer structure at its start), right after
/// the ACPI area, up to 1 MiB.
pub const MPTABLE_START: u64 = ACPI_START + ACPI_SIZE;
/// Size of the MP table area.
pub const MPTABLE_SIZE: u64 = HIMEM_START - MPTABLE_START;

/// Most vCPUs the firmware tables describe: xAPIC IDs are 8 bits and 0xff is the broadcast
/// ID (the MP table has the same limit).
pub const MAX_CPUS: u32 = 254;

/// APIC ID of the IOAPIC in the MADT and the MP table. Its ID register has only 4 bits, so
/// it cannot follow the vCPUs' IDs on larger machines; since the system-bus APICs, IOAPIC and
/// local APIC IDs are separate name spaces, and 0 is what both the in-kernel and ferrovm's
/// IOAPIC report after reset (QEMU declares the same).
pub const IOAPIC_ID: u8 = 0;

/// Smallest guest memory the loaders accept: the boot area below 1 MiB plus 1 MiB.
pub const MIN_MEM_SIZE: u64 = 2 * HIMEM_START;

/// e820 type of a memory range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum E820Kind {
    /// Usable RAM (type 1).
    Ram = 1,
    /// Reserved, not usable by the OS (type 2).
    Reserved = 2,
    /// ACPI reclaimable (type 3).
    Acpi = 3,
    /// ACPI NVS (type 4).
    Nvs = 4,
}

impl E820Kind {
    /// The numeric e820 type (also the PVH `hvm_memmap_table_entry` and Multiboot mmap type).
    pub fn code(self) -> u32 {
        self as u32
    }
}

/// One entry of the e820 memory map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct E820Entry {
    /// First byte of the range.
    pub addr: u64,
    /// Length of the range in bytes.
    pub size: u64,
    /// Type of the range.
    pub kind: E820Kind,
}

impl E820Entry {
    /// One past the last byte of the range.
    pub fn end(&self) -> u64 {
        self.addr.saturating_add(self.size)
    }
}

/// End (exclusive) of the RAM below the MMIO hole: `min(mem_size, 3 GiB)`.
pub fn low_ram_end(mem_size: u64) -> u64 {
    mem_size.min(MMIO_HOLE_START)
}

/// Size of the RAM above 4 GiB.
pub fn high_ram_size(mem_size: u64) -> u64 {
    mem_size.saturating_sub(MMIO_HOLE_START)
}

/// End (exclusive) of all guest RAM, the highest guest-physical RAM address plus one.
pub fn ram_end(mem_size: u64) -> u64 {
    match high_ram_size(mem_size) {
        0 => low_ram_end(mem_size),
        high => HIGH_RAM_START + high,
    }
}

/// The guest RAM regions for `mem_size` bytes of RAM: `[0, mem_size)` when it fits below the
/// MMIO hole, otherwise `[0, 3 GiB)` and `[4 GiB, 4 GiB + mem_size - 3 GiB)`.
/// An empty vector for `mem_size == 0`.
pub fn ram_regions(mem_size: u64) -> Vec<(GuestAddress, u64)> {
    let mut regions = Vec::with_capacity(2);
    let low = low_ram_end(mem_size);
    if low > 0 {
        regions.push((GuestAddress(0), low));
    }
    let high = high_ram_size(mem_size);
    if high > 0 {
        regions.push((GuestAddress(HIGH_RAM_START), high));
    }
    regions
}

/// True when `[start, end)` lies entirely inside one RAM region of the layout.
pub fn range_in_ram(mem_size: u64, start: u64, end: u64) -> bool {
    start <= end
        && ram_regions(mem_size)
            .iter()
            .any(|&(base, size)| start >= base.0 && end <= base.0 + size)
}

/// True when `[start, end)` intersects the 32-bit MMIO hole.
pub fn range_overlaps_mmio_hole(start: u64, end: u64) -> bool {
    start < HIGH_RAM_START && end > MMIO_HOLE_START
}

/// The e820 map for `mem_size` bytes of RAM, sorted by address:
///
/// - `[0, 0x9fc00)` RAM (conventional memory, clipped to `mem_size`);
/// - `[0x9fc00, 0x100000)` reserved (EBDA, VGA hole, BIOS area with the ACPI tables at
///   [`ACPI_START`] and the MP table at [`MPTABLE_START`]);
/// - `[1 MiB, min(mem_size, 3 GiB))` RAM;
/// - the PCI ECAM window and the IOAPIC and local-APIC pages inside the MMIO hole,
///   reserved (the PCI BAR windows are left out: they are the OS's to assign);
/// - `[4 GiB, 4 GiB + mem_size - 3 GiB)` RAM when `mem_size > 3 GiB`.
///
/// Every RAM entry lies inside a region of [`ram_regions`] and every byte of RAM except the
/// legacy area `[0x9fc00, 1 MiB)` is covered by a RAM entry.
pub fn e820_map(mem_size: u64) -> Vec<E820Entry> {
    let mut map = Vec::with_capacity(7);
    let low = low_ram_end(mem_size);
    if low > 0 {
        map.push(E820Entry {
            addr: 0,
            size: low.min(EBDA_START),
            kind: E820Kind::Ram,
        });
    }
    map.push(E820Entry {
        addr: EBDA_START,
        size: HIMEM_START - EBDA_START,
        kind: E820Kind::Reserved,
    });
    if low > HIMEM_START {
        map.push(E820Entry {
            addr: HIMEM_START,
            size: low - HIMEM_START,
            kind: E820Kind::Ram,
        });
    }
    map.push(E820Entry {
        addr: PCI_ECAM_START,
        size: PCI_ECAM_SIZE,
        kind: E820Kind::Reserved,
    });
    map.push(E820Entry {
        addr: IOAPIC_START,
        size: IOAPIC_SIZE,
        kind: E820Kind::Reserved,
    });
    map.push(E820Entry {
        addr: LAPIC_START,
        size: LAPIC_SIZE,
        kind: E820Kind::Reserved,
    });
    let high = high_ram_size(mem_size);
    if high > 0 {
        map.push(E820Entry {
            addr: HIGH_RAM_START,
            size: high,
            kind: E820Kind::Ram,
        });
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn ram(addr: u64, size: u64) -> E820Entry {
        E820Entry {
            addr,
            size,
            kind: E820Kind::Ram,
        }
    }
    fn res(addr: u64, size: u64) -> E820Entry {
        E820Entry {
            addr,
            size,
            kind: E820Kind::Reserved,
        }
    }

    /// Every RAM entry inside the RAM regions, all RAM above 1 MiB covered, sorted, disjoint.
    fn check_consistent(mem_size: u64) {
        let map = e820_map(mem_size);
        let regions = ram_regions(mem_size);
        for w in map.windows(2) {
            assert!(w[0].end() <= w[1].addr, "{mem_size:#x}: {:x?}", w);
        }
        for e in map.iter().filter(|e| e.kind == E820Kind::Ram) {
            assert!(range_in_ram(mem_size, e.addr, e.end()), "{e:x?}");
            assert!(!range_overlaps_mmio_hole(e.addr, e.end()));
        }
        let ram_total: u64 = map
            .iter()
            .filter(|e| e.kind == E820Kind::Ram)
            .map(|e| e.size)
            .sum();
        let region_total: u64 = regions.iter().map(|r| r.1).sum();
        assert_eq!(region_total, mem_size);
        // Only the legacy area [0x9fc00, 1 MiB) is RAM-backed but not reported as RAM.
        let legacy = mem_size.min(HIMEM_START).saturating_sub(EBDA_START);
        assert_eq!(ram_total + legacy, mem_size, "{mem_size:#x}");
    }

    #[test]
    fn regions_small() {
        assert_eq!(ram_regions(128 * MIB), vec![(GuestAddress(0), 128 * MIB)]);
        assert_eq!(ram_regions(3 * GIB), vec![(GuestAddress(0), 3 * GIB)]);
        assert!(ram_regions(0).is_empty());
    }

    #[test]
    fn regions_split() {
        assert_eq!(
            ram_regions(3 * GIB + 1),
            vec![(GuestAddress(0), 3 * GIB), (GuestAddress(4 * GIB), 1)]
        );
        assert_eq!(
            ram_regions(8 * GIB),
            vec![(GuestAddress(0), 3 * GIB), (GuestAddress(4 * GIB), 5 * GIB)]
        );
        assert_eq!(ram_end(8 * GIB), 9 * GIB);
        assert_eq!(ram_end(64 * MIB), 64 * MIB);
    }

    #[test]
    fn e820_128m() {
        assert_eq!(
            e820_map(128 * MIB),
            vec![
                ram(0, 0x9fc00),
                res(0x9fc00, 0x60400),
                ram(MIB, 127 * MIB),
                res(0xe000_0000, 0x10_0000),
                res(0xfec0_0000, 0x1000),
                res(0xfee0_0000, 0x1000),
            ]
        );
        check_consistent(128 * MIB);
    }

    #[test]
    fn e820_3g() {
        assert_eq!(
            e820_map(3 * GIB),
            vec![
                ram(0, 0x9fc00),
                res(0x9fc00, 0x60400),
                ram(MIB, 3 * GIB - MIB),
                res(0xe000_0000, 0x10_0000),
                res(0xfec0_0000, 0x1000),
                res(0xfee0_0000, 0x1000),
            ]
        );
        check_consistent(3 * GIB);
    }

    #[test]
    fn e820_3g_plus_1() {
        assert_eq!(
            e820_map(3 * GIB + 1),
            vec![
                ram(0, 0x9fc00),
                res(0x9fc00, 0x60400),
                ram(MIB, 3 * GIB - MIB),
                res(0xe000_0000, 0x10_0000),
                res(0xfec0_0000, 0x1000),
                res(0xfee0_0000, 0x1000),
                ram(4 * GIB, 1),
            ]
        );
        check_consistent(3 * GIB + 1);
    }

    #[test]
    fn e820_8g() {
        assert_eq!(
            e820_map(8 * GIB),
            vec![
                ram(0, 0x9fc00),
                res(0x9fc00, 0x60400),
                ram(MIB, 3 * GIB - MIB),
                res(0xe000_0000, 0x10_0000),
                res(0xfec0_0000, 0x1000),
                res(0xfee0_0000, 0x1000),
                ram(4 * GIB, 5 * GIB),
            ]
        );
        check_consistent(8 * GIB);
    }

    #[test]
    fn e820_odd_sizes_consistent() {
        for size in [
            MIB / 2,
            MIB,
            MIB + 4096,
            2 * MIB,
            5 * GIB,
            3 * GIB - 1,
            0x9fc00,
        ] {
            check_consistent(size);
        }
    }

    #[test]
    fn apic_pages_inside_hole() {
        for a in [IOAPIC_START, LAPIC_START] {
            assert!(range_overlaps_mmio_hole(a, a + 0x1000));
        }
        assert!(!range_overlaps_mmio_hole(
            HIGH_RAM_START,
            HIGH_RAM_START + 1
        ));
        assert!(!range_overlaps_mmio_hole(0, MMIO_HOLE_START));
    }

    #[test]
    fn firmware_tables_in_reserved_bios_area() {
        const { assert!(ACPI_START + ACPI_SIZE <= MPTABLE_START) };
        const { assert!(MPTABLE_START + MPTABLE_SIZE == HIMEM_START) };
        const { assert!(RSDP_ADDR.is_multiple_of(16) && MPTABLE_START.is_multiple_of(16)) };
        for mem_size in [MIN_MEM_SIZE, 128 * MIB, 8 * GIB] {
            let map = e820_map(mem_size);
            for (start, size) in [(ACPI_START, ACPI_SIZE), (MPTABLE_START, MPTABLE_SIZE)] {
                assert!(range_in_ram(mem_size, start, start + size));
                assert!(map.iter().any(|e| e.kind == E820Kind::Reserved
                    && e.addr <= start
                    && start + size <= e.end()));
                assert!(!map
                    .iter()
                    .any(|e| e.kind == E820Kind::Ram && e.addr < start + size && start < e.end()));
            }
        }
        assert_eq!(IOAPIC_ID, 0);
    }

    #[test]
    fn pci_windows() {
        // The 32-bit window, ECAM and the APIC pages: in the hole, disjoint, outside RAM.
        const { assert!(PCI_MMIO32_START + PCI_MMIO32_SIZE == PCI_ECAM_START) };
        const { assert!(PCI_ECAM_START + PCI_ECAM_SIZE <= IOAPIC_START) };
        assert!(range_overlaps_mmio_hole(PCI_MMIO32_START, PCI_ECAM_START));
        for mem_size in [MIN_MEM_SIZE, 3 * GIB, 3 * GIB + 1, 8 * GIB, 1 << 40] {
            assert!(!ram_regions(mem_size)
                .iter()
                .any(|&(b, s)| b.0 < PCI_ECAM_START + PCI_ECAM_SIZE && PCI_MMIO32_START < b.0 + s));
            let high = pci_mmio64_start(mem_size);
            assert!(high >= ram_end(mem_size) && high >= 4 * GIB);
            assert!(high.is_multiple_of(GIB) && high - ram_end(mem_size).max(4 * GIB) < GIB);
            let map = e820_map(mem_size);
            assert!(map.iter().any(|e| e.kind == E820Kind::Reserved
                && e.addr == PCI_ECAM_START
                && e.size == PCI_ECAM_SIZE));
            assert!(!map
                .iter()
                .any(|e| e.addr < PCI_ECAM_START && e.end() > PCI_MMIO32_START));
            assert!(!map.iter().any(|e| e.end() > high));
        }
        assert_eq!(pci_mmio64_start(128 * MIB), 4 * GIB);
        assert_eq!(pci_mmio64_start(5 * GIB), 6 * GIB);
        assert_eq!(pci_mmio64_start(5 * GIB + 1), 7 * GIB);
        assert_eq!(PCI_IO_START + PCI_IO_SIZE, 0x1_0000);
    }

    #[test]
    fn boot_area_below_ebda() {
        for (addr, size) in [
            (GDT_ADDR, 40),
            (BOOT_INFO_ADDR, 0x1000),
            (BOOT_STACK_START, 0x1000),
            (MEMMAP_ADDR, MEMMAP_MAX_SIZE),
            (MODLIST_ADDR, MODLIST_MAX_SIZE),
            (CMDLINE_ADDR, CMDLINE_MAX_SIZE),
        ] {
            assert!(addr + size <= EBDA_START);
        }
        const { assert!(BOOT_STACK_POINTER > BOOT_STACK_START && BOOT_STACK_POINTER < MEMMAP_ADDR) };
    }
}
