//! ACPI tables for x86-64 guests: RSDP, XSDT, FADT (with FACS), MADT, MCFG and DSDT.
//!
//! The tables live in the reserved BIOS area at [`ACPI_START`] (`[0xe0000, 0xf0000)`):
//!
//! | table | placement | contents |
//! | --- | --- | --- |
//! | RSDP | 0xe0000 (36 bytes, revision 2) | XSDT address, both checksums |
//! | XSDT | next 64-byte boundary | FADT, MADT, MCFG |
//! | FADT | next 64-byte boundary (276 bytes, revision 6.5) | FACS, DSDT, fixed hardware ports |
//! | FACS | next 64-byte boundary (64 bytes) | global lock, waking vector (both unused) |
//! | DSDT | next 64-byte boundary | `\_S3_`, `\_S5_`, COM1, ACPI PM I/O resources, PCI root bridge |
//! | MADT | next 64-byte boundary | local APICs, IOAPIC, overrides, LINT1 NMI |
//! | MCFG | next 64-byte boundary | ECAM of PCI segment 0, bus 0 |
//!
//! [`AcpiTables`] builds every table; only the FADT, XSDT and RSDP hold addresses, and they
//! are made from the addresses the caller chose. [`create_acpi_tables`] places them in the
//! BIOS area for a direct boot; a firmware table loader (fw_cfg) can take the same tables
//! and patch the pointers itself.
//!
//! The PCI platform as `\_SB.PCI0` (PNP0A08, compatible PNP0A03) describes it: bus 0 only,
//! configuration ports 0xcf8-0xcff, I/O windows `[0, 0xcf8)` and `[0xd00, 0x10000)`,
//! memory windows [`PCI_MMIO32_START`] (below ECAM) and the 64-bit window above RAM
//! ([`pci_mmio64_start`]), and a `_PRT` naming for each slot 1-31 and pin the GSI
//! `16 + (slot + pin) % 4` directly (no link devices: level, active low as `_PRT` GSIs
//! are). ECAM is claimed as a motherboard resource too, for OSes that check MCFG
//! against those.
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
    pci_mmio64_start, range_in_ram, ACPI_SIZE, ACPI_START, IOAPIC_ID, IOAPIC_START, LAPIC_START,
    MAX_CPUS, PCI_CONFIG_PORT, PCI_CONFIG_PORTS, PCI_ECAM_SIZE, PCI_ECAM_START, PCI_MMIO32_SIZE,
    PCI_MMIO32_START, PCI_MMIO64_SIZE, RSDP_ADDR,
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
/// SLP_TYP value of the `\_S3_` (suspend to RAM) package.
pub const S3_SLP_TYP: u8 = 1;
/// Reset register: the i8042 command port.
pub const RESET_PORT: u16 = 0x64;
/// Value written to [`RESET_PORT`] to reset (pulse the CPU reset line).
pub const RESET_VALUE: u8 = 0xfe;
/// COM1 as described in the DSDT.
pub const COM1_PORT: u16 = 0x3f8;
/// COM1's ISA IRQ.
pub const COM1_IRQ: u8 = 4;

/// PCI INTx: slots 1-31 (0 is the host bridge) and pins INTA-INTD reach GSI
/// `PCI_INTX_GSI_BASE + (slot + pin) % 4` (the `pci` crate wires them so).
pub const PCI_INTX_GSI_BASE: u32 = 16;
const PCI_SLOTS: u32 = 32;

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

/// AML already serialized, to nest inside another object.
struct RawAml(Vec<u8>);

impl Aml for RawAml {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        sink.vec(&self.0);
    }
}

/// `_PRT` of the root bridge: for every slot 1-31 and pin, the GSI it reaches.
fn pci_routing_table() -> aml::PackageBuilder {
    let mut prt = aml::PackageBuilder::new();
    for slot in 1..PCI_SLOTS {
        for pin in 0..4u32 {
            // Address: device in the high word, any function (0xffff).
            let address = (slot << 16) | 0xffff;
            let gsi = PCI_INTX_GSI_BASE + (slot + pin) % 4;
            let pin = pin as u8;
            prt.add_element(&aml::Package::new(vec![&address, &pin, &aml::ZERO, &gsi]));
        }
    }
    prt
}

