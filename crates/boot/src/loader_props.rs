//! Property tests of the kernel loaders (the entry point that picks the format, and the PVH,
//! Multiboot and bzImage loaders behind it) on untrusted images: arbitrary bytes and
//! structured mutations of valid images give `Ok` or a clean `Err`, never a panic, a hang or
//! an allocation sized by a field of the image; an accepted image is loaded inside guest RAM,
//! byte for byte.

use std::io::Cursor;
use std::sync::OnceLock;

use proptest::prelude::*;
use testkit::{apply_all, bounded, mutations, Bounds};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::elf::{self, PT_LOAD};
use crate::layout::{
    low_ram_end, range_in_ram, HIMEM_START, MMIO_HOLE_START, PVH_START_INFO_ADDR, ZERO_PAGE_ADDR,
};
use crate::loader::{load_kernel, BootEntry, BootProtocol, ReadSeek};
use crate::multiboot::{LOW_KERNEL_MIN, MULTIBOOT_BOOTLOADER_MAGIC};
use crate::testutil::{guest_mem, mb_header, seed_images, MIB};

const MEM: u64 = 32 * MIB;
const INITRD_LEN: usize = 0x2345;
const INITRD_BYTE: u8 = 0x5a;
/// Largest single allocation a load may make besides a copy of the image: the first 8 KiB,
/// the program-header table and the notes are bounded by the file, linux-loader's buffers
/// are small.
const ALLOC_SLACK: usize = 256 << 10;

fn shared_mem() -> GuestMemoryMmap {
    static MEM_ONCE: OnceLock<GuestMemoryMmap> = OnceLock::new();
    MEM_ONCE.get_or_init(|| guest_mem(MEM)).clone()
}

/// Loads `image` under bounds (its own thread, a deadline, an allocation cap) and checks the
/// invariants of an accepted image. Returns the result as text for the caller's assertions.
fn load_checked(image: Vec<u8>, with_initrd: bool) -> Result<BootEntry, String> {
    let mem = shared_mem();
    let bounds = Bounds::alloc(ALLOC_SLACK + image.len());
    let kernel = image.clone();
    let worker_mem = mem.clone();
    let result = bounded(bounds, move || {
        let mut k = Cursor::new(kernel);
        let mut initrd = Cursor::new(vec![INITRD_BYTE; INITRD_LEN]);
        let initrd = with_initrd.then_some(&mut initrd as &mut dyn ReadSeek);
        load_kernel(&worker_mem, &mut k, "console=ttyS0 panic=1", initrd, MEM)
            .map_err(|e| e.to_string())
    });
    if let Ok(be) = &result {
        check_loaded(&mem, &image, be, with_initrd);
    }
    result
}

fn read(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
    v
}

/// What must hold for any image the loader accepts.
fn check_loaded(mem: &GuestMemoryMmap, image: &[u8], be: &BootEntry, with_initrd: bool) {
    let low_end = low_ram_end(MEM);
    let lowest = lowest_load_address(be.protocol);
    assert!(be.kernel_start >= lowest, "{be:x?}");
    assert!(
        be.kernel_start < be.kernel_end && be.kernel_end <= low_end,
        "{be:x?}"
    );
    assert!(
        be.entry_point >= be.kernel_start
            && be.entry_point < be.kernel_end
            && be.entry_point < MMIO_HOLE_START,
        "entry outside the kernel: {be:x?}"
    );
    match be.protocol {
        BootProtocol::Pvh => assert_eq!(u64::from(be.ebx), PVH_START_INFO_ADDR),
        BootProtocol::Multiboot => assert_eq!(be.eax, MULTIBOOT_BOOTLOADER_MAGIC),
        BootProtocol::Linux => assert_eq!(u64::from(be.esi), ZERO_PAGE_ADDR),
    }
    match (be.initrd, with_initrd) {
        (Some((addr, size)), true) => {
            assert_eq!(size, INITRD_LEN as u64);
            assert!(
                addr.is_multiple_of(0x1000) && addr >= be.kernel_end,
                "{be:x?}"
            );
            assert!(addr + size <= low_end, "{be:x?}");
            assert!(read(mem, addr, INITRD_LEN)
                .iter()
                .all(|&b| b == INITRD_BYTE));
        }
        (None, false) => {}
        other => panic!("initrd {other:x?} for with_initrd = {with_initrd}"),
    }
    if elf::is_elf(image) {
        check_elf_segments(mem, image, lowest);
    } else if be.protocol == BootProtocol::Linux {
        let setup_sects = match image[0x1f1] {
            0 => 4,
            n => usize::from(n),
        };
        let payload = &image[(setup_sects + 1) * 512..];
        assert_eq!(read(mem, be.kernel_start, payload.len()), payload);
    }
}

