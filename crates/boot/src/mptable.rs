//! The Intel MultiProcessor Specification 1.4 table, for guests that look for processors and
//! interrupt routing there rather than in ACPI (older kernels, `acpi=off`, small OSes).
//!
//! Placed in the reserved BIOS area at [`MPTABLE_START`] (0xf0000), where OSes scan for the
//! floating pointer structure:
//!
//! - 0xf0000: floating pointer structure (`_MP_`, 16 bytes, spec revision 1.4, no default
//!   configuration, virtual-wire mode);
//! - 0xf0010: configuration table (`PCMP`), its entries in the order the spec requires:
//!   one processor per vCPU (local APIC ID = index, enabled, BSP = 0), bus 0 `ISA   `, the
//!   IOAPIC (ID [`IOAPIC_ID`], at [`IOAPIC_START`]), I/O interrupt assignments of ISA
//!   IRQs 0-15 (IRQ 0 on pin 2, IRQ 2 absent, the others on their own pin; IRQ 9, the ACPI
//!   SCI, level-triggered active high as in the MADT, the rest conforming to ISA), and local
//!   interrupts ExtINT on LINT0 and NMI on LINT1 of every local APIC.
//!
//! The MADT of [`crate::acpi`] describes the same machine.

use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryError};

use crate::layout::{IOAPIC_ID, IOAPIC_START, LAPIC_START, MAX_CPUS, MPTABLE_SIZE, MPTABLE_START};

/// Address of the floating pointer structure.
pub const MPF_ADDR: u64 = MPTABLE_START;
/// Address of the configuration table (right after the floating pointer).
pub const MPC_ADDR: u64 = MPF_ADDR + MPF_LEN as u64;

const MPF_LEN: usize = 16;
const MPC_HEADER_LEN: usize = 44;
const SPEC_REV_1_4: u8 = 4;
const OEM_ID: [u8; 8] = *b"FERROVM ";
const PRODUCT_ID: [u8; 12] = *b"FERROVM     ";

// Entry types and sizes.
const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;
const PROCESSOR_LEN: usize = 20;
const OTHER_ENTRY_LEN: usize = 8;

/// Local APIC version reported for each processor (an integrated xAPIC).
const LAPIC_VERSION: u8 = 0x14;
/// IOAPIC version (82093AA-compatible, what KVM's IOAPIC reports).
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1 << 0;
const CPU_BSP: u8 = 1 << 1;
/// CPU signature: family 6, model 0, stepping 0.
const CPU_SIGNATURE: u32 = 6 << 8;
/// CPUID.1:EDX feature flags: FPU and APIC.
const CPU_FEATURES: u32 = (1 << 0) | (1 << 9);
const IOAPIC_ENABLED: u8 = 1;
const ISA_BUS_ID: u8 = 0;

// Interrupt types.
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
/// Polarity and trigger conforming to the bus (ISA: edge, active high).
const INT_FLAGS_CONFORMING: u16 = 0;
/// Active high (bits 1:0 = 01), level triggered (bits 3:2 = 11).
const INT_FLAGS_LEVEL_HIGH: u16 = 0b1101;
/// ISA IRQ of the ACPI SCI (level, active high in the MADT too).
const SCI_IRQ: u8 = 9;
/// Destination local APIC ID meaning "all local APICs".
const ALL_LAPICS: u8 = 0xff;

/// Why the MP table could not be written.
#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    /// The MP table describes between 1 and [`MAX_CPUS`] processors.
    #[error("the MP table describes 1 to {MAX_CPUS} vCPUs, not {0}")]
    CpuCount(u32),
    /// Writing to guest memory failed (the guest has too little RAM for the BIOS area).
    #[error("cannot write the MP table at {addr:#x}: {source}")]
    GuestMemory {
        /// Guest-physical address of the failed write.
        addr: u64,
        /// The memory error.
        #[source]
        source: GuestMemoryError,
    },
}

/// The byte that makes `bytes` sum to zero together with it.
fn checksum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |a, &b| a.wrapping_sub(b))
}

