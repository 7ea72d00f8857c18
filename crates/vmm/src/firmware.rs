//! Booting through a BIOS firmware ROM (SeaBIOS): the ROM, the shadow RAM below 1 MiB that
//! the host bridge's PAM registers control, the reset state of the boot vCPU and the fw_cfg
//! files the firmware reads.
//!
//! Memory of a firmware machine:
//!
//! - the ROM is mapped read-only at `4 GiB - size` (its own memory slot; guest writes exit
//!   as MMIO writes, which nothing claims, and are dropped);
//! - guest RAM is the same as for a direct boot, but the low region is registered as
//!   several slots: `[0, 0xc0000)`, the thirteen PAM blocks of the BIOS area (twelve of
//!   16 KiB for `[0xc0000, 0xf0000)`, one of 64 KiB for `[0xf0000, 0x100000)`) and the rest;
//! - the last 128 KiB of the ROM (all of a 64 KiB one) are copied into RAM just below
//!   1 MiB before the first instruction, where the CPU finds them after the first far jump.
//!
//! The PAM registers decide, per block, where reads and writes go. The model keeps the
//! block's contents in RAM and makes the block writable when the register's write-enable
//! bit is set, read-only (writes dropped) when it is clear. That is what SeaBIOS relies on:
//! `make_bios_writable` sets every block to read/write RAM and copies the ROM's image into
//! it; `make_bios_readonly` write-protects the blocks that hold code and option ROMs. Reads
//! in modes where real hardware would read the ROM or the PCI bus return the RAM contents:
//! before any write those are the ROM image (at 0xe0000) or zero.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use devices::bus::{Bus, BusError};
use devices::debugcon::DebugCon;
use devices::exit::ExitRequest;
use devices::fw_cfg::FwCfg;
use devices::port92::Port92;

use hypervisor::{MemoryRegion, SegmentRegister, StandardRegisters, Vcpu, Vm};
use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use crate::config::{StartFrom, VmConfig};
use crate::error::{Error, Result};
use crate::memory::{self, GuestMemory};
use crate::platform::{PciHandles, PlacedDevice};
use crate::state::SharedDevice;

/// Smallest ROM accepted: one 64 KiB segment.
pub const ROM_MIN_SIZE: u64 = 64 << 10;
/// Largest ROM accepted (a 16 MiB flash part, as on QEMU's PC machines).
pub const ROM_MAX_SIZE: u64 = 16 << 20;
/// The ROM's size is a multiple of this.
pub const ROM_SIZE_UNIT: u64 = 64 << 10;
/// End of the ROM: the top of the 32-bit address space.
pub const ROM_END: u64 = 1 << 32;
/// The ROM's tail that also appears below 1 MiB, up to [`SHADOW_END`].
pub const BIOS_ALIAS_SIZE: u64 = 128 << 10;
/// The BIOS area the PAM registers control.
pub const SHADOW_START: u64 = 0xc_0000;
/// End of the BIOS area (1 MiB).
pub const SHADOW_END: u64 = 0x10_0000;
/// PAM blocks of 16 KiB from [`SHADOW_START`] to 0xf0000, then one of 64 KiB.
pub const PAM_BLOCKS: usize = 13;
/// PAM registers (PAM0 to PAM6).
pub const PAM_REGISTERS: usize = 7;
/// Offset of the reset vector from the ROM's end.
const RESET_VECTOR_FROM_END: u64 = 16;

/// A firmware image, read and checked.
#[derive(Clone)]
pub struct Rom {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
}

impl std::fmt::Debug for Rom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rom")
            .field("path", &self.path)
            .field("size", &self.bytes.len())
            .finish()
    }
}

