//! qcow2 images made and checked by `qemu-img`: format detection, what is refused (with one
//! line), backing chains and their locks, and I/O through guest memory compared with what
//! `qemu-img` reads.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap, Permissions};

use super::image::Bounce;
use super::tests::TempDir;
use super::*;

const MIB: u64 = 1 << 20;

/// Runs `qemu-img ARGS`; its stdout, or a panic with its stderr.
fn qemu_img(args: &[&str]) -> String {
    let out = Command::new("qemu-img")
        .args(args)
        .output()
        .expect("qemu-img (Debian's qemu-utils; scripts/install-deps.sh installs it)");
    assert!(
        out.status.success(),
        "qemu-img {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn open(path: &Path, configure: impl FnOnce(&mut BlockOptions)) -> Result<DiskImage, ImageError> {
    let mut options = BlockOptions::new(path);
    configure(&mut options);
    DiskImage::open(&options)
}

/// The one-line error opening `path` gives.
fn refusal(path: &Path, configure: impl FnOnce(&mut BlockOptions)) -> String {
    let err = open(path, configure).expect_err("opened").to_string();
    assert!(!err.contains('\n'), "more than one line: {err}");
    err
}

fn patch(path: &Path, offset: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

#[test]
fn the_format_comes_from_the_header_unless_given() {
    let dir = TempDir::new("qcow2-detect");
    let qcow2 = dir.join("a.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&qcow2), "8M"]);
    let image = open(&qcow2, |_| {}).unwrap();
    assert_eq!(image.format(), ImageFormat::Qcow2);
    assert_eq!(image.sectors(), 8 * MIB / SECTOR_SIZE);
    drop(image);
    // format=raw shows the file itself.
    let raw_view = open(&qcow2, |o| o.image.format = ImageFormat::Raw).unwrap();
    assert_eq!(raw_view.format(), ImageFormat::Raw);
    assert!(raw_view.sectors() < 8 * MIB / SECTOR_SIZE);
    drop(raw_view);
    let v2 = dir.join("v2.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "compat=0.10",
        s(&v2),
        "4M",
    ]);
    assert_eq!(open(&v2, |_| {}).unwrap().format(), ImageFormat::Qcow2);
    let raw = dir.join("b.img");
    std::fs::File::create(&raw).unwrap().set_len(MIB).unwrap();
    assert_eq!(open(&raw, |_| {}).unwrap().format(), ImageFormat::Raw);
    let err = refusal(&raw, |o| o.image.format = ImageFormat::Qcow2);
    assert!(err.contains("not a qcow2 image"), "{err}");
    let err = refusal(&raw, |o| o.image.backing = Some(qcow2.clone()));
    assert!(err.contains("the image is raw"), "{err}");
}

#[test]
fn unsupported_qcow2_features_are_refused_with_one_line() {
    let dir = TempDir::new("qcow2-refused");
    let cases: &[(&str, &str)] = &[
        ("extended_l2=on", "extended L2"),
        ("compression_type=zstd", "zstd"),
        ("encrypt.format=aes,encrypt.key-secret=sec0", "encrypted"),
    ];
    for (i, (option, expected)) in cases.iter().enumerate() {
        let path = dir.join(&format!("f{i}.qcow2"));
        let mut args = vec!["create", "-q", "-f", "qcow2", "-o", option, s(&path), "4M"];
        if option.contains("encrypt") {
            args.splice(1..1, ["--object", "secret,id=sec0,data=123456"]);
            args.retain(|a| *a != "-q");
        }
        qemu_img(&args);
        let err = refusal(&path, |_| {});
        assert!(err.contains(expected), "{option}: {err}");
    }
    let data_file = dir.join("data.qcow2");
    let data = format!("data_file={}", s(&dir.join("data.raw")));
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &data,
        s(&data_file),
        "4M",
    ]);
    assert!(refusal(&data_file, |_| {}).contains("external data files"));
}

