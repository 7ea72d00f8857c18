//! QEMU's firmware configuration interface (fw_cfg), traditional I/O-port
//! flavour.
//!
//! Firmware and boot code written for QEMU (SeaBIOS, OVMF, the Linux
//! `qemu_fw_cfg` driver, test guests) learn the machine's RAM size, CPU
//! count and named blobs ("etc/...") through it; speaking the same protocol
//! lets them run unchanged. Only the byte-at-a-time interface is offered (the
//! ID item says so): it needs no guest-memory access from the device, and
//! the DMA interface can be added later behind the same items.
//!
//! Protocol: write a 16-bit item key to port 0x510, then read the item's
//! bytes one at a time from port 0x511; reads past the end return 0.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::bus::{Bus, BusDeviceMut, BusError};
use crate::lifecycle::{DeviceState, Lifecycle, LifecycleError};
use crate::state::StateError;

/// Selector port (16-bit writes).
pub const SELECTOR_PORT: u64 = 0x510;
/// Data port (8-bit reads).
pub const DATA_PORT: u64 = 0x511;
/// First port claimed.
pub const PORT_BASE: u64 = SELECTOR_PORT;
/// Ports claimed: selector and data.
pub const PORT_LEN: u64 = 2;

/// "QEMU".
pub const FW_CFG_SIGNATURE: u16 = 0x00;
/// Interface feature bits (u32 LE): 1 = traditional interface only.
pub const FW_CFG_ID: u16 = 0x01;
/// Guest RAM size in bytes (u64 LE).
pub const FW_CFG_RAM_SIZE: u16 = 0x03;
/// Number of CPUs present at boot (u16 LE).
pub const FW_CFG_NB_CPUS: u16 = 0x05;
/// Maximum number of CPUs (u16 LE).
pub const FW_CFG_MAX_CPUS: u16 = 0x0f;
/// The directory of named files.
pub const FW_CFG_FILE_DIR: u16 = 0x19;
/// Key of the first named file.
pub const FW_CFG_FILE_FIRST: u16 = 0x20;
/// Size of a file-directory name field, including the terminating NUL.
pub const FW_CFG_MAX_FILE_PATH: usize = 56;

/// Set in a key to select an item for writing (unsupported: writes are
/// ignored); it does not change which item is read.
const FW_CFG_WRITE_CHANNEL: u16 = 0x4000;
/// Set in a key for architecture-specific items (x86: ACPI tables, e820...).
const FW_CFG_ARCH_LOCAL: u16 = 0x8000;
/// The part of a key that numbers the item within its space.
const FW_CFG_ENTRY_MASK: u16 = !(FW_CFG_WRITE_CHANNEL | FW_CFG_ARCH_LOCAL);

/// Why an item or file could not be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FwCfgError {
    /// The key is managed by the device itself, or lies in the file range.
    #[error("fw_cfg key {0:#06x} is reserved")]
    ReservedKey(u16),
    /// File names are NUL-terminated in a 56-byte field.
    #[error("fw_cfg file name {0:?} is empty, contains NUL or is longer than 55 bytes")]
    BadName(String),
    /// Two files with one name would make the directory ambiguous.
    #[error("fw_cfg file {0:?} already exists")]
    DuplicateName(String),
    /// Every key from 0x20 to 0x3fff is used.
    #[error("fw_cfg has no free key for file {0:?}")]
    TooManyFiles(String),
    /// Item sizes are 32-bit in the protocol.
    #[error("fw_cfg item of {0} bytes is larger than 4 GiB")]
    TooLarge(usize),
}

/// Guest-visible state, for snapshots. Items are configuration and are
/// rebuilt by the VMM on the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FwCfgState {
    /// The last key written to the selector port.
    pub selector: u16,
    /// Read position within the selected item.
    pub offset: u32,
}

/// The fw_cfg device.
#[derive(Debug, Clone)]
pub struct FwCfg {
    /// Items by key (without the write-channel bit).
    items: BTreeMap<u16, Vec<u8>>,
    /// Named files and their keys, sorted by name (the directory order).
    files: BTreeMap<String, u16>,
    state: FwCfgState,
}