/// `\_SB.PCI0`, the host bridge of bus 0, for `mem_size` bytes of RAM.
fn pci_root_bridge(mem_size: u64, mmio32_end: u64) -> RawAml {
    let hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0A08"));
    let cid = aml::Name::new("_CID".into(), &aml::EISAName::new("PNP0A03"));
    let seg = aml::Name::new("_SEG".into(), &aml::ZERO);
    let bbn = aml::Name::new("_BBN".into(), &aml::ZERO);
    let uid = aml::Name::new("_UID".into(), &aml::ZERO);
    let bus = aml::AddressSpace::new_bus_number(0u16, 0u16);
    let config_port = PCI_CONFIG_PORT as u16;
    let config = aml::IO::new(config_port, config_port, 1, PCI_CONFIG_PORTS as u8);
    let io_low = aml::AddressSpace::new_io(0u16, config_port - 1, None);
    let io_high = aml::AddressSpace::new_io(0x0d00u16, 0xffffu16, None);
    let mmio32 = aml::AddressSpace::new_memory(
        aml::AddressSpaceCacheable::NotCacheable,
        true,
        PCI_MMIO32_START as u32,
        (PCI_MMIO32_START + PCI_MMIO32_SIZE - 1) as u32,
        None,
    );
    // Firmware machines decode BARs above ECAM too, up to the IOAPIC.
    let ecam_end = PCI_ECAM_START + PCI_ECAM_SIZE;
    let above_ecam = aml::AddressSpace::new_memory(
        aml::AddressSpaceCacheable::NotCacheable,
        true,
        ecam_end as u32,
        mmio32_end.saturating_sub(1) as u32,
        None,
    );
    let high = pci_mmio64_start(mem_size);
    let mmio64 = aml::AddressSpace::new_memory(
        aml::AddressSpaceCacheable::Cacheable,
        true,
        high,
        high + (PCI_MMIO64_SIZE - 1),
        None,
    );
    let mut windows: Vec<&dyn Aml> = vec![&bus, &config, &io_low, &io_high, &mmio32];
    if mmio32_end > ecam_end {
        windows.push(&above_ecam);
    }
    windows.push(&mmio64);
    let crs = aml::Name::new("_CRS".into(), &aml::ResourceTemplate::new(windows));
    let prt = aml::Name::new("_PRT".into(), &pci_routing_table());
    let pci0 = aml::Device::new(
        "PCI0".into(),
        vec![&hid, &cid, &seg, &bbn, &uid, &crs, &prt],
    );
    RawAml(bytes_of(&pci0))
}

/// A motherboard-resources device claiming the ECAM window (Linux checks MCFG against
/// these as well as against the e820 map).
fn ecam_reservation() -> RawAml {
    let hid = aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C02"));
    let uid = aml::Name::new("_UID".into(), &2u8);
    let ecam = aml::Memory32Fixed::new(true, PCI_ECAM_START as u32, PCI_ECAM_SIZE as u32);
    let crs = aml::Name::new("_CRS".into(), &aml::ResourceTemplate::new(vec![&ecam]));
    RawAml(bytes_of(&aml::Device::new(
        "MRES".into(),
        vec![&hid, &uid, &crs],
    )))
}

