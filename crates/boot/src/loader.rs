//! Kernel loading: format detection and the PVH, Multiboot v1 and Linux bzImage loaders.
//!
//! Every loader leaves the guest ready for a **32-bit flat protected-mode entry with paging
//! off**; [`BootEntry`] says which registers to set. Before anything is written to guest
//! memory, every offset and length from the file is checked against the file and against the
//! RAM layout of [`crate::layout`].

use std::io::{self, Read, Seek, SeekFrom};

use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, CAN_USE_HEAP, LOADED_HIGH};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info, XEN_HVM_START_MAGIC_VALUE,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{BzImage, KernelLoader};
use vm_memory::{
    ByteValued, Bytes, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryError,
    ReadVolatile,
};

use crate::elf::{self, ElfImage};
use crate::gdt::{self, SegmentDescriptor, CODE32_SELECTOR, DATA_SELECTOR, GDT_LIMIT};
use crate::layout::{
    e820_map, low_ram_end, ram_end, ram_regions, range_in_ram, range_overlaps_mmio_hole,
    BOOT_STACK_POINTER, CMDLINE_ADDR, CMDLINE_MAX_SIZE, HIMEM_START, MEMMAP_ADDR, MEMMAP_MAX_SIZE,
    MIN_MEM_SIZE, MMIO_HOLE_START, MODLIST_ADDR, PVH_START_INFO_ADDR, ZERO_PAGE_ADDR,
};
use crate::multiboot::{
    self, BootArea, MultibootHeader, MULTIBOOT_BOOTLOADER_MAGIC, MULTIBOOT_SEARCH,
};

/// Linux boot protocol: the oldest version accepted (2.10: `pref_address`, `init_size`).
pub const MIN_BOOT_PROTOCOL: u16 = 0x020a;
/// `type_of_loader` value for a boot loader without an assigned id.
pub const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// `heap_end_ptr` written into the setup header (offset from the real-mode code, minus 0x200).
pub const HEAP_END_PTR: u16 = 0xfe00;
/// Page size used to align the initrd.
pub const PAGE_SIZE: u64 = 0x1000;

/// Offsets inside the bzImage setup header (file offsets, identical in the zero page).
mod hdr {
    pub const SETUP_SECTS: usize = 0x1f1;
    pub const JUMP_LEN: usize = 0x201;
    pub const MAGIC: usize = 0x202;
    pub const VERSION: usize = 0x206;
    pub const LOADFLAGS: usize = 0x211;
    pub const INITRD_ADDR_MAX: usize = 0x22c;
    pub const KERNEL_ALIGNMENT: usize = 0x230;
    pub const RELOCATABLE: usize = 0x234;
    pub const CMDLINE_SIZE: usize = 0x238;
    pub const PREF_ADDRESS: usize = 0x258;
    pub const INIT_SIZE: usize = 0x260;
    /// End of `init_size`: the shortest header of protocol 2.10.
    pub const END_2_10: usize = 0x264;
    /// End of the setup header as linux-loader's `setup_header` knows it (protocol 2.15).
    pub const END_MAX: usize = 0x26c;
}

/// Which boot protocol the kernel is entered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BootProtocol {
    /// Xen PVH direct boot (`hvm_start_info` in EBX).
    Pvh,
    /// Multiboot v1 (magic in EAX, information structure in EBX).
    Multiboot,
    /// Linux 32-bit boot protocol (zero page in ESI).
    Linux,
}

/// Everything the VMM needs to start the bootstrap processor, independent of the hypervisor.
///
/// Register state for every protocol (the VMM sets all of it on the BSP):
///
/// - CR0 = PE | ET (0x11): protected mode, paging off; CR3 = CR4 = EFER = 0;
/// - GDTR = (`gdt_base`, `gdt_limit`); IDTR base 0 limit 0; interrupts masked
///   (RFLAGS = 0x2: IF = 0, VM = 0);
/// - CS = `code_selector` with the hidden state [`BootEntry::code_segment`];
///   DS, ES, FS, GS, SS = `data_selector` with [`BootEntry::data_segment`];
/// - TR: a busy 32-bit TSS, base 0, limit 0x67 (the hypervisor's reset value is fine);
///   LDTR unusable;
/// - EIP = `entry_point`; EAX, EBX, ESI as given, all other general registers 0;
///   ESP = `stack_pointer` when `Some`, else 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BootEntry {
    /// The protocol the loader prepared.
    pub protocol: BootProtocol,
    /// Guest-physical entry point (EIP).
    pub entry_point: u64,
    /// GDTR base.
    pub gdt_base: u64,
    /// GDTR limit.
    pub gdt_limit: u16,
    /// CS selector (0x10, flat 32-bit code).
    pub code_selector: u16,
    /// DS/ES/FS/GS/SS selector (0x18, flat data).
    pub data_selector: u16,
    /// EAX: 0x2BADB002 for Multiboot, else 0.
    pub eax: u32,
    /// EBX: `hvm_start_info` (PVH) or Multiboot information address, else 0.
    pub ebx: u32,
    /// ESI: zero page address (Linux), else 0.
    pub esi: u32,
    /// Initial ESP, when the loader provides a stack.
    pub stack_pointer: Option<u32>,
    /// Lowest guest-physical address the kernel image occupies.
    pub kernel_start: u64,
    /// End (exclusive) of the memory the kernel needs (for bzImage: its decompression area).
    pub kernel_end: u64,
    /// The initrd as (address, size) when one was loaded.
    pub initrd: Option<(u64, u64)>,
}

impl BootEntry {
    /// Hidden segment state for CS, consistent with the GDT the loader wrote.
    pub fn code_segment(&self) -> SegmentDescriptor {
        gdt::boot_segment(self.code_selector).unwrap_or_default()
    }

    /// Hidden segment state for DS, ES, FS, GS and SS.
    pub fn data_segment(&self) -> SegmentDescriptor {
        gdt::boot_segment(self.data_selector).unwrap_or_default()
    }
}

