//! The in-kernel PIC pair, IOAPIC and PIT as byte blobs (`IrqChipState`), and the checks a
//! blob must pass before it goes back to the kernel.
//!
//! Blobs are the kernel structures byte for byte (`kvm_pic_state`, `kvm_ioapic_state`,
//! `kvm_pit_state2`). KVM copies what it is given into its models and trusts most fields
//! afterwards (the IOAPIC's base address decides which MMIO it claims, a PIC's ELCR mask
//! decides which lines may be level triggered), so the fields a guest could never have
//! produced are refused here.

use kvm_bindings::{
    kvm_ioapic_state, kvm_irqchip, kvm_irqchip__bindgen_ty_1, kvm_pic_state, kvm_pit_state2,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_PIT_FLAGS_HPET_LEGACY,
    KVM_PIT_FLAGS_SPEAKER_DATA_ON,
};
use zerocopy::{FromBytes, IntoBytes};

use crate::{HypervisorError, IrqChipState, Result};

/// The `backend` tag of KVM blobs.
pub const BACKEND: &str = "kvm";
/// Where KVM's IOAPIC lives (it does not move).
const IOAPIC_BASE: u64 = 0xfec0_0000;
/// ELCR bits KVM lets a guest set on the master and the slave (IRQ 0, 1, 2, 8 and 13 are
/// edge only).
const ELCR_MASKS: [u8; 2] = [0xf8, 0xde];
const IOAPIC_PINS: u32 = 24;
/// `kvm_pit_channel_state.mode` after reset: no mode programmed yet.
const PIT_MODE_UNSET: u8 = 0xff;
/// KVM's RW_STATE_LSB .. RW_STATE_WORD1.
const PIT_RW_STATE_MAX: u8 = 4;

fn invalid<T>(what: String) -> Result<T> {
    Err(HypervisorError::Invalid(format!("irqchip state: {what}")))
}

/// The first `len` bytes of the chip union (the part that belongs to the chip asked for).
fn chip_bytes(chip: &kvm_irqchip, len: usize) -> Vec<u8> {
    chip.chip.as_bytes()[..len].to_vec()
}

pub fn pic_blob(chip: &kvm_irqchip) -> Vec<u8> {
    chip_bytes(chip, std::mem::size_of::<kvm_pic_state>())
}

pub fn ioapic_blob(chip: &kvm_irqchip) -> Vec<u8> {
    chip_bytes(chip, std::mem::size_of::<kvm_ioapic_state>())
}

pub fn pit_blob(pit: &kvm_pit_state2) -> Vec<u8> {
    pit.as_bytes().to_vec()
}

fn parse<T: FromBytes>(what: &str, bytes: &[u8]) -> Result<T> {
    T::read_from_bytes(bytes).or_else(|_| {
        invalid(format!(
            "{what} is {} bytes, expected {}",
            bytes.len(),
            std::mem::size_of::<T>()
        ))
    })
}

/// Checks a PIC blob; `slave` selects which ELCR mask applies.
fn parse_pic(bytes: &[u8], slave: bool) -> Result<kvm_pic_state> {
    let name = if slave { "slave PIC" } else { "master PIC" };
    let p: kvm_pic_state = parse(name, bytes)?;
    let mask = ELCR_MASKS[usize::from(slave)];
    if p.priority_add > 7 || p.init_state > 3 || p.irq_base & 7 != 0 {
        return invalid(format!(
            "{name}: priority {}, init state {}, vector base {:#x}",
            p.priority_add, p.init_state, p.irq_base
        ));
    }
    if p.elcr_mask & !mask != 0 || p.elcr & !p.elcr_mask != 0 {
        return invalid(format!(
            "{name}: ELCR {:#x} with mask {:#x}",
            p.elcr, p.elcr_mask
        ));
    }
    Ok(p)
}