impl Rom {
    /// Reads `path` and checks that it can be an x86 firmware ROM: a whole number of 64 KiB
    /// segments between [`ROM_MIN_SIZE`] and [`ROM_MAX_SIZE`], with a jump at the reset
    /// vector (16 bytes before its end, after optional NOPs).
    pub fn load(path: &Path) -> Result<Self> {
        let refuse = |reason: String| Error::Option {
            option: "--firmware",
            value: path.display().to_string(),
            reason,
        };
        let cannot_open = |e: std::io::Error| {
            let hint = if e.kind() == std::io::ErrorKind::NotFound
                && path == Path::new(crate::config::DEFAULT_FIRMWARE)
            {
                " (the default firmware: install Debian's seabios package, or give --firmware)"
            } else {
                ""
            };
            refuse(format!("cannot open: {e}{hint}"))
        };
        // Looked at before opening: opening a FIFO would wait for a writer for ever.
        let meta = std::fs::metadata(path).map_err(cannot_open)?;
        if !meta.is_file() {
            return Err(refuse(format!(
                "is {}, not a firmware ROM (a regular file)",
                crate::files::kind_of(meta.file_type())
            )));
        }
        let mut file = File::open(path).map_err(cannot_open)?;
        let size = file
            .metadata()
            .map_err(|e| refuse(format!("cannot read: {e}")))?
            .len();
        if !(ROM_MIN_SIZE..=ROM_MAX_SIZE).contains(&size) || size % ROM_SIZE_UNIT != 0 {
            return Err(refuse(format!(
                "{size} bytes: a firmware ROM is a whole number of 64 KiB, from 64 KiB to 16 MiB \
                 (truncated or not a ROM?)"
            )));
        }
        let mut bytes = Vec::with_capacity(size as usize);
        file.read_to_end(&mut bytes)
            .map_err(|e| refuse(format!("cannot read: {e}")))?;
        if bytes.len() as u64 != size {
            return Err(refuse("changed size while being read".into()));
        }
        if !has_reset_jump(&bytes) {
            return Err(refuse(format!(
                "no jump at the reset vector (offset {:#x}): not an x86 firmware ROM",
                size - RESET_VECTOR_FROM_END
            )));
        }
        Ok(Rom {
            path: path.to_path_buf(),
            bytes,
        })
    }

    /// Guest-physical address of the ROM's first byte.
    pub fn base(&self) -> u64 {
        ROM_END - self.bytes.len() as u64
    }

    /// What identifies this ROM in a snapshot or migration: both ends must boot the same
    /// image (its code runs from shadow RAM, which travels, but a reset runs the ROM).
    pub fn identity(&self) -> String {
        format!(
            "{} ({} bytes, crc32 {:08x})",
            self.path.display(),
            self.bytes.len(),
            crc32fast::hash(&self.bytes)
        )
    }
}

/// A far jump (0xea), near jump (0xe9) or short jump (0xeb) at the reset vector, after at
/// most a few NOPs (some firmware pads there).
fn has_reset_jump(rom: &[u8]) -> bool {
    let Some(vector) = rom.len().checked_sub(RESET_VECTOR_FROM_END as usize) else {
        return false;
    };
    rom[vector..]
        .iter()
        .take(4)
        .find(|&&b| b != 0x90)
        // 0xe9 near, 0xea far, 0xeb short.
        .is_some_and(|b| matches!(b, 0xe9..=0xeb))
}

/// The path recorded by [`Rom::identity`].
pub fn path_from_identity(identity: &str) -> Option<PathBuf> {
    let end = identity.rfind(" (")?;
    Some(PathBuf::from(&identity[..end]))
}

/// The ROM a machine with this configuration maps: it boots through firmware, or migrates
/// in (or is restored) from a machine that did. None for a direct kernel boot.
pub fn rom_for(config: &VmConfig) -> Result<Option<Rom>> {
    match (&config.start, &config.firmware) {
        (StartFrom::Kernel(_), _) | (_, None) => Ok(None),
        (_, Some(path)) => Rom::load(path).map(Some),
    }
}

/// `[start, end)` of PAM block `i`.
pub fn pam_block(i: usize) -> (u64, u64) {
    if i + 1 < PAM_BLOCKS {
        let start = SHADOW_START + i as u64 * 0x4000;
        (start, start + 0x4000)
    } else {
        (0xf_0000, SHADOW_END)
    }
}

/// Which PAM blocks the registers make writable: block `i < 12` is PAM`1 + i / 2`'s low
/// (even `i`) or high nibble, block 12 (0xf0000) PAM0's high nibble; a nibble's bit 1 is
/// its write enable.
pub fn pam_writable(pam: &[u8; PAM_REGISTERS]) -> [bool; PAM_BLOCKS] {
    let mut writable = [false; PAM_BLOCKS];
    for (i, w) in writable.iter_mut().enumerate() {
        let nibble = if i + 1 < PAM_BLOCKS {
            pam[1 + i / 2] >> (4 * (i % 2))
        } else {
            pam[0] >> 4
        };
        *w = nibble & 0b10 != 0;
    }
    writable
}

