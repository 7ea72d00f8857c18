//! Tests of the kernel loaders with crafted in-memory images.

use std::io::Cursor;

use linux_loader::loader::bootparam::boot_params;
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::*;
use crate::gdt::{GDT_CODE32, GDT_DATA};
use crate::layout::{e820_map, MULTIBOOT_INFO_ADDR};
use crate::multiboot::{MB_HEADER_AOUT_KLUDGE, MB_HEADER_VIDEO_MODE};
use crate::testutil::*;

const MEM: u64 = 64 * MIB;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn read_bytes(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
    v
}

fn read_cstr(mem: &GuestMemoryMmap, addr: u64) -> String {
    let mut s = Vec::new();
    for i in 0.. {
        let b: u8 = mem.read_obj(GuestAddress(addr + i)).unwrap();
        if b == 0 {
            break;
        }
        s.push(b);
    }
    String::from_utf8(s).unwrap()
}

fn u32_at(mem: &GuestMemoryMmap, addr: u64) -> u32 {
    mem.read_obj(GuestAddress(addr)).unwrap()
}

fn load(
    mem: &GuestMemoryMmap,
    image: Vec<u8>,
    cmdline: &str,
    initrd: Option<Vec<u8>>,
    mem_size: u64,
) -> Result<BootEntry, LoadError> {
    let mut k = Cursor::new(image);
    match initrd {
        Some(bytes) => {
            let mut i = Cursor::new(bytes);
            load_kernel(mem, &mut k, cmdline, Some(&mut i), mem_size)
        }
        None => load_kernel(mem, &mut k, cmdline, None, mem_size),
    }
}

fn check_gdt_and_common(mem: &GuestMemoryMmap, be: &BootEntry) {
    assert_eq!(be.gdt_base, 0x500);
    assert_eq!(be.gdt_limit, 39);
    assert_eq!(be.code_selector, 0x10);
    assert_eq!(be.data_selector, 0x18);
    assert_eq!(be.stack_pointer, Some(0x8ff0));
    let code: u64 = mem.read_obj(GuestAddress(0x510)).unwrap();
    let data: u64 = mem.read_obj(GuestAddress(0x518)).unwrap();
    assert_eq!((code, data), (GDT_CODE32, GDT_DATA));
    assert_eq!(be.code_segment().limit, 0xffff_ffff);
    assert_eq!(be.data_segment().type_, 3);
}

fn pvh_spec(is_64: bool) -> ElfSpec {
    ElfSpec {
        is_64,
        // PVH kernels are x86-64, whatever their class.
        machine: 62,
        entry: 0xffff_ffff_8100_0000, // a virtual e_entry: PVH uses the note
        notes: Some(pvh_note(0x10_0010)),
        segments: vec![
            Seg::new(0x10_0000, pattern(0x1800, 1), 0x4000),
            Seg::new(0x20_0000, pattern(0x100, 2), 0x100),
        ],
        ..Default::default()
    }
}

fn check_pvh(is_64: bool) {
    let mem = guest_mem(MEM);
    // Dirty the bss area to see it zeroed.
    mem.write_slice(&[0xff; 0x2800], GuestAddress(0x10_1800))
        .unwrap();
    let initrd = pattern(10_000, 9);
    let be = load(
        &mem,
        elf_image(&pvh_spec(is_64)),
        " console=ttyS0 panic=-1 ",
        Some(initrd.clone()),
        MEM,
    )
    .unwrap();
    assert_eq!(be.protocol, BootProtocol::Pvh);
    assert_eq!(be.entry_point, 0x10_0010);
    assert_eq!((be.eax, be.ebx, be.esi), (0, 0x7000, 0));
    assert_eq!((be.kernel_start, be.kernel_end), (0x10_0000, 0x20_0100));
    check_gdt_and_common(&mem, &be);

    assert_eq!(read_bytes(&mem, 0x10_0000, 0x1800), pattern(0x1800, 1));
    assert!(read_bytes(&mem, 0x10_1800, 0x2800).iter().all(|&b| b == 0));
    assert_eq!(read_bytes(&mem, 0x20_0000, 0x100), pattern(0x100, 2));

    let si: hvm_start_info = mem.read_obj(GuestAddress(0x7000)).unwrap();
    assert_eq!(si.magic, 0x336e_c578);
    assert_eq!(si.version, 1);
    assert_eq!(si.flags, 0);
    assert_eq!(si.cmdline_paddr, 0x20000);
    assert_eq!(si.rsdp_paddr, 0);
    assert_eq!(si.nr_modules, 1);
    assert_eq!(si.modlist_paddr, 0xa000);
    assert_eq!(si.memmap_paddr, 0x9000);
    let map = e820_map(MEM);
    assert_eq!(si.memmap_entries as usize, map.len());
    for (i, e) in map.iter().enumerate() {
        let m: hvm_memmap_table_entry = mem.read_obj(GuestAddress(0x9000 + 24 * i as u64)).unwrap();
        assert_eq!((m.addr, m.size, m.type_), (e.addr, e.size, e.kind.code()));
    }
    assert_eq!(read_cstr(&mem, 0x20000), "console=ttyS0 panic=-1");

    let module: hvm_modlist_entry = mem.read_obj(GuestAddress(0xa000)).unwrap();
    assert_eq!(module.size, 10_000);
    assert_eq!(module.paddr % 4096, 0);
    assert!(module.paddr + module.size <= MEM);
    assert!(module.paddr >= 0x20_0100);
    assert_eq!(be.initrd, Some((module.paddr, 10_000)));
    assert_eq!(read_bytes(&mem, module.paddr, 10_000), initrd);
}

