//! Linear to guest-physical translation through the guest's own page tables, as the MMU
//! does it for a data access: every paging mode x86-64 firmware and kernels use, access
//! rights checked, accessed and dirty bits set.

use crate::{Exception, GuestRam};

const PRESENT: u64 = 1;
const WRITABLE: u64 = 1 << 1;
const USER: u64 = 1 << 2;
const ACCESSED: u64 = 1 << 5;
const DIRTY: u64 = 1 << 6;
const LARGE: u64 = 1 << 7;
/// Bits 51:12 of an entry: the next table or the page.
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;

const CR0_PG: u64 = 1 << 31;
const CR0_WP: u64 = 1 << 16;
const CR4_PSE: u64 = 1 << 4;
const CR4_PAE: u64 = 1 << 5;
const CR4_LA57: u64 = 1 << 12;
const EFER_LMA: u64 = 1 << 10;

/// The registers that define the translation.
#[derive(Clone, Copy, Debug)]
pub struct Mmu {
    pub cr0: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub efer: u64,
    /// The access is made by ring 3 code.
    pub user: bool,
}

/// A failed translation: the page fault the processor would raise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub linear: u64,
    pub error_code: u32,
}

impl Fault {
    pub fn exception(self) -> Exception {
        Exception {
            vector: 14,
            error_code: Some(self.error_code),
            trap: false,
            cr2: Some(self.linear),
        }
    }
}

/// One level of a walk: where its table is, how many index bits it takes from the address
/// and at which shift, and whether a large page may end the walk here.
struct Level {
    shift: u32,
    index_bits: u32,
    entry_size: u64,
    large_allowed: bool,
}

impl Mmu {
    /// Translates `linear` for a data access (`write` or read). Memory outside guest RAM in
    /// a page-table walk is a fault with the reserved bit set, as no real table lives there.
    pub fn translate(&self, ram: &dyn GuestRam, linear: u64, write: bool) -> Result<u64, Fault> {
        if self.cr0 & CR0_PG == 0 {
            return Ok(linear & 0xffff_ffff);
        }
        let (levels, mut table) = self.levels(ram, linear, write)?;
        let mut entries = Vec::with_capacity(levels.len());
        for (depth, level) in levels.iter().enumerate() {
            let index = (linear >> level.shift) & ((1 << level.index_bits) - 1);
            let at = table + index * level.entry_size;
            let entry = read_entry(ram, at, level.entry_size)
                .ok_or_else(|| self.fault(linear, write, true, true))?;
            if entry & PRESENT == 0 {
                return Err(self.fault(linear, write, false, false));
            }
            entries.push((at, entry, level.entry_size));
            let leaf = depth + 1 == levels.len() || (level.large_allowed && entry & LARGE != 0);
            if leaf {
                self.check_rights(&entries, linear, write)?;
                set_accessed_dirty(ram, &entries, write);
                let page_mask = (1u64 << level.shift) - 1;
                let frame = if level.entry_size == 4 && level.shift == 22 {
                    pse36_frame(entry)
                } else {
                    entry & ADDR_MASK & !page_mask
                };
                return Ok(frame | (linear & page_mask));
            }
            table = entry & ADDR_MASK;
        }
        unreachable!("the last level always ends the walk")
    }

    /// The levels of the current paging mode and the first table's address (legacy PAE
    /// starts from one of the four PDPTEs CR3 points at).
    fn levels(
        &self,
        ram: &dyn GuestRam,
        linear: u64,
        write: bool,
    ) -> Result<(Vec<Level>, u64), Fault> {
        let level = |shift, index_bits, entry_size, large_allowed| Level {
            shift,
            index_bits,
            entry_size,
            large_allowed,
        };
        if self.cr4 & CR4_PAE == 0 {
            let pse = self.cr4 & CR4_PSE != 0;
            let levels = vec![level(22, 10, 4, pse), level(12, 10, 4, false)];
            return Ok((levels, self.cr3 & 0xffff_f000));
        }
        let lower = [
            level(30, 9, 8, true),
            level(21, 9, 8, true),
            level(12, 9, 8, false),
        ];
        if self.efer & EFER_LMA != 0 {
            let mut levels = Vec::new();
            if self.cr4 & CR4_LA57 != 0 {
                levels.push(level(48, 9, 8, false));
            }
            levels.push(level(39, 9, 8, false));
            levels.extend(lower);
            return Ok((levels, self.cr3 & ADDR_MASK));
        }
        // Legacy PAE: CR3 holds four PDPTEs, 32-byte aligned.
        let pdpte_at = (self.cr3 & 0xffff_ffe0) + ((linear >> 30) & 3) * 8;
        let pdpte =
            read_entry(ram, pdpte_at, 8).ok_or_else(|| self.fault(linear, write, true, true))?;
        if pdpte & PRESENT == 0 {
            return Err(self.fault(linear, write, false, false));
        }
        let [_, pd, pt] = lower;
        Ok((vec![pd, pt], pdpte & ADDR_MASK))
    }

