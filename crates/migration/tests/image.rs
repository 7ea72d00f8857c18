//! Snapshot files with page images (format version 2): sparse files, eager and lazy restore,
//! later snapshots of lazily restored RAM, and refusal of damaged or cut files.

mod common;

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use common::*;
use migration::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ferrovm-image-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Source RAM: 9 pages of data (both regions, first and last pages), one touched zero page.
fn populated() -> GuestMemoryMmap<()> {
    let mem = ram();
    let mut rng = Lcg(7);
    for p in [0u64, 1, 2, 10, 509, 510, 511] {
        fill_page(&mem, p * 4096, &mut rng);
    }
    fill_page(&mem, R1_BASE, &mut rng);
    fill_page(&mem, R1_BASE + R1 - 4096, &mut rng);
    mem.write_obj(0u64, GuestAddress(20 * 4096)).unwrap();
    mem
}

const STATE: &[u8] = b"vcpu and device state";

fn write_snapshot(mem: &GuestMemoryMmap<()>, path: &std::path::Path) -> SnapshotReport {
    let cfg = config_of(mem);
    let file = File::create(path).unwrap();
    snapshot_file(mem, &cfg, STATE, &file).unwrap()
}

fn open(path: &std::path::Path, cfg: &MigrationConfig) -> Result<SnapshotImage> {
    SnapshotImage::open(File::open(path).unwrap(), cfg)
}

fn no_stop() -> AtomicBool {
    AtomicBool::new(false)
}

#[test]
fn snapshot_file_is_sparse_and_restores_eagerly_and_lazily() {
    let dir = scratch("roundtrip");
    let path = dir.join("vm.snap");
    let src = populated();
    let cfg = config_of(&src);
    let rep = write_snapshot(&src, &path);
    assert_eq!(rep.round.pages_sent, 9);
    assert_eq!(rep.round.zero_pages, 1);
    assert_eq!(rep.touched_pages, 10);
    assert_eq!(rep.untouched_pages_skipped, 768 - 10);

    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.len(), rep.file_bytes);
    assert!(rep.bytes_total < 10 * 4096 + 4096, "{}", rep.bytes_total);
    // 2 MiB of padding, then 2 MiB and 1 MiB images: the file is long, and holds only the
    // data pages (plus the frames; allow file-system slack).
    assert_eq!(meta.len(), (2 << 20) + (2 << 20) + (1 << 20));
    assert!(
        meta.blocks() * 512 <= 64 << 10,
        "{} bytes allocated",
        meta.blocks() * 512
    );
    assert_eq!(snapshot_version(&File::open(&path).unwrap()).unwrap(), 2);

    let img = open(&path, &cfg).unwrap();
    assert_eq!(img.state(), STATE);
    assert_eq!(img.config(), &cfg);
    assert_eq!(img.data_page_count(), 9);
    assert_eq!(img.images().len(), 2);
    assert!(img
        .images()
        .iter()
        .all(|i| i.offset.is_multiple_of(IMAGE_ALIGN)));
    let v = img.verify(&no_stop()).unwrap();
    assert!(v.complete);
    assert_eq!((v.pages_checked, v.unlisted_pages_checked), (9, 0));

    // Eager: into fresh memory, and into memory that holds other data.
    let dst = ram();
    img.load(&dst).unwrap();
    assert!(diff(&src, &dst).is_empty());
    let used = ram();
    let mut rng = Lcg(99);
    for p in [3u64, 20, 100] {
        fill_page(&used, p * 4096, &mut rng);
    }
    assert_eq!(img.load(&used).unwrap().preexisting_pages_zeroed, 3);
    assert!(diff(&src, &used).is_empty());

    // Lazy: the file mapped over guest RAM reads as the snapshot.
    let lazy = ram();
    img.map_into(&lazy).unwrap();
    assert!(diff(&src, &lazy).is_empty());
    // MAP_PRIVATE: guest writes never reach the file.
    let mut rng = Lcg(5);
    fill_page(&lazy, 0, &mut rng);
    fill_page(&lazy, 300 * 4096, &mut rng);
    assert_eq!(diff(&src, &lazy), vec![0, 300 * 4096]);
    assert!(img.verify(&no_stop()).unwrap().complete);
    let again = ram();
    open(&path, &cfg).unwrap().load(&again).unwrap();
    assert!(diff(&src, &again).is_empty());
}

