//! The ACPI tables handed to firmware through fw_cfg, with QEMU's linker/loader protocol.
//!
//! Firmware written for QEMU (SeaBIOS, OVMF) does not build ACPI tables itself: it reads
//! blobs from fw_cfg and runs the commands of `etc/table-loader` (128 bytes each):
//!
//! - ALLOCATE: load a fw_cfg file into memory the firmware picks, aligned, in the high zone
//!   (reserved RAM below 4 GiB) or the F-segment (`0xf0000`–`0xfffff`, where the RSDP must
//!   be for the legacy scan);
//! - ADD_POINTER: add the address at which one file was loaded to a little-endian pointer
//!   field (1, 2, 4 or 8 bytes) inside another, which holds the offset within that file;
//! - ADD_CHECKSUM: set an ACPI checksum byte so that a range of a file sums to zero.
//!
//! [`firmware_acpi_files`] lays out the tables [`AcpiTables`] builds (the same ones a direct
//! boot writes at 0xe0000) in two files, `etc/acpi/tables` (FACS, DSDT, FADT, MADT, MCFG,
//! XSDT) and `etc/acpi/rsdp`, with the FADT, XSDT and RSDP pointer fields holding offsets
//! and the commands that turn them into addresses and fix the checksums.

use zerocopy::little_endian::U32;
use zerocopy::{Immutable, IntoBytes, KnownLayout};

use crate::acpi::AcpiTables;

/// The fw_cfg file of the loader commands.
pub const LOADER_FILE: &str = "etc/table-loader";
/// The fw_cfg file of the tables other than the RSDP.
pub const TABLES_FILE: &str = "etc/acpi/tables";
/// The fw_cfg file of the RSDP.
pub const RSDP_FILE: &str = "etc/acpi/rsdp";

/// Length of a file name field in a command (fw_cfg's limit, NUL included).
const FILE_NAME_LEN: usize = 56;
/// Every command is this long.
pub const COMMAND_LEN: usize = 128;

const COMMAND_ALLOCATE: u32 = 1;
const COMMAND_ADD_POINTER: u32 = 2;
const COMMAND_ADD_CHECKSUM: u32 = 3;

/// Where ALLOCATE puts a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Zone {
    /// RAM below 4 GiB that the firmware reserves in the memory map.
    High = 1,
    /// The BIOS F-segment.
    FSeg = 2,
}

#[derive(IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
struct Allocate {
    command: U32,
    file: [u8; FILE_NAME_LEN],
    align: U32,
    zone: u8,
    pad: [u8; 63],
}

#[derive(IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
struct AddPointer {
    command: U32,
    dest_file: [u8; FILE_NAME_LEN],
    src_file: [u8; FILE_NAME_LEN],
    offset: U32,
    size: u8,
    pad: [u8; 7],
}

#[derive(IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
struct AddChecksum {
    command: U32,
    file: [u8; FILE_NAME_LEN],
    offset: U32,
    start: U32,
    length: U32,
    pad: [u8; 56],
}

const _: () = assert!(size_of::<Allocate>() == COMMAND_LEN);
const _: () = assert!(size_of::<AddPointer>() == COMMAND_LEN);
const _: () = assert!(size_of::<AddChecksum>() == COMMAND_LEN);

/// A file name as a command's NUL-padded field. Names are this module's constants, all
/// shorter than the field.
fn name_field(name: &str) -> [u8; FILE_NAME_LEN] {
    debug_assert!(name.len() < FILE_NAME_LEN);
    let mut field = [0; FILE_NAME_LEN];
    for (f, b) in field.iter_mut().zip(name.bytes().take(FILE_NAME_LEN - 1)) {
        *f = b;
    }
    field
}

/// A linker/loader script being written.
#[derive(Default, Debug, Clone)]
pub struct TableLoader {
    commands: Vec<u8>,
}