impl FwCfg {
    /// A device describing a machine with `nb_cpus` CPUs (also the maximum;
    /// see [`FwCfg::set_max_cpus`]) and `ram_size` bytes of RAM, with an
    /// empty file directory.
    pub fn new(nb_cpus: u16, ram_size: u64) -> Self {
        let mut fw = FwCfg {
            items: BTreeMap::new(),
            files: BTreeMap::new(),
            state: FwCfgState::default(),
        };
        fw.items.insert(FW_CFG_SIGNATURE, b"QEMU".to_vec());
        fw.items.insert(FW_CFG_ID, 1u32.to_le_bytes().to_vec());
        fw.rebuild_dir();
        fw.set_nb_cpus(nb_cpus);
        fw.set_max_cpus(nb_cpus);
        fw.set_ram_size(ram_size);
        fw
    }

    /// Moves the device onto `bus` at ports 0x510-0x511.
    pub fn register(self, bus: &mut Bus) -> Result<Arc<Mutex<Self>>, BusError> {
        let dev = Arc::new(Mutex::new(self));
        bus.insert(dev.clone(), PORT_BASE, PORT_LEN)?;
        Ok(dev)
    }

    /// Sets `FW_CFG_RAM_SIZE`.
    pub fn set_ram_size(&mut self, bytes: u64) {
        self.items
            .insert(FW_CFG_RAM_SIZE, bytes.to_le_bytes().to_vec());
    }

    /// Sets `FW_CFG_NB_CPUS`.
    pub fn set_nb_cpus(&mut self, n: u16) {
        self.items.insert(FW_CFG_NB_CPUS, n.to_le_bytes().to_vec());
    }

    /// Sets `FW_CFG_MAX_CPUS`.
    pub fn set_max_cpus(&mut self, n: u16) {
        self.items.insert(FW_CFG_MAX_CPUS, n.to_le_bytes().to_vec());
    }

    /// Adds or replaces a raw item under a numeric key (e.g. an
    /// arch-local 0x8000+ item). The signature, ID, file directory and file
    /// keys are managed here and refused.
    pub fn add_item(&mut self, key: u16, data: Vec<u8>) -> Result<(), FwCfgError> {
        let entry = key & FW_CFG_ENTRY_MASK;
        let reserved = key & FW_CFG_WRITE_CHANNEL != 0
            || (key & FW_CFG_ARCH_LOCAL == 0
                && (matches!(entry, FW_CFG_SIGNATURE | FW_CFG_ID | FW_CFG_FILE_DIR)
                    || entry >= FW_CFG_FILE_FIRST));
        if reserved {
            return Err(FwCfgError::ReservedKey(key));
        }
        check_size(&data)?;
        self.items.insert(key, data);
        Ok(())
    }

    /// Adds a named file; returns the key the guest can also select it by.
    pub fn add_file(&mut self, name: &str, data: Vec<u8>) -> Result<u16, FwCfgError> {
        if name.is_empty() || name.len() >= FW_CFG_MAX_FILE_PATH || name.contains('\0') {
            return Err(FwCfgError::BadName(name.to_string()));
        }
        if self.files.contains_key(name) {
            return Err(FwCfgError::DuplicateName(name.to_string()));
        }
        check_size(&data)?;
        let key = u16::try_from(self.files.len())
            .ok()
            .and_then(|n| FW_CFG_FILE_FIRST.checked_add(n))
            .filter(|&k| k <= FW_CFG_ENTRY_MASK)
            .ok_or_else(|| FwCfgError::TooManyFiles(name.to_string()))?;
        self.items.insert(key, data);
        self.files.insert(name.to_string(), key);
        self.rebuild_dir();
        Ok(key)
    }

    /// The guest-visible state.
    pub fn state(&self) -> FwCfgState {
        self.state
    }

    /// Restores a state captured by [`FwCfg::state`], on a device holding the
    /// same items (add them first). A read position past the end of the
    /// selected item, or inside an item that does not exist, is refused.
    pub fn restore(&mut self, state: &FwCfgState) -> Result<(), StateError> {
        let key = state.selector & !FW_CFG_WRITE_CHANNEL;
        let len = self.items.get(&key).map_or(0, Vec::len);
        if usize::try_from(state.offset).map_or(true, |o| o > len) {
            return Err(StateError::new(
                "fw_cfg",
                format!(
                    "read position {} in item {:#06x} of {len} bytes",
                    state.offset, state.selector
                ),
            ));
        }
        self.state = *state;
        Ok(())
    }