#[test]
fn lazily_restored_ram_still_snapshots_every_page() {
    let dir = scratch("resnap");
    let src = populated();
    let cfg = config_of(&src);
    write_snapshot(&src, &dir.join("1.snap"));
    let img = open(&dir.join("1.snap"), &cfg).unwrap();
    let lazy = ram();
    img.map_into(&lazy).unwrap();

    // The mapped pages hold data, but none of them is present yet: residency alone sees
    // nothing, and a snapshot made from it would lose the guest's memory.
    assert_eq!(touched_pages(&lazy).unwrap().pages.count(), 0);
    let data = img.data_pages();
    assert_eq!(data.count(), 9);
    let backed = FileBackedRam::new(&lazy, Some(&data));
    assert_eq!(touched_pages(&backed).unwrap().pages.count(), 9);

    // The guest changes one page and touches a new one; everything else stays untouched.
    let mut rng = Lcg(123);
    fill_page(&lazy, 10 * 4096, &mut rng);
    fill_page(&lazy, 40 * 4096, &mut rng);
    let rep = snapshot_file(
        &backed,
        &cfg,
        STATE,
        &File::create(dir.join("2.snap")).unwrap(),
    )
    .unwrap();
    assert_eq!(rep.round.pages_sent, 10);

    // Both the image format and the stream (what a migration's round 0 sends) carry it all.
    let mut stream = Vec::new();
    snapshot(&backed, &cfg, STATE, &mut stream).unwrap();
    let from_stream = ram();
    restore_from(&from_stream, &stream[..], &cfg).unwrap();
    let eager = ram();
    open(&dir.join("2.snap"), &cfg)
        .unwrap()
        .load(&eager)
        .unwrap();
    let lazy2 = ram();
    let img2 = open(&dir.join("2.snap"), &cfg).unwrap();
    img2.map_into(&lazy2).unwrap();
    // A snapshot of a guest restored from a snapshot of a lazily restored guest.
    let data2 = img2.data_pages();
    let backed2 = FileBackedRam::new(&lazy2, Some(&data2));
    snapshot_file(
        &backed2,
        &cfg,
        STATE,
        &File::create(dir.join("3.snap")).unwrap(),
    )
    .unwrap();
    let third = ram();
    open(&dir.join("3.snap"), &cfg)
        .unwrap()
        .load(&third)
        .unwrap();
    for restored in [&from_stream, &eager, &lazy2, &third] {
        assert!(diff(&lazy, restored).is_empty());
    }
    assert_eq!(diff(&src, &third), vec![10 * 4096, 40 * 4096]);
}

/// Flips bit `mask` of byte `at` of the file in place.
fn flip(path: &std::path::Path, at: u64, mask: u8) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= mask;
    f.write_all_at(&b, at).unwrap();
}

#[test]
fn damaged_frames_are_refused_at_open() {
    let dir = scratch("frames");
    let path = dir.join("vm.snap");
    let src = populated();
    let cfg = config_of(&src);
    write_snapshot(&src, &path);
    let frames_len = open(&path, &cfg).unwrap().frames_len();
    for at in 0..frames_len {
        for mask in [0x01u8, 0x80] {
            flip(&path, at, mask);
            let e = open(&path, &cfg).expect_err(&format!("flipping byte {at} went unnoticed"));
            assert!(!e.to_string().is_empty());
            flip(&path, at, mask);
        }
    }
    open(&path, &cfg).unwrap();
}

#[test]
fn cut_files_are_refused_at_open() {
    let dir = scratch("cut");
    let path = dir.join("vm.snap");
    let src = populated();
    let cfg = config_of(&src);
    let rep = write_snapshot(&src, &path);
    let img = open(&path, &cfg).unwrap();
    let frames_len = img.frames_len();
    let images = img.images().to_vec();
    drop(img);
    // Inside the frames: cut short.
    for cut in 0..frames_len {
        write_snapshot(&src, &path);
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let e = open(&path, &cfg).unwrap_err();
        assert!(
            matches!(e, Error::Truncated { .. } | Error::EndedEarly { .. }),
            "cut at {cut}: {e}"
        );
    }
    // Inside the page area: before region 0's image, in the middle of its first data page,
    // right after the data page 10 (the file ends in a hole of the image: what data it
    // holds is intact, the rest of the image is missing), at region 1's image, one byte short.
    for cut in [
        frames_len + 1,
        images[0].offset,
        images[0].offset + 2048,
        images[0].offset + 3 * 4096,
        images[0].offset + 11 * 4096,
        images[1].offset,
        rep.file_bytes - 1,
    ] {
        write_snapshot(&src, &path);
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let e = open(&path, &cfg).unwrap_err();
        assert!(matches!(e, Error::ShortImage { .. }), "cut at {cut}: {e}");
        assert!(
            e.to_string().starts_with(&format!(
                "snapshot file cut short: it is {cut} bytes, but the page image of the RAM region at guest address"
            )),
            "{e}"
        );
    }
    // A file cut after it was opened: lazy mapping checks again, eager loading notices.
    write_snapshot(&src, &path);
    let img = open(&path, &cfg).unwrap();
    File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(images[0].offset + 4096)
        .unwrap();
    assert!(matches!(
        img.map_into(&ram()).unwrap_err(),
        Error::ShortImage { .. }
    ));
    assert!(matches!(
        img.load(&ram()).unwrap_err(),
        Error::ShortImage { .. }
    ));
}

