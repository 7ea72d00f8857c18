//! Builders for crafted kernel images used by the unit tests (all in memory).

use vm_memory::{GuestAddress, GuestMemoryMmap};

use crate::layout::ram_regions;
use crate::multiboot::MULTIBOOT_HEADER_MAGIC;

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Guest memory laid out like the VMM does for `mem_size`.
pub fn guest_mem(mem_size: u64) -> GuestMemoryMmap {
    let ranges: Vec<(GuestAddress, usize)> = ram_regions(mem_size)
        .into_iter()
        .map(|(a, s)| (a, s as usize))
        .collect();
    GuestMemoryMmap::from_ranges(&ranges).unwrap()
}

/// One PT_LOAD segment.
#[derive(Clone, Debug, Default)]
pub struct Seg {
    pub paddr: u64,
    pub vaddr: u64,
    pub data: Vec<u8>,
    pub memsz: u64,
}

impl Seg {
    pub fn new(paddr: u64, data: Vec<u8>, memsz: u64) -> Self {
        Seg {
            paddr,
            vaddr: paddr,
            data,
            memsz,
        }
    }
}

/// An ELF image: PT_LOAD segments (program headers 0..n, data at 4 KiB-aligned file offsets
/// from 0x1000) and optionally a PT_NOTE segment (the last program header).
#[derive(Clone, Debug, Default)]
pub struct ElfSpec {
    pub is_64: bool,
    /// e_machine; 0 means the natural one for the class.
    pub machine: u16,
    pub entry: u64,
    pub segments: Vec<Seg>,
    pub notes: Option<Vec<u8>>,
    /// p_align of the note segment (4 when 0).
    pub note_align: u64,
}

pub fn ehsize(is_64: bool) -> usize {
    if is_64 {
        64
    } else {
        52
    }
}

pub fn phentsize(is_64: bool) -> usize {
    if is_64 {
        56
    } else {
        32
    }
}

/// File offset of the data of segment `i` built by [`elf_image`].
pub fn seg_offset(spec: &ElfSpec, i: usize) -> usize {
    let mut off = 0x1000;
    for s in &spec.segments[..i] {
        off += (s.data.len() + 0xfff) & !0xfff;
        if s.data.is_empty() {
            off += 0x1000;
        }
    }
    off
}

pub fn elf_image(spec: &ElfSpec) -> Vec<u8> {
    let is_64 = spec.is_64;
    let nph = spec.segments.len() + usize::from(spec.notes.is_some());
    let phoff = ehsize(is_64);
    let notes_off = phoff + nph * phentsize(is_64);
    let notes_off = (notes_off + 7) & !7;
    let mut out = vec![0u8; 0x1000];
    assert!(notes_off + spec.notes.as_ref().map_or(0, |n| n.len()) <= 0x1000);
    // e_ident
    out[0..4].copy_from_slice(b"\x7fELF");
    out[4] = if is_64 { 2 } else { 1 };
    out[5] = 1;
    out[6] = 1;
    let machine = match spec.machine {
        0 if is_64 => 62,
        0 => 3,
        m => m,
    };
    let w16 = |o: &mut Vec<u8>, at: usize, v: u16| o[at..at + 2].copy_from_slice(&v.to_le_bytes());
    let w32 = |o: &mut Vec<u8>, at: usize, v: u32| o[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let w64 = |o: &mut Vec<u8>, at: usize, v: u64| o[at..at + 8].copy_from_slice(&v.to_le_bytes());
    w16(&mut out, 16, 2); // ET_EXEC
    w16(&mut out, 18, machine);
    w32(&mut out, 20, 1);
    if is_64 {
        w64(&mut out, 24, spec.entry);
        w64(&mut out, 32, phoff as u64);
        w16(&mut out, 52, 64);
        w16(&mut out, 54, 56);
        w16(&mut out, 56, nph as u16);
    } else {
        w32(&mut out, 24, spec.entry as u32);
        w32(&mut out, 28, phoff as u32);
        w16(&mut out, 40, 52);
        w16(&mut out, 42, 32);
        w16(&mut out, 44, nph as u16);
    }
    let phdr = |o: &mut Vec<u8>,
                i: usize,
                t: u32,
                off: u64,
                va: u64,
                pa: u64,
                fs: u64,
                ms: u64,
                al: u64| {
        let at = phoff + i * phentsize(is_64);
        if is_64 {
            w32(o, at, t);
            w32(o, at + 4, 5);
            w64(o, at + 8, off);
            w64(o, at + 16, va);
            w64(o, at + 24, pa);
            w64(o, at + 32, fs);
            w64(o, at + 40, ms);
            w64(o, at + 48, al);
        } else {
            w32(o, at, t);
            w32(o, at + 4, off as u32);
            w32(o, at + 8, va as u32);
            w32(o, at + 12, pa as u32);
            w32(o, at + 16, fs as u32);
            w32(o, at + 20, ms as u32);
            w32(o, at + 24, 5);
            w32(o, at + 28, al as u32);
        }
    };
    for (i, s) in spec.segments.iter().enumerate() {
        let off = seg_offset(spec, i);
        phdr(
            &mut out,
            i,
            1,
            off as u64,
            s.vaddr,
            s.paddr,
            s.data.len() as u64,
            s.memsz,
            0x1000,
        );
    }
    if let Some(notes) = &spec.notes {
        let align = if spec.note_align == 0 {
            4
        } else {
            spec.note_align
        };
        phdr(
            &mut out,
            spec.segments.len(),
            4,
            notes_off as u64,
            0,
            0,
            notes.len() as u64,
            notes.len() as u64,
            align,
        );
        out[notes_off..notes_off + notes.len()].copy_from_slice(notes);
    }
    for (i, s) in spec.segments.iter().enumerate() {
        let off = seg_offset(spec, i);
        if out.len() < off + s.data.len() {
            out.resize(off + s.data.len(), 0);
        }
        out[off..off + s.data.len()].copy_from_slice(&s.data);
    }
    out
}

/// A XEN_ELFNOTE_PHYS32_ENTRY note.
pub fn pvh_note(entry: u32) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&4u32.to_le_bytes());
    v.extend_from_slice(&4u32.to_le_bytes());
    v.extend_from_slice(&18u32.to_le_bytes());
    v.extend_from_slice(b"Xen\0");
    v.extend_from_slice(&entry.to_le_bytes());
    v
}

