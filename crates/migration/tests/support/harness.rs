//! Harness for the untrusted-input properties of the migration stream and the snapshot file,
//! shared by the property tests (`tests/props.rs`) and the fuzz target (`fuzz/`, which
//! includes this file): small valid seeds, and checks that run the readers on any bytes and
//! assert what must hold for whatever they accept.

#![allow(dead_code)]

use std::fs::File;
use std::io::{Cursor, Write};
use std::sync::atomic::AtomicBool;

use migration::{
    encode_frame, page_crc, restore_from, EndInfo, Frame, GuestRam, MigrationConfig, RamRange,
    RegionImage, RoundEndInfo, SnapshotImage, StreamReader, StreamWriter, HEADER_LEN, MAGIC,
    MAX_PAGES_PER_FRAME, PAGE_SIZE, SNAPSHOT_VERSION, ZERO_PAGES_FRAME_LEN,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// The RAM of the seeds: 12 KiB at 0 and 4 KiB at 1 MiB (small: fuzzers prefer small inputs).
pub const REGIONS: [(u64, usize); 2] = [(0, 12 << 10), (1 << 20, 4 << 10)];
/// Pages of the seeds that hold data.
pub const DATA_PAGES: [u64; 3] = [0, 0x1000, 1 << 20];
/// A page of the seeds that is sent as zero.
pub const ZERO_PAGE: u64 = 0x2000;
/// Most frames one check reads (the readers stop at `End` anyway).
const MAX_FRAMES: usize = 10_000;

pub fn small_ram() -> GuestMemoryMmap<()> {
    let ranges: Vec<(GuestAddress, usize)> =
        REGIONS.iter().map(|&(a, s)| (GuestAddress(a), s)).collect();
    GuestMemoryMmap::<()>::from_ranges(&ranges).expect("mapping the small RAM")
}

pub fn config() -> MigrationConfig {
    let ram_regions: Vec<RamRange> = REGIONS
        .iter()
        .map(|&(guest_addr, s)| RamRange {
            guest_addr,
            size: s as u64,
        })
        .collect();
    MigrationConfig {
        memory_size: ram_regions.iter().map(|r| r.size).sum(),
        vcpus: 1,
        irqchip: "kernel".into(),
        ram_regions,
        extra: Default::default(),
        devices: None,
    }
}

/// The content of data page `addr` in the seeds.
pub fn page(addr: u64) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| (i as u8).wrapping_mul(7) ^ (addr >> 12) as u8 ^ 0x5a)
        .collect()
}

/// Source RAM holding the seeds' data pages.
pub fn source_ram() -> GuestMemoryMmap<()> {
    let ram = small_ram();
    for addr in DATA_PAGES {
        ram.write_slice(&page(addr), GuestAddress(addr)).unwrap();
    }
    ram
}