/// Multiboot kernels may also load in conventional memory, above the IVT and BIOS data area;
/// the others load from 1 MiB on.
fn lowest_load_address(protocol: BootProtocol) -> u64 {
    match protocol {
        BootProtocol::Multiboot => LOW_KERNEL_MIN,
        _ => HIMEM_START,
    }
}

/// Every PT_LOAD segment lies in RAM at or above `lowest` and, when no segment overlaps
/// another, holds its file bytes followed by zeros.
fn check_elf_segments(mem: &GuestMemoryMmap, image: &[u8], lowest: u64) {
    let len = image.len() as u64;
    let parsed = elf::parse(&mut Cursor::new(image), len).expect("accepted, so it parses");
    let loads: Vec<_> = parsed.loads().filter(|p| p.memsz > 0).collect();
    for p in &loads {
        assert_eq!(p.p_type, PT_LOAD);
        assert!(p.paddr >= lowest, "{p:x?}");
        assert!(range_in_ram(MEM, p.paddr, p.paddr + p.memsz), "{p:x?}");
    }
    let overlap = loads.iter().enumerate().any(|(i, a)| {
        loads[..i]
            .iter()
            .any(|b| a.paddr < b.paddr + b.memsz && b.paddr < a.paddr + a.memsz)
    });
    if overlap {
        return;
    }
    for p in &loads {
        let file = &image[p.offset as usize..(p.offset + p.filesz) as usize];
        assert_eq!(read(mem, p.paddr, file.len()), file, "segment {}", p.index);
        let bss = (p.memsz - p.filesz).min(1 << 20) as usize;
        let zeros = read(mem, p.paddr + p.filesz, bss);
        assert!(zeros.iter().all(|&b| b == 0), "bss of segment {}", p.index);
    }
}

/// Random bytes behind the magic of one of the formats, so that the random part reaches
/// that format's parser.
fn random_image() -> impl Strategy<Value = Vec<u8>> {
    (0u8..5, proptest::collection::vec(any::<u8>(), 0..6000)).prop_map(|(format, mut bytes)| {
        match format {
            0 => {}
            1 | 2 if bytes.len() >= 6 => {
                bytes[..4].copy_from_slice(b"\x7fELF");
                bytes[4] = format; // EI_CLASS: 1 = ELF32, 2 = ELF64
                bytes[5] = 1;
            }
            3 if bytes.len() >= 0x212 => {
                bytes[0x202..0x206].copy_from_slice(b"HdrS");
                bytes[0x207] = 2;
                bytes[0x211] |= 1;
            }
            4 => {
                let at = (bytes.len() / 2) & !3;
                let header = mb_header(1 << 16, Some([0x10_0000, 0x10_0000, 0, 0, 0x10_0000]));
                if at + header.len() <= bytes.len() {
                    bytes[at..at + 12].copy_from_slice(&header[..12]);
                }
            }
            _ => {}
        }
        bytes
    })
}

/// A seed image and mutations aimed at its fields.
fn mutated_seed() -> impl Strategy<Value = (usize, Vec<u8>)> {
    let seeds = seed_images();
    let n = seeds.len();
    (0..n).prop_flat_map(move |i| {
        let seed = seeds[i].clone();
        mutations(&seed.fields).prop_map(move |ms| (i, apply_all(&seed.bytes, &ms)))
    })
}

#[test]
fn every_seed_loads_and_satisfies_the_invariants() {
    for seed in seed_images() {
        for initrd in [false, true] {
            if let Err(e) = load_checked(seed.bytes.clone(), initrd) {
                panic!("seed {}: {e}", seed.name);
            }
        }
    }
}

proptest! {
    // Explicit case counts: the whole file runs in a few seconds whatever PROPTEST_CASES says.
    // No persistence file: failures are turned into named regression tests instead.
    #![proptest_config(ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn arbitrary_bytes_give_ok_or_a_clean_error(image in random_image(), initrd: bool) {
        let _ = load_checked(image, initrd);
    }

    #[test]
    fn mutated_images_give_ok_or_a_clean_error((_seed, image) in mutated_seed(), initrd: bool) {
        let _ = load_checked(image, initrd);
    }
}

/// Writes the seed images into `$FERROVM_FUZZ_CORPUS/boot_loader/` (run by `make fuzz-seeds`).
#[test]
#[ignore = "writes the fuzz corpus seeds; run by make fuzz-seeds"]
fn write_fuzz_seeds() {
    let Some(dir) = std::env::var_os("FERROVM_FUZZ_CORPUS") else {
        panic!("set FERROVM_FUZZ_CORPUS to the fuzz corpus directory");
    };
    let dir = std::path::Path::new(&dir).join("boot_loader");
    std::fs::create_dir_all(&dir).unwrap();
    for seed in seed_images() {
        std::fs::write(dir.join(seed.name), &seed.bytes).unwrap();
    }
}