/// What a boot needs besides the images.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BootConfig {
    /// Kernel command line (printable ASCII).
    pub cmdline: String,
    /// Guest RAM size in bytes; the layout is [`crate::layout::ram_regions`] of it.
    pub mem_size: u64,
    /// Guest-physical address of the ACPI RSDP, when ACPI tables are built: passed in PVH's
    /// `rsdp_paddr` and the zero page's `acpi_rsdp_addr`.
    pub rsdp: Option<u64>,
    /// The kernel's path as the user named it: a Multiboot command line starts with it, as
    /// GRUB and QEMU pass it ("KERNEL-PATH ARGS"). Not used by PVH or Linux.
    pub image_name: Option<String>,
}

/// A readable, seekable source (the initrd); implemented for every `Read + Seek` type.
pub trait ReadSeek: Read + Seek {}
impl<T: Read + Seek + ?Sized> ReadSeek for T {}

/// Why a kernel could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The kernel file has no bytes.
    #[error("kernel image is empty")]
    EmptyKernel,
    /// Reading the kernel file failed.
    #[error("reading the kernel image ({what}) failed: {source}")]
    KernelIo {
        /// Which part of the file.
        what: &'static str,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The file is none of the supported formats.
    #[error("not a recognised kernel: {0}; expected an ELF file with a PVH note or a Multiboot header, or a Linux bzImage")]
    NotRecognised(&'static str),
    /// A structure the header points to lies past the end of the file.
    #[error("kernel image truncated: {what} at file offset {offset:#x} ({len:#x} bytes) extends past the end of the file ({file_len:#x} bytes)")]
    Truncated {
        /// Which structure.
        what: &'static str,
        /// Its file offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The file length.
        file_len: u64,
    },
    /// An ELF header field has a value this loader cannot use.
    #[error("invalid ELF header: {field} = {value:#x}")]
    InvalidElf {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// A big-endian (or invalid data encoding) ELF file.
    #[error("ELF data encoding (EI_DATA) is {ei_data}, only little-endian (1) is supported")]
    ElfNotLittleEndian {
        /// The EI_DATA byte.
        ei_data: u8,
    },
    /// An ELF file for another architecture.
    #[error("ELF e_machine is {machine}, not x86 (3) or x86-64 (62)")]
    WrongMachine {
        /// The e_machine value.
        machine: u16,
    },
    /// A 32-bit x86 ELF file that is not a Multiboot kernel.
    #[error("ELF e_machine {machine} (32-bit x86), not x86-64 (62): only a Multiboot kernel may be 32-bit x86, and this file has no Multiboot header")]
    NotX86_64 {
        /// The e_machine value.
        machine: u16,
    },
    /// A segment's file data lies past the end of the file.
    #[error("segment {index}: file data at offset {offset:#x} ({filesz:#x} bytes) extends past the end of the file ({file_len:#x} bytes)")]
    SegmentBeyondFile {
        /// Program-header index (0 for an a.out-kludge image).
        index: usize,
        /// File offset.
        offset: u64,
        /// Size in the file.
        filesz: u64,
        /// File length.
        file_len: u64,
    },
    /// Two PT_LOAD segments claim the same guest memory: one would silently overwrite the
    /// other.
    #[error("segments {first} ({first_start:#x}..{first_end:#x}) and {second} ({second_start:#x}..{second_end:#x}) overlap in physical memory")]
    OverlappingSegments {
        /// Program-header index of the lower segment.
        first: usize,
        /// Its physical range.
        first_start: u64,
        /// End of its physical range.
        first_end: u64,
        /// Program-header index of the segment that starts inside it.
        second: usize,
        /// Its physical range.
        second_start: u64,
        /// End of its physical range.
        second_end: u64,
    },
    /// No room for the Multiboot boot structures where the kernel is not.
    #[error("no room for the {size:#x} bytes of boot structures (GDT, Multiboot information, memory map, command line) outside the kernel, in conventional memory or low RAM")]
    NoRoomForBootStructures {
        /// Bytes needed.
        size: u64,
    },
    /// `p_filesz > p_memsz`.
    #[error("segment {index}: p_filesz {filesz:#x} is larger than p_memsz {memsz:#x}")]
    SegmentFileSizeTooLarge {
        /// Program-header index.
        index: usize,
        /// p_filesz.
        filesz: u64,
        /// p_memsz.
        memsz: u64,
    },
    /// A segment that does not lie inside guest RAM.
    #[error("segment {index}: guest-physical range [{start:#x}, {end:#x}) is outside guest RAM (RAM ends at {ram_end:#x})")]
    SegmentOutsideRam {
        /// Program-header index.
        index: usize,
        /// First address.
        start: u64,
        /// End address (exclusive; u64::MAX on overflow).
        end: u64,
        /// End of guest RAM.
        ram_end: u64,
    },
    /// A segment below 1 MiB, where the boot structures and firmware tables live (a
    /// Multiboot kernel may load in conventional memory, not over the IVT or the BIOS area).
    #[error("segment {index}: guest-physical range [{start:#x}, {end:#x}) overlaps the boot-structure area below 1 MiB")]
    SegmentInBootArea {
        /// Program-header index.
        index: usize,
        /// First address.
        start: u64,
        /// End address (exclusive).
        end: u64,
    },
    /// A segment in the 32-bit MMIO hole.
    #[error("segment {index}: guest-physical range [{start:#x}, {end:#x}) overlaps the PCI/MMIO hole [0xc0000000, 0x100000000)")]
    SegmentInMmioHole {
        /// Program-header index.
        index: usize,
        /// First address.
        start: u64,
        /// End address (exclusive).
        end: u64,
    },
    /// The entry point is not inside the loaded image or not reachable in 32-bit mode.
    #[error("entry point {entry:#x} is invalid: {reason}")]
    InvalidEntryPoint {
        /// The entry point.
        entry: u64,
        /// Why.
        reason: &'static str,
    },
    /// A malformed XEN_ELFNOTE_PHYS32_ENTRY note.
    #[error("PVH note in program header {index} is invalid: {reason}")]
    InvalidPvhNote {
        /// Program-header index of the note segment.
        index: usize,
        /// Why.
        reason: String,
    },
    /// The Multiboot header requires features this loader does not provide.
    #[error("Multiboot header at file offset {offset:#x}: flags {flags:#x} require unsupported features (bits {unsupported:#x})")]
    UnsupportedMultibootFlags {
        /// File offset of the header.
        offset: u64,
        /// The header flags.
        flags: u32,
        /// The unsupported required bits.
        unsupported: u32,
    },
    /// The Multiboot address fields extend past the first 8192 bytes.
    #[error("Multiboot header at file offset {offset:#x}: its address fields extend past the first 8192 bytes")]
    TruncatedMultibootHeader {
        /// File offset of the header.
        offset: u64,
    },
    /// A non-ELF Multiboot image without address fields.
    #[error("Multiboot header at file offset {offset:#x}: the image is not ELF and flag bit 16 (address fields) is clear, so its load address is unknown")]
    MultibootWithoutAddresses {
        /// File offset of the header.
        offset: u64,
    },
    /// Inconsistent Multiboot address fields.
    #[error(
        "Multiboot header: {field} = {value:#x} is inconsistent with the other address fields"
    )]
    InvalidMultibootAddress {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u32,
    },
    /// The bzImage is shorter than its header says.
    #[error("bzImage truncated: {what} needs {needed:#x} bytes but the file has {file_len:#x}")]
    TruncatedBzImage {
        /// What is missing.
        what: &'static str,
        /// The length needed.
        needed: u64,
        /// The file length.
        file_len: u64,
    },
    /// Boot protocol older than 2.10.
    #[error("bzImage boot protocol {}.{:02} is too old: 2.10 or later is required", .version >> 8, .version & 0xff)]
    ProtocolTooOld {
        /// The header's version field.
        version: u16,
    },
    /// A bzImage header field with an unusable value.
    #[error("bzImage setup header: {field} = {value:#x} is invalid")]
    InvalidBzImageHeader {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// The kernel needs more low memory than the guest has.
    #[error("kernel loaded at {load_addr:#x} needs guest memory up to {needed_end:#x}, but RAM below the PCI hole ends at {ram_end:#x}")]
    KernelTooLarge {
        /// Load address.
        load_addr: u64,
        /// End of the memory the kernel needs.
        needed_end: u64,
        /// End of low RAM.
        ram_end: u64,
    },
    /// Command line longer than the protocol or the boot area allows.
    #[error("kernel command line is {len} bytes, longer than the maximum of {max} bytes")]
    CmdlineTooLong {
        /// Length.
        len: usize,
        /// Maximum.
        max: usize,
    },
    /// Command line with characters that are not printable ASCII.
    #[error("kernel command line is invalid: {0}")]
    CmdlineInvalid(#[source] linux_loader::cmdline::Error),
    /// The initrd does not fit between the kernel and the top of low RAM.
    #[error("initrd of {size:#x} bytes does not fit in guest memory: {available:#x} bytes are free between {low:#x} and {high:#x}")]
    InitrdTooLarge {
        /// Initrd size.
        size: u64,
        /// Bytes available.
        available: u64,
        /// Lowest usable address (end of the kernel).
        low: u64,
        /// Highest usable address.
        high: u64,
    },
    /// Reading the initrd failed.
    #[error("reading the initrd failed: {0}")]
    InitrdIo(#[source] io::Error),
    /// Guest memory smaller than the loaders need.
    #[error("guest memory size {mem_size:#x} is too small: at least {min:#x} bytes are needed")]
    MemoryTooSmall {
        /// The size.
        mem_size: u64,
        /// The minimum.
        min: u64,
    },
    /// The guest memory object does not map the layout's RAM.
    #[error("guest memory does not map RAM [{start:#x}, {end:#x}) of the layout for {mem_size:#x} bytes")]
    MemoryNotMapped {
        /// Region start.
        start: u64,
        /// Region end.
        end: u64,
        /// The memory size.
        mem_size: u64,
    },
    /// A boot structure larger than its area.
    #[error("{what} is {size:#x} bytes, larger than its {max:#x}-byte area")]
    BootAreaOverflow {
        /// The structure.
        what: &'static str,
        /// Its size.
        size: u64,
        /// The area size.
        max: u64,
    },
    /// Writing to guest memory failed.
    #[error("writing {what} to guest memory at {addr:#x} failed: {source}")]
    GuestMemory {
        /// What was written.
        what: &'static str,
        /// Where.
        addr: u64,
        /// The error.
        #[source]
        source: GuestMemoryError,
    },
    /// linux-loader's boot configurator could not write the boot parameters.
    #[error("writing the {what} failed: {source}")]
    BootParams {
        /// Which structure.
        what: &'static str,
        /// The error.
        #[source]
        source: linux_loader::configurator::Error,
    },
    /// linux-loader failed in a way not covered by the checks made before calling it.
    #[error("linux-loader failed: {0}")]
    Loader(#[source] linux_loader::loader::Error),
}

/// Maps linux-loader's errors to the variants above (the checks made before calling it
/// normally catch these first).
fn map_loader_error(e: linux_loader::loader::Error, file_len: u64) -> LoadError {
    use linux_loader::loader::bzimage::Error as B;
    use linux_loader::loader::elf::Error as E;
    use linux_loader::loader::Error as L;
    match e {
        L::Elf(E::InvalidElfMagicNumber) => LoadError::NotRecognised("bad ELF magic"),
        L::Elf(E::BigEndianElfOnLittle) => LoadError::ElfNotLittleEndian { ei_data: 2 },
        L::Elf(E::InvalidProgramHeaderSize) => LoadError::InvalidElf {
            field: "e_phentsize",
            value: 0,
        },
        L::Elf(E::InvalidProgramHeaderOffset) => LoadError::InvalidElf {
            field: "e_phoff",
            value: 0,
        },
        L::Elf(E::InvalidPvhNote) => LoadError::InvalidPvhNote {
            index: 0,
            reason: "descriptor shorter than 4 bytes".into(),
        },
        L::Elf(E::ReadElfHeader) => LoadError::Truncated {
            what: "ELF header",
            offset: 0,
            len: 64,
            file_len,
        },
        L::Bzimage(B::InvalidBzImage) => LoadError::NotRecognised("bzImage header rejected"),
        L::Bzimage(B::Underflow) => LoadError::TruncatedBzImage {
            what: "setup sectors",
            needed: 0,
            file_len,
        },
        other => LoadError::Loader(other),
    }
}

/// Reads exactly `buf.len()` bytes at `offset`, after checking they lie inside the file.
pub(crate) fn read_at<R: Read + Seek + ?Sized>(
    file: &mut R,
    offset: u64,
    buf: &mut [u8],
    file_len: u64,
    what: &'static str,
) -> Result<(), LoadError> {
    let len = buf.len() as u64;
    if offset.checked_add(len).is_none_or(|end| end > file_len) {
        return Err(LoadError::Truncated {
            what,
            offset,
            len,
            file_len,
        });
    }
    file.seek(SeekFrom::Start(offset))
        .and_then(|_| file.read_exact(buf))
        .map_err(|source| LoadError::KernelIo { what, source })
}

fn write_mem<M: GuestMemory + ?Sized>(
    mem: &M,
    what: &'static str,
    addr: u64,
    bytes: &[u8],
) -> Result<(), LoadError> {
    mem.write_slice(bytes, GuestAddress(addr))
        .map_err(|source| LoadError::GuestMemory { what, addr, source })
}

/// Fills `[addr, addr + len)` with zeros.
fn zero_mem<M: GuestMemory + ?Sized>(
    mem: &M,
    what: &'static str,
    addr: u64,
    len: u64,
) -> Result<(), LoadError> {
    static ZEROS: [u8; 0x10000] = [0; 0x10000];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(ZEROS.len() as u64);
        write_mem(mem, what, addr + done, &ZEROS[..n as usize])?;
        done += n;
    }
    Ok(())
}

fn align_up(v: u64, align: u64) -> Option<u64> {
    Some(v.checked_add(align - 1)? & !(align - 1))
}

fn align_down(v: u64, align: u64) -> u64 {
    v & !(align - 1)
}

/// Checks that a segment `[start, start + len)` lies in RAM at or above 1 MiB and outside the
/// MMIO hole; with `low_ok` (Multiboot), also in conventional memory below the EBDA, above
/// the IVT and BIOS data area.
fn check_load_range(
    index: usize,
    start: u64,
    len: u64,
    mem_size: u64,
    low_ok: bool,
) -> Result<(), LoadError> {
    let Some(end) = start.checked_add(len) else {
        return Err(LoadError::SegmentOutsideRam {
            index,
            start,
            end: u64::MAX,
            ram_end: ram_end(mem_size),
        });
    };
    if start < HIMEM_START {
        let conventional = start >= multiboot::LOW_KERNEL_MIN && end <= crate::layout::EBDA_START;
        if low_ok && conventional && range_in_ram(mem_size, start, end) {
            return Ok(());
        }
        return Err(LoadError::SegmentInBootArea { index, start, end });
    }
    if range_in_ram(mem_size, start, end) {
        return Ok(());
    }
    if range_overlaps_mmio_hole(start, end) && mem_size > MMIO_HOLE_START {
        return Err(LoadError::SegmentInMmioHole { index, start, end });
    }
    Err(LoadError::SegmentOutsideRam {
        index,
        start,
        end,
        ram_end: ram_end(mem_size),
    })
}

/// Checks the guest memory object maps every RAM region of the layout.
fn check_memory<M: GuestMemoryBackend>(mem: &M, mem_size: u64) -> Result<(), LoadError> {
    if mem_size < MIN_MEM_SIZE {
        return Err(LoadError::MemoryTooSmall {
            mem_size,
            min: MIN_MEM_SIZE,
        });
    }
    for (base, size) in ram_regions(mem_size) {
        let mapped =
            usize::try_from(size).is_ok_and(|len| GuestMemoryBackend::check_range(mem, base, len));
        if !mapped {
            return Err(LoadError::MemoryNotMapped {
                start: base.0,
                end: base.0 + size,
                mem_size,
            });
        }
    }
    Ok(())
}

/// Validates `cmdline` (printable ASCII, at most `max_len` bytes after trimming) with
/// linux-loader's `Cmdline` and writes it NUL-terminated at [`CMDLINE_ADDR`].
fn write_cmdline<M: GuestMemoryBackend>(
    mem: &M,
    cmdline: &str,
    max_len: usize,
) -> Result<(), LoadError> {
    write_cmdline_at(mem, cmdline, max_len, CMDLINE_ADDR)
}

fn write_cmdline_at<M: GuestMemoryBackend>(
    mem: &M,
    cmdline: &str,
    max_len: usize,
    addr: u64,
) -> Result<(), LoadError> {
    let s = cmdline.trim();
    if s.len() > max_len {
        return Err(LoadError::CmdlineTooLong {
            len: s.len(),
            max: max_len,
        });
    }
    let mut c = Cmdline::new(max_len + 1).map_err(LoadError::CmdlineInvalid)?;
    c.insert_str(s).map_err(LoadError::CmdlineInvalid)?;
    linux_loader::loader::load_cmdline(mem, GuestAddress(addr), &c).map_err(|e| match e {
        linux_loader::loader::Error::InvalidCommandLine => {
            LoadError::CmdlineInvalid(linux_loader::cmdline::Error::NullTerminator)
        }
        other => LoadError::Loader(other),
    })
}

/// Loads the initrd page-aligned as high as possible below `high`, not below `low`.
fn load_initrd<M: GuestMemory + ?Sized>(
    mem: &M,
    initrd: &mut dyn ReadSeek,
    low: u64,
    high: u64,
) -> Result<(u64, u64), LoadError> {
    let size = initrd.seek(SeekFrom::End(0)).map_err(LoadError::InitrdIo)?;
    initrd.rewind().map_err(LoadError::InitrdIo)?;
    let low = align_up(low, PAGE_SIZE).unwrap_or(u64::MAX);
    let available = high.saturating_sub(low);
    let too_large = LoadError::InitrdTooLarge {
        size,
        available,
        low,
        high,
    };
    if size > available {
        return Err(too_large);
    }
    let addr = align_down(high - size, PAGE_SIZE);
    if addr < low {
        return Err(too_large);
    }
    let mut buf = vec![0u8; size.min(1 << 20) as usize];
    let mut done = 0u64;
    while done < size {
        let n = (size - done).min(buf.len() as u64) as usize;
        initrd
            .read_exact(&mut buf[..n])
            .map_err(LoadError::InitrdIo)?;
        write_mem(mem, "initrd", addr + done, &buf[..n])?;
        done += n as u64;
    }
    Ok((addr, size))
}

fn boot_entry(protocol: BootProtocol, entry_point: u64) -> BootEntry {
    BootEntry {
        protocol,
        entry_point,
        gdt_base: crate::layout::GDT_ADDR,
        gdt_limit: GDT_LIMIT,
        code_selector: CODE32_SELECTOR,
        data_selector: DATA_SELECTOR,
        eax: 0,
        ebx: 0,
        esi: 0,
        stack_pointer: Some(BOOT_STACK_POINTER as u32),
        kernel_start: 0,
        kernel_end: 0,
        initrd: None,
    }
}

/// Loads a kernel (PVH ELF, Multiboot v1 or Linux bzImage, detected from its contents),
/// its command line and initrd into `mem` laid out for `mem_size` bytes of RAM.
pub fn load_kernel<M, K>(
    mem: &M,
    kernel: &mut K,
    cmdline: &str,
    initrd: Option<&mut dyn ReadSeek>,
    mem_size: u64,
) -> Result<BootEntry, LoadError>
where
    M: GuestMemoryBackend,
    K: Read + ReadVolatile + Seek,
{
    let config = BootConfig {
        cmdline: cmdline.to_owned(),
        mem_size,
        rsdp: None,
        image_name: None,
    };
    load_kernel_with_config(mem, kernel, initrd, &config)
}

/// [`load_kernel`] with the full [`BootConfig`].
pub fn load_kernel_with_config<M, K>(
    mem: &M,
    kernel: &mut K,
    initrd: Option<&mut dyn ReadSeek>,
    config: &BootConfig,
) -> Result<BootEntry, LoadError>
where
    M: GuestMemoryBackend,
    K: Read + ReadVolatile + Seek,
{
    check_memory(mem, config.mem_size)?;
    let file_len = kernel
        .seek(SeekFrom::End(0))
        .map_err(|source| LoadError::KernelIo {
            what: "file length",
            source,
        })?;
    if file_len == 0 {
        return Err(LoadError::EmptyKernel);
    }
    let mut head = vec![0u8; file_len.min(MULTIBOOT_SEARCH as u64) as usize];
    read_at(kernel, 0, &mut head, file_len, "first bytes")?;

    if elf::is_elf(&head) {
        let image = elf::parse(kernel, file_len)?;
        // A PVH entry is an x86-64 kernel's; 32-bit x86 code runs only as a Multiboot
        // kernel, entered in the 32-bit protected mode it expects.
        if image.is_x86_64() {
            if let Some(entry) = elf::find_pvh_entry(kernel, file_len, &image)? {
                return load_pvh(mem, kernel, file_len, &image, entry, initrd, config);
            }
        }
        if let Some(header) = multiboot::find_header(&head)? {
            return load_multiboot_elf(mem, kernel, file_len, &image, &header, initrd, config);
        }
        if !image.is_x86_64() {
            return Err(LoadError::NotX86_64 {
                machine: image.machine,
            });
        }
        return Err(LoadError::NotRecognised(
            "ELF file without a PVH note (XEN_ELFNOTE_PHYS32_ENTRY) or a Multiboot header",
        ));
    }
    if head.get(hdr::MAGIC..hdr::MAGIC + 4) == Some(b"HdrS".as_slice()) {
        return load_bzimage(mem, kernel, file_len, &head, initrd, config);
    }
    if let Some(header) = multiboot::find_header(&head)? {
        if !header.has_addresses() {
            return Err(LoadError::MultibootWithoutAddresses {
                offset: header.offset,
            });
        }
        return load_multiboot_aout(mem, kernel, file_len, &header, initrd, config);
    }
    Err(LoadError::NotRecognised(
        "no ELF magic, no \"HdrS\" bzImage header, no Multiboot header",
    ))
}

/// Checks and loads the PT_LOAD segments at their physical addresses; returns the lowest
/// start and the highest end of the loaded memory below 4 GiB.
fn load_elf_segments<M, K>(
    mem: &M,
    kernel: &mut K,
    file_len: u64,
    image: &ElfImage,
    mem_size: u64,
    expected_pvh: Option<u32>,
) -> Result<(u64, u64), LoadError>
where
    M: GuestMemoryBackend,
    K: Read + ReadVolatile + Seek,
{
    let mut lowest = u64::MAX;
    let mut highest_low = HIMEM_START;
    for ph in image.loads().filter(|p| p.memsz > 0) {
        // Only Multiboot kernels (no PVH note) may load below 1 MiB.
        check_load_range(
            ph.index,
            ph.paddr,
            ph.memsz,
            mem_size,
            expected_pvh.is_none(),
        )?;
        lowest = lowest.min(ph.paddr);
        if ph.paddr < MMIO_HOLE_START {
            highest_low = highest_low.max(ph.paddr + ph.memsz);
        }
    }
    if lowest == u64::MAX {
        return Err(LoadError::InvalidElf {
            field: "PT_LOAD segments (none with p_memsz > 0)",
            value: 0,
        });
    }
    check_no_overlap(image)?;

    if image.is_64 {
        // linux-loader loads ELF64 (p_filesz bytes of every PT_LOAD at p_paddr).
        let result =
            Elf::load(mem, None, kernel, None).map_err(|e| map_loader_error(e, file_len))?;
        if let (PvhBootCapability::PvhEntryPresent(addr), Some(ours)) =
            (result.pvh_boot_cap, expected_pvh)
        {
            if addr.0 != u64::from(ours) {
                log::warn!(
                    "PVH entry: linux-loader found {:#x}, the note scan {ours:#x}; using the latter",
                    addr.0
                );
            }
        }
    } else {
        // ELF32: linux-loader reads ELF64 only.
        for ph in image.loads().filter(|p| p.filesz > 0) {
            kernel
                .seek(SeekFrom::Start(ph.offset))
                .map_err(|source| LoadError::KernelIo {
                    what: "ELF segment",
                    source,
                })?;
            mem.read_exact_volatile_from(GuestAddress(ph.paddr), kernel, ph.filesz as usize)
                .map_err(|source| LoadError::GuestMemory {
                    what: "ELF segment",
                    addr: ph.paddr,
                    source,
                })?;
        }
    }
    for ph in image.loads().filter(|p| p.memsz > p.filesz) {
        zero_mem(
            mem,
            "ELF segment bss",
            ph.paddr + ph.filesz,
            ph.memsz - ph.filesz,
        )?;
    }
    Ok((lowest, highest_low))
}

/// Refuses PT_LOAD segments whose physical ranges overlap (ranges already checked to lie in
/// RAM, so the ends do not overflow).
fn check_no_overlap(image: &ElfImage) -> Result<(), LoadError> {
    let mut loads: Vec<_> = image.loads().filter(|p| p.memsz > 0).collect();
    loads.sort_by_key(|p| p.paddr);
    for pair in loads.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.paddr + a.memsz > b.paddr {
            return Err(LoadError::OverlappingSegments {
                first: a.index,
                first_start: a.paddr,
                first_end: a.paddr + a.memsz,
                second: b.index,
                second_start: b.paddr,
                second_end: b.paddr + b.memsz,
            });
        }
    }
    Ok(())
}

/// The entry point must lie inside a loaded segment and below 4 GiB (32-bit entry).
fn check_entry(image: &ElfImage, entry: u64) -> Result<(), LoadError> {
    if entry >= MMIO_HOLE_START {
        return Err(LoadError::InvalidEntryPoint {
            entry,
            reason: "not in RAM below the PCI hole, where a 32-bit entry can reach",
        });
    }
    let inside = image
        .loads()
        .any(|p| entry >= p.paddr && entry - p.paddr < p.memsz);
    if !inside {
        return Err(LoadError::InvalidEntryPoint {
            entry,
            reason: "not inside any loaded segment",
        });
    }
    Ok(())
}

fn load_pvh<M, K>(
    mem: &M,
    kernel: &mut K,
    file_len: u64,
    image: &ElfImage,
    entry: u32,
    initrd: Option<&mut dyn ReadSeek>,
    config: &BootConfig,
) -> Result<BootEntry, LoadError>
where
    M: GuestMemoryBackend,
    K: Read + ReadVolatile + Seek,
{
    let mem_size = config.mem_size;
    check_entry(image, u64::from(entry))?;
    write_cmdline(mem, &config.cmdline, (CMDLINE_MAX_SIZE - 1) as usize)?;
    let (start, end) = load_elf_segments(mem, kernel, file_len, image, mem_size, Some(entry))?;
    let initrd = match initrd {
        Some(f) => Some(load_initrd(mem, f, end, low_ram_end(mem_size))?),
        None => None,
    };

    let memmap: Vec<hvm_memmap_table_entry> = e820_map(mem_size)
        .iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind.code(),
            reserved: 0,
        })
        .collect();
    let memmap_bytes = (memmap.len() * std::mem::size_of::<hvm_memmap_table_entry>()) as u64;
    if memmap_bytes > MEMMAP_MAX_SIZE {
        return Err(LoadError::BootAreaOverflow {
            what: "PVH memory map",
            size: memmap_bytes,
            max: MEMMAP_MAX_SIZE,
        });
    }
    let mut start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC_VALUE,
        version: 1,
        cmdline_paddr: CMDLINE_ADDR,
        rsdp_paddr: config.rsdp.unwrap_or(0),
        memmap_paddr: MEMMAP_ADDR,
        memmap_entries: memmap.len() as u32,
        ..Default::default()
    };
    if initrd.is_some() {
        start_info.nr_modules = 1;
        start_info.modlist_paddr = MODLIST_ADDR;
    }
    let mut params = BootParams::new(&start_info, GuestAddress(PVH_START_INFO_ADDR));
    params.set_sections(&memmap, GuestAddress(MEMMAP_ADDR));
    if let Some((paddr, size)) = initrd {
        let module = hvm_modlist_entry {
            paddr,
            size,
            ..Default::default()
        };
        params.set_modules(&[module], GuestAddress(MODLIST_ADDR));
    }
    PvhBootConfigurator::write_bootparams(&params, mem).map_err(|source| {
        LoadError::BootParams {
            what: "PVH start_info, memory map and module list",
            source,
        }
    })?;
    let (gdt_base, _) = gdt::write_gdt(mem).map_err(|source| LoadError::GuestMemory {
        what: "GDT",
        addr: crate::layout::GDT_ADDR,
        source,
    })?;
    debug_assert_eq!(gdt_base, crate::layout::GDT_ADDR);

    let mut be = boot_entry(BootProtocol::Pvh, u64::from(entry));
    be.ebx = PVH_START_INFO_ADDR as u32;
    be.kernel_start = start;
    be.kernel_end = end;
    be.initrd = initrd;
    Ok(be)
}