/// A valid migration stream (version 1) of the seed RAM: with `live`, a live round of every
/// data page, then the final round; else only the final round.
pub fn seed_stream(live: bool) -> Vec<u8> {
    let mut w = StreamWriter::new(Vec::new());
    w.write_header().unwrap();
    w.write_frame(&Frame::Config(config())).unwrap();
    let mut rounds = 0;
    let mut total = (0u64, 0u64);
    for final_round in [false, true] {
        if !final_round && !live {
            continue;
        }
        let mut bytes = 0;
        for addr in DATA_PAGES {
            bytes += w.write_pages(addr, &page(addr), !final_round).unwrap();
        }
        w.write_frame(&Frame::ZeroPages {
            addr: ZERO_PAGE,
            count: 1,
        })
        .unwrap();
        bytes += ZERO_PAGES_FRAME_LEN;
        w.write_frame(&Frame::RoundEnd(RoundEndInfo {
            round: rounds,
            final_round,
            pages: DATA_PAGES.len() as u64,
            zero_pages: 1,
            bytes,
            dirty_pages_found: 4,
            duration_us: 10,
        }))
        .unwrap();
        rounds += 1;
        total.0 += DATA_PAGES.len() as u64;
        total.1 += 1;
    }
    w.write_frame(&Frame::State(br#"{"vcpus":[],"devices":{}}"#.to_vec()))
        .unwrap();
    w.write_frame(&Frame::End(EndInfo {
        rounds,
        total_pages: total.0,
        total_zero_pages: total.1,
    }))
    .unwrap();
    w.flush().unwrap();
    w.into_inner()
}

/// A valid migration stream whose page 0x1000 is a `SamePage` copy of page 0 (one final
/// round): the seed through which mutations reach the marker's checks.
pub fn seed_stream_same_page() -> Vec<u8> {
    let mut w = StreamWriter::new(Vec::new());
    w.write_header().unwrap();
    w.write_frame(&Frame::Config(config())).unwrap();
    let mut bytes = w.write_pages(0, &page(0), false).unwrap();
    bytes += w
        .write_frame(&Frame::SamePage {
            addr: 0x1000,
            from: 0,
            crc: page_crc(&page(0)),
            live: false,
        })
        .unwrap();
    w.write_frame(&Frame::RoundEnd(RoundEndInfo {
        round: 0,
        final_round: true,
        pages: 2,
        zero_pages: 0,
        bytes,
        dirty_pages_found: 2,
        duration_us: 10,
    }))
    .unwrap();
    w.write_frame(&Frame::State(b"{}".to_vec())).unwrap();
    w.write_frame(&Frame::End(EndInfo {
        rounds: 1,
        total_pages: 2,
        total_zero_pages: 0,
    }))
    .unwrap();
    w.flush().unwrap();
    w.into_inner()
}

fn header_v2() -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    let crc = crc32fast::hash(&h);
    h.extend_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(h.len(), HEADER_LEN);
    h
}

/// A valid snapshot file (version 2) of the seed RAM, laid out compactly: the page images
/// start at the first 4 KiB boundary after the frames (the writer aligns them to 2 MiB,
/// which the format does not require), so the file stays small enough for a fuzzer.
pub fn seed_snapshot_file() -> Vec<u8> {
    let images_at = |frames_len: u64| {
        let mut next = frames_len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        REGIONS.map(|(guest_addr, size)| {
            let image = RegionImage {
                guest_addr,
                size: size as u64,
                offset: next,
            };
            next += size as u64;
            image
        })
    };
    let mut tail = Vec::new();
    // Runs of consecutive data pages, one DataPages frame each.
    let mut runs: Vec<(u64, Vec<u32>)> = Vec::new();
    for addr in DATA_PAGES {
        match runs.last_mut() {
            Some((start, crcs)) if *start + crcs.len() as u64 * PAGE_SIZE == addr => {
                crcs.push(page_crc(&page(addr)))
            }
            _ => runs.push((addr, vec![page_crc(&page(addr))])),
        }
    }
    for (addr, crcs) in runs {
        tail.extend(encode_frame(&Frame::DataPages { addr, crcs }).unwrap());
    }
    tail.extend(encode_frame(&Frame::State(b"{}".to_vec())).unwrap());
    tail.extend(
        encode_frame(&Frame::End(EndInfo {
            rounds: 0,
            total_pages: DATA_PAGES.len() as u64,
            total_zero_pages: 0,
        }))
        .unwrap(),
    );
    let mut head = header_v2();
    head.extend(encode_frame(&Frame::Config(config())).unwrap());
    let images_len = encode_frame(&Frame::Images(images_at(0).to_vec()))
        .unwrap()
        .len();
    let frames_len = (head.len() + images_len + tail.len()) as u64;
    let images = images_at(frames_len);
    head.extend(encode_frame(&Frame::Images(images.to_vec())).unwrap());
    head.extend(tail);
    let end = images.last().map(|i| i.offset + i.size).unwrap();
    head.resize(end as usize, 0);
    for addr in DATA_PAGES {
        let (image, base) = images
            .iter()
            .zip(REGIONS)
            .find(|(_, (a, s))| addr >= *a && addr < a + *s as u64)
            .map(|(i, (a, _))| (i, a))
            .unwrap();
        let at = (image.offset + addr - base) as usize;
        head[at..at + PAGE_SIZE as usize].copy_from_slice(&page(addr));
    }
    head
}

/// A valid reply channel: Ready, RoundAck 0, Ack, then an Error.
pub fn seed_replies() -> Vec<u8> {
    let mut v = Vec::new();
    for f in [
        Frame::Ready,
        Frame::RoundAck(0),
        Frame::Ack,
        Frame::Error("destination: no".into()),
    ] {
        v.extend(encode_frame(&f).unwrap());
    }
    v
}

/// Reads every frame of `bytes` (a stream, or a snapshot file with `snapshot`) and checks
/// that each accepted frame re-encodes to the bytes it was read from (a `Config` frame to the
/// same configuration, since JSON may be spelled differently). Returns the frames read.
pub fn check_frames(bytes: &[u8], snapshot: bool) -> usize {
    let mut r = if snapshot {
        StreamReader::snapshot_file(Cursor::new(bytes))
    } else {
        StreamReader::new(Cursor::new(bytes))
    };
    if r.read_header().is_err() {
        return 0;
    }
    for n in 0..MAX_FRAMES {
        let start = r.offset() as usize;
        let frame = match r.next_frame() {
            Ok(f) => f,
            Err(_) => return n,
        };
        if let Frame::Config(c) = &frame {
            r.set_ram_ranges(c.ram_regions.clone());
        }
        let reencoded = match &frame {
            Frame::Pages(h) => {
                let Ok((data, bad)) = r.read_page_data_vec() else {
                    return n;
                };
                if !bad.is_empty() || h.count > MAX_PAGES_PER_FRAME {
                    continue;
                }
                let mut w = StreamWriter::new(Vec::new());
                w.write_pages(h.addr, &data, h.live).unwrap();
                w.flush().unwrap();
                w.into_inner()
            }
            Frame::Config(c) => {
                let again = encode_frame(&frame).expect("an accepted Config re-encodes");
                let json = &again[8..again.len() - 4];
                let back: MigrationConfig = serde_json::from_slice(json).unwrap();
                assert_eq!(&back, c, "Config does not survive re-encoding");
                continue;
            }
            // Invalid UTF-8 in an Error frame is accepted and shown lossily.
            Frame::Error(_) => continue,
            other => encode_frame(other).expect("an accepted frame re-encodes"),
        };
        let end = r.offset() as usize;
        assert_eq!(
            reencoded,
            &bytes[start..end],
            "frame {n} at byte {start} re-encodes differently: {frame:?}"
        );
    }
    MAX_FRAMES
}

/// Reads a reply channel; every accepted frame is a reply and re-encodes to its bytes.
pub fn check_replies(bytes: &[u8]) -> usize {
    let mut r = StreamReader::replies(Cursor::new(bytes));
    for n in 0..MAX_FRAMES {
        let start = r.offset() as usize;
        let frame = match r.next_frame() {
            Ok(f) => f,
            Err(_) => return n,
        };
        assert!(
            matches!(
                frame,
                Frame::Ready | Frame::Ack | Frame::RoundAck(_) | Frame::Error(_)
            ),
            "{frame:?} on the reply channel"
        );
        if !matches!(frame, Frame::Error(_)) {
            let end = r.offset() as usize;
            assert_eq!(encode_frame(&frame).unwrap(), &bytes[start..end]);
        }
    }
    MAX_FRAMES
}

/// Restores `bytes` as a snapshot stream and receives it as a migration into fresh RAM. What
/// is accepted matches the configuration, and the destination's replies are well-formed.
/// Returns whether the stream was accepted.
pub fn check_receive(bytes: &[u8]) -> bool {
    let expected = config();
    let ram = small_ram();
    let restored = restore_from(&ram, Cursor::new(bytes), &expected);
    if let Ok(r) = &restored {
        assert_eq!(r.config.ram_regions, expected.ram_regions);
        assert!(r.report.bytes_total <= bytes.len() as u64);
    }
    let ram = small_ram();
    let mut replies = Vec::new();
    let received = migration::receive(&ram, Cursor::new(bytes), &mut replies, &expected).is_ok();
    assert_eq!(received, restored.is_ok(), "receive and restore disagree");
    let mut r = StreamReader::replies(Cursor::new(&replies));
    let mut frames = Vec::new();
    while let Ok(f) = r.next_frame() {
        frames.push(f);
    }
    assert_eq!(
        r.offset() as usize,
        replies.len(),
        "the destination wrote a malformed reply: {frames:?}"
    );
    if !received {
        assert!(matches!(frames.last(), Some(Frame::Error(_))), "{frames:?}");
    } else {
        assert_eq!(frames.first(), Some(&Frame::Ready));
    }
    restored.is_ok()
}

/// A file holding `bytes` (an anonymous memory file: no disk, no name).
fn file_with(bytes: &[u8]) -> File {
    use std::os::fd::FromRawFd;
    // SAFETY: memfd_create with a static NUL-terminated name; on success the descriptor is
    // new and owned by nobody else, so `File` may take it.
    let file = unsafe {
        let fd = libc::memfd_create(c"snapshot".as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        File::from_raw_fd(fd)
    };
    (&file).write_all(bytes).unwrap();
    file
}

/// Opens `bytes` as a snapshot file; when accepted, verifies it and, when that passes, loads
/// it into fresh RAM and checks every listed page against its CRC. Returns whether it opened.
pub fn check_snapshot_file(bytes: &[u8]) -> bool {
    let Ok(image) = SnapshotImage::open(file_with(bytes), &config()) else {
        return false;
    };
    assert_eq!(image.config(), &config());
    assert!(image.frames_len() <= bytes.len() as u64);
    for i in image.images() {
        assert!(i.offset >= image.frames_len() && i.offset + i.size <= bytes.len() as u64);
    }
    let verified = image.verify(&AtomicBool::new(false));
    let ram = small_ram();
    let loaded = image.load(&ram);
    if let Ok(report) = &verified {
        assert!(report.complete);
        assert!(loaded.is_ok(), "verified but not loaded: {loaded:?}");
    }
    if loaded.is_ok() {
        check_listed_pages(&image, &ram);
    }
    true
}

/// The loaded RAM holds data only in the pages the snapshot lists (whose CRCs `load`
/// checked), and it lists as many as it counts.
fn check_listed_pages(image: &SnapshotImage, ram: &GuestMemoryMmap<()>) {
    let listed = image.data_pages();
    let mut found = 0u64;
    let mut data = vec![0u8; PAGE_SIZE as usize];
    for (ri, region) in ram.regions().iter().enumerate() {
        for p in 0..region.size / PAGE_SIZE {
            let addr = region.guest_addr + p * PAGE_SIZE;
            if listed.get(ri, p) {
                found += 1;
                continue;
            }
            ram.read_slice(&mut data, GuestAddress(addr)).unwrap();
            assert!(
                data.iter().all(|&b| b == 0),
                "unlisted page {addr:#x} holds data"
            );
        }
    }
    assert_eq!(found, image.data_page_count());
}

/// The fuzz targets' entry: byte 0 picks the reader (bits 0-1: receive, frames, snapshot
/// file, replies) and whether the CRCs are fixed first (bit 7), the rest is the input.
pub fn fuzz_one(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut input = rest.to_vec();
    if mode & 0x80 != 0 {
        match mode & 3 {
            3 => testkit::stream::fix_frame_crcs(&mut input, 0),
            _ => testkit::stream::fix_stream_crcs(&mut input),
        }
    }
    match mode & 3 {
        0 => {
            check_receive(&input);
        }
        1 => {
            check_frames(&input, false);
        }
        2 => {
            check_frames(&input, true);
            check_snapshot_file(&input);
        }
        _ => {
            check_replies(&input);
        }
    }
}

/// The (offset, width) of the fields of every frame from byte `start` of `bytes`: kind,
/// flags, length, and the addresses, counts and offsets at the start of the payloads; for
/// property tests that set them to extremes.
pub fn frame_fields(bytes: &[u8], start: usize) -> Vec<(usize, u8)> {
    let mut fields = vec![(8, 4), (12, 4)];
    let mut pos = start;
    while pos + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap()) as usize;
        fields.extend([(pos, 1), (pos + 1, 1), (pos + 4, 4)]);
        let payload = pos + 8;
        fields.extend([
            (payload, 8),
            (payload, 4),
            (payload + 4, 4),
            (payload + 8, 4),
        ]);
        fields.extend([(payload + 12, 4), (payload + 16, 8), (payload + 24, 8)]);
        if bytes[pos] == 11 {
            // Images: 24-byte entries after 8 bytes.
            for at in (payload + 8..payload + len).step_by(8) {
                fields.push((at, 8));
            }
        }
        pos = payload + len + 4;
    }
    fields.retain(|&(at, w)| at + usize::from(w) <= bytes.len());
    fields
}