    /// User accesses need U/S on every level; writes need R/W on every level, for the
    /// supervisor too when CR0.WP is set.
    fn check_rights(
        &self,
        entries: &[(u64, u64, u64)],
        linear: u64,
        write: bool,
    ) -> Result<(), Fault> {
        let all = |bit| entries.iter().all(|&(_, e, _)| e & bit != 0);
        let user_ok = !self.user || all(USER);
        let write_ok = !write || all(WRITABLE) || (!self.user && self.cr0 & CR0_WP == 0);
        if user_ok && write_ok {
            Ok(())
        } else {
            Err(self.fault(linear, write, true, false))
        }
    }

    fn fault(&self, linear: u64, write: bool, present: bool, reserved: bool) -> Fault {
        let bit = |on: bool, n: u32| u32::from(on) << n;
        Fault {
            linear,
            error_code: bit(present, 0) | bit(write, 1) | bit(self.user, 2) | bit(reserved, 3),
        }
    }
}

/// A 4 MiB page's frame with PSE-36: bits 20:13 of the entry are bits 39:32 of the frame.
fn pse36_frame(entry: u64) -> u64 {
    (entry & 0xffc0_0000) | ((entry >> 13) & 0xff) << 32
}

fn read_entry(ram: &dyn GuestRam, at: u64, size: u64) -> Option<u64> {
    let mut raw = [0u8; 8];
    ram.read(at, &mut raw[..size as usize])
        .then(|| u64::from_le_bytes(raw))
}