/// A Multiboot header; `addrs` = (header, load, load_end, bss_end, entry) when bit 16 is set.
pub fn mb_header(flags: u32, addrs: Option<[u32; 5]>) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&MULTIBOOT_HEADER_MAGIC.to_le_bytes());
    v.extend_from_slice(&flags.to_le_bytes());
    let checksum = 0u32
        .wrapping_sub(MULTIBOOT_HEADER_MAGIC)
        .wrapping_sub(flags);
    v.extend_from_slice(&checksum.to_le_bytes());
    if let Some(a) = addrs {
        for x in a {
            v.extend_from_slice(&x.to_le_bytes());
        }
    }
    v
}

/// A fake bzImage.
#[derive(Clone, Debug)]
pub struct BzSpec {
    pub version: u16,
    pub setup_sects: u8,
    pub loadflags: u8,
    pub relocatable: bool,
    pub kernel_alignment: u32,
    pub pref_address: u64,
    pub init_size: u32,
    pub cmdline_size: u32,
    pub initrd_addr_max: u32,
    pub payload: Vec<u8>,
}

impl Default for BzSpec {
    fn default() -> Self {
        BzSpec {
            version: 0x020f,
            setup_sects: 4,
            loadflags: 1,
            relocatable: true,
            kernel_alignment: 0x20_0000,
            pref_address: 0x100_0000,
            init_size: 0x40_0000,
            cmdline_size: 2047,
            initrd_addr_max: 0x7fff_ffff,
            payload: (0..0x3000u32).map(|i| (i * 7 + 3) as u8).collect(),
        }
    }
}