fn load_multiboot_elf<M, K>(
    mem: &M,
    kernel: &mut K,
    file_len: u64,
    image: &ElfImage,
    _header: &MultibootHeader,
    initrd: Option<&mut dyn ReadSeek>,
    config: &BootConfig,
) -> Result<BootEntry, LoadError>
where
    M: GuestMemoryBackend,
    K: Read + ReadVolatile + Seek,
{
    // Like GRUB: an e_entry inside a segment's virtual range is translated to physical.
    let entry = image
        .loads()
        .find(|p| image.entry >= p.vaddr && image.entry - p.vaddr < p.memsz)
        .map(|p| image.entry - p.vaddr + p.paddr)
        .unwrap_or(image.entry);
    check_entry(image, entry)?;
    let (start, end) = load_elf_segments(mem, kernel, file_len, image, config.mem_size, None)?;
    let occupied: Vec<(u64, u64)> = image
        .loads()
        .filter(|p| p.memsz > 0)
        .map(|p| (p.paddr, p.paddr + p.memsz))
        .collect();
    finish_multiboot(mem, entry, (start, end), &occupied, initrd, config)
}

fn load_multiboot_aout<M, K>(
    mem: &M,
    kernel: &mut K,
    file_len: u64,
    h: &MultibootHeader,
    initrd: Option<&mut dyn ReadSeek>,
    config: &BootConfig,
) -> Result<BootEntry, LoadError>
where
    M: GuestMemoryBackend,
    K: Read + ReadVolatile + Seek,
{
    let bad = |field, value| LoadError::InvalidMultibootAddress { field, value };
    if h.load_addr > h.header_addr {
        return Err(bad("load_addr", h.load_addr));
    }
    let header_delta = u64::from(h.header_addr - h.load_addr);
    let Some(file_start) = h.offset.checked_sub(header_delta) else {
        return Err(bad("header_addr", h.header_addr));
    };
    let load_start = u64::from(h.load_addr);
    let load_end = if h.load_end_addr == 0 {
        load_start + (file_len - file_start)
    } else if h.load_end_addr <= h.load_addr {
        return Err(bad("load_end_addr", h.load_end_addr));
    } else {
        u64::from(h.load_end_addr)
    };
    let filesz = load_end - load_start;
    if file_start + filesz > file_len {
        return Err(LoadError::SegmentBeyondFile {
            index: 0,
            offset: file_start,
            filesz,
            file_len,
        });
    }
    let mem_end = if h.bss_end_addr == 0 {
        load_end
    } else if u64::from(h.bss_end_addr) < load_end {
        return Err(bad("bss_end_addr", h.bss_end_addr));
    } else {
        u64::from(h.bss_end_addr)
    };
    check_load_range(0, load_start, mem_end - load_start, config.mem_size, true)?;
    let entry = u64::from(h.entry_addr);
    if entry < load_start || entry >= mem_end {
        return Err(LoadError::InvalidEntryPoint {
            entry,
            reason: "not inside the range the Multiboot address fields load",
        });
    }
    kernel
        .seek(SeekFrom::Start(file_start))
        .map_err(|source| LoadError::KernelIo {
            what: "Multiboot image",
            source,
        })?;
    mem.read_exact_volatile_from(GuestAddress(load_start), kernel, filesz as usize)
        .map_err(|source| LoadError::GuestMemory {
            what: "Multiboot image",
            addr: load_start,
            source,
        })?;
    zero_mem(mem, "Multiboot bss", load_end, mem_end - load_end)?;
    let occupied = [(load_start, mem_end)];
    finish_multiboot(mem, entry, (load_start, mem_end), &occupied, initrd, config)
}