/// The DSDT: `\_S3_`, `\_S5_` and, under `\_SB_`, COM1, the ACPI PM I/O ports (with the PM timer
/// wherever it is) as motherboard resources, the PCI root bridge and the ECAM reservation.
fn dsdt(pm_timer_port: u16, mem_size: u64, mmio32_end: u64) -> Vec<u8> {
    let s3 = aml::Name::new(
        "\\_S3_".into(),
        &aml::Package::new(vec![&S3_SLP_TYP, &S3_SLP_TYP, &aml::ZERO, &aml::ZERO]),
    );
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

    let pci0 = pci_root_bridge(mem_size, mmio32_end);
    let ecam = ecam_reservation();
    let sb = aml::Scope::new("\\_SB_".into(), vec![&com1, &pm, &pci0, &ecam]);

    let mut dsdt = Sdt::new(*b"DSDT", 36, 2, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    let mut body = Vec::new();
    s3.to_aml_bytes(&mut body);
    s5.to_aml_bytes(&mut body);
    sb.to_aml_bytes(&mut body);
    dsdt.append_slice(&body);
    dsdt.as_slice().to_vec()
}

/// The MCFG: ECAM of PCI segment 0, buses 0-0.
fn mcfg() -> Vec<u8> {
    let mut mcfg = acpi_tables::mcfg::MCFG::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    mcfg.add_ecam(PCI_ECAM_START, 0, 0, 0);
    bytes_of(&mcfg)
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

/// Every ACPI table of the machine. The DSDT, FACS, MADT and MCFG hold no addresses and
/// are built once; the FADT, XSDT and RSDP are made for the addresses the caller picked.
#[derive(Clone, Debug)]
pub struct AcpiTables {
    pub dsdt: Vec<u8>,
    pub facs: Vec<u8>,
    pub madt: Vec<u8>,
    pub mcfg: Vec<u8>,
    pm_timer_port: u16,
}

/// A table and the guest-physical address it was placed at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacedTable {
    /// "RSDP", "XSDT", ...
    pub name: &'static str,
    pub addr: u64,
    pub bytes: Vec<u8>,
}

impl AcpiTables {
    /// The tables for `cpus` vCPUs and `mem_size` bytes of RAM (which places the 64-bit
    /// PCI window). The FADT points at the PM timer on `pm_timer_port`: [`PM_TMR_BLK`]
    /// when the VMM provides it, the kernel's port otherwise.
    pub fn new(cpus: u32, mem_size: u64, pm_timer_port: u16) -> Result<Self, AcpiError> {
        Self::with_mmio32_end(
            cpus,
            mem_size,
            pm_timer_port,
            PCI_MMIO32_START + PCI_MMIO32_SIZE,
        )
    }

    /// Like [`AcpiTables::new`], for a machine whose 32-bit BAR window runs on past ECAM
    /// up to `mmio32_end` (a firmware machine: BIOS firmware places BARs below the IOAPIC):
    /// the root bridge gets a second 32-bit window from the end of ECAM.
    pub fn with_mmio32_end(
        cpus: u32,
        mem_size: u64,
        pm_timer_port: u16,
        mmio32_end: u64,
    ) -> Result<Self, AcpiError> {
        if cpus == 0 || cpus > MAX_CPUS {
            return Err(AcpiError::CpuCount(cpus));
        }
        Ok(AcpiTables {
            dsdt: dsdt(pm_timer_port, mem_size, mmio32_end),
            facs: bytes_of(&FACS::new()),
            madt: madt(cpus),
            mcfg: mcfg(),
            pm_timer_port,
        })
    }

    /// The FADT, pointing at the DSDT and FACS placed at these addresses.
    pub fn fadt(&self, dsdt_addr: u64, facs_addr: u64) -> Vec<u8> {
        fadt(dsdt_addr, facs_addr, self.pm_timer_port)
    }

    /// The XSDT listing the FADT, MADT and MCFG placed at these addresses.
    pub fn xsdt(fadt_addr: u64, madt_addr: u64, mcfg_addr: u64) -> Vec<u8> {
        let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
        for addr in [fadt_addr, madt_addr, mcfg_addr] {
            xsdt.add_entry(addr);
        }
        bytes_of(&xsdt)
    }

    /// The RSDP (revision 2) pointing at the XSDT.
    pub fn rsdp(xsdt_addr: u64) -> Vec<u8> {
        bytes_of(&Rsdp::new(OEM_ID, xsdt_addr))
    }

    /// Lays the tables out in the BIOS area from [`RSDP_ADDR`], RSDP first, each on a
    /// 64-byte boundary; fails if they outgrow the area.
    pub fn place_in_bios_area(&self) -> Result<Vec<PlacedTable>, AcpiError> {
        let mut placer = Placer { next: RSDP_ADDR };
        let rsdp = placer.place(Rsdp::len());
        let xsdt = placer.place(36 + 3 * 8);
        let fadt = placer.place(acpi_tables::fadt::FADT::len());
        let facs = placer.place(self.facs.len());
        let dsdt = placer.place(self.dsdt.len());
        let madt = placer.place(self.madt.len());
        let mcfg = placer.place(self.mcfg.len());
        let end = ACPI_START + ACPI_SIZE;
        if placer.next > end {
            return Err(AcpiError::TooLarge {
                needed: placer.next - ACPI_START,
                available: ACPI_SIZE,
            });
        }
        let table = |name, addr, bytes| PlacedTable { name, addr, bytes };
        Ok(vec![
            table("RSDP", rsdp, Self::rsdp(xsdt)),
            table("XSDT", xsdt, Self::xsdt(fadt, madt, mcfg)),
            table("FADT", fadt, self.fadt(dsdt, facs)),
            table("FACS", facs, self.facs.clone()),
            table("DSDT", dsdt, self.dsdt.clone()),
            table("MADT", madt, self.madt.clone()),
            table("MCFG", mcfg, self.mcfg.clone()),
        ])
    }
}

/// Writes the ACPI tables for `cpus` vCPUs into the BIOS area of `mem` (guest RAM of
/// `mem_size` bytes laid out by [`crate::layout`]) and returns the RSDP's address
/// ([`RSDP_ADDR`]), for [`crate::BootConfig::rsdp`]. See [`AcpiTables::new`] for
/// `pm_timer_port`.
pub fn create_acpi_tables<M: GuestMemory + ?Sized>(
    mem: &M,
    cpus: u32,
    mem_size: u64,
    pm_timer_port: u16,
) -> Result<u64, AcpiError> {
    let tables = AcpiTables::new(cpus, mem_size, pm_timer_port)?;
    let (start, end) = (ACPI_START, ACPI_START + ACPI_SIZE);
    if !range_in_ram(mem_size, start, end) {
        return Err(AcpiError::AreaNotInRam {
            mem_size,
            start,
            end,
        });
    }
    let placed = tables.place_in_bios_area()?;
    for t in &placed {
        mem.write_slice(&t.bytes, GuestAddress(t.addr))
            .map_err(|source| AcpiError::GuestMemory {
                table: t.name,
                addr: t.addr,
                source,
            })?;
    }
    log::debug!("ACPI tables for {cpus} vCPUs in [{start:#x}, {end:#x}), RSDP at {RSDP_ADDR:#x}");
    Ok(RSDP_ADDR)
}

/// Where the OS asked the platform to resume from S3: the FACS waking vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakingVector {
    /// `Firmware_Waking_Vector`: real mode, CS = vector >> 4, IP = vector & 0xf.
    RealMode(u32),
    /// `X_Firmware_Waking_Vector` with 64BIT_WAKE_F clear: 32-bit flat protected mode,
    /// paging off, EIP = the vector.
    Protected32(u32),
}