fn parse_ioapic(bytes: &[u8]) -> Result<kvm_ioapic_state> {
    let io: kvm_ioapic_state = parse("IOAPIC", bytes)?;
    if io.base_address != IOAPIC_BASE {
        return invalid(format!("IOAPIC at {:#x}", io.base_address));
    }
    if io.id > 0xf || io.ioregsel > 0xff || io.irr >> IOAPIC_PINS != 0 {
        return invalid(format!(
            "IOAPIC id {:#x}, register select {:#x}, IRR {:#x}",
            io.id, io.ioregsel, io.irr
        ));
    }
    Ok(io)
}

fn parse_pit(bytes: &[u8]) -> Result<kvm_pit_state2> {
    let pit: kvm_pit_state2 = parse("PIT", bytes)?;
    if pit.flags & !(KVM_PIT_FLAGS_HPET_LEGACY | KVM_PIT_FLAGS_SPEAKER_DATA_ON) != 0 {
        return invalid(format!("PIT flags {:#x}", pit.flags));
    }
    for (i, c) in pit.channels.iter().enumerate() {
        let ok = (c.mode <= 5 || c.mode == PIT_MODE_UNSET)
            && c.rw_mode <= 3
            && c.read_state <= PIT_RW_STATE_MAX
            && c.write_state <= PIT_RW_STATE_MAX
            && c.count_latched <= PIT_RW_STATE_MAX
            && c.status_latched <= 1
            && c.bcd <= 1
            && c.gate <= 1
            && c.count <= 0x10000;
        if !ok {
            return invalid(format!("PIT channel {i}: {c:?}"));
        }
    }
    Ok(pit)
}

/// The kernel structures of a validated state, ready for KVM_SET_IRQCHIP ×3 and
/// KVM_SET_PIT2.
pub struct KernelIrqChip {
    pub chips: [kvm_irqchip; 3],
    pub pit: kvm_pit_state2,
}