    /// Directory layout: u32 BE count, then per file (in name order)
    /// u32 BE size, u16 BE key, u16 reserved, 56-byte NUL-padded name.
    fn rebuild_dir(&mut self) {
        let count = u32::try_from(self.files.len()).unwrap_or(u32::MAX);
        let mut dir = Vec::with_capacity(4 + self.files.len() * (8 + FW_CFG_MAX_FILE_PATH));
        dir.extend_from_slice(&count.to_be_bytes());
        for (name, &key) in &self.files {
            let size = self.items.get(&key).map_or(0, Vec::len);
            // Sizes were checked when the file was added.
            let size = u32::try_from(size).unwrap_or(u32::MAX);
            dir.extend_from_slice(&size.to_be_bytes());
            dir.extend_from_slice(&key.to_be_bytes());
            dir.extend_from_slice(&0u16.to_be_bytes());
            let mut field = [0u8; FW_CFG_MAX_FILE_PATH];
            // Names were checked to be shorter than the field
            // (the zip stops at the shorter; the last byte stays NUL).
            for (f, &b) in field.iter_mut().zip(name.as_bytes()) {
                *f = b;
            }
            dir.extend_from_slice(&field);
        }
        self.items.insert(FW_CFG_FILE_DIR, dir);
    }

    fn select(&mut self, key: u16) {
        self.state = FwCfgState {
            selector: key,
            offset: 0,
        };
    }

    /// Next byte of the selected item; 0 past its end or for unknown keys.
    fn read_byte(&mut self) -> u8 {
        let key = self.state.selector & !FW_CFG_WRITE_CHANNEL;
        let Some(item) = self.items.get(&key) else {
            return 0;
        };
        match usize::try_from(self.state.offset)
            .ok()
            .and_then(|o| item.get(o))
        {
            Some(&b) => {
                // Cannot overflow: items are shorter than u32::MAX.
                self.state.offset = self.state.offset.saturating_add(1);
                b
            }
            None => 0,
        }
    }
}

fn check_size(data: &[u8]) -> Result<(), FwCfgError> {
    if u32::try_from(data.len()).is_err() {
        return Err(FwCfgError::TooLarge(data.len()));
    }
    Ok(())
}

impl BusDeviceMut for FwCfg {
    /// Only byte reads of the data port return item bytes (that is what
    /// QEMU's port interface accepts); anything else reads as zero.
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match (offset, data) {
            (1, [b]) => *b = self.read_byte(),
            (_, data) => data.fill(0),
        }
    }

    /// Only 16-bit writes of the selector port select; byte writes to it
    /// and writes to the data port are ignored, as QEMU does.
    fn write(&mut self, offset: u64, data: &[u8]) {
        match (offset, data) {
            (0, &[lo, hi]) => self.select(u16::from_le_bytes([lo, hi])),
            _ => log::trace!(
                "fw_cfg: ignored write of {} bytes at offset {offset}",
                data.len()
            ),
        }
    }
}

/// Layout version of the state [`Lifecycle::save`] writes: an [`FwCfgState`].
pub const FW_CFG_STATE_VERSION: u32 = 1;

/// Items are configuration (the destination's VMM adds the same ones); only the selector and
/// the read position travel. Nothing runs on its own, so pause and resume have nothing to do.
impl Lifecycle for FwCfg {
    fn id(&self) -> String {
        "fw_cfg".into()
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(FW_CFG_STATE_VERSION, &self.state())
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        FwCfg::restore(self, &state.parse("fw_cfg", FW_CFG_STATE_VERSION)?)
    }