/// Why no waking vector could be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WakingVectorError {
    #[error("the ACPI tables cannot be followed to the FACS: {0}")]
    Tables(&'static str),
    #[error("the OS set no waking vector in the FACS at {0:#x}")]
    NotSet(u64),
    #[error("the OS asked for a 64-bit waking vector ({0:#x}), which the FACS does not offer")]
    SixtyFourBit(u64),
    #[error("the 32-bit protected-mode waking vector {0:#x} is beyond 4 GiB")]
    Beyond4G(u64),
}

/// Reads the waking vector the OS wrote into the FACS that the tables from [`RSDP_ADDR`]
/// point at (RSDP → XSDT → FADT → X_FIRMWARE_CTRL): what the platform jumps to on resume
/// from S3. A non-zero `X_Firmware_Waking_Vector` takes precedence, as ACPI says.
pub fn read_waking_vector<M: GuestMemory + ?Sized>(
    mem: &M,
) -> Result<WakingVector, WakingVectorError> {
    let facs = find_facs(mem)?;
    let vector = read_u32(mem, facs + 12).ok_or(WakingVectorError::Tables("FACS unreadable"))?;
    let x_vector = read_u64(mem, facs + 24).ok_or(WakingVectorError::Tables("FACS unreadable"))?;
    let ospm_flags =
        read_u32(mem, facs + 36).ok_or(WakingVectorError::Tables("FACS unreadable"))?;
    if x_vector != 0 {
        if ospm_flags & 1 != 0 {
            return Err(WakingVectorError::SixtyFourBit(x_vector));
        }
        let eip = u32::try_from(x_vector).map_err(|_| WakingVectorError::Beyond4G(x_vector))?;
        return Ok(WakingVector::Protected32(eip));
    }
    if vector == 0 {
        return Err(WakingVectorError::NotSet(facs));
    }
    Ok(WakingVector::RealMode(vector))
}

