//! Multiboot v1 (the rust-vmm crates do not provide it): header search and the boot
//! information structure.
//!
//! Specification: <https://www.gnu.org/software/grub/manual/multiboot/multiboot.html>.

use vm_memory::{Bytes, GuestAddress, GuestMemory};

use crate::layout::{
    e820_map, low_ram_end, E820Entry, BOOT_STACK_POINTER, CMDLINE_ADDR, CMDLINE_MAX_SIZE,
    EBDA_START, GDT_ADDR, HIMEM_START, MEMMAP_ADDR, MEMMAP_MAX_SIZE, MODLIST_ADDR,
    MULTIBOOT_INFO_ADDR,
};
use crate::loader::LoadError;

/// Magic value of the Multiboot header in the kernel image.
pub const MULTIBOOT_HEADER_MAGIC: u32 = 0x1bad_b002;
/// Value in EAX at the kernel's entry.
pub const MULTIBOOT_BOOTLOADER_MAGIC: u32 = 0x2bad_b002;
/// The header must lie entirely within this many bytes from the start of the file.
pub const MULTIBOOT_SEARCH: usize = 8192;

/// Header flag: align modules on 4 KiB pages.
pub const MB_HEADER_PAGE_ALIGN: u32 = 1 << 0;
/// Header flag: provide memory information.
pub const MB_HEADER_MEMORY_INFO: u32 = 1 << 1;
/// Header flag: video mode table requested.
pub const MB_HEADER_VIDEO_MODE: u32 = 1 << 2;
/// Header flag: the address fields (a.out kludge) are valid.
pub const MB_HEADER_AOUT_KLUDGE: u32 = 1 << 16;
/// The required-feature bits (the low 16) this loader honours; bit 2 (video mode) is only a
/// request and is accepted without setting a video mode.
pub const MB_HEADER_SUPPORTED_REQUIRED: u32 =
    MB_HEADER_PAGE_ALIGN | MB_HEADER_MEMORY_INFO | MB_HEADER_VIDEO_MODE;

/// Info flag: `mem_lower`/`mem_upper` valid.
pub const MB_INFO_MEMORY: u32 = 1 << 0;
/// Info flag: `cmdline` valid.
pub const MB_INFO_CMDLINE: u32 = 1 << 2;
/// Info flag: `mods_count`/`mods_addr` valid.
pub const MB_INFO_MODS: u32 = 1 << 3;
/// Info flag: `mmap_length`/`mmap_addr` valid.
pub const MB_INFO_MEM_MAP: u32 = 1 << 6;
/// Info flag: `boot_loader_name` valid.
pub const MB_INFO_BOOT_LOADER_NAME: u32 = 1 << 9;

/// Size of the Multiboot information structure (through the framebuffer fields).
pub const MB_INFO_SIZE: usize = 116;
/// Size of one memory-map entry including its `size` field.
pub const MB_MMAP_ENTRY_SIZE: usize = 24;
/// Size of one module entry.
pub const MB_MODULE_SIZE: usize = 16;

/// Name written for the initrd module.
const MODULE_NAME: &[u8] = b"initrd\0";
/// Boot-loader name.
const LOADER_NAME: &[u8] = b"ferrovm\0";
/// Offsets of the module name and the boot-loader name in the module-list page.
const MODULE_NAME_OFFSET: u64 = MB_MODULE_SIZE as u64;
const LOADER_NAME_OFFSET: u64 = MODULE_NAME_OFFSET + 16;

/// The lowest address a Multiboot kernel may load at: the real-mode IVT and BIOS data area
/// come first.
pub const LOW_KERNEL_MIN: u64 = 0x1000;

/// Where the boot structures of a Multiboot boot go: GDT, information structure, stack,
/// memory map, module list (with the boot-loader strings) and command line.
///
/// Multiboot kernels may load below 1 MiB (a kernel linked at 0x8000 boots under GRUB and
/// QEMU): the structures then go where the kernel is not, [`BootArea::choose`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BootArea {
    pub gdt: u64,
    pub info: u64,
    pub stack_top: u64,
    pub memmap: u64,
    pub modlist: u64,
    pub cmdline: u64,
}

impl BootArea {
    /// The layout every boot protocol uses (`layout`'s fixed addresses).
    pub const DEFAULT: BootArea = BootArea {
        gdt: GDT_ADDR,
        info: MULTIBOOT_INFO_ADDR,
        stack_top: BOOT_STACK_POINTER,
        memmap: MEMMAP_ADDR,
        modlist: MODLIST_ADDR,
        cmdline: CMDLINE_ADDR,
    };

    /// Bytes of a compact area: five 4 KiB pages, then the command line.
    pub const COMPACT_SIZE: u64 = 0x5000 + CMDLINE_MAX_SIZE;

    /// A compact area at `base` (4 KiB-aligned).
    pub fn compact(base: u64) -> BootArea {
        BootArea {
            gdt: base,
            info: base + 0x1000,
            stack_top: base + 0x2ff0,
            memmap: base + 0x3000,
            modlist: base + 0x4000,
            cmdline: base + 0x5000,
        }
    }