/// The firmware's memory: the ROM's mapping and slot, and the slots of the PAM blocks.
pub struct FirmwareMemory {
    /// Holds the ROM's host mapping for as long as the VM exists.
    _rom_mapping: memory::GuestRegion,
    pub rom_slot: MemoryRegion,
    pub shadow: Arc<ShadowRam>,
}

/// Registers guest RAM for a firmware machine (the low region split around the PAM
/// blocks, which start read-only as after reset) and the ROM. Returns the RAM slots in
/// address order, as a snapshot or migration walks them, and the firmware's memory.
pub fn map_memory(
    vm: &Arc<dyn Vm>,
    guest_memory: &GuestMemory,
    rom: &Rom,
) -> Result<(Vec<MemoryRegion>, FirmwareMemory)> {
    let slots = map_ram_slots(vm, guest_memory)?;
    let blocks: Vec<MemoryRegion> = slots.iter().filter(|s| s.readonly).copied().collect();
    if blocks.len() != PAM_BLOCKS {
        return Err(Error::Memory(
            "a firmware boot needs guest RAM up to 1 MiB at least".into(),
        ));
    }
    // The PAM registers switch these slots later: find out now whether the accelerator can
    // (a no-op where it can: they are read-only already).
    vm.set_memory_readonly(&blocks[0], true).map_err(|e| {
        Error::Memory(format!(
            "firmware boot needs shadow RAM the accelerator can write-protect: {e}"
        ))
    })?;
    let rom_mapping = map_rom(rom)?;
    let rom_slot = MemoryRegion {
        slot: slots.len() as u32,
        guest_addr: rom.base(),
        size: rom.bytes.len() as u64,
        host_addr: rom_mapping
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| Error::Memory(e.to_string()))? as u64,
        readonly: true,
        log_dirty: false,
    };
    // SAFETY: the mapping lives in the returned FirmwareMemory, which the machine keeps for
    // as long as the VM exists.
    unsafe { vm.map_memory(&rom_slot)? };
    let shadow = Arc::new(ShadowRam {
        vm: vm.clone(),
        blocks,
    });
    let fw = FirmwareMemory {
        _rom_mapping: rom_mapping,
        rom_slot,
        shadow,
    };
    Ok((slots, fw))
}

/// [`map_memory`], with guest RAM's regions as snapshots and migration see them: returns
/// (regions, slots, the firmware's memory).
pub fn map_guest_memory(
    vm: &Arc<dyn Vm>,
    guest_memory: &GuestMemory,
    rom: &Rom,
) -> Result<(Vec<MemoryRegion>, Vec<MemoryRegion>, Option<FirmwareMemory>)> {
    let (slots, fw) = map_memory(vm, guest_memory, rom)?;
    let regions = ram_regions(guest_memory, &slots)?;
    Ok((regions, slots, Some(fw)))
}

/// The legacy devices BIOS code and boot loaders use besides a direct boot's: port 0x92
/// (fast A20 and reset) and the firmware's debug console at 0x402 (not saved: no state).
pub fn add_legacy_devices(
    pio: &mut Bus,
    exit: &Arc<ExitRequest>,
) -> std::result::Result<Vec<SharedDevice>, BusError> {
    let port92 = Port92::new(exit.clone()).register(pio)?;
    DebugCon::default().register(pio)?;
    Ok(vec![port92])
}

/// Registers guest RAM as memory slots in address order, the region holding the BIOS area
/// cut at the PAM blocks (which start read-only, as after reset).
fn map_ram_slots(vm: &Arc<dyn Vm>, guest_memory: &GuestMemory) -> Result<Vec<MemoryRegion>> {
    let mut slots = Vec::new();
    for region in guest_memory.iter() {
        let host = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| Error::Memory(e.to_string()))? as u64;
        let (start, end) = (region.start_addr().0, region.start_addr().0 + region.len());
        let mut cuts = vec![start];
        if start < SHADOW_START && end >= SHADOW_END {
            cuts.extend((0..PAM_BLOCKS).map(|i| pam_block(i).0));
            cuts.push(SHADOW_END);
        }
        cuts.push(end);
        cuts.dedup();
        for w in cuts.windows(2) {
            let slot = MemoryRegion {
                slot: slots.len() as u32,
                guest_addr: w[0],
                size: w[1] - w[0],
                host_addr: host + (w[0] - start),
                readonly: (SHADOW_START..SHADOW_END).contains(&w[0]),
                log_dirty: false,
            };
            // SAFETY: the range lies inside `region`, which the machine keeps mapped for as
            // long as the VM exists.
            unsafe { vm.map_memory(&slot)? };
            slots.push(slot);
        }
    }
    Ok(slots)
}