fn find_facs<M: GuestMemory + ?Sized>(mem: &M) -> Result<u64, WakingVectorError> {
    let bad = WakingVectorError::Tables;
    let mut sig = [0u8; 8];
    mem.read_slice(&mut sig, GuestAddress(RSDP_ADDR))
        .map_err(|_| bad("RSDP unreadable"))?;
    if &sig != b"RSD PTR " {
        return Err(bad("no RSDP"));
    }
    let xsdt = read_u64(mem, RSDP_ADDR + 24).ok_or(bad("RSDP unreadable"))?;
    let xsdt_len = read_u32(mem, xsdt + 4).ok_or(bad("XSDT unreadable"))?;
    // Bounded by the table's own length, at most a page of entries.
    let entries = (u64::from(xsdt_len).saturating_sub(36) / 8).min(512);
    for i in 0..entries {
        let table = read_u64(mem, xsdt + 36 + 8 * i).ok_or(bad("XSDT unreadable"))?;
        if read_u32(mem, table) != Some(u32::from_le_bytes(*b"FACP")) {
            continue;
        }
        let fadt_len = read_u32(mem, table + 4).ok_or(bad("FADT unreadable"))?;
        // X_FIRMWARE_CTRL (offset 132) exists only in a FADT of revision 2 and later.
        let x_facs = match fadt_len {
            140.. => read_u64(mem, table + 132).ok_or(bad("FADT unreadable"))?,
            _ => 0,
        };
        let facs = match x_facs {
            0 => u64::from(read_u32(mem, table + 36).ok_or(bad("FADT unreadable"))?),
            x => x,
        };
        return match read_u32(mem, facs) {
            Some(s) if s == u32::from_le_bytes(*b"FACS") => Ok(facs),
            _ => Err(bad("no FACS where the FADT points")),
        };
    }
    Err(bad("no FADT in the XSDT"))
}

fn read_u32<M: GuestMemory + ?Sized>(mem: &M, addr: u64) -> Option<u32> {
    let mut b = [0u8; 4];
    mem.read_slice(&mut b, GuestAddress(addr)).ok()?;
    Some(u32::from_le_bytes(b))
}