    /// The guest ranges `[start, end)` the area writes.
    fn ranges(&self) -> [(u64, u64); 6] {
        let page = |a: u64| (a, a + 0x1000);
        [
            page(self.gdt),
            page(self.info),
            page(self.stack_top & !0xfff),
            page(self.memmap),
            page(self.modlist),
            (self.cmdline, self.cmdline + CMDLINE_MAX_SIZE),
        ]
    }

    /// The default area when no range of `kernel` touches it; otherwise the first compact
    /// area, in conventional memory or from 1 MiB on, that none touches. Fails when nothing
    /// fits.
    pub fn choose(kernel: &[(u64, u64)], mem_size: u64) -> Result<BootArea, LoadError> {
        let free = |start: u64, end: u64| kernel.iter().all(|&(s, e)| e <= start || s >= end);
        if Self::DEFAULT.ranges().iter().all(|&(s, e)| free(s, e)) {
            return Ok(Self::DEFAULT);
        }
        let low_end = low_ram_end(mem_size);
        let fits = |base: u64| {
            let end = base + Self::COMPACT_SIZE;
            let in_ram = (base >= LOW_KERNEL_MIN && end <= EBDA_START)
                || (base >= HIMEM_START && end <= low_end);
            in_ram && free(base, end)
        };
        let mut candidates: Vec<u64> = [LOW_KERNEL_MIN, HIMEM_START]
            .into_iter()
            .chain(kernel.iter().map(|&(_, e)| (e + 0xfff) & !0xfff))
            .collect();
        candidates.sort_unstable();
        candidates
            .into_iter()
            .find(|&base| fits(base))
            .map(Self::compact)
            .ok_or(LoadError::NoRoomForBootStructures {
                size: Self::COMPACT_SIZE,
            })
    }
}

/// A Multiboot header found in a kernel image.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MultibootHeader {
    /// File offset of the header's magic.
    pub offset: u64,
    /// Header flags.
    pub flags: u32,
    /// Address fields (valid when flag bit 16 is set).
    pub header_addr: u32,
    /// Physical address of the start of the text to load.
    pub load_addr: u32,
    /// End of the data to load (0: to the end of the file).
    pub load_end_addr: u32,
    /// End of the bss (0: no bss).
    pub bss_end_addr: u32,
    /// Entry point.
    pub entry_addr: u32,
}

