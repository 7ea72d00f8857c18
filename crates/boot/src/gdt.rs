//! The boot GDT and the segment state derived from it.
//!
//! All three boot protocols enter the kernel in 32-bit flat protected mode with paging off.
//! The Linux 32-bit boot protocol requires `__BOOT_CS` = 0x10 and `__BOOT_DS` = 0x18, so the
//! same table serves PVH and Multiboot too (their selectors are unspecified).

use vm_memory::{Bytes, GuestAddress, GuestMemory};

use crate::layout::GDT_ADDR;

/// Flat 32-bit code segment: base 0, limit 4 GiB, present, ring 0, execute/read, accessed.
pub const GDT_CODE32: u64 = gdt_entry(0xc09b, 0, 0xfffff);
/// Flat data segment: base 0, limit 4 GiB, present, ring 0, read/write, accessed.
pub const GDT_DATA: u64 = gdt_entry(0xc093, 0, 0xfffff);
/// 64-bit code segment (L=1): for a later 64-bit entry.
pub const GDT_CODE64: u64 = gdt_entry(0xa09b, 0, 0xfffff);

/// The boot GDT: null, null, code32 (0x10), data (0x18), code64 (0x20).
pub const GDT_TABLE: [u64; 5] = [0, 0, GDT_CODE32, GDT_DATA, GDT_CODE64];

/// Selector of the flat 32-bit code segment (`__BOOT_CS`).
pub const CODE32_SELECTOR: u16 = 0x10;
/// Selector of the flat data segment (`__BOOT_DS`).
pub const DATA_SELECTOR: u16 = 0x18;
/// Selector of the 64-bit code segment.
pub const CODE64_SELECTOR: u16 = 0x20;
/// GDTR limit of [`GDT_TABLE`] (size in bytes minus one).
pub const GDT_LIMIT: u16 = (GDT_TABLE.len() * 8 - 1) as u16;

/// Builds a descriptor from `flags` (bits 15..12: G, D/B, L, AVL; bits 7..0: the access byte),
/// a 32-bit base and a 20-bit limit, in the layout of the processor's segment descriptors.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

/// The decoded (hidden, "cached") state of a segment register loaded from a descriptor:
/// what a VMM writes into the vCPU's segment registers so that they match the GDT.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentDescriptor {
    /// Selector (index * 8, TI = 0, RPL = 0).
    pub selector: u16,
    /// Segment base.
    pub base: u64,
    /// Effective limit in bytes (already scaled by the granularity bit: 0xffff_ffff for a
    /// flat segment), as KVM's `kvm_segment.limit` and bhyve's `seg_desc.limit` expect.
    pub limit: u32,
    /// Type field (4 bits): 0xb = code execute/read accessed, 0x3 = data read/write accessed.
    pub type_: u8,
    /// S bit: 1 for code/data, 0 for system segments.
    pub s: bool,
    /// Descriptor privilege level.
    pub dpl: u8,
    /// Present bit.
    pub present: bool,
    /// Available-for-software bit.
    pub avl: bool,
    /// L bit (64-bit code segment).
    pub l: bool,
    /// D/B bit (32-bit default operand size).
    pub db: bool,
    /// Granularity bit (limit in 4 KiB units in the descriptor).
    pub g: bool,
}

impl SegmentDescriptor {
    /// Access rights in the VMX/bhyve encoding: type | S<<4 | DPL<<5 | P<<7 | AVL<<12 | L<<13 |
    /// D/B<<14 | G<<15 (bit 16, "unusable", is clear).
    pub fn vmx_access_rights(&self) -> u32 {
        u32::from(self.type_ & 0xf)
            | u32::from(self.s) << 4
            | u32::from(self.dpl & 3) << 5
            | u32::from(self.present) << 7
            | u32::from(self.avl) << 12
            | u32::from(self.l) << 13
            | u32::from(self.db) << 14
            | u32::from(self.g) << 15
    }
}