/// The configuration table (header and base entries) for `cpus` processors.
fn config_table(cpus: u32) -> Vec<u8> {
    let ioapic = IOAPIC_ID;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    let mut push = |e: &[u8]| {
        entries.extend_from_slice(e);
        count += 1;
    };

    for id in 0..cpus {
        let mut e = [0u8; PROCESSOR_LEN];
        e[0] = ENTRY_PROCESSOR;
        e[1] = id as u8; // cpus <= MAX_CPUS < 256
        e[2] = LAPIC_VERSION;
        e[3] = CPU_ENABLED | if id == 0 { CPU_BSP } else { 0 };
        e[4..8].copy_from_slice(&CPU_SIGNATURE.to_le_bytes());
        e[8..12].copy_from_slice(&CPU_FEATURES.to_le_bytes());
        push(&e);
    }

    let mut bus = [0u8; OTHER_ENTRY_LEN];
    bus[0] = ENTRY_BUS;
    bus[1] = ISA_BUS_ID;
    bus[2..8].copy_from_slice(b"ISA   ");
    push(&bus);

    let mut io = [0u8; OTHER_ENTRY_LEN];
    io[0] = ENTRY_IOAPIC;
    io[1] = ioapic;
    io[2] = IOAPIC_VERSION;
    io[3] = IOAPIC_ENABLED;
    io[4..8].copy_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    push(&io);

    for irq in (0u8..16).filter(|&i| i != 2) {
        let pin = if irq == 0 { 2 } else { irq };
        let flags = if irq == SCI_IRQ {
            INT_FLAGS_LEVEL_HIGH
        } else {
            INT_FLAGS_CONFORMING
        };
        let [f0, f1] = flags.to_le_bytes();
        push(&[
            ENTRY_IO_INTERRUPT,
            INT_TYPE_INT,
            f0,
            f1,
            ISA_BUS_ID,
            irq,
            ioapic,
            pin,
        ]);
    }

    for (int_type, lint) in [(INT_TYPE_EXTINT, 0u8), (INT_TYPE_NMI, 1)] {
        let [f0, f1] = INT_FLAGS_CONFORMING.to_le_bytes();
        push(&[
            ENTRY_LOCAL_INTERRUPT,
            int_type,
            f0,
            f1,
            ISA_BUS_ID,
            0,
            ALL_LAPICS,
            lint,
        ]);
    }

    let len = MPC_HEADER_LEN + entries.len();
    let mut t = vec![0u8; MPC_HEADER_LEN];
    t[0..4].copy_from_slice(b"PCMP");
    t[4..6].copy_from_slice(&(len as u16).to_le_bytes());
    t[6] = SPEC_REV_1_4;
    t[8..16].copy_from_slice(&OEM_ID);
    t[16..28].copy_from_slice(&PRODUCT_ID);
    // OEM table pointer and size (28..34) stay 0: no OEM table.
    t[34..36].copy_from_slice(&count.to_le_bytes());
    t[36..40].copy_from_slice(&(LAPIC_START as u32).to_le_bytes());
    // Extended table length and checksum (40..43) stay 0: no extended entries.
    t.extend_from_slice(&entries);
    t[7] = checksum(&t);
    t
}

/// The floating pointer structure pointing at the configuration table at `mpc_addr`.
fn floating_pointer(mpc_addr: u32) -> [u8; MPF_LEN] {
    let mut f = [0u8; MPF_LEN];
    f[0..4].copy_from_slice(b"_MP_");
    f[4..8].copy_from_slice(&mpc_addr.to_le_bytes());
    f[8] = 1; // length in 16-byte paragraphs
    f[9] = SPEC_REV_1_4;
    // Feature bytes 1-5 are 0: a configuration table is present, no IMCR (virtual wire mode).
    f[10] = checksum(&f);
    f
}