#[test]
fn pvh_elf64() {
    check_pvh(true);
}

#[test]
fn pvh_elf32() {
    check_pvh(false);
}

#[test]
fn pvh_with_rsdp_and_no_initrd() {
    let mem = guest_mem(MEM);
    let config = BootConfig {
        cmdline: String::new(),
        mem_size: MEM,
        rsdp: Some(0xe0000),
        image_name: None,
    };
    let mut k = Cursor::new(elf_image(&pvh_spec(true)));
    let be = load_kernel_with_config(&mem, &mut k, None, &config).unwrap();
    assert_eq!(be.initrd, None);
    let si: hvm_start_info = mem.read_obj(GuestAddress(0x7000)).unwrap();
    assert_eq!(si.rsdp_paddr, 0xe0000);
    assert_eq!(si.nr_modules, 0);
    assert_eq!(si.modlist_paddr, 0);
    assert_eq!(read_cstr(&mem, 0x20000), "");
}

#[test]
fn pvh_5g_layout() {
    let size = 5 * GIB;
    let mem = guest_mem(size);
    let mut spec = pvh_spec(true);
    // A segment in RAM above 4 GiB is fine; the entry is below the hole.
    spec.segments[1] = Seg::new(4 * GIB + 0x1000, pattern(64, 3), 0x1000);
    let be = load(&mem, elf_image(&spec), "x", Some(vec![7; 100]), size).unwrap();
    assert_eq!(be.protocol, BootProtocol::Pvh);
    assert_eq!(read_bytes(&mem, 4 * GIB + 0x1000, 64), pattern(64, 3));
    let si: hvm_start_info = mem.read_obj(GuestAddress(0x7000)).unwrap();
    assert_eq!(si.memmap_entries, 7);
    let last: hvm_memmap_table_entry = mem.read_obj(GuestAddress(0x9000 + 24 * 6)).unwrap();
    assert_eq!((last.addr, last.size, last.type_), (4 * GIB, 2 * GIB, 1));
    // The initrd goes to the top of RAM below the hole.
    let (addr, len) = be.initrd.unwrap();
    assert_eq!(len, 100);
    assert_eq!(addr, 3 * GIB - 4096);
}

#[test]
fn pvh_wins_over_multiboot() {
    let mut spec = pvh_spec(false);
    let mut data = mb_header(3, None);
    data.resize(0x1800, 0x90);
    spec.segments[0].data = data;
    let mem = guest_mem(MEM);
    let be = load(&mem, elf_image(&spec), "", None, MEM).unwrap();
    assert_eq!(be.protocol, BootProtocol::Pvh);
    assert_eq!(be.eax, 0);
}

/// An EM_386 file used to boot through its PVH note as if it were x86-64: without a
/// Multiboot header it is refused; with one, it boots as the Multiboot kernel it is.
#[test]
fn only_multiboot_kernels_may_be_32_bit_x86() {
    let mem = guest_mem(MEM);
    for is_64 in [false, true] {
        let mut spec = pvh_spec(is_64);
        spec.machine = 3;
        let err = load(&mem, elf_image(&spec), "", None, MEM).unwrap_err();
        assert!(matches!(err, LoadError::NotX86_64 { machine: 3 }), "{err}");
        let mut data = mb_header(3, None);
        data.resize(0x1800, 0x90);
        spec.segments[0].data = data;
        spec.entry = 0x10_0010;
        let be = load(&mem, elf_image(&spec), "", None, MEM).unwrap();
        assert_eq!(be.protocol, BootProtocol::Multiboot);
    }
}

fn multiboot_spec(is_64: bool) -> ElfSpec {
    let mut text = mb_header(3 | MB_HEADER_VIDEO_MODE, None);
    // video fields are only read for bit 2 with an a.out header; pad them anyway
    text.extend_from_slice(&[0u8; 16]);
    text.resize(0x800, 0xf4);
    ElfSpec {
        is_64,
        // A higher-half kernel: the entry is virtual and translated through p_vaddr.
        entry: 0xc010_0040,
        segments: vec![
            Seg {
                paddr: 0x10_0000,
                vaddr: 0xc010_0000,
                data: text,
                memsz: 0x3000,
            },
            Seg::new(0x40_0000, vec![], 0x2000), // pure bss
        ],
        ..Default::default()
    }
}

