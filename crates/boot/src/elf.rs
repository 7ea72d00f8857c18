//! A minimal, fully bounds-checked ELF32/ELF64 header reader.
//!
//! linux-loader's `Elf` loader reads ELF64 only and trusts the file's offsets; this reader
//! validates the header, the program headers and the notes of both classes before anything is
//! loaded, and finds the PVH entry note in any `PT_NOTE` segment.

use std::io::{Read, Seek};

use crate::loader::{read_at, LoadError};

pub(crate) const PT_LOAD: u32 = 1;
pub(crate) const PT_NOTE: u32 = 4;
pub(crate) const EM_386: u16 = 3;
pub(crate) const EM_X86_64: u16 = 62;
const ET_EXEC: u16 = 2;
const ET_DYN: u16 = 3;
/// XEN_ELFNOTE_PHYS32_ENTRY: the 32-bit physical PVH entry point.
pub(crate) const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;
/// Notes larger than this are not searched (no real kernel comes close).
const MAX_NOTE_SCAN: u64 = 1 << 20;

/// A program header, widened to 64 bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ProgramHeader {
    pub index: usize,
    pub p_type: u32,
    pub offset: u64,
    pub vaddr: u64,
    pub paddr: u64,
    pub filesz: u64,
    pub memsz: u64,
    pub align: u64,
}

/// The parts of an ELF file the loaders use.
#[derive(Clone, Debug, Default)]
pub(crate) struct ElfImage {
    pub is_64: bool,
    /// e_machine: [`EM_386`] or [`EM_X86_64`].
    pub machine: u16,
    pub entry: u64,
    pub phdrs: Vec<ProgramHeader>,
}

impl ElfImage {
    /// True for x86-64 code; false for 32-bit x86, which only a Multiboot kernel may be.
    pub(crate) fn is_x86_64(&self) -> bool {
        self.machine == EM_X86_64
    }

