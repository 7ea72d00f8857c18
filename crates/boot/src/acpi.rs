//! ACPI tables for x86-64 guests: RSDP, XSDT, FADT (with FACS), MADT and DSDT.
//!
//! The tables live in the reserved BIOS area at [`ACPI_START`] (`[0xe0000, 0xf0000)`):
//!
//! | table | placement | contents |
//! | --- | --- | --- |
//! | RSDP | 0xe0000 (36 bytes, revision 2) | XSDT address, both checksums |
//! | XSDT | next 64-byte boundary | FADT, MADT |
//! | FADT | next 64-byte boundary (276 bytes, revision 6.5) | FACS, DSDT, fixed hardware ports |
//! | FACS | next 64-byte boundary (64 bytes) | global lock, waking vector (both unused) |
//! | DSDT | next 64-byte boundary | `\_S5_`, COM1, ACPI PM I/O resources |
//! | MADT | next 64-byte boundary | local APICs, IOAPIC, overrides, LINT1 NMI |
//!
//! The machine they describe: one local APIC per vCPU (APIC ID = vCPU index) at
//! [`LAPIC_START`], one IOAPIC with ID [`IOAPIC_ID`] at [`IOAPIC_START`] routing GSIs
//! 0-23, ISA IRQ 0 on GSI 2, the SCI on IRQ/GSI 9 (level, active high), and the ACPI PM
//! registers of `devices::acpi_pm` at I/O ports 0x600-0x60b (the fixed-feature power button,
//! no GPE block, no SMI command port: the machine is always in ACPI mode). Reset goes through
//! the i8042 (port 0x64, value 0xfe), which the VMM already models.
//!
//! Static tables come from the `acpi_tables` crate (RSDP, XSDT, FADT, FACS, the MADT's
//! processor and IOAPIC entries, the AML of the DSDT); only the MADT entries it lacks
//! (interrupt source overrides, local APIC NMI) and the MADT header flags are written here.

use acpi_tables::facs::FACS;
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{EnabledStatus, IoApic, ProcessorLocalApic};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{aml, Aml};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryError};

use crate::layout::{
    range_in_ram, ACPI_SIZE, ACPI_START, IOAPIC_ID, IOAPIC_START, LAPIC_START, MAX_CPUS, RSDP_ADDR,
};

/// OEM ID in every table header and the RSDP.
pub const OEM_ID: [u8; 6] = *b"FERROV";
/// OEM table ID in every table header.
pub const OEM_TABLE_ID: [u8; 8] = *b"FERROVM ";
/// OEM revision in every table header.
pub const OEM_REVISION: u32 = 1;

/// First I/O port of the ACPI PM register block (`devices::acpi_pm` must agree).
pub const PM_IO_BASE: u16 = 0x600;
/// Ports taken by the PM register block: PM1a event (4), PM1a control (2), pad (2), timer (4).
pub const PM_IO_LEN: u16 = 12;
/// PM1a event block: PM1 status (2 bytes) followed by PM1 enable (2 bytes).
pub const PM1A_EVT_BLK: u16 = PM_IO_BASE;
/// Length of the PM1a event block.
pub const PM1_EVT_LEN: u8 = 4;
/// PM1a control block.
pub const PM1A_CNT_BLK: u16 = PM_IO_BASE + 4;
/// Length of the PM1a control block.
pub const PM1_CNT_LEN: u8 = 2;
/// PM timer (24 bits, 3.579545 MHz).
pub const PM_TMR_BLK: u16 = PM_IO_BASE + 8;
/// Length of the PM timer block.
pub const PM_TMR_LEN: u8 = 4;
/// ISA IRQ and GSI of the SCI.
pub const SCI_IRQ: u8 = 9;
/// SLP_TYP value of the `\_S5_` (soft off) package: writing it with SLP_EN to PM1a control
/// powers the machine off.
pub const S5_SLP_TYP: u8 = 5;
/// Reset register: the i8042 command port.
pub const RESET_PORT: u16 = 0x64;
/// Value written to [`RESET_PORT`] to reset (pulse the CPU reset line).
pub const RESET_VALUE: u8 = 0xfe;
/// COM1 as described in the DSDT.
pub const COM1_PORT: u16 = 0x3f8;
/// COM1's ISA IRQ.
pub const COM1_IRQ: u8 = 4;