#[test]
fn damaged_page_data_fails_verification_and_eager_load() {
    let dir = scratch("pages");
    let path = dir.join("vm.snap");
    let src = populated();
    let cfg = config_of(&src);
    write_snapshot(&src, &path);
    let images = open(&path, &cfg).unwrap().images().to_vec();

    // A byte of guest page 0x2000 (region 0, page 2): its CRC no longer matches.
    let at = images[0].offset + 2 * 4096 + 100;
    flip(&path, at, 0x04);
    let img = open(&path, &cfg).expect("page data is not read at open");
    let e = img.verify(&no_stop()).unwrap_err();
    assert!(
        matches!(e, Error::PageCorrupt { addr: 0x2000, offset, .. } if offset == at - 100),
        "{e}"
    );
    assert!(e
        .to_string()
        .starts_with("snapshot file corrupted: guest page 0x2000 (page data at byte"));
    let e = img.load(&ram()).unwrap_err();
    assert!(matches!(e, Error::PageCorrupt { addr: 0x2000, .. }), "{e}");
    flip(&path, at, 0x04);

    // Data where the table lists none (a touched zero page, and an untouched one).
    for page in [20u64, 400] {
        let at = images[0].offset + page * 4096 + 7;
        flip(&path, at, 0x10);
        let img = open(&path, &cfg).unwrap();
        let e = img.verify(&no_stop()).unwrap_err();
        assert!(
            matches!(e, Error::UnlistedData { addr, .. } if addr == page * 4096),
            "{e}"
        );
        flip(&path, at, 0x10);
    }
    // The flipped-back byte is stored data now (no longer a hole) but zero: fine.
    let v = open(&path, &cfg).unwrap().verify(&no_stop()).unwrap();
    assert!(v.complete);
    assert!(v.unlisted_pages_checked >= 2, "{v:?}");

    // Stopped verification says so.
    let stopped = open(&path, &cfg)
        .unwrap()
        .verify(&AtomicBool::new(true))
        .unwrap();
    assert!(!stopped.complete);
}

#[test]
fn versions_are_told_apart() {
    let dir = scratch("versions");
    let src = populated();
    let cfg = config_of(&src);

    // Version 1 (a stream) still restores, eagerly; it is not a page-image file.
    let v1 = dir.join("v1.snap");
    snapshot(&src, &cfg, STATE, File::create(&v1).unwrap()).unwrap();
    assert_eq!(snapshot_version(&File::open(&v1).unwrap()).unwrap(), 1);
    let dst = ram();
    restore_from(&dst, File::open(&v1).unwrap(), &cfg).unwrap();
    assert!(diff(&src, &dst).is_empty());
    let e = open(&v1, &cfg).unwrap_err().to_string();
    assert!(e.contains("version 1"), "{e}");

    // Version 2 is refused as a migration stream, with its version named.
    let v2 = dir.join("v2.snap");
    write_snapshot(&src, &v2);
    let e = restore_from(&ram(), File::open(&v2).unwrap(), &cfg)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("unsupported migration stream version 2: "),
        "{e}"
    );
    // An unknown version is refused by name.
    let v3 = dir.join("v3.snap");
    std::fs::copy(&v2, &v3).unwrap();
    File::options()
        .write(true)
        .open(&v3)
        .unwrap()
        .write_all_at(&3u32.to_le_bytes(), 8)
        .unwrap();
    let e = open(&v3, &cfg).unwrap_err().to_string();
    assert_eq!(
        e,
        "unsupported migration stream version 3: this ferrovm reads versions 1 and 2"
    );
    assert!(snapshot_version(&File::open(&v3).unwrap()).is_err());

    // The page-image frames do not exist in version 1.
    let mut s = Vec::new();
    let mut w = StreamWriter::new(&mut s);
    w.write_header().unwrap();
    w.write_frame(&Frame::Config(cfg.clone())).unwrap();
    w.flush().unwrap();
    drop(w);
    s.extend(
        encode_frame(&Frame::DataPages {
            addr: 0,
            crcs: vec![1, 2],
        })
        .unwrap(),
    );
    let e = restore_from(&ram(), &s[..], &cfg).unwrap_err();
    assert!(matches!(e, Error::UnknownKind { kind: 12, .. }), "{e}");

    // A configuration mismatch is refused at open, with both values.
    let mut other = cfg.clone();
    other.vcpus = 4;
    let e = open(&v2, &other).unwrap_err().to_string();
    assert_eq!(
        e,
        "machine mismatch: vCPU count differs: source 2, destination 4"
    );
}