    pub(crate) fn loads(&self) -> impl Iterator<Item = &ProgramHeader> {
        self.phdrs.iter().filter(|p| p.p_type == PT_LOAD)
    }
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// True when `head` starts with the ELF magic.
pub(crate) fn is_elf(head: &[u8]) -> bool {
    head.starts_with(b"\x7fELF")
}

/// Reads and validates the ELF header and program headers.
pub(crate) fn parse<R: Read + Seek + ?Sized>(
    file: &mut R,
    file_len: u64,
) -> Result<ElfImage, LoadError> {
    let mut ident = [0u8; 16];
    read_at(file, 0, &mut ident, file_len, "ELF identification")?;
    let is_64 = match ident[4] {
        1 => false,
        2 => true,
        other => {
            return Err(LoadError::InvalidElf {
                field: "EI_CLASS",
                value: u64::from(other),
            })
        }
    };
    if ident[5] != 1 {
        return Err(LoadError::ElfNotLittleEndian { ei_data: ident[5] });
    }
    let ehsize = if is_64 { 64 } else { 52 };
    let mut eh = [0u8; 64];
    read_at(file, 0, &mut eh[..ehsize], file_len, "ELF header")?;
    let e_type = u16_at(&eh, 16);
    let machine = u16_at(&eh, 18);
    if machine != EM_386 && machine != EM_X86_64 {
        return Err(LoadError::WrongMachine { machine });
    }
    if e_type != ET_EXEC && e_type != ET_DYN {
        return Err(LoadError::InvalidElf {
            field: "e_type",
            value: u64::from(e_type),
        });
    }
    let (entry, phoff, phentsize, phnum) = if is_64 {
        (
            u64_at(&eh, 24),
            u64_at(&eh, 32),
            u16_at(&eh, 54),
            u16_at(&eh, 56),
        )
    } else {
        (
            u64::from(u32_at(&eh, 24)),
            u64::from(u32_at(&eh, 28)),
            u16_at(&eh, 42),
            u16_at(&eh, 44),
        )
    };
    let want_phentsize = if is_64 { 56 } else { 32 };
    if phentsize != want_phentsize {
        return Err(LoadError::InvalidElf {
            field: "e_phentsize",
            value: u64::from(phentsize),
        });
    }
    if phnum == 0 {
        return Err(LoadError::InvalidElf {
            field: "e_phnum",
            value: 0,
        });
    }
    if phoff < ehsize as u64 {
        return Err(LoadError::InvalidElf {
            field: "e_phoff",
            value: phoff,
        });
    }
    let table_len = u64::from(phnum) * u64::from(phentsize);
    // Checked before allocating: e_phnum alone would size a 3.6 MiB buffer for a tiny file.
    if phoff
        .checked_add(table_len)
        .is_none_or(|end| end > file_len)
    {
        return Err(LoadError::Truncated {
            what: "program header table",
            offset: phoff,
            len: table_len,
            file_len,
        });
    }
    let mut table = vec![0u8; table_len as usize];
    read_at(file, phoff, &mut table, file_len, "program header table")?;

    let mut phdrs = Vec::with_capacity(usize::from(phnum));
    for (index, b) in table.chunks_exact(usize::from(phentsize)).enumerate() {
        let ph = if is_64 {
            ProgramHeader {
                index,
                p_type: u32_at(b, 0),
                offset: u64_at(b, 8),
                vaddr: u64_at(b, 16),
                paddr: u64_at(b, 24),
                filesz: u64_at(b, 32),
                memsz: u64_at(b, 40),
                align: u64_at(b, 48),
            }
        } else {
            ProgramHeader {
                index,
                p_type: u32_at(b, 0),
                offset: u64::from(u32_at(b, 4)),
                vaddr: u64::from(u32_at(b, 8)),
                paddr: u64::from(u32_at(b, 12)),
                filesz: u64::from(u32_at(b, 16)),
                memsz: u64::from(u32_at(b, 20)),
                align: u64::from(u32_at(b, 28)),
            }
        };
        if ph.p_type == PT_LOAD || ph.p_type == PT_NOTE {
            let in_file = ph
                .offset
                .checked_add(ph.filesz)
                .is_some_and(|end| end <= file_len);
            if !in_file {
                return Err(LoadError::SegmentBeyondFile {
                    index,
                    offset: ph.offset,
                    filesz: ph.filesz,
                    file_len,
                });
            }
        }
        if ph.p_type == PT_LOAD && ph.filesz > ph.memsz {
            return Err(LoadError::SegmentFileSizeTooLarge {
                index,
                filesz: ph.filesz,
                memsz: ph.memsz,
            });
        }
        phdrs.push(ph);
    }
    Ok(ElfImage {
        is_64,
        machine,
        entry,
        phdrs,
    })
}

fn align_up(v: u64, align: u64) -> Option<u64> {
    Some(v.checked_add(align - 1)? & !(align - 1))
}

/// Searches every `PT_NOTE` segment for XEN_ELFNOTE_PHYS32_ENTRY (name "Xen"); returns the
/// 32-bit entry point it holds.
pub(crate) fn find_pvh_entry<R: Read + Seek + ?Sized>(
    file: &mut R,
    file_len: u64,
    elf: &ElfImage,
) -> Result<Option<u32>, LoadError> {
    for ph in elf.phdrs.iter().filter(|p| p.p_type == PT_NOTE) {
        // Notes are 4-byte aligned, or 8-byte aligned in segments with p_align 8.
        let align = if ph.align == 8 { 8 } else { 4 };
        let len = ph.filesz.min(MAX_NOTE_SCAN);
        let mut data = vec![0u8; len as usize];
        read_at(file, ph.offset, &mut data, file_len, "note segment")?;
        let mut pos: u64 = 0;
        while pos.checked_add(12).is_some_and(|end| end <= len) {
            let p = pos as usize;
            let namesz = u64::from(u32_at(&data, p));
            let descsz = u64::from(u32_at(&data, p + 4));
            let n_type = u32_at(&data, p + 8);
            let name_off = pos + 12;
            // align_up can only fail near u64::MAX, impossible for u32 sizes plus a small pos.
            let desc_off = align_up(name_off + namesz, align).unwrap_or(u64::MAX);
            let next = desc_off
                .checked_add(descsz)
                .and_then(|e| align_up(e, align))
                .unwrap_or(u64::MAX);
            if n_type == XEN_ELFNOTE_PHYS32_ENTRY
                && namesz == 4
                && name_off + 4 <= len
                && &data[name_off as usize..name_off as usize + 4] == b"Xen\0"
            {
                if descsz < 4 {
                    return Err(LoadError::InvalidPvhNote {
                        index: ph.index,
                        reason: format!("descriptor is {descsz} bytes, 4 are needed"),
                    });
                }
                if desc_off + 4 > len {
                    return Err(LoadError::InvalidPvhNote {
                        index: ph.index,
                        reason: format!(
                            "descriptor at note offset {desc_off:#x} is past the segment end {len:#x}"
                        ),
                    });
                }
                return Ok(Some(u32_at(&data, desc_off as usize)));
            }
            pos = next;
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{elf_image, pvh_note, ElfSpec, Seg};
    use std::io::Cursor;

    #[test]
    fn parse_elf64_and_find_note() {
        let img = elf_image(&ElfSpec {
            is_64: true,
            notes: Some(pvh_note(0x0010_0040)),
            segments: vec![Seg::new(0x10_0000, vec![0x90; 64], 0x1000)],
            entry: 0x10_0000,
            ..Default::default()
        });
        let len = img.len() as u64;
        let mut c = Cursor::new(img);
        let e = parse(&mut c, len).unwrap();
        assert!(e.is_64);
        assert_eq!(e.loads().count(), 1);
        assert_eq!(find_pvh_entry(&mut c, len, &e).unwrap(), Some(0x0010_0040));
    }

    #[test]
    fn note_among_others_and_8_aligned() {
        // A GNU note before the Xen note, with 8-byte note alignment.
        let mut notes = Vec::new();
        notes.extend_from_slice(&4u32.to_le_bytes());
        notes.extend_from_slice(&5u32.to_le_bytes());
        notes.extend_from_slice(&3u32.to_le_bytes());
        notes.extend_from_slice(b"GNU\0");
        notes.extend_from_slice(&[1, 2, 3, 4, 5, 0, 0, 0]);
        notes.extend_from_slice(&pvh_note(0x0020_0000));
        let img = elf_image(&ElfSpec {
            is_64: false,
            notes: Some(notes),
            note_align: 8,
            segments: vec![Seg::new(0x20_0000, vec![1; 16], 16)],
            entry: 0x20_0000,
            ..Default::default()
        });
        let len = img.len() as u64;
        let mut c = Cursor::new(img);
        let e = parse(&mut c, len).unwrap();
        assert!(!e.is_64);
        assert_eq!(find_pvh_entry(&mut c, len, &e).unwrap(), Some(0x0020_0000));
    }

    /// Regression: a huge e_phnum in a small file allocated the whole claimed table first.
    #[test]
    fn program_header_count_does_not_size_an_allocation() {
        let mut img = elf_image(&ElfSpec {
            is_64: true,
            notes: Some(pvh_note(0x0010_0000)),
            segments: vec![Seg::new(0x10_0000, vec![0x90; 64], 0x1000)],
            entry: 0x10_0000,
            ..Default::default()
        });
        img[56..58].copy_from_slice(&0xffffu16.to_le_bytes());
        let len = img.len() as u64;
        let result = testkit::bounded(testkit::Bounds::alloc(64 << 10), move || {
            parse(&mut Cursor::new(img), len).map(|_| ())
        });
        assert!(
            matches!(result, Err(LoadError::Truncated { len, .. }) if len == 0xffff * 56),
            "{result:?}"
        );
    }

    #[test]
    fn truncated_and_garbage_never_panic() {
        let img = elf_image(&ElfSpec {
            is_64: true,
            notes: Some(pvh_note(0x0010_0000)),
            segments: vec![Seg::new(0x10_0000, vec![0x90; 64], 0x1000)],
            entry: 0x10_0000,
            ..Default::default()
        });
        for cut in 0..img.len() {
            let part = img[..cut].to_vec();
            let len = part.len() as u64;
            let mut c = Cursor::new(part);
            if let Ok(e) = parse(&mut c, len) {
                let _ = find_pvh_entry(&mut c, len, &e);
            }
        }
        // Flip every byte of the headers in turn.
        for i in 0..img.len().min(512) {
            let mut bad = img.clone();
            bad[i] ^= 0xff;
            let len = bad.len() as u64;
            let mut c = Cursor::new(bad);
            if let Ok(e) = parse(&mut c, len) {
                let _ = find_pvh_entry(&mut c, len, &e);
            }
        }
    }
}