impl TableLoader {
    /// ALLOCATE `file` aligned to `align` bytes (a power of two) in `zone`.
    pub fn allocate(&mut self, file: &str, align: u32, zone: Zone) {
        let c = Allocate {
            command: COMMAND_ALLOCATE.into(),
            file: name_field(file),
            align: align.into(),
            zone: zone as u8,
            pad: [0; 63],
        };
        self.commands.extend_from_slice(c.as_bytes());
    }

    /// ADD_POINTER: the `size`-byte field at `offset` in `dest` gets `src`'s address added.
    pub fn add_pointer(&mut self, dest: &str, src: &str, offset: u32, size: u8) {
        let c = AddPointer {
            command: COMMAND_ADD_POINTER.into(),
            dest_file: name_field(dest),
            src_file: name_field(src),
            offset: offset.into(),
            size,
            pad: [0; 7],
        };
        self.commands.extend_from_slice(c.as_bytes());
    }

    /// ADD_CHECKSUM: the byte at `offset` in `file` makes `[start, start + length)` sum to 0.
    pub fn add_checksum(&mut self, file: &str, offset: u32, start: u32, length: u32) {
        let c = AddChecksum {
            command: COMMAND_ADD_CHECKSUM.into(),
            file: name_field(file),
            offset: offset.into(),
            start: start.into(),
            length: length.into(),
            pad: [0; 56],
        };
        self.commands.extend_from_slice(c.as_bytes());
    }

    /// The script's bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.commands
    }
}

/// The three fw_cfg files of the ACPI tables.
#[derive(Debug, Clone)]
pub struct FirmwareAcpiFiles {
    /// `etc/acpi/tables`.
    pub tables: Vec<u8>,
    /// `etc/acpi/rsdp`.
    pub rsdp: Vec<u8>,
    /// `etc/table-loader`.
    pub loader: Vec<u8>,
}