    /// Selector 0 (the signature) at offset 0; the items stay.
    fn reset(&mut self) {
        self.state = FwCfgState::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (Bus, Arc<Mutex<FwCfg>>) {
        let mut fw = FwCfg::new(4, 512 << 20);
        fw.set_max_cpus(8);
        let mut bus = Bus::new();
        let dev = fw.register(&mut bus).unwrap();
        (bus, dev)
    }

    fn select(bus: &Bus, key: u16) {
        assert!(bus.write(SELECTOR_PORT, &key.to_le_bytes()));
    }

    fn read(bus: &Bus, n: usize) -> Vec<u8> {
        (0..n)
            .map(|_| {
                let mut d = [0u8];
                assert!(bus.read(DATA_PORT, &mut d));
                d[0]
            })
            .collect()
    }

    #[test]
    fn signature_id_and_numbers() {
        let (bus, _) = setup();
        select(&bus, FW_CFG_SIGNATURE);
        assert_eq!(read(&bus, 6), b"QEMU\0\0");
        // Reselecting rewinds.
        select(&bus, FW_CFG_SIGNATURE);
        assert_eq!(read(&bus, 4), b"QEMU");
        select(&bus, FW_CFG_ID);
        assert_eq!(read(&bus, 4), 1u32.to_le_bytes());
        select(&bus, FW_CFG_NB_CPUS);
        assert_eq!(read(&bus, 2), 4u16.to_le_bytes());
        select(&bus, FW_CFG_MAX_CPUS);
        assert_eq!(read(&bus, 2), 8u16.to_le_bytes());
        select(&bus, FW_CFG_RAM_SIZE);
        assert_eq!(read(&bus, 8), (512u64 << 20).to_le_bytes());
        // The write-channel bit still reads the item.
        select(&bus, FW_CFG_NB_CPUS | FW_CFG_WRITE_CHANNEL);
        assert_eq!(read(&bus, 2), 4u16.to_le_bytes());
        // Unknown keys read as zero.
        select(&bus, 0x1234);
        assert_eq!(read(&bus, 3), [0, 0, 0]);
    }

    #[test]
    fn odd_accesses_are_ignored() {
        let (bus, dev) = setup();
        select(&bus, FW_CFG_SIGNATURE);
        assert_eq!(read(&bus, 1), b"Q");
        // A byte write to the selector does not select, nor rewind.
        assert!(bus.write(SELECTOR_PORT, &[FW_CFG_NB_CPUS as u8]));
        assert!(bus.write(DATA_PORT, &[0x55]));
        assert_eq!(read(&bus, 1), b"E");
        // Reading the selector port returns 0 and does not advance.
        let mut d = [0xaa; 2];
        assert!(bus.read(SELECTOR_PORT, &mut d));
        assert_eq!(d, [0, 0]);
        assert_eq!(read(&bus, 2), b"MU");
        // Wider accesses at the data port do not fit the range.
        assert!(!bus.read(DATA_PORT, &mut d));
        assert!(!bus.write(DATA_PORT, &[1, 2]));
        assert_eq!(
            dev.lock().unwrap().state(),
            FwCfgState {
                selector: FW_CFG_SIGNATURE,
                offset: 4
            }
        );
    }

    #[test]
    fn file_directory() {
        let (bus, dev) = setup();
        select(&bus, FW_CFG_FILE_DIR);
        assert_eq!(read(&bus, 4), [0, 0, 0, 0]);

        let zk = dev
            .lock()
            .unwrap()
            .add_file("opt/z", b"zzz".to_vec())
            .unwrap();
        let ak = dev
            .lock()
            .unwrap()
            .add_file("etc/acpi/tables", vec![7; 300])
            .unwrap();
        assert_eq!((zk, ak), (0x20, 0x21));

        select(&bus, FW_CFG_FILE_DIR);
        let dir = read(&bus, 4 + 2 * 64 + 4);
        assert_eq!(&dir[0..4], &2u32.to_be_bytes());
        // Sorted by name: etc/acpi/tables first.
        let e0 = &dir[4..68];
        assert_eq!(&e0[0..4], &300u32.to_be_bytes());
        assert_eq!(&e0[4..6], &0x21u16.to_be_bytes());
        assert_eq!(&e0[6..8], &[0, 0]);
        assert_eq!(&e0[8..8 + 15], b"etc/acpi/tables");
        assert!(e0[8 + 15..].iter().all(|&b| b == 0));
        let e1 = &dir[68..132];
        assert_eq!(&e1[0..4], &3u32.to_be_bytes());
        assert_eq!(&e1[4..6], &0x20u16.to_be_bytes());
        assert_eq!(&e1[8..13], b"opt/z");
        assert_eq!(&dir[132..], &[0, 0, 0, 0], "past the end");

        select(&bus, zk);
        assert_eq!(read(&bus, 4), b"zzz\0");
    }

    #[test]
    fn add_errors() {
        let mut fw = FwCfg::new(1, 1 << 20);
        let long = "x".repeat(56);
        assert!(matches!(
            fw.add_file(&long, vec![]),
            Err(FwCfgError::BadName(_))
        ));
        fw.add_file(&long[..55], vec![]).unwrap();
        assert!(matches!(
            fw.add_file("", vec![]),
            Err(FwCfgError::BadName(_))
        ));
        assert!(matches!(
            fw.add_file("a\0b", vec![]),
            Err(FwCfgError::BadName(_))
        ));
        fw.add_file("etc/a", vec![1]).unwrap();
        assert_eq!(
            fw.add_file("etc/a", vec![2]),
            Err(FwCfgError::DuplicateName("etc/a".into()))
        );
        for key in [
            FW_CFG_SIGNATURE,
            FW_CFG_ID,
            FW_CFG_FILE_DIR,
            0x20,
            0x3fff,
            FW_CFG_WRITE_CHANNEL | 3,
        ] {
            assert_eq!(fw.add_item(key, vec![]), Err(FwCfgError::ReservedKey(key)));
        }
        fw.add_item(0x8003, vec![1, 2, 3]).unwrap(); // arch-local, e.g. e820
        fw.add_item(0x08, vec![0; 4]).unwrap(); // kernel size
    }

    #[test]
    fn state_round_trip() {
        let (bus, dev) = setup();
        select(&bus, FW_CFG_SIGNATURE);
        read(&bus, 2);
        let s = dev.lock().unwrap().state();
        let mut other = FwCfg::new(1, 1 << 20);
        other.restore(&s).unwrap();
        let mut d = [0u8];
        other.read(1, &mut d);
        assert_eq!(d[0], b'M');
    }

    #[test]
    fn state_survives_serde_after_activity() {
        let (bus, dev) = setup();
        dev.lock()
            .unwrap()
            .add_file("etc/boot-order", b"/disk@0".to_vec())
            .unwrap();
        select(&bus, 0x20 | FW_CFG_WRITE_CHANNEL);
        assert_eq!(read(&bus, 3), b"/di");
        let s = dev.lock().unwrap().state();
        let json = serde_json::to_string(&s).unwrap();
        let back: FwCfgState = serde_json::from_str(&json).unwrap();

        // The destination builds the same items, then takes the state.
        let (bus2, dev2) = setup();
        dev2.lock()
            .unwrap()
            .add_file("etc/boot-order", b"/disk@0".to_vec())
            .unwrap();
        dev2.lock().unwrap().restore(&back).unwrap();
        assert_eq!(dev2.lock().unwrap().state(), s);
        assert_eq!(read(&bus2, 5), b"sk@0\0");

        // Positions that cannot be: past the end, inside an unknown item.
        let mut d = dev2.lock().unwrap();
        let bad = FwCfgState {
            selector: 0x20,
            offset: 8,
        };
        assert!(d.restore(&bad).is_err());
        let bad = FwCfgState {
            selector: 0x1234,
            offset: 1,
        };
        assert!(d.restore(&bad).is_err());
        d.restore(&FwCfgState {
            selector: 0x20,
            offset: 7,
        })
        .unwrap();
        assert!(serde_json::from_str::<FwCfgState>("{\"selector\": -1, \"offset\": 0}").is_err());
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = crate::test_util::XorShift(7);
        let (bus, dev) = setup();
        dev.lock()
            .unwrap()
            .add_file("etc/x", vec![1, 2, 3])
            .unwrap();
        let mut buf = [0u8; 8];
        for _ in 0..50_000 {
            let port = 0x50e + rng.next() % 6;
            let size = (rng.next() % 5) as usize;
            for b in buf.iter_mut() {
                *b = rng.next() as u8;
            }
            if rng.next().is_multiple_of(3) {
                bus.write(port, &buf[..size]);
            } else {
                bus.read(port, &mut buf[..size]);
            }
        }
        let mut d = dev.lock().unwrap();
        // Whatever the guest did, the state it left restores (on the same items).
        let st = d.state();
        let mut other = d.clone();
        other.restore(&FwCfgState::default()).unwrap();
        other.restore(&st).unwrap();
        assert_eq!(other.state(), st);
        assert!(d
            .restore(&FwCfgState {
                selector: FW_CFG_FILE_DIR,
                offset: u32::MAX,
            })
            .is_err());
        d.read(1, &mut buf[..1]);
        d.read(u64::MAX, &mut buf);
        d.write(u64::MAX, &buf);
    }
}
