//! The host bridge at 00:00.0: an Intel 82441FX (i440FX) PMC as guests and firmware know
//! it, with its PAM and SMRAM registers.
//!
//! The Programmable Attribute Map registers (0x59–0x5f) say, per block of the BIOS area
//! 0xc0000–0xfffff, whether reads and writes go to RAM or to ROM. They are stored and
//! reported to a [`PamListener`], through which the machine can make shadow RAM writable
//! or read-only. The SMRAM register (0x72) is stored with its lock semantics; ferrovm has
//! no SMM, so it changes nothing else.

use std::fmt;
use std::sync::Arc;

use devices::{DeviceState, Lifecycle, LifecycleError, StateError};
use serde::{Deserialize, Serialize};

use crate::config::{
    ConfigSpace, ConfigSpaceState, PciIds, COMMAND, COMMAND_BUS_MASTER, COMMAND_MEMORY,
};
use crate::{BarRequest, PciDevice};

pub const VENDOR_INTEL: u16 = 0x8086;
/// 82441FX PMC.
pub const DEVICE_I440FX: u16 = 0x1237;
pub const REVISION_I440FX: u8 = 2;
/// Subsystem IDs of QEMU's PC host bridge (Red Hat, "QEMU virtual machine"): SeaBIOS
/// recognises a QEMU-style machine, and so uses fw_cfg, by them.
pub const SUBSYSTEM_VENDOR_QEMU: u16 = 0x1af4;
pub const SUBSYSTEM_QEMU_PC: u16 = 0x1100;
/// Bridge, host bridge.
pub const CLASS_HOST_BRIDGE: u32 = 0x06_00_00;

/// First PAM register (PAM0).
pub const PAM_BASE: usize = 0x59;
/// PAM0 to PAM6.
pub const PAM_COUNT: usize = 7;
/// SMRAM control register.
pub const SMRAM: usize = 0x72;

/// PAM0 controls only 0xf0000–0xfffff (bits 5:4); PAM1–6 control two blocks each.
const PAM0_WRITABLE: u8 = 0x30;
const PAM_WRITABLE: u8 = 0x33;
/// SMRAM: D_OPEN, D_CLS, D_LCK, G_SMRAME; C_BASE_SEG (2:0) is hard-wired to 010.
const SMRAM_D_OPEN: u8 = 1 << 6;
const SMRAM_D_CLS: u8 = 1 << 5;
const SMRAM_D_LCK: u8 = 1 << 4;
const SMRAM_G_SMRAME: u8 = 1 << 3;
const SMRAM_C_BASE_SEG: u8 = 0b010;
const SMRAM_UNLOCKED_WRITABLE: u8 = SMRAM_D_OPEN | SMRAM_D_CLS | SMRAM_D_LCK | SMRAM_G_SMRAME;
/// The 82441FX's command register after reset: memory access and bus master enabled.
const RESET_COMMAND: u16 = COMMAND_MEMORY | COMMAND_BUS_MASTER;

/// Told of every change of the PAM registers (and of their values after a restore or a
/// reset). Called with the host bridge's lock held: must not touch the PCI bus.
pub trait PamListener: Send + Sync {
    /// `pam[i]` is PAM register `i` (PAM0 at 0x59).
    fn pam_changed(&self, pam: &[u8; PAM_COUNT]);
}

/// The host bridge; see the module documentation.
pub struct HostBridge {
    config: ConfigSpace,
    listener: Option<Arc<dyn PamListener>>,
}

impl fmt::Debug for HostBridge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBridge")
            .field("pam", &self.pam())
            .field("smram", &self.smram())
            .finish_non_exhaustive()
    }
}

impl Default for HostBridge {
    fn default() -> Self {
        Self::new()
    }
}

/// The host bridge's saved state: its whole configuration space (command, PAM, SMRAM,
/// interrupt line, ...).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct HostBridgeState {
    config: ConfigSpaceState,
}

const STATE_VERSION: u32 = 1;