impl FirmwareAcpiFiles {
    /// The files as (fw_cfg name, contents).
    pub fn into_files(self) -> [(&'static str, Vec<u8>); 3] {
        [
            (TABLES_FILE, self.tables),
            (RSDP_FILE, self.rsdp),
            (LOADER_FILE, self.loader),
        ]
    }
}

/// Alignment of the tables blob (the FACS's) and of each table in it.
const TABLE_ALIGN: usize = 64;
/// Offset of the checksum byte in a system description table header.
const SDT_CHECKSUM: u32 = 9;
/// FADT pointer fields: FIRMWARE_CTRL, DSDT (32-bit), X_FIRMWARE_CTRL, X_DSDT (64-bit).
const FADT_FIRMWARE_CTRL: u32 = 36;
const FADT_DSDT: u32 = 40;
const FADT_X_FIRMWARE_CTRL: u32 = 132;
const FADT_X_DSDT: u32 = 140;
/// First XSDT entry.
const XSDT_ENTRIES: u32 = 36;
/// RSDP fields: checksum of the first 20 bytes, XSDT address, extended checksum.
const RSDP_CHECKSUM: u32 = 8;
const RSDP_V1_LEN: u32 = 20;
const RSDP_XSDT: u32 = 24;
const RSDP_EXT_CHECKSUM: u32 = 32;

/// Appends `table` to the blob at the next aligned offset; returns the offset.
fn append(blob: &mut Vec<u8>, table: &[u8]) -> u32 {
    blob.resize(blob.len().next_multiple_of(TABLE_ALIGN), 0);
    let offset = blob.len() as u32;
    blob.extend_from_slice(table);
    offset
}

/// Lays out `tables` for the linker/loader; see the module documentation.
pub fn firmware_acpi_files(tables: &AcpiTables) -> FirmwareAcpiFiles {
    let mut blob = Vec::new();
    // Tables that hold no pointers first; the FADT, XSDT and RSDP are built with offsets.
    let facs = append(&mut blob, &tables.facs);
    let dsdt = append(&mut blob, &tables.dsdt);
    let madt = append(&mut blob, &tables.madt);
    let mcfg = append(&mut blob, &tables.mcfg);
    let fadt_bytes = tables.fadt(u64::from(dsdt), u64::from(facs));
    let fadt = append(&mut blob, &fadt_bytes);
    let xsdt_bytes = AcpiTables::xsdt(u64::from(fadt), u64::from(madt), u64::from(mcfg));
    let xsdt = append(&mut blob, &xsdt_bytes);
    let rsdp = AcpiTables::rsdp(u64::from(xsdt));

    let mut loader = TableLoader::default();
    loader.allocate(RSDP_FILE, 16, Zone::FSeg);
    loader.allocate(TABLES_FILE, TABLE_ALIGN as u32, Zone::High);
    for (field, size) in [
        (FADT_FIRMWARE_CTRL, 4),
        (FADT_DSDT, 4),
        (FADT_X_FIRMWARE_CTRL, 8),
        (FADT_X_DSDT, 8),
    ] {
        loader.add_pointer(TABLES_FILE, TABLES_FILE, fadt + field, size);
    }
    let entries = (xsdt_bytes.len() as u32 - XSDT_ENTRIES) / 8;
    for i in 0..entries {
        loader.add_pointer(TABLES_FILE, TABLES_FILE, xsdt + XSDT_ENTRIES + 8 * i, 8);
    }
    loader.add_pointer(RSDP_FILE, TABLES_FILE, RSDP_XSDT, 8);
    for (start, len) in [
        (dsdt, tables.dsdt.len()),
        (madt, tables.madt.len()),
        (mcfg, tables.mcfg.len()),
        (fadt, fadt_bytes.len()),
        (xsdt, xsdt_bytes.len()),
    ] {
        loader.add_checksum(TABLES_FILE, start + SDT_CHECKSUM, start, len as u32);
    }
    loader.add_checksum(RSDP_FILE, RSDP_CHECKSUM, 0, RSDP_V1_LEN);
    loader.add_checksum(RSDP_FILE, RSDP_EXT_CHECKSUM, 0, rsdp.len() as u32);
    FirmwareAcpiFiles {
        tables: blob,
        rsdp,
        loader: loader.into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acpi::{AcpiTables, PM_TMR_BLK};
    use std::collections::HashMap;

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }
    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, &x| a.wrapping_add(x))
    }
    fn name(field: &[u8]) -> String {
        let end = field.iter().position(|&b| b == 0).unwrap();
        String::from_utf8(field[..end].to_vec()).unwrap()
    }

    /// Runs a loader script the way firmware does: files "loaded" at the given addresses,
    /// pointers patched, checksums fixed. Returns each file's final bytes.
    fn run_loader(
        files: &FirmwareAcpiFiles,
        bases: &HashMap<String, u64>,
    ) -> HashMap<String, Vec<u8>> {
        let mut data: HashMap<String, Vec<u8>> = HashMap::new();
        let source: HashMap<&str, &Vec<u8>> =
            HashMap::from([(TABLES_FILE, &files.tables), (RSDP_FILE, &files.rsdp)]);
        assert_eq!(files.loader.len() % COMMAND_LEN, 0);
        for c in files.loader.chunks(COMMAND_LEN) {
            match u32_at(c, 0) {
                COMMAND_ALLOCATE => {
                    let f = name(&c[4..60]);
                    let align = u64::from(u32_at(c, 60));
                    assert!(align.is_power_of_two());
                    assert_eq!(bases[&f] % align, 0);
                    let zone = c[64];
                    assert_eq!(zone, if f == RSDP_FILE { 2 } else { 1 }, "{f}");
                    data.insert(f.clone(), source[f.as_str()].clone());
                }
                COMMAND_ADD_POINTER => {
                    let (dest, src) = (name(&c[4..60]), name(&c[60..116]));
                    let (offset, size) = (u32_at(c, 116) as usize, c[120] as usize);
                    let d = data.get_mut(&dest).expect("allocated before use");
                    let mut v = [0u8; 8];
                    v[..size].copy_from_slice(&d[offset..offset + size]);
                    let patched = u64::from_le_bytes(v) + bases[&src];
                    d[offset..offset + size].copy_from_slice(&patched.to_le_bytes()[..size]);
                }
                COMMAND_ADD_CHECKSUM => {
                    let f = name(&c[4..60]);
                    let (offset, start, len) = (
                        u32_at(c, 60) as usize,
                        u32_at(c, 64) as usize,
                        u32_at(c, 68) as usize,
                    );
                    let d = data.get_mut(&f).unwrap();
                    let s = sum(&d[start..start + len]);
                    d[offset] = d[offset].wrapping_sub(s);
                }
                other => panic!("command {other}"),
            }
        }
        data
    }

    #[test]
    fn tables_link_at_any_address() {
        let tables = AcpiTables::new(4, 256 << 20, PM_TMR_BLK).unwrap();
        let files = firmware_acpi_files(&tables);
        for (tables_base, rsdp_base) in [(0x0fff_0000u64, 0xf5a40u64), (0x7ffc_0000, 0xf0000)] {
            let bases = HashMap::from([
                (TABLES_FILE.to_string(), tables_base),
                (RSDP_FILE.to_string(), rsdp_base),
            ]);
            let out = run_loader(&files, &bases);
            let (blob, rsdp) = (&out[TABLES_FILE], &out[RSDP_FILE]);
            let table_at = |addr: u64, sig: &[u8; 4]| -> Vec<u8> {
                let off = (addr - tables_base) as usize;
                assert_eq!(&blob[off..off + 4], sig);
                let t = blob[off..off + u32_at(blob, off + 4) as usize].to_vec();
                assert_eq!(sum(&t), 0, "{} checksum", String::from_utf8_lossy(sig));
                t
            };
            assert_eq!(&rsdp[..8], b"RSD PTR ");
            assert_eq!(sum(&rsdp[..20]), 0);
            assert_eq!(sum(rsdp), 0);
            let xsdt = table_at(u64_at(rsdp, 24), b"XSDT");
            let entries: Vec<u64> = xsdt[36..].chunks(8).map(|c| u64_at(c, 0)).collect();
            assert_eq!(entries.len(), 3);
            let fadt = table_at(entries[0], b"FACP");
            assert_eq!(table_at(entries[1], b"APIC"), tables.madt);
            assert_eq!(table_at(entries[2], b"MCFG"), tables.mcfg);
            let dsdt = u64_at(&fadt, 140);
            assert_eq!(u64::from(u32_at(&fadt, 40)), dsdt);
            assert_eq!(table_at(dsdt, b"DSDT"), tables.dsdt);
            let facs = u64_at(&fadt, 132);
            assert_eq!(u64::from(u32_at(&fadt, 36)), facs);
            assert_eq!(facs % 64, 0);
            let off = (facs - tables_base) as usize;
            assert_eq!(&blob[off..off + 4], b"FACS");
            // The FADT is the direct boot's, but for the addresses.
            assert_eq!(fadt, tables.fadt(dsdt, facs));
        }
    }

    #[test]
    fn command_layout() {
        let mut l = TableLoader::default();
        l.allocate("etc/x", 64, Zone::High);
        l.add_pointer("etc/x", "etc/y", 0x24, 4);
        l.add_checksum("etc/x", 9, 0, 0x30);
        let b = l.into_bytes();
        assert_eq!(b.len(), 3 * COMMAND_LEN);
        assert_eq!(&b[0..4], &[1, 0, 0, 0]);
        assert_eq!(&b[4..9], b"etc/x");
        assert_eq!(u32_at(&b, 60), 64);
        assert_eq!(b[64], 1);
        let p = &b[128..256];
        assert_eq!(u32_at(p, 0), 2);
        assert_eq!(&p[60..65], b"etc/y");
        assert_eq!((u32_at(p, 116), p[120]), (0x24, 4));
        let c = &b[256..];
        assert_eq!(
            (u32_at(c, 0), u32_at(c, 60), u32_at(c, 64), u32_at(c, 68)),
            (3, 9, 0, 0x30)
        );
    }
}