/// Header fields a broken or hostile file may hold: every one is refused with one line,
/// before imago reads any table.
#[test]
fn broken_headers_are_refused_with_one_line() {
    let dir = TempDir::new("qcow2-broken");
    let good = dir.join("good.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&good), "4M"]);
    let cases: &[(&str, u64, &[u8], &str)] = &[
        ("version 4", 4, &[0, 0, 0, 4], "version 4"),
        ("cluster_bits 40", 20, &[0, 0, 0, 40], "cluster_bits 40"),
        (
            "L1 past the end",
            40,
            &[0, 0, 0, 1, 0, 0, 0, 0],
            "past the end",
        ),
        (
            "L1 unaligned",
            40,
            &[0, 0, 0, 0, 0, 3, 0, 1],
            "not cluster-aligned",
        ),
        (
            "L1 size huge",
            36,
            &[0x7f, 0xff, 0xff, 0xff],
            "past the end",
        ),
        (
            "refcount table past the end",
            56,
            &[0, 0, 0x10, 0],
            "past the end",
        ),
        (
            "unknown incompatible bit",
            72,
            &[0, 0, 0, 0, 0, 0, 0x4, 0],
            "unknown incompatible",
        ),
        ("dirty", 79, &[1], "dirty bit"),
        ("corrupt", 79, &[2], "corrupt"),
        (
            "backing name too long",
            16,
            &[0, 0, 0x10, 0],
            "backing file name",
        ),
        (
            "backing name outside",
            8,
            &[0, 0, 0, 0, 0, 1, 0, 0],
            "backing file name",
        ),
        ("refcount order 9", 96, &[0, 0, 0, 9], "refcount_order"),
    ];
    for (what, offset, bytes, expected) in cases {
        let path = dir.join("bad.qcow2");
        std::fs::copy(&good, &path).unwrap();
        patch(&path, *offset, bytes);
        if *what == "backing name too long" || *what == "backing name outside" {
            patch(&path, 8, &[0, 0, 0, 0, 0, 0, 1, 0]);
        }
        let err = refusal(&path, |_| {});
        assert!(err.contains(expected), "{what}: {err}");
    }
    for len in [0usize, 3, 20, 71, 100] {
        let path = dir.join("short.qcow2");
        std::fs::copy(&good, &path).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len as u64)
            .unwrap();
        // Shorter than the magic: a raw image when probed; qcow2 demanded: refused.
        let err = refusal(&path, |o| o.image.format = ImageFormat::Qcow2);
        assert!(
            err.contains("truncated")
                || err.contains("not a qcow2")
                || err.contains("past the end"),
            "{len} bytes: {err}"
        );
    }
}

#[test]
fn backing_chains_missing_looping_or_too_deep_are_refused() {
    let dir = TempDir::new("qcow2-chains");
    let a = dir.join("a.qcow2");
    let b = dir.join("b.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&a), "4M"]);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "a.qcow2",
        "-F",
        "qcow2",
        s(&b),
    ]);
    // A loop: a names b, which names a.
    qemu_img(&["rebase", "-q", "-u", "-b", "b.qcow2", "-F", "qcow2", s(&a)]);
    assert!(refusal(&b, |_| {}).contains("backing file loop"));
    // Missing: a names a file that is not there.
    qemu_img(&["rebase", "-q", "-u", "-b", "gone.img", "-F", "raw", s(&a)]);
    let err = refusal(&b, |_| {});
    assert!(
        err.contains("gone.img") && err.contains("cannot open"),
        "{err}"
    );
    // 100 deep.
    let base = dir.join("d0.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), "1M"]);
    for i in 1..=100 {
        let name = dir.join(&format!("d{i}.qcow2"));
        let below = format!("d{}.qcow2", i - 1);
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-b",
            &below,
            "-F",
            "qcow2",
            s(&name),
            "1M",
        ]);
    }
    let err = refusal(&dir.join("d100.qcow2"), |_| {});
    assert!(
        err.contains(&format!("deeper than {MAX_BACKING_DEPTH}")),
        "{err}"
    );
    // Just short enough works.
    let top = dir.join(&format!("d{MAX_BACKING_DEPTH}.qcow2"));
    open(&top, |_| {}).unwrap();
}