impl HostBridge {
    /// The bridge after reset: PAM all zero (BIOS area reads ROM), SMRAM closed.
    pub fn new() -> Self {
        let mut config = ConfigSpace::new(PciIds {
            vendor: VENDOR_INTEL,
            device: DEVICE_I440FX,
            revision: REVISION_I440FX,
            class: CLASS_HOST_BRIDGE,
            subsystem_vendor: SUBSYSTEM_VENDOR_QEMU,
            subsystem: SUBSYSTEM_QEMU_PC,
        });
        config.set_u16(COMMAND, RESET_COMMAND);
        let mut pam_writable = [PAM_WRITABLE; PAM_COUNT];
        pam_writable[0] = PAM0_WRITABLE;
        config.set_writable(PAM_BASE, &pam_writable);
        config.set_u8(SMRAM, SMRAM_C_BASE_SEG);
        config.set_writable(SMRAM, &[SMRAM_UNLOCKED_WRITABLE]);
        HostBridge {
            config,
            listener: None,
        }
    }

    /// Sends PAM changes to `listener` from now on.
    pub fn set_pam_listener(&mut self, listener: Arc<dyn PamListener>) {
        self.listener = Some(listener);
    }

    /// PAM0 to PAM6.
    pub fn pam(&self) -> [u8; PAM_COUNT] {
        let mut pam = [0; PAM_COUNT];
        for (i, p) in pam.iter_mut().enumerate() {
            *p = self.config.read_u8(PAM_BASE + i);
        }
        pam
    }

    /// The SMRAM control register.
    pub fn smram(&self) -> u8 {
        self.config.read_u8(SMRAM)
    }

    fn tell_listener(&self) {
        if let Some(l) = &self.listener {
            l.pam_changed(&self.pam());
        }
    }

    /// D_LCK set: G_SMRAME and D_LCK become read-only, D_OPEN clears and stays clear.
    fn apply_smram_lock(&mut self) {
        let smram = self.smram();
        if smram & SMRAM_D_LCK != 0 {
            self.config.set_u8(SMRAM, smram & !SMRAM_D_OPEN);
            self.config.set_writable(SMRAM, &[SMRAM_D_CLS]);
        } else {
            self.config.set_writable(SMRAM, &[SMRAM_UNLOCKED_WRITABLE]);
        }
    }

    /// Checks PAM and SMRAM values a restore would load.
    fn check_chipset(config: &ConfigSpace) -> Result<(), StateError> {
        let err = |detail: String| StateError::new("host bridge", detail);
        for i in 0..PAM_COUNT {
            let writable = if i == 0 { PAM0_WRITABLE } else { PAM_WRITABLE };
            let pam = config.read_u8(PAM_BASE + i);
            if pam & !writable != 0 {
                return Err(err(format!("PAM{i} = {pam:#x}: reserved bits set")));
            }
        }
        let smram = config.read_u8(SMRAM);
        if smram & !SMRAM_UNLOCKED_WRITABLE != SMRAM_C_BASE_SEG {
            return Err(err(format!("SMRAM = {smram:#x}")));
        }
        Ok(())
    }
}

impl PciDevice for HostBridge {
    fn bars(&self) -> Vec<BarRequest> {
        Vec::new()
    }

    fn config_read(&mut self, offset: u16) -> u32 {
        self.config.read(offset)
    }

    fn config_write(&mut self, offset: u16, sub: u8, data: &[u8]) {
        let pam = self.pam();
        self.config.write(offset, sub, data);
        self.apply_smram_lock();
        if self.pam() != pam {
            self.tell_listener();
        }
    }

    fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn bar_write(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
}

impl Lifecycle for HostBridge {
    fn id(&self) -> String {
        "pci-00:00.0".into()
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(
            STATE_VERSION,
            &HostBridgeState {
                config: self.config.state(),
            },
        )
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        let s: HostBridgeState = state.parse("host bridge", STATE_VERSION)?;
        let mut config = self.config.clone();
        config.restore(&s.config)?;
        Self::check_chipset(&config)?;
        self.config = config;
        self.apply_smram_lock();
        self.tell_listener();
        Ok(())
    }

    fn reset(&mut self) {
        let listener = self.listener.take();
        *self = HostBridge::new();
        self.listener = listener;
        self.tell_listener();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<[u8; PAM_COUNT]>>);

    impl PamListener for Recorder {
        fn pam_changed(&self, pam: &[u8; PAM_COUNT]) {
            self.0.lock().unwrap().push(*pam);
        }
    }

    fn byte(hb: &mut HostBridge, offset: usize) -> u8 {
        (hb.config_read((offset & !3) as u16) >> ((offset & 3) * 8)) as u8
    }