/// Decodes the GDT descriptor `entry` loaded with `selector` into segment-register state.
pub fn segment_from_gdt_entry(selector: u16, entry: u64) -> SegmentDescriptor {
    let base = ((entry >> 16) & 0x00ff_ffff) | (((entry >> 56) & 0xff) << 24);
    let raw_limit = ((entry & 0xffff) | ((entry >> 32) & 0x000f_0000)) as u32;
    let g = (entry >> 55) & 1 == 1;
    let limit = if g {
        (raw_limit << 12) | 0xfff
    } else {
        raw_limit
    };
    SegmentDescriptor {
        selector,
        base,
        limit,
        type_: ((entry >> 40) & 0xf) as u8,
        s: (entry >> 44) & 1 == 1,
        dpl: ((entry >> 45) & 3) as u8,
        present: (entry >> 47) & 1 == 1,
        avl: (entry >> 52) & 1 == 1,
        l: (entry >> 53) & 1 == 1,
        db: (entry >> 54) & 1 == 1,
        g,
    }
}

/// The segment state for `selector` in the boot GDT, `None` for a null or out-of-table one.
pub fn boot_segment(selector: u16) -> Option<SegmentDescriptor> {
    let entry = *GDT_TABLE.get(usize::from(selector >> 3))?;
    (entry != 0).then(|| segment_from_gdt_entry(selector, entry))
}

/// Writes [`GDT_TABLE`] at [`GDT_ADDR`]; returns the GDTR (base, limit).
pub fn write_gdt<M: GuestMemory + ?Sized>(
    mem: &M,
) -> Result<(u64, u16), vm_memory::GuestMemoryError> {
    write_gdt_at(mem, GDT_ADDR)
}

/// [`write_gdt`] at another address (a Multiboot kernel may occupy the usual one).
pub fn write_gdt_at<M: GuestMemory + ?Sized>(
    mem: &M,
    addr: u64,
) -> Result<(u64, u16), vm_memory::GuestMemoryError> {
    let mut bytes = [0u8; GDT_TABLE.len() * 8];
    for (chunk, entry) in bytes.chunks_exact_mut(8).zip(GDT_TABLE) {
        chunk.copy_from_slice(&entry.to_le_bytes());
    }
    mem.write_slice(&bytes, GuestAddress(addr))?;
    Ok((addr, GDT_LIMIT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    #[test]
    fn known_encodings() {
        assert_eq!(GDT_CODE32, 0x00cf_9b00_0000_ffff);
        assert_eq!(GDT_DATA, 0x00cf_9300_0000_ffff);
        assert_eq!(GDT_CODE64, 0x00af_9b00_0000_ffff);
        assert_eq!(GDT_LIMIT, 39);
    }

    #[test]
    fn decode_flat_segments() {
        let cs = boot_segment(CODE32_SELECTOR).unwrap();
        assert_eq!(
            cs,
            SegmentDescriptor {
                selector: 0x10,
                base: 0,
                limit: 0xffff_ffff,
                type_: 0xb,
                s: true,
                dpl: 0,
                present: true,
                avl: false,
                l: false,
                db: true,
                g: true,
            }
        );
        assert_eq!(cs.vmx_access_rights(), 0xc09b);
        let ds = boot_segment(DATA_SELECTOR).unwrap();
        assert_eq!(ds.type_, 3);
        assert!(ds.db && ds.g && ds.present && ds.s);
        assert_eq!(ds.limit, 0xffff_ffff);
        assert_eq!(ds.vmx_access_rights(), 0xc093);
        let cs64 = boot_segment(CODE64_SELECTOR).unwrap();
        assert!(cs64.l && !cs64.db);
        assert!(boot_segment(0).is_none());
        assert!(boot_segment(8).is_none());
        assert!(boot_segment(0x28).is_none());
    }

    #[test]
    fn decode_arbitrary_base_limit() {
        let e = gdt_entry(0x0093, 0x1234_5678, 0xabcde);
        let s = segment_from_gdt_entry(0x18, e);
        assert_eq!(s.base, 0x1234_5678);
        assert_eq!(s.limit, 0xabcde);
        assert!(!s.g);
    }

    #[test]
    fn write_gdt_to_memory() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let (base, limit) = write_gdt(&mem).unwrap();
        assert_eq!((base, limit), (0x500, 39));
        let e: u64 = mem.read_obj(GuestAddress(0x510)).unwrap();
        assert_eq!(e, GDT_CODE32);
        let e: u64 = mem.read_obj(GuestAddress(0x518)).unwrap();
        assert_eq!(e, GDT_DATA);
    }
}