/// Guest RAM's regions as snapshots and migration lay RAM out (one per region of
/// `guest_memory`, whatever slots hold it), each named by the first of `slots` inside it.
pub fn ram_regions(
    guest_memory: &GuestMemory,
    slots: &[MemoryRegion],
) -> Result<Vec<MemoryRegion>> {
    guest_memory
        .iter()
        .map(|region| {
            let start = region.start_addr().0;
            let first = slots
                .iter()
                .find(|s| s.guest_addr == start)
                .ok_or_else(|| Error::Memory(format!("no memory slot starts at {start:#x}")))?;
            Ok(MemoryRegion {
                size: region.len(),
                readonly: false,
                ..*first
            })
        })
        .collect()
}

/// An anonymous mapping holding the ROM image.
fn map_rom(rom: &Rom) -> Result<memory::GuestRegion> {
    let mapping = memory::map_region(vm_memory::GuestAddress(rom.base()), rom.bytes.len())?;
    mapping
        .write_slice(&rom.bytes, MemoryRegionAddress(0))
        .map_err(|e| Error::Memory(format!("copying the firmware ROM: {e}")))?;
    Ok(mapping)
}

/// Copies the ROM's last 128 KiB (all of a smaller ROM, as a PC shows a 64 KiB BIOS at
/// 0xf0000) to RAM just below 1 MiB, where the CPU runs it after its first far jump (a
/// fresh boot only: restored RAM has its own contents).
pub fn load_bios_alias(guest_memory: &GuestMemory, rom: &Rom) -> Result<()> {
    let size = rom.bytes.len().min(BIOS_ALIAS_SIZE as usize);
    let tail = &rom.bytes[rom.bytes.len() - size..];
    guest_memory
        .write_slice(tail, vm_memory::GuestAddress(SHADOW_END - size as u64))
        .map_err(|e| Error::Memory(format!("copying the BIOS below 1 MiB: {e}")))
}

/// The BIOS area's PAM blocks as memory slots, switched between read-only and writable as
/// the host bridge's PAM registers say.
pub struct ShadowRam {
    vm: Arc<dyn Vm>,
    blocks: Vec<MemoryRegion>,
}

impl ShadowRam {
    /// Applies PAM register values (after a guest write, a restore or a reset).
    pub fn apply(&self, pam: &[u8; PAM_REGISTERS]) -> Result<()> {
        for (block, writable) in self.blocks.iter().zip(pam_writable(pam)) {
            self.vm.set_memory_readonly(block, !writable)?;
        }
        Ok(())
    }
}

/// The key under which a firmware machine's migration config names its ROM
/// ([`Rom::identity`]).
pub const CONFIG_KEY: &str = "firmware";
/// The BIOS console: SeaBIOS mirrors its screen output (and the boot loader's INT 10h
/// output) to this serial port.
const SERCON_PORT: u16 = 0x3f8;
/// How long SeaBIOS waits after "No bootable device" before it resets the machine (which
/// ends the VM), in milliseconds.
const BOOT_FAIL_WAIT_MS: u32 = 2000;

/// The fw_cfg files a BIOS reads besides the ACPI tables: the memory map, the serial
/// console, no interactive boot menu, the wait after a failed boot, and the boot order
/// (`boot_paths`: the OpenFirmware-style paths of the devices to try first, in order).
pub fn fw_cfg_files(mem_size: u64, boot_paths: &[String]) -> Vec<(&'static str, Vec<u8>)> {
    let mut files = vec![
        ("etc/e820", e820_table(mem_size)),
        ("etc/sercon-port", SERCON_PORT.to_le_bytes().to_vec()),
        ("etc/show-boot-menu", 0u16.to_le_bytes().to_vec()),
        (
            "etc/boot-fail-wait",
            BOOT_FAIL_WAIT_MS.to_le_bytes().to_vec(),
        ),
    ];
    if !boot_paths.is_empty() {
        files.push(("bootorder", boot_paths.join("\n").into_bytes()));
    }
    files
}