fn check_multiboot_info(mem: &GuestMemoryMmap, be: &BootEntry, mem_size: u64, initrd: bool) {
    assert_eq!(be.protocol, BootProtocol::Multiboot);
    assert_eq!(be.eax, 0x2bad_b002);
    assert_eq!(be.ebx, 0x7000);
    let info = MULTIBOOT_INFO_ADDR;
    let flags = u32_at(mem, info);
    assert_eq!(flags & 1, 1, "mem fields");
    assert_eq!(flags & 4, 4, "cmdline");
    assert_eq!(flags & 0x40, 0x40, "mmap");
    assert_eq!(flags & 8 != 0, initrd, "mods");
    assert_eq!(u32_at(mem, info + 4), 639);
    let low = mem_size.min(3 * GIB);
    assert_eq!(u64::from(u32_at(mem, info + 8)), (low - MIB) / 1024);
    assert_eq!(u32_at(mem, info + 16), 0x20000);
    let map = e820_map(mem_size);
    assert_eq!(u32_at(mem, info + 44) as usize, map.len() * 24);
    assert_eq!(u32_at(mem, info + 48), 0x9000);
    for (i, e) in map.iter().enumerate() {
        let at = 0x9000 + 24 * i as u64;
        assert_eq!(u32_at(mem, at), 20);
        let addr: u64 = mem.read_obj(GuestAddress(at + 4)).unwrap();
        let len: u64 = mem.read_obj(GuestAddress(at + 12)).unwrap();
        assert_eq!(
            (addr, len, u32_at(mem, at + 20)),
            (e.addr, e.size, e.kind.code())
        );
    }
    assert_eq!(read_cstr(mem, u64::from(u32_at(mem, info + 64))), "ferrovm");
}

fn check_multiboot_elf(is_64: bool) {
    let mem = guest_mem(MEM);
    mem.write_slice(&[0xff; 0x2000], GuestAddress(0x40_0000))
        .unwrap();
    let initrd = pattern(5000, 4);
    let be = load(
        &mem,
        elf_image(&multiboot_spec(is_64)),
        "root=/dev/vda",
        Some(initrd.clone()),
        MEM,
    )
    .unwrap();
    assert_eq!(be.entry_point, 0x10_0040);
    check_gdt_and_common(&mem, &be);
    check_multiboot_info(&mem, &be, MEM, true);
    assert_eq!(read_cstr(&mem, 0x20000), "root=/dev/vda");
    assert_eq!(u32_at(&mem, MULTIBOOT_INFO_ADDR + 20), 1);
    let mods = u64::from(u32_at(&mem, MULTIBOOT_INFO_ADDR + 24));
    let start = u32_at(&mem, mods);
    let end = u32_at(&mem, mods + 4);
    assert_eq!(end - start, 5000);
    assert_eq!(start % 4096, 0);
    assert!(u64::from(start) >= 0x40_2000);
    assert_eq!(read_bytes(&mem, u64::from(start), 5000), initrd);
    assert_eq!(read_cstr(&mem, u64::from(u32_at(&mem, mods + 8))), "initrd");
    assert!(read_bytes(&mem, 0x40_0000, 0x2000).iter().all(|&b| b == 0));
    assert_eq!(read_bytes(&mem, 0x10_0000, 4), 0x1bad_b002u32.to_le_bytes());
}

#[test]
fn multiboot_elf32() {
    check_multiboot_elf(false);
}

#[test]
fn multiboot_elf64() {
    check_multiboot_elf(true);
}

#[test]
fn multiboot_without_initrd_and_5g() {
    let size = 5 * GIB;
    let mem = guest_mem(size);
    let be = load(&mem, elf_image(&multiboot_spec(false)), "", None, size).unwrap();
    check_multiboot_info(&mem, &be, size, false);
}