#[test]
fn backing_files_are_shared_locked_and_may_be_overridden() {
    let dir = TempDir::new("qcow2-locks");
    let base = dir.join("base.img");
    std::fs::File::create(&base)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    let one = dir.join("one.qcow2");
    let two = dir.join("two.qcow2");
    for overlay in [&one, &two] {
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            s(&base),
            "-F",
            "raw",
            s(overlay),
        ]);
    }
    let first = open(&one, |_| {}).unwrap();
    // Two overlays share a base; nobody writes it meanwhile.
    let second = open(&two, |_| {}).unwrap();
    let err = open(&base, |_| {}).unwrap_err();
    assert_eq!(err.kind, ImageErrorKind::Locked, "{err}");
    drop((first, second));
    open(&base, |_| {}).unwrap();
    // backing= replaces the header's name.
    let other = dir.join("other.img");
    std::fs::File::create(&other)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    patch(&other, 0, b"other base");
    let image = open(&one, |o| o.image.backing = Some(other.clone())).unwrap();
    let mut head = [0u8; 10];
    read_at(&image, 0, &mut head);
    assert_eq!(&head, b"other base");
}

/// Guest memory for one transfer of `len` bytes at guest address 0.
fn memory(len: usize) -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), len.max(4096))]).unwrap()
}

fn slices(
    mem: &GuestMemoryMmap,
    len: usize,
    access: Permissions,
) -> Vec<vm_memory::VolatileSlice<'_, vm_memory::bitmap::MS<'_, GuestMemoryMmap>>> {
    mem.get_slices(GuestAddress(0), len, access)
        .unwrap()
        .map(|s| s.unwrap())
        .collect()
}

fn read_at(image: &DiskImage, offset: u64, out: &mut [u8]) {
    let mem = memory(out.len());
    let slices = slices(&mem, out.len(), Permissions::Write);
    image
        .read_into(offset, &slices, &mut Bounce::default())
        .unwrap();
    mem.read_slice(out, GuestAddress(0)).unwrap();
}

fn write_at(image: &DiskImage, offset: u64, data: &[u8]) -> std::io::Result<()> {
    let mem = memory(data.len());
    mem.write_slice(data, GuestAddress(0)).unwrap();
    let slices = slices(&mem, data.len(), Permissions::Read);
    image.write_from(offset, &slices, &mut Bounce::default())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7) ^ seed | 1)
        .collect()
}

/// An overlay over a compressed base: writes, discards and zeroes through guest memory, then
/// qemu-img finds the image clean and equal to a raw file written the same way.
#[test]
fn an_overlay_reads_and_writes_as_qemu_img_sees_it() {
    let dir = TempDir::new("qcow2-io");
    let reference = dir.join("reference.raw");
    std::fs::File::create(&reference)
        .unwrap()
        .set_len(8 * MIB)
        .unwrap();
    patch(&reference, 0, &pattern(3 * MIB as usize, 0x40));
    let base = dir.join("base.qcow2");
    qemu_img(&["convert", "-c", "-O", "qcow2", s(&reference), s(&base)]);
    let overlay = dir.join("overlay.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        s(&overlay),
    ]);
    let image = open(&overlay, |_| {}).unwrap();
    let raw = open(&reference, |o| o.image.format = ImageFormat::Raw).unwrap();
    let mut got = vec![0u8; 3 * MIB as usize];
    read_at(&image, 0, &mut got);
    assert!(
        got == pattern(3 * MIB as usize, 0x40),
        "compressed base read back wrong"
    );
    let writes: &[(u64, usize, u8)] = &[(512, 4096, 1), (MIB - 512, 70000, 2), (5 * MIB, 65536, 3)];
    for (offset, len, seed) in writes {
        for target in [&image, &raw] {
            write_at(target, *offset, &pattern(*len, *seed)).unwrap();
        }
    }
    for target in [&image, &raw] {
        target.discard(2 * MIB, MIB).unwrap();
        target
            .write_zeroes(512 * 1024, 8192, false, &mut Bounce::default())
            .unwrap();
        target
            .write_zeroes(5 * MIB, 4096, true, &mut Bounce::default())
            .unwrap();
        target.flush().unwrap();
    }
    let mut after = vec![0u8; 4096];
    read_at(&image, 2 * MIB, &mut after);
    assert!(
        after.iter().all(|&b| b == 0),
        "a discard shows the backing file's data"
    );
    drop((image, raw));
    let check = qemu_img(&["check", s(&overlay)]);
    assert!(check.contains("No errors were found"), "{check}");
    qemu_img(&["compare", "-q", s(&overlay), s(&reference)]);
    // The base was never written.
    qemu_img(&["check", s(&base)]);
}