/// Tables are placed on this alignment (FACS needs 64 bytes; the others take 64 for tidiness).
const TABLE_ALIGN: u64 = 64;

/// MADT header flag: the machine also has dual 8259 PICs (they must be masked).
const MADT_PCAT_COMPAT: u32 = 1;
/// MADT structure types hand-written here.
const MADT_INT_SRC_OVERRIDE: u8 = 2;
const MADT_LOCAL_APIC_NMI: u8 = 4;
/// MPS INTI flags: polarity (bits 1:0) and trigger mode (bits 3:2).
const MPS_ACTIVE_HIGH: u16 = 0b01;
const MPS_EDGE: u16 = 0b01 << 2;
const MPS_LEVEL: u16 = 0b11 << 2;
/// IAPC_BOOT_ARCH: legacy (ISA) devices, an 8042, no VGA (an RTC is present: bit 5 clear).
const IAPC_LEGACY_DEVICES: u16 = 1 << 0;
const IAPC_8042: u16 = 1 << 1;
const IAPC_VGA_NOT_PRESENT: u16 = 1 << 2;
/// Processor C2/C3 latencies above 100 / 1000 µs mean "not supported".
const C_STATE_NOT_SUPPORTED: u16 = 0x0fff;

/// Why the ACPI tables could not be written.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// The MADT describes between 1 and [`MAX_CPUS`] xAPIC processors.
    #[error("ACPI tables describe 1 to {MAX_CPUS} vCPUs, not {0}")]
    CpuCount(u32),
    /// The guest has too little RAM to hold the BIOS area.
    #[error(
        "guest RAM of {mem_size:#x} bytes does not cover the ACPI table area [{start:#x}, {end:#x})"
    )]
    AreaNotInRam {
        /// Guest RAM size.
        mem_size: u64,
        /// Start of the ACPI area.
        start: u64,
        /// End of the ACPI area.
        end: u64,
    },
    /// The tables do not fit the ACPI area.
    #[error("ACPI tables need {needed:#x} bytes, more than the {available:#x}-byte area")]
    TooLarge {
        /// Bytes needed.
        needed: u64,
        /// Size of the area.
        available: u64,
    },
    /// Writing a table to guest memory failed.
    #[error("cannot write the ACPI {table} at {addr:#x}: {source}")]
    GuestMemory {
        /// Which table.
        table: &'static str,
        /// Its guest-physical address.
        addr: u64,
        /// The memory error.
        #[source]
        source: GuestMemoryError,
    },
}

/// Serializes anything the `acpi_tables` crate can emit.
fn bytes_of(table: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    table.to_aml_bytes(&mut v);
    v
}