#[test]
fn multiboot_aout_kludge() {
    // A flat binary loaded at 2 MiB whose header sits 0x40 bytes in.
    let mut img = vec![0x90u8; 0x40];
    img.extend_from_slice(&mb_header(
        MB_HEADER_AOUT_KLUDGE | 2,
        Some([0x20_0040, 0x20_0000, 0, 0x20_3000, 0x20_0080]),
    ));
    img.resize(0x1000, 0xf4);
    let mem = guest_mem(MEM);
    mem.write_slice(&[0xff; 0x2000], GuestAddress(0x20_1000))
        .unwrap();
    let be = load(&mem, img.clone(), "a", None, MEM).unwrap();
    check_multiboot_info(&mem, &be, MEM, false);
    assert_eq!(be.entry_point, 0x20_0080);
    assert_eq!((be.kernel_start, be.kernel_end), (0x20_0000, 0x20_3000));
    assert_eq!(read_bytes(&mem, 0x20_0000, 0x1000), img);
    assert!(read_bytes(&mem, 0x20_1000, 0x2000).iter().all(|&b| b == 0));

    // load_end_addr past the file.
    let mut bad = img.clone();
    bad[0x40..0x60].copy_from_slice(&mb_header(
        MB_HEADER_AOUT_KLUDGE,
        Some([0x20_0040, 0x20_0000, 0x20_2000, 0, 0x20_0080]),
    ));
    assert!(matches!(
        load(&mem, bad, "", None, MEM),
        Err(LoadError::SegmentBeyondFile { .. })
    ));
    // header_addr implies text before the start of the file.
    let mut bad = img.clone();
    bad[0x40..0x60].copy_from_slice(&mb_header(
        MB_HEADER_AOUT_KLUDGE,
        Some([0x20_1000, 0x20_0000, 0, 0, 0x20_0080]),
    ));
    assert!(matches!(
        load(&mem, bad, "", None, MEM),
        Err(LoadError::InvalidMultibootAddress {
            field: "header_addr",
            ..
        })
    ));
    // Entry outside the image.
    let mut bad = img.clone();
    bad[0x40..0x60].copy_from_slice(&mb_header(
        MB_HEADER_AOUT_KLUDGE,
        Some([0x20_0040, 0x20_0000, 0, 0, 0x30_0000]),
    ));
    assert!(matches!(
        load(&mem, bad, "", None, MEM),
        Err(LoadError::InvalidEntryPoint { .. })
    ));
    // Over the IVT, or into the EBDA and BIOS area below 1 MiB: refused.
    let low = [(0x540, 0x500, 0x580), (0x9_f040, 0x9_f000, 0x9_f080)];
    for (header_addr, load_addr, entry) in low {
        let mut bad = img.clone();
        bad[0x40..0x60].copy_from_slice(&mb_header(
            MB_HEADER_AOUT_KLUDGE,
            Some([header_addr, load_addr, 0, 0, entry]),
        ));
        assert!(matches!(
            load(&mem, bad, "", None, MEM),
            Err(LoadError::SegmentInBootArea { .. })
        ));
    }
}

/// A Multiboot kernel linked at 0x8000 boots as under GRUB and QEMU (it used to be refused
/// for overlapping the boot-structure area): the boot structures move where it is not, and
/// the command line starts with the kernel's path.
#[test]
fn multiboot_kernel_below_1_mib_gets_boot_structures_elsewhere() {
    let mut img = vec![0x90u8; 0x40];
    img.extend_from_slice(&mb_header(
        MB_HEADER_AOUT_KLUDGE | 2,
        Some([0x8040, 0x8000, 0, 0x2_8000, 0x8080]),
    ));
    img.resize(0x1000, 0xf4);
    let mem = guest_mem(MEM);
    let config = BootConfig {
        cmdline: " -v  a=1 ".into(),
        mem_size: MEM,
        rsdp: None,
        image_name: Some("/boot/kernel.elf".into()),
    };
    let mut k = Cursor::new(img.clone());
    let mut initrd = Cursor::new(pattern(3000, 5));
    let be = load_kernel_with_config(&mem, &mut k, Some(&mut initrd), &config).unwrap();
    assert_eq!((be.kernel_start, be.kernel_end), (0x8000, 0x2_8000));
    assert_eq!(read_bytes(&mem, 0x8000, 0x1000), img);
    // Everything the loader wrote lies outside [0x8000, 0x28000).
    let outside = |addr: u64, len: u64| addr + len <= 0x8000 || addr >= 0x2_8000;
    let info = u64::from(be.ebx);
    assert!(outside(info, 116) && outside(be.gdt_base, 40), "{be:?}");
    assert!(outside(u64::from(be.stack_pointer.unwrap()) - 0x100, 0x100));
    let cmdline = u64::from(u32_at(&mem, info + 16));
    let mmap = u64::from(u32_at(&mem, info + 48));
    let mods = u64::from(u32_at(&mem, info + 24));
    assert!(outside(cmdline, 0x1000) && outside(mmap, 0x1000) && outside(mods, 0x1000));
    assert_eq!(read_cstr(&mem, cmdline), "/boot/kernel.elf -v  a=1");
    assert_eq!(
        read_cstr(&mem, u64::from(u32_at(&mem, info + 64))),
        "ferrovm"
    );
    let (initrd_addr, initrd_len) = be.initrd.unwrap();
    assert!(initrd_addr >= HIMEM_START && initrd_len == 3000);
    let gdt: u64 = mem.read_obj(GuestAddress(be.gdt_base + 0x10)).unwrap();
    assert_eq!(gdt, crate::gdt::GDT_CODE32);

    // A kernel that fills conventional memory: the structures go above 1 MiB.
    let mut big = img.clone();
    big[0x40..0x60].copy_from_slice(&mb_header(
        MB_HEADER_AOUT_KLUDGE | 2,
        Some([0x1040, 0x1000, 0, 0x9_f000, 0x1080]),
    ));
    let be = load(&mem, big, "", None, MEM).unwrap();
    assert!(u64::from(be.ebx) >= HIMEM_START, "{be:?}");
    // Without its path the command line is left as given (PVH, Linux, or no path).
    assert_eq!(
        read_cstr(&mem, u64::from(u32_at(&mem, u64::from(be.ebx) + 16))),
        ""
    );
}