/// `etc/e820` as QEMU writes it (20-byte entries: address, length, type): the RAM below
/// the MMIO hole in one piece from 0 (the firmware reserves its own areas below 1 MiB), the
/// RAM above 4 GiB, and the machine's reserved ranges above 1 MiB (IOAPIC, local APIC,
/// ECAM).
pub fn e820_table(mem_size: u64) -> Vec<u8> {
    use boot::layout::{e820_map, low_ram_end, E820Kind, HIMEM_START};
    let mut entries = vec![(0, low_ram_end(mem_size), E820Kind::Ram)];
    entries.extend(
        e820_map(mem_size)
            .into_iter()
            .filter(|e| e.addr >= HIMEM_START && (e.kind != E820Kind::Ram || e.addr >= 1 << 32))
            .map(|e| (e.addr, e.size, e.kind)),
    );
    entries.sort_by_key(|e| e.0);
    let mut table = Vec::with_capacity(entries.len() * 20);
    for (addr, size, kind) in entries {
        table.extend_from_slice(&addr.to_le_bytes());
        table.extend_from_slice(&size.to_le_bytes());
        table.extend_from_slice(&kind.code().to_le_bytes());
    }
    table
}

impl pci::PamListener for ShadowRam {
    fn pam_changed(&self, pam: &[u8; pci::host_bridge::PAM_COUNT]) {
        if let Err(e) = self.apply(pam) {
            log::error!("shadow RAM: cannot apply the PAM registers {pam:02x?}: {e}");
        }
    }
}

/// Adds the PIIX ISA bridge (00:01.0) and PM function (00:01.3) to the bus; call before the
/// virtio functions take their slots. Returns them for the lifecycle list.
pub fn add_piix(pci: &PciHandles) -> Result<Vec<SharedDevice>> {
    let pci_err = |e: pci::PciError| Error::Devices(format!("PIIX: {e}"));
    let isa = Arc::new(Mutex::new(pci::piix::isa_bridge()));
    let pm = Arc::new(Mutex::new(pci::piix::power_management()));
    pci.bus
        .add_device_at(pci::piix::PIIX_SLOT, isa.clone())
        .map_err(pci_err)?;
    pci.bus
        .add_function_at(pci::piix::PIIX_SLOT, pci::piix::PM_FUNCTION, pm.clone())
        .map_err(pci_err)?;
    Ok(vec![isa, pm])
}

/// What [`attach`] connects the firmware to.
pub struct MachineParts<'a> {
    pub pci: &'a PciHandles,
    pub fw_cfg: &'a Mutex<FwCfg>,
    /// The devices of the machine's list, where they sit on the bus.
    pub virtio: &'a [PlacedDevice],
    /// The accelerator's own ACPI PM timer port, if it has one (bhyve).
    pub kernel_pm_timer: Option<u16>,
}

/// Connects the firmware to the machine: the host bridge's PAM registers drive the shadow
/// RAM, and fw_cfg gets the files the firmware reads (memory map, console, boot order from
/// the disks' PCI functions in `config.boot_order`, ACPI tables).
pub fn attach(fw: &FirmwareMemory, config: &VmConfig, machine: &MachineParts) -> Result<()> {
    lock(&machine.pci.host_bridge).set_pam_listener(fw.shadow.clone());
    let boot_paths = config
        .boot_order
        .iter()
        .map(|id| {
            machine
                .virtio
                .iter()
                .find(|placed| placed.id == *id)
                .map(|placed| boot_path(placed.slot, 0))
                .ok_or_else(|| Error::Devices(format!("--boot: {id} is not on the PCI bus")))
        })
        .collect::<Result<Vec<_>>>()?;
    let pm_timer = machine.kernel_pm_timer.unwrap_or(boot::acpi::PM_TMR_BLK);
    // The root bridge's 32-bit window as the bus decodes it on a firmware machine.
    let acpi = boot::acpi::AcpiTables::with_mmio32_end(
        config.cpus,
        config.memory,
        pm_timer,
        boot::layout::IOAPIC_START,
    )
    .map_err(|e| Error::Firmware(e.to_string()))?;
    let acpi_files = boot::table_loader::firmware_acpi_files(&acpi).into_files();
    let mut fw_cfg = lock(machine.fw_cfg);
    for (name, data) in fw_cfg_files(config.memory, &boot_paths)
        .into_iter()
        .chain(acpi_files)
    {
        fw_cfg
            .add_file(name, data)
            .map_err(|e| Error::Devices(e.to_string()))?;
    }
    Ok(())
}

