//! Random guest accesses, bounded in number: the transport must never panic, and must
//! keep answering sensibly afterwards.

use super::*;

/// xorshift64*: deterministic, so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A BAR0 offset: mostly inside the interesting regions, sometimes anywhere.
fn bar_offset(rng: &mut Rng, layout: &layout::BarLayout) -> u64 {
    match rng.below(9) {
        0 => rng.next(),
        1 => rng.below(layout.size * 2),
        2 => layout::ISR_OFFSET + rng.below(8),
        3 => layout::DEVICE_OFFSET + rng.below(layout::DEVICE_LEN + 8),
        4 => layout::NOTIFY_OFFSET + rng.below(16),
        5 => layout.table_offset + rng.below(layout.table_len + 16),
        6 => layout.pba_offset + rng.below(16),
        _ => rng.below(0x40),
    }
}

/// A value a driver might write: small numbers, the status bits, or anything.
fn plausible(rng: &mut Rng, len: usize) -> Vec<u8> {
    let value = match rng.below(4) {
        0 => rng.below(4),
        1 => [0u64, 1, 3, 7, 0xb, 0xf, 0x8f][rng.below(7) as usize],
        2 => 0x1000 * rng.below(0x100),
        _ => rng.next(),
    };
    value.to_le_bytes()[..len.min(8)].to_vec()
}

fn one_access(rig: &mut Rig, rng: &mut Rng) {
    let layout = *rig.dev.layout();
    let len = [1usize, 2, 4, 8, 3, 0][rng.below(6) as usize];
    let bar = if rng.below(8) == 0 { 2 } else { 0 };
    match rng.below(6) {
        0 => {
            let offset = bar_offset(rng, &layout);
            let mut data = vec![0u8; len];
            rig.dev.bar_read(bar, offset, &mut data);
        }
        1 | 2 => {
            let mut offset = bar_offset(rng, &layout);
            if rng.below(2) == 0 && len.is_power_of_two() {
                offset &= !(len as u64 - 1); // a well-formed access
            }
            let data = plausible(rng, len);
            rig.dev.bar_write(bar, offset, &data);
        }
        3 => {
            rig.dev.config_read(rng.below(0x1100) as u16);
        }
        4 => {
            // Mostly the header and capabilities; any sub and length.
            let span = if rng.below(4) == 0 { 0x1100 } else { 0xb0 };
            let offset = rng.below(span) as u16;
            let data = plausible(rng, len);
            rig.dev.config_write(offset & !3, rng.below(5) as u8, &data);
        }
        _ => match rng.below(4) {
            0 => rig.dev.interrupt().signal_queue(rng.below(4) as u16),
            1 => rig.dev.interrupt().signal_config(),
            2 => rig.dev.bar_moved(0, Some(rng.next() & !0xffff)),
            _ => {
                if rig.dev.is_active() {
                    serve(&rig.log);
                }
            }
        },
    }
}

#[test]
fn random_accesses_never_panic() {
    let mem = memory();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut msi_events, mut activations, mut needs_reset) = (0, 0, 0);
    for round in 0..40 {
        let mut rig = Rig::on(mem.clone());
        // Half the rounds start from a working device, so the random accesses also hit
        // an active one.
        if round % 2 == 0 {
            rig.msix_control(true, false);
            rig.bring_up(&mem, EVENT_IDX);
        }
        for _ in 0..2_000 {
            one_access(&mut rig, &mut rng);
        }
        msi_events += rig.msi.take().len();
        activations += lock(&rig.log)
            .calls
            .iter()
            .filter(|c| **c == "activate")
            .count();
        needs_reset += usize::from(rig.status() & STATUS_NEEDS_RESET != 0);
        // Whatever happened, the device still saves, restores and resets.
        rig.dev.pause().unwrap();
        let saved = rig.dev.save().unwrap();
        let mut other = Rig::on(mem.clone());
        other.dev.restore(&saved).unwrap();
        other.dev.resume().unwrap();
        rig.dev.reset();
        assert_eq!(rig.status(), 0);
        assert!(!rig.dev.is_active());
    }
    // The accesses reached deep enough to matter.
    assert!(msi_events > 10, "{msi_events} MSI-X events");
    assert!(activations >= 20, "{activations} activations");
    assert!(needs_reset > 0);
}