/// Writes the MP table for `cpus` vCPUs into the BIOS area of `mem` and returns the address
/// of its floating pointer structure ([`MPF_ADDR`]).
pub fn create_mptable<M: GuestMemory + ?Sized>(mem: &M, cpus: u32) -> Result<u64, MpTableError> {
    if cpus == 0 || cpus > MAX_CPUS {
        return Err(MpTableError::CpuCount(cpus));
    }
    let table = config_table(cpus);
    // At most 44 + 254 * 20 + 19 * 8 bytes: far below the 64 KiB area.
    debug_assert!((MPF_LEN + table.len()) as u64 <= MPTABLE_SIZE);
    let mpf = floating_pointer(MPC_ADDR as u32);
    for (addr, bytes) in [(MPF_ADDR, &mpf[..]), (MPC_ADDR, &table[..])] {
        mem.write_slice(bytes, GuestAddress(addr))
            .map_err(|source| MpTableError::GuestMemory { addr, source })?;
    }
    log::debug!(
        "MP table for {cpus} vCPUs at {MPF_ADDR:#x} ({} bytes)",
        MPF_LEN + table.len()
    );
    Ok(MPF_ADDR)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{ACPI_SIZE, ACPI_START, HIMEM_START};
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
    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, &x| a.wrapping_add(x))
    }

    /// Finds the floating pointer the way Linux does (16-byte steps over 0xf0000-0xfffff),
    /// validates it and the configuration table, and returns the table's entries.
    fn parse(mem: &GuestMemoryMmap) -> (Vec<u8>, Vec<Vec<u8>>) {
        let area = read(mem, 0xf_0000, 0x1_0000);
        let off = (0..area.len())
            .step_by(16)
            .find(|&o| &area[o..o + 4] == b"_MP_" && sum(&area[o..o + 16]) == 0)
            .expect("floating pointer");
        let mpf = &area[off..off + 16];
        assert_eq!(mpf[8], 1, "length in paragraphs");
        assert_eq!(mpf[9], 4, "spec revision 1.4");
        assert_eq!(&mpf[11..16], &[0; 5], "feature bytes");
        let mpc_addr = u64::from(u32_at(mpf, 4));
        assert_eq!(mpc_addr, MPC_ADDR);

        let hdr = read(mem, mpc_addr, MPC_HEADER_LEN);
        assert_eq!(&hdr[0..4], b"PCMP");
        let len = usize::from(u16_at(&hdr, 4));
        let mpc = read(mem, mpc_addr, len);
        assert_eq!(sum(&mpc), 0, "configuration table checksum");
        assert_eq!(mpc[6], 4);
        assert_eq!(u32_at(&mpc, 36), 0xfee0_0000, "local APIC address");
        assert_eq!(u16_at(&mpc, 40), 0, "no extended table");
        assert!(mpc_addr + len as u64 <= HIMEM_START);
        const { assert!(MPF_ADDR >= ACPI_START + ACPI_SIZE, "overlaps the ACPI area") };

        let count = u16_at(&mpc, 34) as usize;
        let mut entries = Vec::new();
        let mut o = MPC_HEADER_LEN;
        let mut last_type = 0;
        while o < mpc.len() {
            let n = if mpc[o] == ENTRY_PROCESSOR { 20 } else { 8 };
            assert!(mpc[o] >= last_type, "entries out of order");
            last_type = mpc[o];
            entries.push(mpc[o..o + n].to_vec());
            o += n;
        }
        assert_eq!(o, mpc.len());
        assert_eq!(entries.len(), count);
        (mpc, entries)
    }

    #[test]
    fn table_contents() {
        for cpus in [1u32, 2, 8, 100, MAX_CPUS] {
            let mem = guest_mem(64 * MIB);
            assert_eq!(create_mptable(&mem, cpus).unwrap(), 0xf_0000);
            let (_, entries) = parse(&mem);
            let of = |ty: u8| entries.iter().filter(move |e| e[0] == ty);

            let cpus_found: Vec<_> = of(ENTRY_PROCESSOR).collect();
            assert_eq!(cpus_found.len(), cpus as usize);
            for (i, e) in cpus_found.iter().enumerate() {
                assert_eq!(e[1] as usize, i, "APIC ID");
                assert_eq!(e[2], 0x14);
                assert_eq!(e[3], if i == 0 { 3 } else { 1 }, "EN, BP on 0");
                assert_ne!(u32_at(e, 4), 0, "signature");
                assert_ne!(u32_at(e, 8) & (1 << 9), 0, "APIC feature");
            }

            let buses: Vec<_> = of(ENTRY_BUS).collect();
            assert_eq!(buses.len(), 1);
            assert_eq!(&buses[0][1..8], b"\0ISA   ");

            let ioapics: Vec<_> = of(ENTRY_IOAPIC).collect();
            assert_eq!(ioapics.len(), 1);
            let io = ioapics[0];
            assert_eq!(io[1], IOAPIC_ID);
            assert_eq!(io[3], 1, "enabled");
            assert_eq!(u32_at(io, 4), 0xfec0_0000);

            // (source IRQ, pin, flags), all INT type, ISA bus, to the IOAPIC.
            let ints: Vec<_> = of(ENTRY_IO_INTERRUPT)
                .map(|e| {
                    assert_eq!((e[1], e[4], e[6]), (0, 0, io[1]));
                    (e[5], e[7], u16_at(e, 2))
                })
                .collect();
            let mut want: Vec<_> = (0u8..16)
                .filter(|&i| i != 2)
                .map(|i| (i, if i == 0 { 2 } else { i }, 0))
                .collect();
            want[8].2 = 0xd; // IRQ 9 (index 8 after skipping IRQ 2): level, active high
            assert_eq!(ints, want);

            let lints: Vec<_> = of(ENTRY_LOCAL_INTERRUPT)
                .map(|e| e[1..8].to_vec())
                .collect();
            assert_eq!(
                lints,
                vec![vec![3, 0, 0, 0, 0, 0xff, 0], vec![1, 0, 0, 0, 0, 0xff, 1]]
            );
        }
    }

    #[test]
    fn rejects_bad_cpu_counts_and_small_memory() {
        let mem = guest_mem(2 * MIB);
        assert!(matches!(
            create_mptable(&mem, 0),
            Err(MpTableError::CpuCount(0))
        ));
        assert!(matches!(
            create_mptable(&mem, 255),
            Err(MpTableError::CpuCount(255))
        ));
        let small = guest_mem(0xf_0000);
        assert!(matches!(
            create_mptable(&small, 1),
            Err(MpTableError::GuestMemory { addr: 0xf_0000, .. })
        ));
    }

    #[test]
    fn checksum_helper() {
        let mut b = vec![1u8, 2, 250, 0];
        b[3] = checksum(&b);
        assert_eq!(sum(&b), 0);
    }
}