/// Sets the accessed bit on every entry of the walk and the dirty bit on the leaf of a
/// write, as the MMU does; only entries that lack them are written.
fn set_accessed_dirty(ram: &dyn GuestRam, entries: &[(u64, u64, u64)], write: bool) {
    let last = entries.len() - 1;
    for (i, &(at, entry, size)) in entries.iter().enumerate() {
        let mut wanted = entry | ACCESSED;
        if i == last && write {
            wanted |= DIRTY;
        }
        if wanted != entry {
            ram.write(at, &wanted.to_le_bytes()[..size as usize]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// 4 MiB of guest RAM in a vector.
    struct Ram(Mutex<Vec<u8>>);

    impl Ram {
        fn new() -> Self {
            Ram(Mutex::new(vec![0; 4 << 20]))
        }
        fn set(&self, at: u64, entry: u64) {
            self.write(at, &entry.to_le_bytes());
        }
        fn get(&self, at: u64) -> u64 {
            let mut raw = [0u8; 8];
            self.read(at, &mut raw);
            u64::from_le_bytes(raw)
        }
    }

    impl GuestRam for Ram {
        fn read(&self, gpa: u64, buf: &mut [u8]) -> bool {
            let ram = self.0.lock().unwrap();
            let Some(src) = ram.get(gpa as usize..gpa as usize + buf.len()) else {
                return false;
            };
            buf.copy_from_slice(src);
            true
        }
        fn write(&self, gpa: u64, buf: &[u8]) -> bool {
            let mut ram = self.0.lock().unwrap();
            let Some(dst) = ram.get_mut(gpa as usize..gpa as usize + buf.len()) else {
                return false;
            };
            dst.copy_from_slice(buf);
            true
        }
    }

    const PML4: u64 = 0x1000;
    const PDPT: u64 = 0x2000;
    const PD: u64 = 0x3000;
    const PT: u64 = 0x4000;
    const RW: u64 = PRESENT | WRITABLE;

    /// Long mode with: 0x40_0000_1000 -> 0x20_5000 (a 4 KiB user page, read-only),
    /// 0x40_0020_0000 -> a 2 MiB page at 0x20_0000, 0x80_0000_0000 -> a 1 GiB page at 0.
    fn long_mode(ram: &Ram, user: bool) -> Mmu {
        ram.set(PML4, PDPT | RW | USER);
        ram.set(PML4 + 8, 0x5000 | RW);
        ram.set(0x5000, LARGE | RW); // 1 GiB page at 0 for 0x80_0000_0000
        ram.set(PDPT + 8 * 256, PD | RW | USER); // 0x40_0000_0000: PML4[0], PDPT[256]
        ram.set(PD, PT | RW | USER);
        ram.set(PD + 8, 0x20_0000 | LARGE | RW | USER);
        ram.set(PT + 8, 0x20_5000 | PRESENT | USER);
        Mmu {
            cr0: CR0_PG | CR0_WP,
            cr3: PML4,
            cr4: CR4_PAE,
            efer: EFER_LMA,
            user,
        }
    }

    #[test]
    fn four_level_walks_reach_4k_2m_and_1g_pages_and_set_accessed_dirty() {
        let ram = Ram::new();
        let mmu = long_mode(&ram, false);
        assert_eq!(mmu.translate(&ram, 0x40_0000_1234, false), Ok(0x20_5234));
        assert_eq!(mmu.translate(&ram, 0x40_0021_2345, true), Ok(0x21_2345));
        assert_eq!(mmu.translate(&ram, 0x80_0012_3456, false), Ok(0x12_3456));
        assert_ne!(ram.get(PT + 8) & ACCESSED, 0, "accessed set on the leaf");
        assert_eq!(ram.get(PT + 8) & DIRTY, 0, "a read leaves dirty clear");
        assert_ne!(ram.get(PD + 8) & DIRTY, 0, "a write sets dirty on the leaf");
        assert_ne!(ram.get(PML4) & ACCESSED, 0);
    }

    #[test]
    fn faults_carry_the_error_code_the_processor_gives() {
        let ram = Ram::new();
        let kernel = long_mode(&ram, false);
        // Not present: P=0; a write: W=1.
        let fault = kernel.translate(&ram, 0x40_0000_3000, true).unwrap_err();
        assert_eq!((fault.linear, fault.error_code), (0x40_0000_3000, 0b010));
        // A supervisor write to a read-only page with CR0.WP: P=1, W=1.
        let fault = kernel.translate(&ram, 0x40_0000_1000, true).unwrap_err();
        assert_eq!(fault.error_code, 0b011);
        // Without CR0.WP the supervisor may write it.
        let no_wp = Mmu {
            cr0: CR0_PG,
            ..kernel
        };
        assert!(no_wp.translate(&ram, 0x40_0000_1000, true).is_ok());
        // User mode: the 1 GiB supervisor page is refused (P=1, U=1).
        let user = long_mode(&ram, true);
        let fault = user.translate(&ram, 0x80_0000_0000, false).unwrap_err();
        assert_eq!(fault.error_code, 0b101);
        assert_eq!(user.translate(&ram, 0x40_0000_1008, false), Ok(0x20_5008));
        // A table outside RAM: the reserved bit.
        ram.set(PD + 16, 0x1000_0000 | RW);
        let fault = kernel.translate(&ram, 0x40_0040_0000, false).unwrap_err();
        assert_eq!(fault.error_code & 0b1000, 0b1000);
    }

    #[test]
    fn paging_off_and_32_bit_modes() {
        let ram = Ram::new();
        let off = Mmu {
            cr0: 0,
            cr3: 0,
            cr4: 0,
            efer: 0,
            user: false,
        };
        assert_eq!(off.translate(&ram, 0x1234_5678, true), Ok(0x1234_5678));
        // 32-bit paging: a 4 MiB page (PSE) and a 4 KiB page.
        ram.set(PD, 0x0040_0000 | LARGE | RW); // 0..4 MiB -> 4 MiB
        ram.set(PD + 4, PT | RW); // 4..8 MiB through PT
        ram.set(PT + 4 * 2, 0x7000 | RW);
        let pse = Mmu {
            cr0: CR0_PG,
            cr3: PD,
            cr4: CR4_PSE,
            efer: 0,
            user: false,
        };
        assert_eq!(pse.translate(&ram, 0x0012_3456, false), Ok(0x0052_3456));
        assert_eq!(pse.translate(&ram, 0x0040_2abc, false), Ok(0x7abc));
    }
}