    #[test]
    fn identity() {
        let mut hb = HostBridge::new();
        assert_eq!(hb.config_read(0), 0x1237_8086);
        assert_eq!(hb.config_read(8), 0x0600_0002);
        assert_eq!(hb.config_read(0x0c) >> 16 & 0xff, 0, "header type 0");
        assert!(hb.bars().is_empty());
        assert_eq!(hb.config_read(0x10), 0);
        assert_eq!(hb.config_read(4) & 0xffff, 6);
        assert_eq!(hb.config_read(0x3c) >> 8 & 0xff, 0, "no interrupt pin");
        assert_eq!(hb.config_read(0x2c), 0x1100_1af4, "QEMU's subsystem IDs");
    }

    #[test]
    fn pam_registers_are_stored_and_reported() {
        let mut hb = HostBridge::new();
        let rec = Arc::new(Recorder::default());
        hb.set_pam_listener(rec.clone());
        // PAM0 at 0x59 is byte 1 of dword 0x58; a dword write at 0x5c covers PAM3-6.
        hb.config_write(0x58, 1, &[0xff, 0x33, 0x11]);
        hb.config_write(0x5c, 0, &[0x33, 0x22, 0xff, 0x30]);
        assert_eq!(hb.pam(), [0x30, 0x33, 0x11, 0x33, 0x22, 0x33, 0x30]);
        assert_eq!(byte(&mut hb, 0x59), 0x30, "PAM0 reserved bits read zero");
        assert_eq!(byte(&mut hb, 0x58), 0, "0x58 is not PAM");
        // An unchanged PAM is not reported again.
        hb.config_write(0x5c, 0, &[0x33]);
        assert_eq!(rec.0.lock().unwrap().len(), 2);
        assert_eq!(rec.0.lock().unwrap()[1], hb.pam());
    }

    #[test]
    fn smram_lock() {
        let mut hb = HostBridge::new();
        assert_eq!(hb.smram(), 0x02);
        hb.config_write(0x70, 2, &[0xef]);
        assert_eq!(hb.smram(), 0x6a, "C_BASE_SEG and bit 7 read-only");
        let locked = SMRAM_D_LCK | SMRAM_G_SMRAME | SMRAM_D_OPEN | SMRAM_C_BASE_SEG;
        hb.config_write(0x70, 2, &[locked]);
        assert_eq!(
            hb.smram(),
            SMRAM_D_LCK | SMRAM_G_SMRAME | 2,
            "D_OPEN cleared"
        );
        hb.config_write(0x70, 2, &[SMRAM_D_OPEN | SMRAM_D_CLS]);
        assert_eq!(hb.smram(), SMRAM_D_LCK | SMRAM_G_SMRAME | SMRAM_D_CLS | 2);
        hb.reset();
        assert_eq!(hb.smram(), 0x02);
    }

    #[test]
    fn save_restore() {
        let mut hb = HostBridge::new();
        hb.config_write(0x58, 1, &[0x10, 0x33]);
        hb.config_write(4, 0, &[0x07, 0x04]);
        hb.config_write(0x70, 2, &[SMRAM_G_SMRAME]);
        hb.config_write(0x3c, 0, &[0x0b]);
        let saved = hb.save().unwrap();

        let mut other = HostBridge::new();
        let rec = Arc::new(Recorder::default());
        other.set_pam_listener(rec.clone());
        other.restore(&saved).unwrap();
        assert_eq!(other.pam(), hb.pam());
        assert_eq!(other.config_read(4) & 0xffff, 0x0407);
        assert_eq!(other.smram(), SMRAM_G_SMRAME | 2);
        assert_eq!(other.config_read(0x3c) & 0xff, 0x0b);
        assert_eq!(rec.0.lock().unwrap().as_slice(), &[hb.pam()]);

        let mut bad = saved.clone();
        bad.data["config"]["bytes"][PAM_BASE] = 0xff.into();
        assert!(other.restore(&bad).is_err());
        let mut bad = saved.clone();
        bad.data["config"]["bytes"][SMRAM] = 0x80.into();
        assert!(other.restore(&bad).is_err());
        let mut bad = saved.clone();
        bad.data["config"]["bytes"][0] = 0x11.into();
        assert!(other.restore(&bad).is_err(), "another vendor");
        assert_eq!(other.pam(), hb.pam(), "refused states change nothing");
        let mut bad = saved;
        bad.version = 9;
        assert!(other.restore(&bad).is_err());
    }
}
