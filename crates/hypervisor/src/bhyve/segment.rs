//! Segment registers: the backend-neutral [`SegmentRegister`] against bhyve's `struct
//! seg_desc` (base, byte-granular limit, VMX access rights) plus the selector, which bhyve
//! keeps in a separate register (`VM_SET_REGISTER(VM_REG_GUEST_CS)` etc.).
//!
//! VMX access rights (Intel SDM vol. 3, "Guest Register State"; vmm.h `SEG_DESC_*`):
//! type bits 0-3, S 4, DPL 5-6, P 7, AVL 12, L 13, D/B 14, G 15, unusable 16.

use super::abi::SegDesc;
use crate::SegmentRegister;

pub const AR_TYPE_MASK: u32 = 0xf;
pub const AR_S: u32 = 1 << 4;
pub const AR_DPL_SHIFT: u32 = 5;
pub const AR_P: u32 = 1 << 7;
pub const AR_AVL: u32 = 1 << 12;
pub const AR_L: u32 = 1 << 13;
pub const AR_DB: u32 = 1 << 14;
pub const AR_G: u32 = 1 << 15;
pub const AR_UNUSABLE: u32 = 1 << 16;

/// VMX access rights of `s`.
///
/// A segment that is not present is marked unusable as well: VM entry refuses a usable
/// data segment with P = 0, and KVM reads "not present" the same way. Every other field is
/// kept, so a usable segment converts back exactly.
pub fn access_rights(s: &SegmentRegister) -> u32 {
    let mut ar = u32::from(s.type_) & AR_TYPE_MASK
        | u32::from(s.dpl & 3) << AR_DPL_SHIFT
        | if s.s { AR_S } else { 0 }
        | if s.present { AR_P } else { 0 }
        | if s.avl { AR_AVL } else { 0 }
        | if s.l { AR_L } else { 0 }
        | if s.db { AR_DB } else { 0 }
        | if s.g { AR_G } else { 0 };
    if s.unusable || !s.present {
        ar |= AR_UNUSABLE;
    }
    ar
}

/// bhyve's descriptor for `s` (the selector travels separately).
pub fn to_seg_desc(s: &SegmentRegister) -> SegDesc {
    SegDesc {
        base: s.base,
        limit: s.limit,
        access: access_rights(s),
    }
}

/// The neutral segment from bhyve's descriptor and the selector register.
pub fn from_seg_desc(desc: &SegDesc, selector: u16) -> SegmentRegister {
    let ar = desc.access;
    SegmentRegister {
        base: desc.base,
        limit: desc.limit,
        selector,
        type_: (ar & AR_TYPE_MASK) as u8,
        present: ar & AR_P != 0,
        dpl: ((ar >> AR_DPL_SHIFT) & 3) as u8,
        db: ar & AR_DB != 0,
        s: ar & AR_S != 0,
        l: ar & AR_L != 0,
        g: ar & AR_G != 0,
        avl: ar & AR_AVL != 0,
        unusable: ar & AR_UNUSABLE != 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(type_: u8, s: bool, dpl: u8, l: bool, db: bool, g: bool) -> SegmentRegister {
        SegmentRegister {
            base: 0,
            limit: if g { 0xffff_ffff } else { 0xffff },
            selector: 0x10,
            type_,
            present: true,
            dpl,
            db,
            s,
            l,
            g,
            avl: false,
            unusable: false,
        }
    }

    #[test]
    fn well_known_access_rights() {
        // Real-mode data segment and 64-bit ring-0 code segment (the fact sheet's examples).
        assert_eq!(access_rights(&seg(3, true, 0, false, false, false)), 0x93);
        assert_eq!(access_rights(&seg(0xb, true, 0, true, false, true)), 0xa09b);
        // Flat 32-bit code and data, ring 0; ring-3 data; a busy 64-bit TSS.
        assert_eq!(access_rights(&seg(0xb, true, 0, false, true, true)), 0xc09b);
        assert_eq!(access_rights(&seg(3, true, 3, false, true, true)), 0xc0f3);
        assert_eq!(
            access_rights(&seg(0xb, false, 0, false, false, false)),
            0x8b
        );
        // The boot GDT's encoding (boot::gdt::SegmentDescriptor::vmx_access_rights) agrees.
        let d = seg(0xb, true, 0, false, true, true);
        assert_eq!(from_seg_desc(&to_seg_desc(&d), 0x10), d);
    }

    #[test]
    fn every_usable_segment_round_trips() {
        for bits in 0u32..(1 << 12) {
            let s = SegmentRegister {
                base: 0x1234_5678_9abc_def0 ^ u64::from(bits),
                limit: 0xfff0_0000 | bits,
                selector: (bits as u16) << 3,
                type_: (bits & 0xf) as u8,
                present: true,
                dpl: ((bits >> 4) & 3) as u8,
                db: bits & (1 << 6) != 0,
                s: bits & (1 << 7) != 0,
                l: bits & (1 << 8) != 0,
                g: bits & (1 << 9) != 0,
                avl: bits & (1 << 10) != 0,
                unusable: false,
            };
            let desc = to_seg_desc(&s);
            assert_eq!(from_seg_desc(&desc, s.selector), s, "bits {bits:#x}");
            // And the other way: access rights -> neutral -> access rights.
            assert_eq!(access_rights(&from_seg_desc(&desc, 0)), desc.access);
        }
    }

    #[test]
    fn unusable_and_not_present() {
        // An unusable LDT keeps its other bits and round-trips.
        let mut ldt = seg(2, false, 0, false, false, false);
        ldt.unusable = true;
        let desc = to_seg_desc(&ldt);
        assert_eq!(desc.access, 0x1_0082);
        assert_eq!(from_seg_desc(&desc, 0x10), ldt);
        // A null data segment (P = 0) becomes unusable: VM entry would refuse it usable.
        let mut null = seg(3, true, 0, false, false, false);
        null.present = false;
        let back = from_seg_desc(&to_seg_desc(&null), 0x10);
        assert!(back.unusable && !back.present);
        assert_eq!(back.type_, 3);
        // Bit 16 alone (what a kernel may report for an unusable segment).
        let s = from_seg_desc(
            &SegDesc {
                base: 0,
                limit: 0,
                access: AR_UNUSABLE,
            },
            0,
        );
        assert!(s.unusable && !s.present);
        assert_eq!(access_rights(&s), AR_UNUSABLE);
    }
}