/// The boot structures, command line and initrd of a Multiboot boot, placed where the
/// kernel (`occupied`, its loaded ranges spanning `kernel`) is not.
fn finish_multiboot<M: GuestMemoryBackend>(
    mem: &M,
    entry: u64,
    kernel: (u64, u64),
    occupied: &[(u64, u64)],
    initrd: Option<&mut dyn ReadSeek>,
    config: &BootConfig,
) -> Result<BootEntry, LoadError> {
    let area = BootArea::choose(occupied, config.mem_size)?;
    let cmdline = match &config.image_name {
        // GRUB and QEMU pass "KERNEL-PATH ARGS".
        Some(name) => format!("{name} {}", config.cmdline.trim()),
        None => config.cmdline.clone(),
    };
    write_cmdline_at(mem, &cmdline, (CMDLINE_MAX_SIZE - 1) as usize, area.cmdline)?;
    // Above the kernel, the boot structures and the firmware area below 1 MiB.
    let initrd_low = kernel
        .1
        .max(area.cmdline + CMDLINE_MAX_SIZE)
        .max(HIMEM_START);
    let initrd = match initrd {
        Some(f) => Some(load_initrd(
            mem,
            f,
            initrd_low,
            low_ram_end(config.mem_size),
        )?),
        None => None,
    };
    let info = multiboot::write_info(mem, config.mem_size, &area, initrd)?;
    gdt::write_gdt_at(mem, area.gdt).map_err(|source| LoadError::GuestMemory {
        what: "GDT",
        addr: area.gdt,
        source,
    })?;
    let mut be = boot_entry(BootProtocol::Multiboot, entry);
    be.gdt_base = area.gdt;
    be.stack_pointer = Some(area.stack_top as u32);
    be.eax = MULTIBOOT_BOOTLOADER_MAGIC;
    be.ebx = info as u32;
    be.kernel_start = kernel.0;
    be.kernel_end = kernel.1;
    be.initrd = initrd;
    Ok(be)
}