fn read_u64<M: GuestMemory + ?Sized>(mem: &M, addr: u64) -> Option<u64> {
    let mut b = [0u8; 8];
    mem.read_slice(&mut b, GuestAddress(addr)).ok()?;
    Some(u64::from_le_bytes(b))
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
        mcfg: Vec<u8>,
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
        assert_eq!(xsdt_entries.len(), 3);
        let fadt = table(mem, xsdt_entries[0], b"FACP");
        let madt = table(mem, xsdt_entries[1], b"APIC");
        let mcfg = table(mem, xsdt_entries[2], b"MCFG");

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
            mcfg,
            dsdt,
            dsdt_addr,
            facs,
            facs_addr,
        }
    }

    fn build(cpus: u32) -> (GuestMemoryMmap, Tables) {
        build_with_ram(cpus, 128 * MIB)
    }

    /// Tables for `mem_size` bytes of RAM (guest memory holds only the first 128 MiB: the
    /// tables live below 1 MiB).
    fn build_with_ram(cpus: u32, mem_size: u64) -> (GuestMemoryMmap, Tables) {
        let mem = guest_mem(128 * MIB);
        let rsdp = create_acpi_tables(&mem, cpus, mem_size, PM_TMR_BLK).unwrap();
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
    fn waking_vector_follows_the_tables_to_the_facs() {
        let (mem, t) = build(2);
        let facs = t.facs_addr;
        assert_eq!(
            read_waking_vector(&mem),
            Err(WakingVectorError::NotSet(facs))
        );
        mem.write_obj(0x3_0000u32, GuestAddress(facs + 12)).unwrap();
        assert_eq!(
            read_waking_vector(&mem),
            Ok(WakingVector::RealMode(0x3_0000))
        );
        mem.write_obj(0x10_0000u64, GuestAddress(facs + 24))
            .unwrap();
        assert_eq!(
            read_waking_vector(&mem),
            Ok(WakingVector::Protected32(0x10_0000))
        );
        mem.write_obj(1u32, GuestAddress(facs + 36)).unwrap();
        assert_eq!(
            read_waking_vector(&mem),
            Err(WakingVectorError::SixtyFourBit(0x10_0000))
        );
        mem.write_obj(0u32, GuestAddress(RSDP_ADDR)).unwrap();
        assert!(matches!(
            read_waking_vector(&mem),
            Err(WakingVectorError::Tables(_))
        ));
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
        // Name(\_S3_, Package(4) {1, 1, 0, 0})
        let s3 = find(b"\x08\\_S3_\x12").expect("\\_S3_ package");
        assert_eq!(&d[s3 + 6..s3 + 13], &[0x12, 6, 4, 1, 1, 0, 0]);
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
    fn mcfg_contents() {
        let (_, t) = build(1);
        let m = &t.mcfg;
        assert_eq!(m.len(), 36 + 8 + 16, "one allocation entry");
        assert_eq!(m[8], 1, "revision");
        assert_eq!(u64_at(m, 36), 0, "reserved");
        assert_eq!(u64_at(m, 44), 0xe000_0000, "ECAM base");
        assert_eq!(u16_at(m, 52), 0, "segment");
        assert_eq!((m[54], m[55]), (0, 0), "buses 0-0");
        assert_eq!(u32_at(m, 56), 0, "reserved");
    }

    /// A PkgLength at `b[0..]`: (length, bytes it took).
    fn pkg_length(b: &[u8]) -> (usize, usize) {
        let follow = usize::from(b[0] >> 6);
        if follow == 0 {
            return (usize::from(b[0] & 0x3f), 1);
        }
        let mut len = usize::from(b[0] & 0x0f);
        for i in 0..follow {
            len |= usize::from(b[1 + i]) << (4 + 8 * i);
        }
        (len, 1 + follow)
    }

    /// An integer term at `b[0..]`: (value, bytes it took).
    fn integer(b: &[u8]) -> (u64, usize) {
        match b[0] {
            0x00 => (0, 1),
            0x01 => (1, 1),
            0x0a => (u64::from(b[1]), 2),
            0x0b => (u64::from(u16_at(b, 1)), 3),
            0x0c => (u64::from(u32_at(b, 1)), 5),
            0x0e => (u64_at(b, 1), 9),
            op => panic!("not an integer: {op:#x}"),
        }
    }

    /// The object `Name(path, ...)` names, after `from` in the DSDT.
    fn named<'a>(d: &'a [u8], from: usize, path: &[u8; 4]) -> &'a [u8] {
        let mut needle = vec![0x08];
        needle.extend_from_slice(path);
        let at = d[from..]
            .windows(5)
            .position(|w| w == needle.as_slice())
            .unwrap_or_else(|| panic!("Name {}", String::from_utf8_lossy(path)));
        &d[from + at + 5..]
    }

    /// Resource descriptors of the buffer `Name(_CRS, ResourceTemplate {...})` starts with:
    /// (tag, body) with the tag of large descriptors as 0x80 | type.
    fn resources(obj: &[u8]) -> Vec<(u8, Vec<u8>)> {
        assert_eq!(obj[0], 0x11, "BufferOp");
        let (_, n) = pkg_length(&obj[1..]);
        let (size, m) = integer(&obj[1 + n..]);
        let mut b = &obj[1 + n + m..1 + n + m + size as usize];
        let mut out = Vec::new();
        loop {
            let (tag, body_at, len) = if b[0] & 0x80 != 0 {
                (b[0], 3, usize::from(u16_at(b, 1)))
            } else {
                (b[0] >> 3, 1, usize::from(b[0] & 7))
            };
            if tag == 0x0f {
                return out; // end tag
            }
            out.push((tag, b[body_at..body_at + len].to_vec()));
            b = &b[body_at + len..];
        }
    }

    /// A package of integer packages: `Name(_PRT, Package {Package {a, b, c, d}, ...})`.
    fn integer_packages(obj: &[u8]) -> Vec<Vec<u64>> {
        assert_eq!(obj[0], 0x12, "PackageOp");
        let (_, n) = pkg_length(&obj[1..]);
        let count = usize::from(obj[1 + n]);
        let mut at = 2 + n;
        let mut out = Vec::new();
        for _ in 0..count {
            assert_eq!(obj[at], 0x12, "inner PackageOp");
            let (len, n) = pkg_length(&obj[at + 1..]);
            let elements = usize::from(obj[at + 1 + n]);
            let mut p = at + 2 + n;
            let mut values = Vec::new();
            for _ in 0..elements {
                let (v, used) = integer(&obj[p..]);
                values.push(v);
                p += used;
            }
            assert_eq!(p, at + 1 + len, "package length");
            out.push(values);
            at = p;
        }
        out
    }

    /// Address-space descriptor bodies: (resource type, min, max, length).
    fn address_space(tag: u8, body: &[u8]) -> (u8, u64, u64, u64) {
        match tag {
            0x88 => {
                let w = |i: usize| u64::from(u16_at(body, 3 + 2 * i));
                (body[0], w(1), w(2), w(4))
            }
            0x87 => {
                let d = |i: usize| u64::from(u32_at(body, 3 + 4 * i));
                (body[0], d(1), d(2), d(4))
            }
            0x8a => {
                let q = |i: usize| u64_at(body, 3 + 8 * i);
                (body[0], q(1), q(2), q(4))
            }
            _ => panic!("not an address space descriptor: {tag:#x}"),
        }
    }

    #[test]
    fn dsdt_pci_root_bridge() {
        for (mem_size, high) in [
            (128 * MIB, 4u64 << 30),
            (5 << 30, 6 << 30),
            (6 << 30, 7 << 30),
        ] {
            let (_, t) = build_with_ram(1, mem_size);
            let d = &t.dsdt;
            let pci0 = d.windows(4).position(|w| w == b"PCI0").expect("PCI0");
            assert_eq!(&d[pci0 - 4..pci0 - 2], &[0x5b, 0x82], "DeviceOp");
            let eisa = |id: &[u8]| [0x0c, id[0], id[1], id[2], id[3]];
            assert_eq!(
                named(d, pci0, b"_HID")[..5],
                eisa(&[0x41, 0xd0, 0x0a, 0x08])
            );
            assert_eq!(
                named(d, pci0, b"_CID")[..5],
                eisa(&[0x41, 0xd0, 0x0a, 0x03])
            );
            for name in [b"_SEG", b"_BBN", b"_UID"] {
                assert_eq!(named(d, pci0, name)[0], 0, "{name:?} = Zero");
            }
            let crs = resources(named(d, pci0, b"_CRS"));
            let spaces: Vec<_> = crs
                .iter()
                .filter(|(tag, _)| tag & 0x80 != 0)
                .map(|(tag, body)| address_space(*tag, body))
                .collect();
            assert_eq!(
                spaces,
                vec![
                    (2, 0, 0, 1),
                    (1, 0, 0xcf7, 0xcf8),
                    (1, 0xd00, 0xffff, 0xf300),
                    (0, 0xc000_0000, 0xdfff_ffff, 0x2000_0000),
                    (0, high, high + (64 << 30) - 1, 64 << 30),
                ],
                "RAM {mem_size:#x}"
            );
            // Producer windows; the config ports as an I/O descriptor.
            for (tag, body) in &crs {
                if tag & 0x80 != 0 {
                    assert_eq!(body[1] & 1, 0, "ResourceProducer");
                }
            }
            assert!(crs.contains(&(0x08, vec![1, 0xf8, 0x0c, 0xf8, 0x0c, 1, 8])));

            let prt = integer_packages(named(d, pci0, b"_PRT"));
            assert_eq!(prt.len(), 31 * 4);
            for (i, entry) in prt.iter().enumerate() {
                let (slot, pin) = (i as u64 / 4 + 1, i as u64 % 4);
                assert_eq!(
                    entry,
                    &vec![slot << 16 | 0xffff, pin, 0, 16 + (slot + pin) % 4]
                );
            }
        }
    }

    #[test]
    fn dsdt_reserves_ecam() {
        let (_, t) = build(1);
        let d = &t.dsdt;
        let mres = d.windows(4).position(|w| w == b"MRES").expect("MRES");
        assert_eq!(named(d, mres, b"_HID")[..5], [0x0c, 0x41, 0xd0, 0x0c, 0x02]);
        assert_eq!(
            named(d, mres, b"_UID")[..2],
            [0x0a, 2],
            "distinct from PMIO's"
        );
        let crs = resources(named(d, mres, b"_CRS"));
        let mut fixed = vec![1];
        fixed.extend_from_slice(&0xe000_0000u32.to_le_bytes());
        fixed.extend_from_slice(&0x10_0000u32.to_le_bytes());
        assert_eq!(crs, vec![(0x86, fixed)]);
    }

    /// The tables a firmware loader would take are the ones the direct boot writes.
    #[test]
    fn placed_tables_match_the_builder() {
        let tables = AcpiTables::new(2, 128 * MIB, PM_TMR_BLK).unwrap();
        let placed = tables.place_in_bios_area().unwrap();
        let names: Vec<_> = placed.iter().map(|t| t.name).collect();
        assert_eq!(
            names,
            ["RSDP", "XSDT", "FADT", "FACS", "DSDT", "MADT", "MCFG"]
        );
        let (mem, t) = build(2);
        for p in &placed {
            assert_eq!(read(&mem, p.addr, p.bytes.len()), p.bytes, "{}", p.name);
        }
        assert_eq!(t.dsdt, tables.dsdt);
        assert_eq!(t.mcfg, tables.mcfg);
        assert_eq!(
            AcpiTables::xsdt(1, 2, 3)[36..],
            [1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn tables_do_not_overlap() {
        let (_, t) = build(MAX_CPUS);
        let mut ranges = vec![
            (RSDP_ADDR, 36u64),
            (t.xsdt_entries[0], t.fadt.len() as u64),
            (t.xsdt_entries[1], t.madt.len() as u64),
            (t.xsdt_entries[2], t.mcfg.len() as u64),
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

    #[test]
    fn firmware_window_above_ecam() {
        let plain = AcpiTables::new(1, 256 * MIB, PM_TMR_BLK).unwrap();
        let fw = AcpiTables::with_mmio32_end(1, 256 * MIB, PM_TMR_BLK, 0xfec0_0000).unwrap();
        // DWordMemory: tag 0x87; minimum and maximum at bytes 10 and 14 of the descriptor.
        let window = |dsdt: &[u8], min: u32, max: u32| {
            dsdt.windows(18).any(|w| {
                w[0] == 0x87
                    && u32::from_le_bytes(w[10..14].try_into().unwrap()) == min
                    && u32::from_le_bytes(w[14..18].try_into().unwrap()) == max
            })
        };
        assert!(window(&plain.dsdt, 0xc000_0000, 0xdfff_ffff));
        assert!(!window(&plain.dsdt, 0xe010_0000, 0xfebf_ffff));
        assert!(window(&fw.dsdt, 0xc000_0000, 0xdfff_ffff));
        assert!(window(&fw.dsdt, 0xe010_0000, 0xfebf_ffff));
        assert_eq!(fw.madt, plain.madt);
    }
}