pub fn to_kernel(state: &IrqChipState) -> Result<KernelIrqChip> {
    if state.backend != BACKEND {
        return invalid(format!(
            "made by the {:?} backend, this is {BACKEND}",
            state.backend
        ));
    }
    if let Some(blob) = state.blobs.first() {
        return invalid(format!(
            "{} named blobs (the first is {:?}); KVM's state has none",
            state.blobs.len(),
            blob.name
        ));
    }
    let master = parse_pic(&state.pic_master, false)?;
    let slave = parse_pic(&state.pic_slave, true)?;
    let ioapic = parse_ioapic(&state.ioapic)?;
    let pit = parse_pit(&state.pit)?;
    let chip = |chip_id, chip| kvm_irqchip {
        chip_id,
        pad: 0,
        chip,
    };
    Ok(KernelIrqChip {
        chips: [
            chip(
                KVM_IRQCHIP_PIC_MASTER,
                kvm_irqchip__bindgen_ty_1 { pic: master },
            ),
            chip(
                KVM_IRQCHIP_PIC_SLAVE,
                kvm_irqchip__bindgen_ty_1 { pic: slave },
            ),
            chip(KVM_IRQCHIP_IOAPIC, kvm_irqchip__bindgen_ty_1 { ioapic }),
        ],
        pit,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state shaped like a freshly created KVM irqchip.
    fn fresh() -> IrqChipState {
        let pic = |elcr_mask| kvm_pic_state {
            elcr_mask,
            ..Default::default()
        };
        let master = kvm_irqchip {
            chip_id: KVM_IRQCHIP_PIC_MASTER,
            pad: 0,
            chip: kvm_irqchip__bindgen_ty_1 { pic: pic(0xf8) },
        };
        let slave = kvm_irqchip {
            chip_id: KVM_IRQCHIP_PIC_SLAVE,
            pad: 0,
            chip: kvm_irqchip__bindgen_ty_1 { pic: pic(0xde) },
        };
        let ioapic = kvm_irqchip {
            chip_id: KVM_IRQCHIP_IOAPIC,
            pad: 0,
            chip: kvm_irqchip__bindgen_ty_1 {
                ioapic: kvm_ioapic_state {
                    base_address: IOAPIC_BASE,
                    ..Default::default()
                },
            },
        };
        let mut pit = kvm_pit_state2::default();
        for c in &mut pit.channels {
            c.mode = PIT_MODE_UNSET;
            c.count = 0x10000;
            c.gate = 1;
        }
        IrqChipState {
            backend: BACKEND.into(),
            pic_master: pic_blob(&master),
            pic_slave: pic_blob(&slave),
            ioapic: ioapic_blob(&ioapic),
            pit: pit_blob(&pit),
            blobs: Vec::new(),
        }
    }

    #[test]
    fn blobs_have_the_kernel_sizes_and_round_trip() {
        let s = fresh();
        assert_eq!(s.pic_master.len(), 16);
        assert_eq!(s.ioapic.len(), 216);
        assert_eq!(s.pit.len(), 112);
        let k = to_kernel(&s).unwrap();
        assert_eq!(pic_blob(&k.chips[0]), s.pic_master);
        assert_eq!(pic_blob(&k.chips[1]), s.pic_slave);
        assert_eq!(ioapic_blob(&k.chips[2]), s.ioapic);
        assert_eq!(pit_blob(&k.pit), s.pit);
        assert_eq!(k.chips[2].chip_id, KVM_IRQCHIP_IOAPIC);
    }

    /// KVM's state serialises exactly as it did before bhyve's named blobs existed, and
    /// such old snapshots still load.
    #[test]
    fn json_has_no_named_blobs_field() {
        let s = fresh();
        let json = serde_json::to_string(&s).unwrap();
        assert!(!json.contains("blobs"), "{json}");
        assert!(
            json.starts_with("{\"backend\":\"kvm\",\"pic_master\":["),
            "{json}"
        );
        let back: IrqChipState = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn malformed_blobs_are_refused() {
        type Corruption = Box<dyn Fn(&mut IrqChipState)>;
        let mut cases: Vec<Corruption> = vec![
            Box::new(|s| s.backend = "bhyve".into()),
            Box::new(|s| s.pic_master.push(0)),
            Box::new(|s| s.pic_slave.clear()),
            Box::new(|s| s.ioapic.truncate(100)),
            Box::new(|s| s.pit.extend_from_slice(&[0; 8])),
            Box::new(|s| s.pic_master[4] = 9),     // priority_add
            Box::new(|s| s.pic_master[9] = 4),     // init_state
            Box::new(|s| s.pic_slave[5] = 0x21),   // irq_base not a multiple of 8
            Box::new(|s| s.pic_slave[14] = 0x01),  // ELCR outside the mask
            Box::new(|s| s.pic_master[15] = 0xff), // ELCR mask widened
            Box::new(|s| s.ioapic[0] = 0x10),      // base address moved
            Box::new(|s| s.ioapic[12] = 0x10),     // id > 15
            Box::new(|s| s.ioapic[19] = 0x01),     // IRR beyond pin 23
            Box::new(|s| s.pit[72] = 4),           // PIT flags
            Box::new(|s| s.pit[13] = 6),           // channel 0 mode
            Box::new(|s| s.pit[24 + 3] = 1),       // channel 1 count > 0x10000
            Box::new(|s| {
                s.blobs.push(crate::KernelBlob {
                    name: "vm".into(),
                    data: vec![0; 8],
                })
            }),
        ];
        for (i, corrupt) in cases.drain(..).enumerate() {
            let mut s = fresh();
            corrupt(&mut s);
            assert!(to_kernel(&s).is_err(), "case {i} accepted");
        }
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut accepted = 0;
        for _ in 0..2000 {
            let mut s = fresh();
            for blob in [
                &mut s.pic_master,
                &mut s.pic_slave,
                &mut s.ioapic,
                &mut s.pit,
            ] {
                let i = (next() as usize) % blob.len();
                blob[i] = next() as u8;
            }
            accepted += usize::from(to_kernel(&s).is_ok());
        }
        assert!(accepted < 2000);
    }
}