fn hdr_u8(head: &[u8], off: usize) -> u8 {
    head[off]
}
fn hdr_u16(head: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([head[off], head[off + 1]])
}
fn hdr_u32(head: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([head[off], head[off + 1], head[off + 2], head[off + 3]])
}
fn hdr_u64(head: &[u8], off: usize) -> u64 {
    u64::from(hdr_u32(head, off)) | u64::from(hdr_u32(head, off + 4)) << 32
}

fn load_bzimage<M, K>(
    mem: &M,
    kernel: &mut K,
    file_len: u64,
    head: &[u8],
    initrd: Option<&mut dyn ReadSeek>,
    config: &BootConfig,
) -> Result<BootEntry, LoadError>
where
    M: GuestMemoryBackend,
    K: Read + ReadVolatile + Seek,
{
    let mem_size = config.mem_size;
    if head.len() < hdr::VERSION + 2 {
        return Err(LoadError::TruncatedBzImage {
            what: "setup header version",
            needed: (hdr::VERSION + 2) as u64,
            file_len,
        });
    }
    let version = hdr_u16(head, hdr::VERSION);
    if version < MIN_BOOT_PROTOCOL {
        return Err(LoadError::ProtocolTooOld { version });
    }
    // The setup header ends at 0x202 + the byte at 0x201 (the short jump's offset).
    let hdr_end = hdr::MAGIC + usize::from(hdr_u8(head, hdr::JUMP_LEN));
    if hdr_end < hdr::END_2_10 {
        return Err(LoadError::InvalidBzImageHeader {
            field: "setup header length (byte 0x201)",
            value: u64::from(hdr_u8(head, hdr::JUMP_LEN)),
        });
    }
    let copy_end = hdr_end.min(hdr::END_MAX);
    if head.len() < copy_end {
        return Err(LoadError::TruncatedBzImage {
            what: "setup header",
            needed: copy_end as u64,
            file_len,
        });
    }
    let setup_sects = match hdr_u8(head, hdr::SETUP_SECTS) {
        0 => 4,
        n => u64::from(n),
    };
    let setup_size = (setup_sects + 1) * 512;
    if file_len <= setup_size {
        return Err(LoadError::TruncatedBzImage {
            what: "setup sectors and protected-mode kernel",
            needed: setup_size + 1,
            file_len,
        });
    }
    let loadflags = hdr_u8(head, hdr::LOADFLAGS);
    if loadflags & LOADED_HIGH == 0 {
        return Err(LoadError::InvalidBzImageHeader {
            field: "loadflags (LOADED_HIGH clear: a zImage, not supported)",
            value: u64::from(loadflags),
        });
    }
    let relocatable = hdr_u8(head, hdr::RELOCATABLE) != 0;
    let kernel_alignment = u64::from(hdr_u32(head, hdr::KERNEL_ALIGNMENT));
    if !kernel_alignment.is_power_of_two() {
        return Err(LoadError::InvalidBzImageHeader {
            field: "kernel_alignment",
            value: kernel_alignment,
        });
    }
    let pref_address = hdr_u64(head, hdr::PREF_ADDRESS);
    let init_size = u64::from(hdr_u32(head, hdr::INIT_SIZE));
    let payload = file_len - setup_size;
    let low_end = low_ram_end(mem_size);

    // Load at the preferred address when the kernel is relocatable and it is usable (saves
    // the decompressor a copy), else at 1 MiB.
    let pref_usable = relocatable
        && pref_address >= HIMEM_START
        && pref_address.is_multiple_of(kernel_alignment)
        && pref_address
            .checked_add(payload.max(init_size))
            .is_some_and(|end| end <= low_end);
    let load_addr = if pref_usable {
        pref_address
    } else {
        HIMEM_START
    };
    let image_end = load_addr + payload;
    if image_end > low_end {
        return Err(LoadError::KernelTooLarge {
            load_addr,
            needed_end: image_end,
            ram_end: low_end,
        });
    }
    // The decompressor runs at max(load address aligned up, pref_address) and needs
    // init_size bytes from there.
    let run_addr = align_up(load_addr, kernel_alignment)
        .unwrap_or(u64::MAX)
        .max(pref_address);
    let needed_end = run_addr.saturating_add(init_size).max(image_end);
    if needed_end > low_end {
        return Err(LoadError::KernelTooLarge {
            load_addr,
            needed_end,
            ram_end: low_end,
        });
    }

    // cmdline_size (protocol >= 2.06): maximum length without the NUL.
    let cmdline_max = (hdr_u32(head, hdr::CMDLINE_SIZE) as u64).min(CMDLINE_MAX_SIZE - 1) as usize;
    write_cmdline(mem, &config.cmdline, cmdline_max)?;

    let result = BzImage::load(mem, Some(GuestAddress(load_addr)), kernel, None)
        .map_err(|e| map_loader_error(e, file_len))?;
    if result.kernel_end != image_end {
        log::warn!(
            "bzImage: linux-loader ended the kernel at {:#x}, expected {image_end:#x}",
            result.kernel_end
        );
    }

    // initrd_addr_max is the highest address the initrd's last byte may occupy.
    let initrd_max_end = (u64::from(hdr_u32(head, hdr::INITRD_ADDR_MAX)) + 1).min(low_end);
    let initrd = match initrd {
        Some(f) => Some(load_initrd(mem, f, needed_end, initrd_max_end)?),
        None => None,
    };

    // The zero page: the image's setup header, then the loader's fields.
    let mut bp = boot_params::default();
    bp.as_mut_slice()[hdr::SETUP_SECTS..copy_end]
        .copy_from_slice(&head[hdr::SETUP_SECTS..copy_end]);
    bp.hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
    bp.hdr.loadflags = loadflags | CAN_USE_HEAP;
    bp.hdr.heap_end_ptr = HEAP_END_PTR;
    bp.hdr.code32_start = load_addr as u32;
    bp.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    if let Some((addr, size)) = initrd {
        bp.hdr.ramdisk_image = addr as u32;
        bp.hdr.ramdisk_size = size as u32;
    }
    let map = e820_map(mem_size);
    if map.len() > bp.e820_table.len() {
        return Err(LoadError::BootAreaOverflow {
            what: "e820 table",
            size: map.len() as u64,
            max: bp.e820_table.len() as u64,
        });
    }
    for (slot, e) in bp.e820_table.iter_mut().zip(&map) {
        *slot = boot_e820_entry {
            addr: e.addr,
            size: e.size,
            r#type: e.kind.code(),
        };
    }
    bp.e820_entries = map.len() as u8;
    if let Some(rsdp) = config.rsdp {
        bp.acpi_rsdp_addr = rsdp;
    }
    LinuxBootConfigurator::write_bootparams(
        &BootParams::new(&bp, GuestAddress(ZERO_PAGE_ADDR)),
        mem,
    )
    .map_err(|source| LoadError::BootParams {
        what: "Linux zero page",
        source,
    })?;
    gdt::write_gdt(mem).map_err(|source| LoadError::GuestMemory {
        what: "GDT",
        addr: crate::layout::GDT_ADDR,
        source,
    })?;

    let mut be = boot_entry(BootProtocol::Linux, load_addr);
    be.esi = ZERO_PAGE_ADDR as u32;
    be.kernel_start = load_addr;
    be.kernel_end = needed_end;
    be.initrd = initrd;
    Ok(be)
}

#[cfg(test)]
#[path = "loader_tests.rs"]
mod tests;