#[test]
fn multiboot_flat_without_addresses_refused() {
    let mut img = vec![0u8; 0x20];
    img.extend_from_slice(&mb_header(3, None));
    img.resize(0x400, 0);
    let mem = guest_mem(MEM);
    assert!(matches!(
        load(&mem, img, "", None, MEM),
        Err(LoadError::MultibootWithoutAddresses { offset: 0x20 })
    ));
}

#[test]
fn multiboot_unsupported_flags_refused() {
    let mut spec = multiboot_spec(false);
    let mut text = mb_header(1 << 5, None);
    text.resize(0x800, 0);
    spec.segments[0].data = text;
    let mem = guest_mem(MEM);
    let err = load(&mem, elf_image(&spec), "", None, MEM).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::UnsupportedMultibootFlags {
                unsupported: 0x20,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("0x20"), "{err}");
}

#[test]
fn bzimage_relocatable_at_pref_address() {
    let mem = guest_mem(MEM);
    let spec = BzSpec::default();
    let initrd = pattern(20_000, 5);
    let be = load(
        &mem,
        bzimage(&spec),
        "console=ttyS0 earlyprintk=serial",
        Some(initrd.clone()),
        MEM,
    )
    .unwrap();
    assert_eq!(be.protocol, BootProtocol::Linux);
    assert_eq!(be.entry_point, 0x100_0000);
    assert_eq!((be.eax, be.ebx, be.esi), (0, 0, 0x7000));
    assert_eq!(be.kernel_end, 0x140_0000);
    check_gdt_and_common(&mem, &be);
    assert_eq!(
        read_bytes(&mem, 0x100_0000, spec.payload.len()),
        spec.payload
    );

    let bp: boot_params = mem.read_obj(GuestAddress(0x7000)).unwrap();
    let hdr = bp.hdr;
    assert_eq!({ hdr.header }, 0x5372_6448);
    assert_eq!({ hdr.version }, 0x020f);
    assert_eq!({ hdr.boot_flag }, 0xaa55);
    assert_eq!({ hdr.setup_sects }, 4);
    assert_eq!({ hdr.vid_mode }, 0xffff);
    assert_eq!({ hdr.type_of_loader }, 0xff);
    assert_eq!({ hdr.loadflags }, 0x81);
    assert_eq!({ hdr.heap_end_ptr }, 0xfe00);
    assert_eq!({ hdr.code32_start }, 0x100_0000);
    assert_eq!({ hdr.cmd_line_ptr }, 0x20000);
    assert_eq!({ hdr.kernel_alignment }, 0x20_0000);
    assert_eq!({ hdr.cmdline_size }, 2047);
    assert_eq!(read_cstr(&mem, 0x20000), "console=ttyS0 earlyprintk=serial");
    let (rd, rd_size) = (hdr.ramdisk_image, hdr.ramdisk_size);
    assert_eq!(rd_size, 20_000);
    assert_eq!(rd % 4096, 0);
    assert!(u64::from(rd) >= 0x140_0000 && u64::from(rd + rd_size) <= MEM);
    assert_eq!(be.initrd, Some((u64::from(rd), 20_000)));
    assert_eq!(read_bytes(&mem, u64::from(rd), 20_000), initrd);

    let map = e820_map(MEM);
    assert_eq!(bp.e820_entries as usize, map.len());
    for (i, e) in map.iter().enumerate() {
        let t = bp.e820_table[i];
        assert_eq!(
            ({ t.addr }, { t.size }, { t.r#type }),
            (e.addr, e.size, e.kind.code())
        );
    }
    assert_eq!({ bp.acpi_rsdp_addr }, 0);
}

#[test]
fn bzimage_not_relocatable_loads_at_1m_and_old_header_not_overcopied() {
    let mem = guest_mem(MEM);
    // Protocol 2.10: the header ends at 0x264; the bytes after it are 0xaa in the image.
    let spec = BzSpec {
        version: 0x020a,
        relocatable: false,
        ..Default::default()
    };
    let be = load(&mem, bzimage(&spec), "", None, MEM).unwrap();
    assert_eq!(be.entry_point, 0x10_0000);
    assert_eq!(
        read_bytes(&mem, 0x10_0000, spec.payload.len()),
        spec.payload
    );
    let zp = read_bytes(&mem, 0x7000, 4096);
    assert!(
        zp[0x264..0x26c].iter().all(|&b| b == 0),
        "{:x?}",
        &zp[0x264..0x26c]
    );
    assert!(zp[..0x1e8].iter().all(|&b| b == 0));
    assert_eq!(zp[0x1e8], 6); // e820_entries
    let bp: boot_params = mem.read_obj(GuestAddress(0x7000)).unwrap();
    assert_eq!({ bp.hdr.ramdisk_image }, 0);
    assert_eq!({ bp.hdr.code32_start }, 0x10_0000);
    // Decompression at pref_address (16 MiB) + init_size.
    assert_eq!(be.kernel_end, 0x140_0000);
}

#[test]
fn bzimage_rsdp_and_5g_initrd_below_initrd_addr_max() {
    let size = 5 * GIB;
    let mem = guest_mem(size);
    let config = BootConfig {
        cmdline: "quiet".into(),
        mem_size: size,
        rsdp: Some(0xf0000),
        image_name: None,
    };
    let mut k = Cursor::new(bzimage(&BzSpec::default()));
    let mut initrd = Cursor::new(vec![1u8; 3000]);
    let be = load_kernel_with_config(&mem, &mut k, Some(&mut initrd), &config).unwrap();
    let bp: boot_params = mem.read_obj(GuestAddress(0x7000)).unwrap();
    assert_eq!({ bp.acpi_rsdp_addr }, 0xf0000);
    assert_eq!(bp.e820_entries, 7);
    let last = bp.e820_table[6];
    assert_eq!(
        ({ last.addr }, { last.size }, { last.r#type }),
        (4 * GIB, 2 * GIB, 1)
    );
    // initrd_addr_max = 0x7fffffff: the initrd ends at or below 2 GiB.
    assert_eq!(be.initrd, Some((0x8000_0000 - 4096, 3000)));
    assert_eq!({ bp.hdr.ramdisk_image }, 0x8000_0000 - 4096);
}

#[test]
fn bzimage_cmdline_limited_by_header() {
    let mem = guest_mem(MEM);
    let spec = BzSpec {
        cmdline_size: 16,
        ..Default::default()
    };
    assert!(load(&mem, bzimage(&spec), "0123456789abcdef", None, MEM).is_ok());
    assert!(matches!(
        load(&mem, bzimage(&spec), "0123456789abcdefg", None, MEM),
        Err(LoadError::CmdlineTooLong { len: 17, max: 16 })
    ));
}

#[test]
fn bzimage_too_old_protocol() {
    let mem = guest_mem(MEM);
    let spec = BzSpec {
        version: 0x0209,
        ..Default::default()
    };
    let err = load(&mem, bzimage(&spec), "", None, MEM).unwrap_err();
    assert!(matches!(err, LoadError::ProtocolTooOld { version: 0x0209 }));
    assert!(err.to_string().contains("2.09"), "{err}");
}

#[test]
fn bzimage_truncated_and_bad_fields() {
    let mem = guest_mem(MEM);
    let full = bzimage(&BzSpec::default());
    // Setup sectors only, no protected-mode kernel.
    assert!(matches!(
        load(&mem, full[..5 * 512].to_vec(), "", None, MEM),
        Err(LoadError::TruncatedBzImage { .. })
    ));
    // Cut inside the header.
    assert!(matches!(
        load(&mem, full[..0x240].to_vec(), "", None, MEM),
        Err(LoadError::TruncatedBzImage { .. })
    ));
    let spec = BzSpec {
        loadflags: 0,
        ..Default::default()
    };
    assert!(matches!(
        load(&mem, bzimage(&spec), "", None, MEM),
        Err(LoadError::InvalidBzImageHeader { .. })
    ));
    let spec = BzSpec {
        kernel_alignment: 0x30_0000,
        ..Default::default()
    };
    assert!(matches!(
        load(&mem, bzimage(&spec), "", None, MEM),
        Err(LoadError::InvalidBzImageHeader {
            field: "kernel_alignment",
            ..
        })
    ));
}

#[test]
fn bzimage_too_large_for_memory() {
    let mem = guest_mem(16 * MIB);
    // Decompression at 16 MiB cannot fit in 16 MiB of RAM.
    let err = load(&mem, bzimage(&BzSpec::default()), "", None, 16 * MIB).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::KernelTooLarge {
                needed_end: 0x140_0000,
                ram_end: 0x100_0000,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn bzimage_initrd_too_large() {
    let mem = guest_mem(MEM);
    let err = load(
        &mem,
        bzimage(&BzSpec::default()),
        "",
        Some(vec![0; (50 * MIB) as usize]),
        MEM,
    )
    .unwrap_err();
    assert!(
        matches!(err, LoadError::InitrdTooLarge { size, .. } if size == 50 * MIB),
        "{err}"
    );
}

#[test]
fn empty_and_unrecognised() {
    let mem = guest_mem(MEM);
    assert!(matches!(
        load(&mem, vec![], "", None, MEM),
        Err(LoadError::EmptyKernel)
    ));
    assert!(matches!(
        load(&mem, vec![0x55; 10_000], "", None, MEM),
        Err(LoadError::NotRecognised(_))
    ));
    // An ELF with neither a PVH note nor a Multiboot header.
    let spec = ElfSpec {
        is_64: true,
        entry: 0x10_0000,
        segments: vec![Seg::new(0x10_0000, vec![0; 16], 16)],
        ..Default::default()
    };
    let err = load(&mem, elf_image(&spec), "", None, MEM).unwrap_err();
    assert!(matches!(err, LoadError::NotRecognised(_)), "{err}");
    assert!(err.to_string().contains("PVH"), "{err}");
}

#[test]
fn truncated_elf_header() {
    let mem = guest_mem(MEM);
    let img = elf_image(&pvh_spec(true));
    assert!(matches!(
        load(&mem, img[..40].to_vec(), "", None, MEM),
        Err(LoadError::Truncated {
            what: "ELF header",
            ..
        })
    ));
    // Program headers cut off.
    assert!(matches!(
        load(&mem, img[..100].to_vec(), "", None, MEM),
        Err(LoadError::Truncated {
            what: "program header table",
            ..
        })
    ));
}

#[test]
fn wrong_machine() {
    let mem = guest_mem(MEM);
    let mut spec = pvh_spec(true);
    spec.machine = 183; // AArch64
    let err = load(&mem, elf_image(&spec), "", None, MEM).unwrap_err();
    assert!(
        matches!(err, LoadError::WrongMachine { machine: 183 }),
        "{err}"
    );
}

#[test]
fn big_endian_refused() {
    let mem = guest_mem(MEM);
    let mut img = elf_image(&pvh_spec(false));
    img[5] = 2;
    assert!(matches!(
        load(&mem, img, "", None, MEM),
        Err(LoadError::ElfNotLittleEndian { ei_data: 2 })
    ));
}

#[test]
fn segment_past_file_end() {
    let mem = guest_mem(MEM);
    let spec = pvh_spec(true);
    let mut img = elf_image(&spec);
    img.truncate(seg_offset(&spec, 1) + 0x80); // second segment's data cut short
    let err = load(&mem, img, "", None, MEM).unwrap_err();
    assert!(
        matches!(err, LoadError::SegmentBeyondFile { index: 1, .. }),
        "{err}"
    );
}

#[test]
fn segment_past_ram() {
    let mem = guest_mem(MEM);
    let mut spec = pvh_spec(false);
    spec.segments[1] = Seg::new(MEM - 0x1000, vec![1; 16], 0x2000);
    let err = load(&mem, elf_image(&spec), "", None, MEM).unwrap_err();
    assert!(
        matches!(err, LoadError::SegmentOutsideRam { index: 1, start, end, ram_end }
            if start == MEM - 0x1000 && end == MEM + 0x1000 && ram_end == MEM),
        "{err}"
    );
    // Nothing of the kernel was written.
    assert!(read_bytes(&mem, 0x10_0000, 16).iter().all(|&b| b == 0));
}

#[test]
fn segment_overflowing_address() {
    let mem = guest_mem(MEM);
    let mut spec = pvh_spec(true);
    spec.segments[1] = Seg::new(u64::MAX - 8, vec![], 0x100);
    assert!(matches!(
        load(&mem, elf_image(&spec), "", None, MEM),
        Err(LoadError::SegmentOutsideRam { index: 1, .. })
    ));
}

#[test]
fn segment_in_boot_area() {
    let mem = guest_mem(MEM);
    let mut spec = pvh_spec(true);
    spec.segments[1] = Seg::new(0x7000, vec![1; 16], 16);
    assert!(matches!(
        load(&mem, elf_image(&spec), "", None, MEM),
        Err(LoadError::SegmentInBootArea {
            index: 1,
            start: 0x7000,
            ..
        })
    ));
}

#[test]
fn segment_in_mmio_hole() {
    let size = 5 * GIB;
    let mem = guest_mem(size);
    let mut spec = pvh_spec(true);
    spec.segments[1] = Seg::new(3 * GIB - 0x1000, vec![1; 16], 0x2000);
    let err = load(&mem, elf_image(&spec), "", None, size).unwrap_err();
    assert!(
        matches!(err, LoadError::SegmentInMmioHole { index: 1, .. }),
        "{err}"
    );
}

#[test]
fn filesz_larger_than_memsz() {
    let mem = guest_mem(MEM);
    let mut spec = pvh_spec(true);
    spec.segments[1].memsz = 0x10;
    assert!(matches!(
        load(&mem, elf_image(&spec), "", None, MEM),
        Err(LoadError::SegmentFileSizeTooLarge { index: 1, .. })
    ));
}

#[test]
fn pvh_entry_outside_image() {
    let mem = guest_mem(MEM);
    let mut spec = pvh_spec(true);
    spec.notes = Some(pvh_note(0x30_0000));
    assert!(matches!(
        load(&mem, elf_image(&spec), "", None, MEM),
        Err(LoadError::InvalidEntryPoint {
            entry: 0x30_0000,
            ..
        })
    ));
}

#[test]
fn pvh_note_too_short() {
    let mem = guest_mem(MEM);
    let mut spec = pvh_spec(true);
    let mut note = pvh_note(0x10_0010);
    note[4] = 2; // descsz 2
    spec.notes = Some(note);
    assert!(matches!(
        load(&mem, elf_image(&spec), "", None, MEM),
        Err(LoadError::InvalidPvhNote { .. })
    ));
}

#[test]
fn cmdline_errors() {
    let mem = guest_mem(MEM);
    let long = "a".repeat(0x1_0000);
    assert!(matches!(
        load(&mem, elf_image(&pvh_spec(true)), &long, None, MEM),
        Err(LoadError::CmdlineTooLong {
            len: 0x10000,
            max: 0xffff
        })
    ));
    assert!(load(&mem, elf_image(&pvh_spec(true)), &long[1..], None, MEM).is_ok());
    assert!(matches!(
        load(&mem, elf_image(&pvh_spec(true)), "a\tb", None, MEM),
        Err(LoadError::CmdlineInvalid(_))
    ));
}

#[test]
fn initrd_too_large_for_memory() {
    let mem = guest_mem(MEM);
    let err = load(
        &mem,
        elf_image(&pvh_spec(true)),
        "",
        Some(vec![0; (MEM - 2 * MIB) as usize]),
        MEM,
    )
    .unwrap_err();
    assert!(matches!(err, LoadError::InitrdTooLarge { .. }), "{err}");
}

#[test]
fn memory_checks() {
    let mem = guest_mem(MIB);
    assert!(matches!(
        load(&mem, elf_image(&pvh_spec(true)), "", None, MIB),
        Err(LoadError::MemoryTooSmall { .. })
    ));
    let mem = guest_mem(32 * MIB);
    assert!(matches!(
        load(&mem, elf_image(&pvh_spec(true)), "", None, MEM),
        Err(LoadError::MemoryNotMapped { .. })
    ));
}

/// Deterministic pseudo-random mutations of every format: errors are fine, panics are not.
#[test]
fn mutated_images_never_panic() {
    let mem = guest_mem(MEM);
    let mut bz = BzSpec::default();
    bz.payload.truncate(0x200);
    let mut aout = vec![0x90u8; 0x40];
    aout.extend_from_slice(&mb_header(
        MB_HEADER_AOUT_KLUDGE,
        Some([0x20_0040, 0x20_0000, 0, 0x20_3000, 0x20_0080]),
    ));
    aout.resize(0x400, 0);
    let images = [
        elf_image(&pvh_spec(true)),
        elf_image(&pvh_spec(false)),
        elf_image(&multiboot_spec(false)),
        elf_image(&multiboot_spec(true)),
        bzimage(&bz),
        aout,
    ];
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for img in &images {
        // Every truncation of the headers.
        for cut in (0..img.len().min(0x1100)).step_by(3) {
            let _ = load(&mem, img[..cut].to_vec(), "", None, MEM);
        }
        for _ in 0..400 {
            let mut m = img.clone();
            for _ in 0..(1 + next() % 4) {
                let pos = (next() % 0x1100.min(m.len() as u64)) as usize;
                m[pos] = next() as u8;
            }
            let _ = load(&mem, m, "x", Some(vec![1; 100]), MEM);
        }
    }
}

/// Overlapping PT_LOAD segments (one would overwrite the other) are refused, in both ELF
/// classes, naming both segments; adjacent ones are fine.
#[test]
fn overlapping_segments_are_refused() {
    for is_64 in [false, true] {
        let spec = |second: u64| ElfSpec {
            is_64,
            machine: 62,
            entry: 0x10_0010,
            notes: Some(pvh_note(0x10_0010)),
            segments: vec![
                Seg::new(0x10_0000, pattern(0x1800, 1), 0x4000),
                Seg::new(second, pattern(0x100, 2), 0x100),
            ],
            ..Default::default()
        };
        let mem = guest_mem(MEM);
        let e = load(&mem, elf_image(&spec(0x10_3000)), "", None, MEM).unwrap_err();
        assert!(
            matches!(
                e,
                LoadError::OverlappingSegments {
                    first: 0,
                    second: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("overlap"), "{e}");
        load(&mem, elf_image(&spec(0x10_4000)), "", None, MEM).unwrap();
    }
}
