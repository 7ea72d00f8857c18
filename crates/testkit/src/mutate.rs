//! Structured mutations of a valid input, as proptest strategies: what a corrupted file, a
//! cut stream or a hostile peer produces. Positions are taken modulo the input's length when
//! applied, so one strategy serves inputs of any size.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;

/// One change to an input.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// Flip bit `bit` of byte `at`.
    Flip { at: usize, bit: u8 },
    /// Set byte `at`.
    Set { at: usize, byte: u8 },
    /// Keep the first `len` bytes.
    Truncate { len: usize },
    /// Copy `len` bytes from `from` over the bytes at `to`.
    Splice { from: usize, to: usize, len: usize },
    /// Insert bytes before `at`.
    Insert { at: usize, bytes: Vec<u8> },
    /// Remove `len` bytes from `at`.
    Remove { at: usize, len: usize },
    /// Set the little-endian field of `width` bytes (1, 2, 4 or 8) at `at` to `value`
    /// (truncated to the width): a length, count or offset set to an extreme.
    Field { at: usize, width: u8, value: u64 },
}

/// Values that break length, count and offset arithmetic.
pub fn extreme_value() -> BoxedStrategy<u64> {
    prop_oneof![
        3 => select(vec![
            0u64,
            1,
            2,
            3,
            4,
            7,
            8,
            0x7f,
            0x80,
            0xff,
            0xfff,
            0x1000,
            0x7fff,
            0x8000,
            0xffff,
            0x10_0000,
            0x7fff_ffff,
            0x8000_0000,
            0xffff_fff0,
            0xffff_ffff,
            0x1_0000_0000,
            0x8000_0000_0000_0000,
            u64::MAX - 0xfff,
            u64::MAX,
        ]),
        1 => any::<u64>(),
    ]
    .boxed()
}

/// One mutation; `Field` mutations go to one of `fields` (offset, width) — the input's known
/// length, count and offset fields — or anywhere.
pub fn mutation(fields: &[(usize, u8)]) -> BoxedStrategy<Mutation> {
    let anywhere = (any::<usize>(), select(vec![1u8, 2, 4, 8]));
    let field = if fields.is_empty() {
        anywhere.boxed()
    } else {
        prop_oneof![3 => select(fields.to_vec()), 1 => anywhere].boxed()
    };
    prop_oneof![
        3 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        1 => any::<usize>().prop_map(|len| Mutation::Truncate { len }),
        1 => (any::<usize>(), any::<usize>(), 1usize..256)
            .prop_map(|(from, to, len)| Mutation::Splice { from, to, len }),
        1 => (any::<usize>(), vec(any::<u8>(), 1..32))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), 1usize..256).prop_map(|(at, len)| Mutation::Remove { at, len }),
        4 => (field, extreme_value())
            .prop_map(|((at, width), value)| Mutation::Field { at, width, value }),
    ]
    .boxed()
}

/// One to four mutations (see [`mutation`]).
pub fn mutations(fields: &[(usize, u8)]) -> BoxedStrategy<Vec<Mutation>> {
    vec(mutation(fields), 1..=4).boxed()
}

/// Applies `m` to `data`.
pub fn apply(data: &mut Vec<u8>, m: &Mutation) {
    let len = data.len();
    match m {
        Mutation::Flip { at, bit } if len > 0 => data[at % len] ^= 1 << (bit % 8),
        Mutation::Set { at, byte } if len > 0 => data[at % len] = *byte,
        Mutation::Truncate { len: keep } => data.truncate(keep % (len + 1)),
        Mutation::Splice { from, to, len: n } if len > 0 => {
            let (from, to) = (from % len, to % len);
            let n = (*n).min(len - from).min(len - to);
            data.copy_within(from..from + n, to);
        }
        Mutation::Insert { at, bytes } => {
            let at = at % (len + 1);
            data.splice(at..at, bytes.iter().copied());
        }
        Mutation::Remove { at, len: n } if len > 0 => {
            let at = at % len;
            data.drain(at..(at + n).min(len));
        }
        Mutation::Field { at, width, value } => {
            let w = usize::from(*width).min(8);
            if let Some(dst) = at.checked_add(w).and_then(|end| data.get_mut(*at..end)) {
                dst.copy_from_slice(&value.to_le_bytes()[..w]);
            }
        }
        _ => {}
    }
}

/// `data` with every mutation of `ms` applied in order.
pub fn apply_all(data: &[u8], ms: &[Mutation]) -> Vec<u8> {
    let mut out = data.to_vec();
    for m in ms {
        apply(&mut out, m);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_apply_at_any_length() {
        let ms = [
            Mutation::Flip { at: 9, bit: 3 },
            Mutation::Set { at: 1, byte: 7 },
            Mutation::Splice {
                from: 0,
                to: 2,
                len: 99,
            },
            Mutation::Field {
                at: 1,
                width: 2,
                value: 0xabcd,
            },
            Mutation::Insert {
                at: 100,
                bytes: vec![1, 2],
            },
            Mutation::Remove { at: 0, len: 1 },
            Mutation::Truncate { len: 4 },
        ];
        assert_eq!(apply_all(&[0, 0, 0, 0], &ms), vec![2, 0, 0xcd, 0xab]);
        for n in 0..3 {
            let _ = apply_all(&vec![0xaa; n], &ms);
        }
    }
}