#[test]
fn page_image_frames_round_trip() {
    let images = vec![
        RegionImage {
            guest_addr: 0,
            size: 2 << 20,
            offset: 2 << 20,
        },
        RegionImage {
            guest_addr: 4 << 20,
            size: 1 << 20,
            offset: 4 << 20,
        },
    ];
    let cfg = config_of(&ram());
    let mut s = Vec::new();
    let mut w = StreamWriter::new(&mut s);
    w.write_header().unwrap();
    w.flush().unwrap();
    drop(w);
    s[8..12].copy_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
    let crc = page_crc(&s[..16]);
    s[16..20].copy_from_slice(&crc.to_le_bytes());
    let frames = [
        Frame::Config(cfg.clone()),
        Frame::Images(images.clone()),
        Frame::DataPages {
            addr: 4 << 20,
            crcs: vec![7, 8, 9],
        },
    ];
    for f in &frames {
        s.extend(encode_frame(f).unwrap());
    }
    let mut r = StreamReader::snapshot_file(&s[..]);
    r.set_ram_ranges(cfg.ram_regions.clone());
    for f in &frames {
        assert_eq!(&r.next_frame().unwrap(), f);
    }
    assert_eq!(r.header().unwrap().version, 2);
    // Pages outside RAM are refused from the frame alone.
    let mut bad = s[..20].to_vec();
    bad.extend(
        encode_frame(&Frame::DataPages {
            addr: 3 << 20,
            crcs: vec![1],
        })
        .unwrap(),
    );
    let mut r = StreamReader::snapshot_file(&bad[..]);
    r.set_ram_ranges(cfg.ram_regions.clone());
    assert!(matches!(
        r.next_frame().unwrap_err(),
        Error::BadPageRange { .. }
    ));
    assert!(encode_frame(&Frame::Images(vec![])).is_err());
    assert!(encode_frame(&Frame::DataPages {
        addr: 0,
        crcs: vec![]
    })
    .is_err());
}

/// `read_verified`, what a verify-on-fault restore serves: data pages from the file checked
/// against their CRCs, zero for every page without data (whatever the file stores there),
/// and one error naming the first bad page: damaged, past the end of a truncated file.
#[test]
fn pages_are_read_verified_one_block_at_a_time() {
    let dir = scratch("read-verified");
    let path = dir.join("vm.snap");
    let src = populated();
    let cfg = config_of(&src);
    write_snapshot(&src, &path);
    let img = open(&path, &cfg).unwrap();
    let image0 = img.images()[0].offset;
    let runs: Vec<_> = img.data_runs().collect();
    assert_eq!(runs[0], (0, 0, 3));
    assert_eq!(runs.len(), 5, "{runs:?}");

    // Garbage where the table lists no data (page 5) is never served.
    File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .write_all_at(&[0xaa; 4096], image0 + 5 * 4096)
        .unwrap();
    let mut buf = vec![0xffu8; 16 * 4096];
    img.read_verified(0, 0, &mut buf).unwrap();
    let mut want = vec![0u8; 16 * 4096];
    src.read_slice(&mut want, GuestAddress(0)).unwrap();
    assert!(buf == want, "block 0 differs from the source");
    // The last pages of region 1.
    let mut buf = vec![0u8; 2 * 4096];
    img.read_verified(1, R1 / 4096 - 2, &mut buf).unwrap();
    let mut want = vec![0u8; 2 * 4096];
    src.read_slice(&mut want, GuestAddress(R1_BASE + R1 - 2 * 4096))
        .unwrap();
    assert!(buf == want);
    // Outside the region: refused.
    assert!(img.read_verified(1, R1 / 4096 - 1, &mut buf).is_err());

    flip(&path, image0 + 10 * 4096 + 7, 0x01);
    let mut buf = vec![0u8; 16 * 4096];
    let e = img.read_verified(0, 0, &mut buf).unwrap_err().to_string();
    assert!(
        e.contains("guest page 0xa000") && e.contains("fails its checksum"),
        "{e}"
    );

    File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(image0 + 4096)
        .unwrap();
    let e = img.read_verified(0, 0, &mut buf).unwrap_err().to_string();
    assert!(
        e.contains("guest page 0x1000 ") && e.contains("truncated after the restore began"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