/// The MADT: local APIC address and PCAT_COMPAT, one enabled local APIC per vCPU (processor
/// UID = APIC ID = index), the IOAPIC, the ISA IRQ 0 → GSI 2 and SCI overrides, and NMI on
/// LINT1 of every processor.
fn madt(cpus: u32) -> Vec<u8> {
    // Header (36) + local APIC address (4) + flags (4); the structures follow.
    let mut madt = Sdt::new(*b"APIC", 44, 5, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    madt.write_u32(36, LAPIC_START as u32);
    madt.write_u32(40, MADT_PCAT_COMPAT);
    for id in 0..cpus {
        let id = id as u8; // cpus <= MAX_CPUS < 256
        madt.append_slice(&bytes_of(&ProcessorLocalApic::new(
            id,
            id,
            EnabledStatus::Enabled,
        )));
    }
    madt.append_slice(&bytes_of(&IoApic::new(IOAPIC_ID, IOAPIC_START as u32, 0)));
    let overrides = [
        (0u8, 2u32, MPS_EDGE | MPS_ACTIVE_HIGH),
        (SCI_IRQ, u32::from(SCI_IRQ), MPS_LEVEL | MPS_ACTIVE_HIGH),
    ];
    for (source, gsi, flags) in overrides {
        let mut e = vec![MADT_INT_SRC_OVERRIDE, 10, 0 /* bus: ISA */, source];
        e.extend_from_slice(&gsi.to_le_bytes());
        e.extend_from_slice(&flags.to_le_bytes());
        madt.append_slice(&e);
    }
    // Local APIC NMI: all processors (UID 0xff), edge/active high, LINT1.
    let mut nmi = vec![MADT_LOCAL_APIC_NMI, 6, 0xff];
    nmi.extend_from_slice(&(MPS_EDGE | MPS_ACTIVE_HIGH).to_le_bytes());
    nmi.push(1);
    madt.append_slice(&nmi);
    madt.as_slice().to_vec()
}

/// The DSDT: `\_S5_` and, under `\_SB_`, COM1 and the ACPI PM I/O ports (with the PM timer
/// wherever it is) as motherboard resources.
fn dsdt(pm_timer_port: u16) -> Vec<u8> {
    let s5 = aml::Name::new(
        "\\_S5_".into(),
        &aml::Package::new(vec![&S5_SLP_TYP, &S5_SLP_TYP, &aml::ZERO, &aml::ZERO]),
    );

    let com1_hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0501"));
    let com1_uid = aml::Name::new("_UID".into(), &aml::ONE);
    let com1_io = aml::IO::new(COM1_PORT, COM1_PORT, 0, 8);
    let com1_irq = aml::Interrupt::new(true, true, false, false, u32::from(COM1_IRQ));
    let com1_crs = aml::Name::new(
        "_CRS".into(),
        &aml::ResourceTemplate::new(vec![&com1_io, &com1_irq]),
    );
    let com1 = aml::Device::new("COM1".into(), vec![&com1_hid, &com1_uid, &com1_crs]);

    let pm_hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C02"));
    let pm_uid = aml::Name::new("_UID".into(), &aml::ONE);
    let pm_io = aml::IO::new(PM_IO_BASE, PM_IO_BASE, 1, PM_IO_LEN as u8);
    let timer_io = aml::IO::new(pm_timer_port, pm_timer_port, 1, PM_TMR_LEN);
    let mut pm_resources: Vec<&dyn Aml> = vec![&pm_io];
    if !(PM_IO_BASE..PM_IO_BASE + PM_IO_LEN).contains(&pm_timer_port) {
        pm_resources.push(&timer_io);
    }
    let pm_crs = aml::Name::new("_CRS".into(), &aml::ResourceTemplate::new(pm_resources));
    let pm = aml::Device::new("PMIO".into(), vec![&pm_hid, &pm_uid, &pm_crs]);

    let sb = aml::Scope::new("\\_SB_".into(), vec![&com1, &pm]);

    let mut dsdt = Sdt::new(*b"DSDT", 36, 2, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    let mut body = Vec::new();
    s5.to_aml_bytes(&mut body);
    sb.to_aml_bytes(&mut body);
    dsdt.append_slice(&body);
    dsdt.as_slice().to_vec()
}

fn io_gas(port: u16, bytes: u8, access: AccessSize) -> GAS {
    GAS::new(
        AddressSpace::SystemIo,
        bytes * 8,
        0,
        access,
        u64::from(port),
    )
}

/// The FADT (revision 6.5, 276 bytes): fixed hardware at [`PM_IO_BASE`] (the PM timer at
/// `pm_timer_port`), SCI on IRQ 9, both the 32-bit and the X_ forms of every address, reset
/// through the i8042.
fn fadt(dsdt_addr: u64, facs_addr: u64, pm_timer_port: u16) -> Vec<u8> {
    let mut f = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .flag(Flags::Wbinvd)
        .flag(Flags::ProcC1)
        .flag(Flags::SlpButton)
        .flag(Flags::ResetRegSup);
    // Both forms of the same address (they fit 32 bits: the area is below 1 MiB).
    f.firmware_ctrl = (facs_addr as u32).into();
    f.x_firmware_ctrl = facs_addr.into();
    f.dsdt = (dsdt_addr as u32).into();
    f.x_dsdt = dsdt_addr.into();
    f.sci_int = u16::from(SCI_IRQ).into();
    f.pm1a_evt_blk = u32::from(PM1A_EVT_BLK).into();
    f.pm1a_cnt_blk = u32::from(PM1A_CNT_BLK).into();
    f.pm_tmr_blk = u32::from(pm_timer_port).into();
    f.pm1_evt_len = PM1_EVT_LEN;
    f.pm1_cnt_len = PM1_CNT_LEN;
    f.pm_tmr_len = PM_TMR_LEN;
    f.x_pm1a_evt_blk = io_gas(PM1A_EVT_BLK, PM1_EVT_LEN, AccessSize::WordAccess);
    f.x_pm1a_cnt_blk = io_gas(PM1A_CNT_BLK, PM1_CNT_LEN, AccessSize::WordAccess);
    f.x_pm_tmr_blk = io_gas(pm_timer_port, PM_TMR_LEN, AccessSize::DwordAccess);
    f.p_lvl2_lat = C_STATE_NOT_SUPPORTED.into();
    f.p_lvl3_lat = C_STATE_NOT_SUPPORTED.into();
    f.iapc_boot_arch = (IAPC_LEGACY_DEVICES | IAPC_8042 | IAPC_VGA_NOT_PRESENT).into();
    f.reset_reg = io_gas(RESET_PORT, 1, AccessSize::ByteAccess);
    f.reset_value = RESET_VALUE;
    bytes_of(&f.finalize())
}

/// Hands out table addresses in the ACPI area.
struct Placer {
    next: u64,
}

impl Placer {
    fn place(&mut self, len: usize) -> u64 {
        let addr = self.next.next_multiple_of(TABLE_ALIGN);
        self.next = addr + len as u64;
        addr
    }
}

/// Writes the ACPI tables for `cpus` vCPUs into the BIOS area of `mem` (guest RAM of
/// `mem_size` bytes laid out by [`crate::layout`]) and returns the RSDP's address
/// ([`RSDP_ADDR`]), for [`crate::BootConfig::rsdp`]. The FADT points at the PM timer on
/// `pm_timer_port`: [`PM_TMR_BLK`] when the VMM provides it, the kernel's port otherwise.
pub fn create_acpi_tables<M: GuestMemory + ?Sized>(
    mem: &M,
    cpus: u32,
    mem_size: u64,
    pm_timer_port: u16,
) -> Result<u64, AcpiError> {
    if cpus == 0 || cpus > MAX_CPUS {
        return Err(AcpiError::CpuCount(cpus));
    }
    let (start, end) = (ACPI_START, ACPI_START + ACPI_SIZE);
    if !range_in_ram(mem_size, start, end) {
        return Err(AcpiError::AreaNotInRam {
            mem_size,
            start,
            end,
        });
    }

    let madt = madt(cpus);
    let dsdt = dsdt(pm_timer_port);

    let mut placer = Placer { next: RSDP_ADDR };
    let rsdp_addr = placer.place(Rsdp::len());
    let xsdt_addr = placer.place(36 + 2 * 8);
    let fadt_addr = placer.place(acpi_tables::fadt::FADT::len());
    let facs_addr = placer.place(FACS::len());
    let dsdt_addr = placer.place(dsdt.len());
    let madt_addr = placer.place(madt.len());
    if placer.next > end {
        return Err(AcpiError::TooLarge {
            needed: placer.next - start,
            available: ACPI_SIZE,
        });
    }

    let fadt = fadt(dsdt_addr, facs_addr, pm_timer_port);
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let xsdt = bytes_of(&xsdt);
    let rsdp = bytes_of(&Rsdp::new(OEM_ID, xsdt_addr));
    let facs = bytes_of(&FACS::new());

    for (table, addr, bytes) in [
        ("RSDP", rsdp_addr, &rsdp),
        ("XSDT", xsdt_addr, &xsdt),
        ("FADT", fadt_addr, &fadt),
        ("FACS", facs_addr, &facs),
        ("DSDT", dsdt_addr, &dsdt),
        ("MADT", madt_addr, &madt),
    ] {
        mem.write_slice(bytes, GuestAddress(addr))
            .map_err(|source| AcpiError::GuestMemory {
                table,
                addr,
                source,
            })?;
    }
    log::debug!(
        "ACPI tables for {cpus} vCPUs at [{start:#x}, {:#x}), RSDP at {rsdp_addr:#x}",
        placer.next
    );
    Ok(rsdp_addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{MIN_MEM_SIZE, MPTABLE_START};
    use crate::testutil::{guest_mem, MIB};
    use vm_memory::GuestMemoryMmap;

    fn read(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }
    fn u16_at(b: &[u8], off: usize) -> u16 {
        u16::from_le_bytes(b[off..off + 2].try_into().unwrap())
    }
    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }
    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, &x| a.wrapping_add(x))
    }

    /// A system description table read back: checks its length field and checksum.
    fn table(mem: &GuestMemoryMmap, addr: u64, sig: &[u8; 4]) -> Vec<u8> {
        let hdr = read(mem, addr, 36);
        assert_eq!(&hdr[0..4], sig, "signature at {addr:#x}");
        let len = u32_at(&hdr, 4) as usize;
        assert!(len >= 36);
        let t = read(mem, addr, len);
        assert_eq!(sum(&t), 0, "{} checksum", String::from_utf8_lossy(sig));
        assert_eq!(&t[10..16], &OEM_ID);
        assert_eq!(&t[16..24], &OEM_TABLE_ID);
        let (start, end) = (addr, addr + len as u64);
        assert!(
            start >= ACPI_START && end <= MPTABLE_START,
            "{sig:?} outside the area"
        );
        t
    }

    struct Tables {
        xsdt_entries: Vec<u64>,
        fadt: Vec<u8>,
        madt: Vec<u8>,
        dsdt: Vec<u8>,
        dsdt_addr: u64,
        facs: Vec<u8>,
        facs_addr: u64,
    }

    fn parse(mem: &GuestMemoryMmap, rsdp_addr: u64) -> Tables {
        assert_eq!(rsdp_addr, RSDP_ADDR);
        assert_eq!(rsdp_addr % 16, 0);
        let rsdp = read(mem, rsdp_addr, 36);
        assert_eq!(&rsdp[0..8], b"RSD PTR ");
        assert_eq!(sum(&rsdp[..20]), 0, "RSDP checksum");
        assert_eq!(sum(&rsdp), 0, "RSDP extended checksum");
        assert_eq!(rsdp[15], 2, "revision");
        assert_eq!(u32_at(&rsdp, 16), 0, "no RSDT");
        assert_eq!(u32_at(&rsdp, 20), 36, "length");
        let xsdt_addr = u64_at(&rsdp, 24);

        let xsdt = table(mem, xsdt_addr, b"XSDT");
        let xsdt_entries: Vec<u64> = xsdt[36..].chunks(8).map(|c| u64_at(c, 0)).collect();
        assert_eq!(xsdt_entries.len(), 2);
        let fadt = table(mem, xsdt_entries[0], b"FACP");
        let madt = table(mem, xsdt_entries[1], b"APIC");

        let dsdt_addr = u64_at(&fadt, 140);
        assert_eq!(u64::from(u32_at(&fadt, 40)), dsdt_addr, "DSDT == X_DSDT");
        let dsdt = table(mem, dsdt_addr, b"DSDT");
        let facs_addr = u64_at(&fadt, 132);
        assert_eq!(u64::from(u32_at(&fadt, 36)), facs_addr, "FIRMWARE_CTRL");
        assert_eq!(facs_addr % 64, 0, "FACS alignment");
        let facs = read(mem, facs_addr, 64);
        Tables {
            xsdt_entries,
            fadt,
            madt,
            dsdt,
            dsdt_addr,
            facs,
            facs_addr,
        }
    }

    fn build(cpus: u32) -> (GuestMemoryMmap, Tables) {
        let mem = guest_mem(128 * MIB);
        let rsdp = create_acpi_tables(&mem, cpus, 128 * MIB, PM_TMR_BLK).unwrap();
        let t = parse(&mem, rsdp);
        (mem, t)
    }

    /// `(type, bytes)` of every MADT structure.
    fn madt_entries(madt: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let mut out = Vec::new();
        let mut off = 44;
        while off < madt.len() {
            let (ty, len) = (madt[off], madt[off + 1] as usize);
            assert!(len >= 2 && off + len <= madt.len(), "entry at {off}");
            out.push((ty, madt[off..off + len].to_vec()));
            off += len;
        }
        assert_eq!(off, madt.len());
        out
    }

    #[test]
    fn madt_contents() {
        for cpus in [1, 2, 4, 64, MAX_CPUS] {
            let (_, t) = build(cpus);
            let m = &t.madt;
            assert_eq!(u32_at(m, 36), 0xfee0_0000, "local APIC address");
            assert_eq!(u32_at(m, 40), 1, "PCAT_COMPAT");
            let entries = madt_entries(m);
            let lapics: Vec<_> = entries.iter().filter(|e| e.0 == 0).collect();
            assert_eq!(lapics.len(), cpus as usize);
            for (i, (_, e)) in lapics.iter().enumerate() {
                assert_eq!(e.len(), 8);
                assert_eq!(e[2] as usize, i, "processor UID");
                assert_eq!(e[3] as usize, i, "APIC ID");
                assert_eq!(u32_at(e, 4), 1, "enabled");
            }
            let ioapics: Vec<_> = entries.iter().filter(|e| e.0 == 1).collect();
            assert_eq!(ioapics.len(), 1);
            let io = &ioapics[0].1;
            assert_eq!(io.len(), 12);
            assert_eq!(io[2], IOAPIC_ID);
            assert_eq!(u32_at(io, 4), 0xfec0_0000);
            assert_eq!(u32_at(io, 8), 0, "GSI base");

            let isos: Vec<_> = entries
                .iter()
                .filter(|e| e.0 == 2)
                .map(|(_, e)| (e.len(), e[2], e[3], u32_at(e, 4), u16_at(e, 8)))
                .collect();
            assert_eq!(isos, vec![(10, 0, 0, 2, 0x5), (10, 0, 9, 9, 0xd)]);
            let nmis: Vec<_> = entries.iter().filter(|e| e.0 == 4).collect();
            assert_eq!(nmis.len(), 1);
            assert_eq!(nmis[0].1, vec![4, 6, 0xff, 5, 0, 1]);
            assert_eq!(entries.len(), cpus as usize + 4);
        }
    }

    #[test]
    fn fadt_contents() {
        let (_, t) = build(2);
        let f = &t.fadt;
        assert_eq!(f.len(), 276);
        assert_eq!(f[8], 6, "major revision");
        assert_eq!(f[131], 5, "minor revision");
        assert_eq!(u16_at(f, 46), 9, "SCI_INT");
        assert_eq!(u32_at(f, 48), 0, "no SMI_CMD: always in ACPI mode");
        assert_eq!(u32_at(f, 56), 0x600, "PM1a_EVT_BLK");
        assert_eq!(u32_at(f, 60), 0, "PM1b_EVT_BLK");
        assert_eq!(u32_at(f, 64), 0x604, "PM1a_CNT_BLK");
        assert_eq!(u32_at(f, 76), 0x608, "PM_TMR_BLK");
        assert_eq!(u32_at(f, 80), 0, "no GPE0");
        assert_eq!((f[88], f[89], f[91], f[92]), (4, 2, 4, 0), "lengths");
        assert!(u16_at(f, 96) > 100 && u16_at(f, 98) > 1000, "no C2/C3");
        assert_eq!(u16_at(f, 109), 0x7, "IAPC_BOOT_ARCH");
        let flags = u32_at(f, 112);
        for bit in [0, 2, 5, 10] {
            assert_ne!(flags & (1 << bit), 0, "flag bit {bit}");
        }
        for bit in [4, 8, 20] {
            assert_eq!(flags & (1 << bit), 0, "flag bit {bit}");
        }
        // RESET_REG: system I/O, 8 bits, port 0x64; value 0xfe.
        assert_eq!(&f[116..120], &[1, 8, 0, 1]);
        assert_eq!(u64_at(f, 120), 0x64);
        assert_eq!(f[128], 0xfe);
        // X_ blocks: (space, width, offset, address).
        for (off, width, addr) in [(148, 32, 0x600), (172, 16, 0x604), (208, 32, 0x608)] {
            assert_eq!(
                (f[off], f[off + 1], f[off + 2]),
                (1, width, 0),
                "GAS at {off}"
            );
            assert_eq!(u64_at(f, off + 4), addr);
        }
        // PM1b, PM2, GPE0/1 and the sleep registers are absent.
        for off in [160, 184, 196, 220, 232, 244, 256] {
            assert!(f[off..off + 12].iter().all(|&b| b == 0), "GAS at {off}");
        }
        assert!(t.dsdt_addr > 0);
        assert_eq!(&t.facs[0..4], b"FACS");
        assert_eq!(u32_at(&t.facs, 4), 64);
        assert!(t.facs_addr >= ACPI_START);
    }

    #[test]
    fn dsdt_contents() {
        let (_, t) = build(1);
        let d = &t.dsdt;
        assert_eq!(d[8], 2, "revision 2: 64-bit integers");
        let find = |needle: &[u8]| d.windows(needle.len()).position(|w| w == needle);
        // Name(\_S5_, Package(4) {5, 5, 0, 0})
        let s5 = find(b"\x08\\_S5_\x12").expect("\\_S5_ package");
        assert_eq!(&d[s5 + 6..s5 + 15], &[0x12, 8, 4, 0x0a, 5, 0x0a, 5, 0, 0]);
        assert!(find(b"\\_SB_").is_some());
        // Device(COM1) with EISAID("PNP0501") = 0x0105d041 and IO 0x3f8/8, IRQ 4.
        assert!(find(b"\x5b\x82").is_some(), "DeviceOp");
        assert!(find(b"COM1").is_some());
        assert!(find(&[0x0c, 0x41, 0xd0, 0x05, 0x01]).is_some(), "PNP0501");
        assert!(
            find(&[0x47, 1, 0xf8, 3, 0xf8, 3, 0, 8]).is_some(),
            "IO 0x3f8"
        );
        assert!(find(&[0x89, 6, 0, 0x03, 1, 4, 0, 0, 0]).is_some(), "IRQ 4");
        // The PM block as motherboard resources.
        assert!(find(&[0x0c, 0x41, 0xd0, 0x0c, 0x02]).is_some(), "PNP0C02");
        assert!(find(&[0x47, 1, 0, 6, 0, 6, 1, 12]).is_some(), "IO 0x600");
    }

    /// With the PM timer in the kernel (bhyve's port 0x408) the FADT points there and the
    /// DSDT claims that port too; the PM1 blocks stay at 0x600.
    #[test]
    fn kernel_pm_timer_port() {
        let mem = guest_mem(128 * MIB);
        let rsdp = create_acpi_tables(&mem, 2, 128 * MIB, 0x408).unwrap();
        let t = parse(&mem, rsdp);
        let f = &t.fadt;
        assert_eq!(u32_at(f, 76), 0x408, "PM_TMR_BLK");
        assert_eq!(u64_at(f, 208 + 4), 0x408, "X_PM_TMR_BLK");
        assert_eq!(u32_at(f, 56), 0x600, "PM1a_EVT_BLK");
        let d = &t.dsdt;
        let has = |needle: &[u8]| d.windows(needle.len()).any(|w| w == needle);
        assert!(has(&[0x47, 1, 0x08, 4, 0x08, 4, 1, 4]), "IO 0x408/4");
        assert!(has(&[0x47, 1, 0, 6, 0, 6, 1, 12]), "IO 0x600");
        // The default layout claims no extra port.
        let (_, t) = build(1);
        let io_408 = [0x47, 1, 0x08, 4, 0x08, 4, 1, 4];
        assert!(!t.dsdt.windows(8).any(|w| w == io_408));
    }

    #[test]
    fn tables_do_not_overlap() {
        let (_, t) = build(MAX_CPUS);
        let mut ranges = vec![
            (RSDP_ADDR, 36u64),
            (t.xsdt_entries[0], t.fadt.len() as u64),
            (t.xsdt_entries[1], t.madt.len() as u64),
            (t.dsdt_addr, t.dsdt.len() as u64),
            (t.facs_addr, 64),
        ];
        ranges.sort();
        for w in ranges.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{ranges:x?}");
        }
        let last = ranges.last().unwrap();
        assert!(last.0 + last.1 <= ACPI_START + ACPI_SIZE);
    }

    #[test]
    fn rejects_bad_input() {
        let mem = guest_mem(MIN_MEM_SIZE);
        assert!(matches!(
            create_acpi_tables(&mem, 0, MIN_MEM_SIZE, PM_TMR_BLK),
            Err(AcpiError::CpuCount(0))
        ));
        assert!(matches!(
            create_acpi_tables(&mem, MAX_CPUS + 1, MIN_MEM_SIZE, PM_TMR_BLK),
            Err(AcpiError::CpuCount(255))
        ));
        assert!(matches!(
            create_acpi_tables(&mem, 1, 0x9_fc00, PM_TMR_BLK),
            Err(AcpiError::AreaNotInRam { .. })
        ));
        // RAM that does not reach the area: the write fails rather than panicking.
        let small = guest_mem(0xe_0000);
        let err = create_acpi_tables(&small, 1, MIN_MEM_SIZE, PM_TMR_BLK).unwrap_err();
        assert!(matches!(err, AcpiError::GuestMemory { .. }), "{err}");
        assert_eq!(
            create_acpi_tables(&mem, 1, MIN_MEM_SIZE, PM_TMR_BLK).unwrap(),
            RSDP_ADDR
        );
    }
}