pub fn bzimage(spec: &BzSpec) -> Vec<u8> {
    let sects = if spec.setup_sects == 0 {
        4
    } else {
        spec.setup_sects as usize
    };
    let setup_len = (sects + 1) * 512;
    // Fill the setup area with a marker so that copying past the header end shows.
    let mut out = vec![0xaau8; setup_len];
    out[0x1f1..0x26c].fill(0);
    let hdr_end = if spec.version >= 0x020f {
        0x26c
    } else if spec.version >= 0x020b {
        0x268
    } else {
        0x264
    };
    out[hdr_end..0x26c].fill(0xaa);
    out[0x1f1] = spec.setup_sects;
    out[0x1fa..0x1fc].copy_from_slice(&0xffffu16.to_le_bytes());
    out[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    out[0x200] = 0xeb;
    out[0x201] = (hdr_end - 0x202) as u8;
    out[0x202..0x206].copy_from_slice(b"HdrS");
    out[0x206..0x208].copy_from_slice(&spec.version.to_le_bytes());
    out[0x211] = spec.loadflags;
    out[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes());
    out[0x22c..0x230].copy_from_slice(&spec.initrd_addr_max.to_le_bytes());
    out[0x230..0x234].copy_from_slice(&spec.kernel_alignment.to_le_bytes());
    out[0x234] = u8::from(spec.relocatable);
    out[0x236..0x238].copy_from_slice(&1u16.to_le_bytes()); // XLF_KERNEL_64
    out[0x238..0x23c].copy_from_slice(&spec.cmdline_size.to_le_bytes());
    out[0x258..0x260].copy_from_slice(&spec.pref_address.to_le_bytes());
    out[0x260..0x264].copy_from_slice(&spec.init_size.to_le_bytes());
    out.extend_from_slice(&spec.payload);
    out
}

/// A valid kernel image and the offsets (and widths) of its length, count, offset and
/// address fields: a seed for the property tests and for the fuzz corpus.
#[derive(Clone, Debug)]
pub struct SeedImage {
    pub name: &'static str,
    pub bytes: Vec<u8>,
    pub fields: Vec<(usize, u8)>,
}

fn seed_pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Field offsets of an image built by [`elf_image`] from `spec`.
fn elf_fields(spec: &ElfSpec) -> Vec<(usize, u8)> {
    let is_64 = spec.is_64;
    let nph = spec.segments.len() + usize::from(spec.notes.is_some());
    let phoff = ehsize(is_64);
    let mut f: Vec<(usize, u8)> = if is_64 {
        vec![(16, 2), (18, 2), (24, 8), (32, 8), (54, 2), (56, 2)]
    } else {
        vec![(16, 2), (18, 2), (24, 4), (28, 4), (42, 2), (44, 2)]
    };
    for i in 0..nph {
        let at = phoff + i * phentsize(is_64);
        let (w, offs): (u8, &[usize]) = if is_64 {
            (8, &[8, 16, 24, 32, 40, 48])
        } else {
            (4, &[4, 8, 12, 16, 20, 28])
        };
        f.push((at, 4));
        f.extend(offs.iter().map(|o| (at + o, w)));
    }
    if spec.notes.is_some() {
        let notes_off = (phoff + nph * phentsize(is_64) + 7) & !7;
        f.extend([0, 4, 8, 16].map(|o| (notes_off + o, 4)));
    }
    f
}

fn elf_seed(name: &'static str, spec: ElfSpec) -> SeedImage {
    SeedImage {
        name,
        fields: elf_fields(&spec),
        bytes: elf_image(&spec),
    }
}

/// One valid image of each format and class the loader takes (PVH ELF64 and ELF32,
/// Multiboot ELF32 and ELF64, Multiboot a.out kludge, bzImage), each loadable in 32 MiB.
pub fn seed_images() -> Vec<SeedImage> {
    let pvh = |is_64| ElfSpec {
        is_64,
        machine: 62, // a PVH kernel is x86-64 in either class
        entry: 0xffff_ffff_8100_0000,
        notes: Some(pvh_note(0x10_0010)),
        segments: vec![
            Seg::new(0x10_0000, seed_pattern(0x1800, 1), 0x4000),
            Seg::new(0x20_0000, seed_pattern(0x100, 2), 0x100),
        ],
        ..Default::default()
    };
    let multiboot = |is_64| {
        let mut text = mb_header(3 | crate::multiboot::MB_HEADER_VIDEO_MODE, None);
        text.resize(0x800, 0xf4);
        ElfSpec {
            is_64,
            entry: 0xc010_0040,
            segments: vec![
                Seg {
                    paddr: 0x10_0000,
                    vaddr: 0xc010_0000,
                    data: text,
                    memsz: 0x3000,
                },
                Seg::new(0x40_0000, vec![], 0x2000),
            ],
            ..Default::default()
        }
    };
    let mut aout = vec![0x90u8; 0x40];
    aout.extend_from_slice(&mb_header(
        crate::multiboot::MB_HEADER_AOUT_KLUDGE,
        Some([0x20_0040, 0x20_0000, 0, 0x20_3000, 0x20_0080]),
    ));
    aout.resize(0x400, 0xf4);
    let mut bz = BzSpec::default();
    bz.payload.truncate(0x400);
    bz.pref_address = 0x40_0000;
    bz.init_size = 0x20_0000;
    let bz_fields = [
        (0x1f1, 1),
        (0x201, 1),
        (0x206, 2),
        (0x211, 1),
        (0x22c, 4),
        (0x230, 4),
        (0x234, 1),
        (0x238, 4),
        (0x258, 8),
        (0x260, 4),
    ];
    vec![
        elf_seed("pvh-elf64", pvh(true)),
        elf_seed("pvh-elf32", pvh(false)),
        elf_seed("multiboot-elf32", multiboot(false)),
        elf_seed("multiboot-elf64", multiboot(true)),
        SeedImage {
            name: "multiboot-aout",
            bytes: aout,
            fields: (0x40..0x60).step_by(4).map(|o| (o, 4)).collect(),
        },
        SeedImage {
            name: "bzimage",
            bytes: bzimage(&bz),
            fields: bz_fields.to_vec(),
        },
    ]
}