/// A guest cannot make its raw disk a qcow2 image that the next open would trust.
#[test]
fn a_probed_raw_image_refuses_a_qcow2_header() {
    let dir = TempDir::new("qcow2-probed");
    let path = dir.join("raw.img");
    std::fs::File::create(&path).unwrap().set_len(MIB).unwrap();
    let image = open(&path, |_| {}).unwrap();
    let err = write_at(&image, 0, b"QFI\xfb\0\0\0\x03").unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied);
    write_at(&image, 0, b"QFI\0").unwrap();
    // The rest of sector 0 and the sectors after are the guest's to write.
    write_at(&image, 512, b"QFI\xfb").unwrap();
    drop(image);
    let explicit = open(&path, |o| o.image.format = ImageFormat::Raw).unwrap();
    write_at(&explicit, 0, b"QFI\xfb").unwrap();
}

#[test]
fn header_parser_survives_every_prefix_and_bit_flip() {
    let dir = TempDir::new("qcow2-parse");
    let path = dir.join("a.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.img",
        "-F",
        "raw",
        "-u",
        s(&path),
        "4M",
    ]);
    let bytes = std::fs::read(&path).unwrap();
    let header = &bytes[..4096];
    let summary = parse_header(header, bytes.len() as u64).unwrap();
    assert_eq!(summary.backing.as_deref(), Some("base.img"));
    assert_eq!(summary.size, 4 * MIB);
    for len in 0..header.len().min(600) {
        let _ = parse_header(&header[..len], bytes.len() as u64);
    }
    for bit in 0..(600 * 8) {
        let mut flipped = header.to_vec();
        flipped[bit / 8] ^= 1 << (bit % 8);
        let _ = parse_header(&flipped, bytes.len() as u64);
    }
}

/// The extremes of cluster size and refcount width: written, then clean and equal to a raw
/// file given the same writes.
#[test]
fn cluster_sizes_and_refcount_widths() {
    let dir = TempDir::new("qcow2-sizes");
    let reference = dir.join("reference.raw");
    for (cluster, refcount_bits) in [(512, 1), (65536, 16), (2 << 20, 64)] {
        let path = dir.join("sizes.qcow2");
        let _ = std::fs::remove_file(&path);
        let options = format!("cluster_size={cluster},refcount_bits={refcount_bits}");
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &options,
            s(&path),
            "8M",
        ]);
        std::fs::File::create(&reference)
            .unwrap()
            .set_len(8 * MIB)
            .unwrap();
        let image = open(&path, |_| {}).unwrap();
        let raw = open(&reference, |o| o.image.format = ImageFormat::Raw).unwrap();
        for (offset, len, seed) in [
            (0, 1536, 1),
            (3 * MIB + 512, 200_000, 2),
            (8 * MIB - 4096, 4096, 3),
        ] {
            for target in [&image, &raw] {
                write_at(target, offset, &pattern(len, seed)).unwrap();
                target.flush().unwrap();
            }
        }
        drop((image, raw));
        let check = qemu_img(&["check", s(&path)]);
        assert!(check.contains("No errors were found"), "{options}: {check}");
        qemu_img(&["compare", "-q", s(&path), s(&reference)]);
    }
}