impl MultibootHeader {
    /// True when the a.out-kludge address fields are valid.
    pub fn has_addresses(&self) -> bool {
        self.flags & MB_HEADER_AOUT_KLUDGE != 0
    }
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Searches `head` (the first bytes of the image; only the first 8192 are searched) for a
/// 4-byte-aligned Multiboot header whose checksum is right, and checks its flags.
pub fn find_header(head: &[u8]) -> Result<Option<MultibootHeader>, LoadError> {
    let head = &head[..head.len().min(MULTIBOOT_SEARCH)];
    let mut off = 0usize;
    while off + 12 <= head.len() {
        let magic = u32_at(head, off);
        let flags = u32_at(head, off + 4);
        let checksum = u32_at(head, off + 8);
        if magic == MULTIBOOT_HEADER_MAGIC && magic.wrapping_add(flags).wrapping_add(checksum) == 0
        {
            let unsupported = flags & 0xffff & !MB_HEADER_SUPPORTED_REQUIRED;
            if unsupported != 0 {
                return Err(LoadError::UnsupportedMultibootFlags {
                    offset: off as u64,
                    flags,
                    unsupported,
                });
            }
            let mut h = MultibootHeader {
                offset: off as u64,
                flags,
                ..Default::default()
            };
            if h.has_addresses() {
                if off + 32 > head.len() {
                    return Err(LoadError::TruncatedMultibootHeader { offset: off as u64 });
                }
                h.header_addr = u32_at(head, off + 12);
                h.load_addr = u32_at(head, off + 16);
                h.load_end_addr = u32_at(head, off + 20);
                h.bss_end_addr = u32_at(head, off + 24);
                h.entry_addr = u32_at(head, off + 28);
            }
            return Ok(Some(h));
        }
        off += 4;
    }
    Ok(None)
}

/// The bytes of the Multiboot memory map for `map`.
pub fn mmap_bytes(map: &[E820Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(map.len() * MB_MMAP_ENTRY_SIZE);
    for e in map {
        out.extend_from_slice(&20u32.to_le_bytes());
        out.extend_from_slice(&e.addr.to_le_bytes());
        out.extend_from_slice(&e.size.to_le_bytes());
        out.extend_from_slice(&e.kind.code().to_le_bytes());
    }
    out
}

fn put(buf: &mut [u8], off: usize, v: u32) {
    buf[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

fn write<M: GuestMemory + ?Sized>(
    mem: &M,
    what: &'static str,
    addr: u64,
    bytes: &[u8],
) -> Result<(), LoadError> {
    mem.write_slice(bytes, GuestAddress(addr))
        .map_err(|source| LoadError::GuestMemory { what, addr, source })
}

/// Writes the Multiboot information structure, its memory map and, with an initrd
/// `(address, size)`, module 0, where `area` says; the command line is expected at
/// `area.cmdline`. Returns the address of the information structure (the value for EBX).
pub fn write_info<M: GuestMemory + ?Sized>(
    mem: &M,
    mem_size: u64,
    area: &BootArea,
    initrd: Option<(u64, u64)>,
) -> Result<u64, LoadError> {
    let module_name_addr = area.modlist + MODULE_NAME_OFFSET;
    let loader_name_addr = area.modlist + LOADER_NAME_OFFSET;
    let mut info = [0u8; MB_INFO_SIZE];
    let mut flags = MB_INFO_MEMORY | MB_INFO_CMDLINE | MB_INFO_MEM_MAP | MB_INFO_BOOT_LOADER_NAME;
    // KiB of conventional memory below the EBDA, and from 1 MiB to the first hole.
    let mem_lower = (low_ram_end(mem_size).min(EBDA_START) / 1024) as u32;
    let mem_upper = (low_ram_end(mem_size).saturating_sub(HIMEM_START) / 1024) as u32;
    put(&mut info, 4, mem_lower);
    put(&mut info, 8, mem_upper);
    put(&mut info, 16, area.cmdline as u32);

    let mmap = mmap_bytes(&e820_map(mem_size));
    // The map has a handful of entries; this guards against a layout change overflowing it.
    if mmap.len() as u64 > MEMMAP_MAX_SIZE {
        return Err(LoadError::BootAreaOverflow {
            what: "Multiboot memory map",
            size: mmap.len() as u64,
            max: MEMMAP_MAX_SIZE,
        });
    }
    write(mem, "Multiboot memory map", area.memmap, &mmap)?;
    put(&mut info, 44, mmap.len() as u32);
    put(&mut info, 48, area.memmap as u32);

    if let Some((addr, size)) = initrd {
        flags |= MB_INFO_MODS;
        let mut module = [0u8; MB_MODULE_SIZE];
        put(&mut module, 0, addr as u32);
        put(&mut module, 4, (addr + size) as u32);
        put(&mut module, 8, module_name_addr as u32);
        write(mem, "Multiboot module list", area.modlist, &module)?;
        write(mem, "Multiboot module name", module_name_addr, MODULE_NAME)?;
        put(&mut info, 20, 1);
        put(&mut info, 24, area.modlist as u32);
    }
    write(mem, "boot loader name", loader_name_addr, LOADER_NAME)?;
    put(&mut info, 64, loader_name_addr as u32);
    put(&mut info, 0, flags);
    write(mem, "Multiboot information", area.info, &info)?;
    Ok(area.info)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(flags: u32) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&MULTIBOOT_HEADER_MAGIC.to_le_bytes());
        v.extend_from_slice(&flags.to_le_bytes());
        v.extend_from_slice(
            &(0u32
                .wrapping_sub(MULTIBOOT_HEADER_MAGIC)
                .wrapping_sub(flags))
            .to_le_bytes(),
        );
        v
    }

    #[test]
    fn finds_aligned_header_only() {
        let mut img = vec![0u8; 4096];
        img[0x102..0x10e].copy_from_slice(&header(3)); // misaligned: ignored
        assert_eq!(find_header(&img).unwrap(), None);
        img[0x200..0x20c].copy_from_slice(&header(3));
        let h = find_header(&img).unwrap().unwrap();
        assert_eq!(h.offset, 0x200);
        assert_eq!(h.flags, 3);
        assert!(!h.has_addresses());
    }

    #[test]
    fn bad_checksum_ignored_and_beyond_8k_ignored() {
        let mut img = vec![0u8; 16384];
        let mut h = header(0);
        h[8] ^= 1;
        img[0..12].copy_from_slice(&h);
        img[8192..8204].copy_from_slice(&header(0));
        assert_eq!(find_header(&img).unwrap(), None);
        // A header ending exactly at 8192 is found.
        img[8180..8192].copy_from_slice(&header(0));
        assert_eq!(find_header(&img).unwrap().unwrap().offset, 8180);
    }

    #[test]
    fn unknown_required_flag_refused_video_accepted() {
        let mut img = vec![0u8; 64];
        img[0..12].copy_from_slice(&header(MB_HEADER_VIDEO_MODE));
        assert!(find_header(&img).unwrap().is_some());
        img[0..12].copy_from_slice(&header(1 << 3));
        match find_header(&img) {
            Err(LoadError::UnsupportedMultibootFlags { unsupported, .. }) => {
                assert_eq!(unsupported, 8)
            }
            other => panic!("{other:?}"),
        }
        // Unknown optional bits (above 16) are fine.
        img[0..12].copy_from_slice(&header(1 << 20));
        assert!(find_header(&img).unwrap().is_some());
    }

    #[test]
    fn address_fields_truncated() {
        let mut img = vec![0u8; 8192];
        img[8176..8188].copy_from_slice(&header(MB_HEADER_AOUT_KLUDGE));
        assert!(matches!(
            find_header(&img),
            Err(LoadError::TruncatedMultibootHeader { offset: 8176 })
        ));
        // Short input never panics.
        for n in 0..16 {
            let _ = find_header(&img[8176..8176 + n.min(12)]);
        }
    }
}