/// The boot-order path SeaBIOS matches for the PCI function at `slot`.`function` of bus 0
/// ("/pci@i0cf8/*@SS" for function 0, "/pci@i0cf8/*@SS,F" otherwise).
fn boot_path(slot: u8, function: u8) -> String {
    match function {
        0 => format!("/pci@i0cf8/*@{slot:x}"),
        f => format!("/pci@i0cf8/*@{slot:x},{f:x}"),
    }
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Puts `vcpu` in the state the CPU has after RESET: real mode, CS:IP = F000:FFF0 with CS
/// base 0xffff0000 (so the first fetch comes from the ROM's reset vector), caches enabled
/// by CR0's reset value, EDX = the processor signature.
pub fn set_reset_registers(vcpu: &dyn Vcpu) -> Result<()> {
    let segment = |selector: u16, base: u64, type_: u8| SegmentRegister {
        base,
        limit: 0xffff,
        selector,
        type_,
        present: true,
        dpl: 0,
        db: false,
        s: true,
        l: false,
        g: false,
        avl: false,
        unusable: false,
    };
    let mut sregs = vcpu.sregs()?;
    // Code: execute/read, accessed; data: read/write, accessed.
    sregs.cs = segment(0xf000, 0xffff_0000, 0xb);
    let data = segment(0, 0, 0x3);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    // LDT and a busy 32-bit TSS, both empty, as after reset.
    sregs.ldt = SegmentRegister {
        s: false,
        type_: 0x2,
        ..segment(0, 0, 0x2)
    };
    sregs.tr = SegmentRegister {
        s: false,
        type_: 0xb,
        ..segment(0, 0, 0xb)
    };
    sregs.gdt.base = 0;
    sregs.gdt.limit = 0xffff;
    sregs.idt.base = 0;
    sregs.idt.limit = 0xffff;
    // CD and NW set, ET set.
    sregs.cr0 = 0x6000_0010;
    sregs.cr2 = 0;
    sregs.cr3 = 0;
    sregs.cr4 = 0;
    sregs.efer = 0;
    vcpu.set_sregs(&sregs)?;
    vcpu.set_regs(&StandardRegisters {
        rip: 0xfff0,
        rflags: 0x2,
        // Family 6: what CPUID leaf 1 reports is the firmware's business.
        rdx: 0x600,
        ..Default::default()
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rom_file(bytes: &[u8]) -> (tempfile_path::TempPath, PathBuf) {
        let t = tempfile_path::TempPath::new();
        std::fs::write(&t.0, bytes).unwrap();
        let p = t.0.clone();
        (t, p)
    }

    /// A temporary file path, removed on drop (no tempfile crate in this workspace).
    mod tempfile_path {
        use std::path::PathBuf;
        pub struct TempPath(pub PathBuf);
        impl TempPath {
            pub fn new() -> Self {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let n = N.fetch_add(1, Ordering::Relaxed);
                TempPath(
                    std::env::temp_dir()
                        .join(format!("ferrovm-rom-test-{}-{n}", std::process::id())),
                )
            }
        }
        impl Drop for TempPath {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    fn good_rom(size: usize) -> Vec<u8> {
        let mut rom = vec![0xffu8; size];
        // ljmp $0xf000, $0xe05b
        rom[size - 16..size - 11].copy_from_slice(&[0xea, 0x5b, 0xe0, 0x00, 0xf0]);
        rom
    }

    #[test]
    fn roms_are_checked() {
        let (_t, p) = rom_file(&good_rom(256 << 10));
        let rom = Rom::load(&p).unwrap();
        assert_eq!(rom.base(), 0xfffc_0000);
        assert!(rom.identity().contains("262144 bytes"));
        assert_eq!(path_from_identity(&rom.identity()).unwrap(), p);

        let err = |bytes: &[u8]| {
            let (_t, p) = rom_file(bytes);
            Rom::load(&p).unwrap_err().to_string()
        };
        let e = err(&good_rom(256 << 10)[..100_000]);
        assert!(
            e.starts_with("--firmware ") && e.contains("100000 bytes"),
            "{e}"
        );
        assert!(err(&[]).contains("0 bytes"));
        assert!(err(&vec![0; 32 << 20]).contains("16 MiB"));
        let e = err(&vec![0u8; 128 << 10]);
        assert!(e.contains("not an x86 firmware ROM"), "{e}");
        let mut nops = good_rom(64 << 10);
        let n = nops.len();
        nops[n - 16..n - 13].copy_from_slice(&[0x90, 0x90, 0xe9]);
        let (_t, p) = rom_file(&nops);
        Rom::load(&p).unwrap();
        let e = Rom::load(Path::new("/nonexistent/bios.bin"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot open"), "{e}");
        let e = Rom::load(Path::new("/")).unwrap_err().to_string();
        assert!(e.contains("directory"), "{e}");
    }

    #[test]
    fn e820_for_the_firmware() {
        let entries = |mem: u64| -> Vec<(u64, u64, u32)> {
            e820_table(mem)
                .chunks(20)
                .map(|c| {
                    (
                        u64::from_le_bytes(c[0..8].try_into().unwrap()),
                        u64::from_le_bytes(c[8..16].try_into().unwrap()),
                        u32::from_le_bytes(c[16..20].try_into().unwrap()),
                    )
                })
                .collect()
        };
        let small = entries(256 << 20);
        assert_eq!(small[0], (0, 256 << 20, 1));
        assert!(small.contains(&(0xfec0_0000, 0x1000, 2)));
        assert!(small.contains(&(0xfee0_0000, 0x1000, 2)));
        assert!(small.iter().all(|e| e.2 != 1 || e.0 == 0));
        let big = entries(5 << 30);
        assert_eq!(big[0], (0, 3 << 30, 1));
        assert_eq!(*big.last().unwrap(), (4 << 30, 2 << 30, 1));
        for w in big.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{big:x?}");
        }
    }

    #[test]
    fn fw_cfg_file_contents() {
        let files = fw_cfg_files(
            256 << 20,
            &["/pci@i0cf8/*@3".into(), "/pci@i0cf8/*@4".into()],
        );
        let get = |name: &str| files.iter().find(|f| f.0 == name).unwrap().1.clone();
        assert_eq!(get("etc/sercon-port"), vec![0xf8, 0x03]);
        assert_eq!(get("etc/show-boot-menu"), vec![0, 0]);
        assert_eq!(get("bootorder"), b"/pci@i0cf8/*@3\n/pci@i0cf8/*@4".to_vec());
        assert!(!fw_cfg_files(256 << 20, &[])
            .iter()
            .any(|f| f.0 == "bootorder"));
    }

    #[test]
    fn boot_paths() {
        assert_eq!(boot_path(2, 0), "/pci@i0cf8/*@2");
        assert_eq!(boot_path(0x1f, 0), "/pci@i0cf8/*@1f");
        assert_eq!(boot_path(1, 3), "/pci@i0cf8/*@1,3");
    }

    #[test]
    fn pam_decoding() {
        assert_eq!(pam_writable(&[0; 7]), [false; 13]);
        // make_bios_writable: PAM0 = 0x30, PAM1-6 = 0x33.
        assert_eq!(
            pam_writable(&[0x30, 0x33, 0x33, 0x33, 0x33, 0x33, 0x33]),
            [true; 13]
        );
        // make_bios_readonly with option ROMs up to 0xc8000 and the UMB after: 0x11 for
        // PAM1, 0x31 for PAM2 (0xc8000 read-only, 0xcc000 writable), PAM0 = 0x10.
        let w = pam_writable(&[0x10, 0x11, 0x31, 0x33, 0x33, 0x33, 0x33]);
        assert_eq!(
            w,
            [false, false, false, true, true, true, true, true, true, true, true, true, false]
        );
        // Write-only (mode 2) counts as writable; read-only (mode 1) does not.
        let w = pam_writable(&[0x20, 0x12, 0, 0, 0, 0, 0]);
        assert_eq!((w[0], w[1], w[12]), (true, false, true));
        assert_eq!(pam_block(0), (0xc0000, 0xc4000));
        assert_eq!(pam_block(11), (0xec000, 0xf0000));
        assert_eq!(pam_block(12), (0xf0000, 0x100000));
    }
}
