//! The stream format: round trips of every frame kind, and refusal of corrupted, cut,
//! oversized, misplaced or mismatched streams (with an error, never a panic).

mod common;

use common::*;
use migration::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

fn header_and_config(w: &mut StreamWriter<&mut Vec<u8>>, cfg: &MigrationConfig) {
    w.write_header().unwrap();
    w.write_frame(&Frame::Config(cfg.clone())).unwrap();
}

#[test]
fn every_frame_kind_round_trips() {
    let mem = ram();
    let cfg = config_of(&mem);
    let mut rng = Lcg(1);
    let data: Vec<u8> = (0..3).flat_map(|_| rng.page()).collect();
    let big_state: Vec<u8> = (0..(MAX_FRAME_PAYLOAD as usize + 100))
        .map(|i| i as u8)
        .collect();
    let round = RoundEndInfo {
        round: 0,
        final_round: true,
        pages: 3,
        zero_pages: 5,
        bytes: 12345,
        dirty_pages_found: 8,
        duration_us: 777,
    };
    let end = EndInfo {
        rounds: 1,
        total_pages: 3,
        total_zero_pages: 5,
    };
    let mut buf = Vec::new();
    let mut w = StreamWriter::new(&mut buf);
    header_and_config(&mut w, &cfg);
    w.write_pages(R1_BASE + 4096, &data, true).unwrap();
    w.write_frame(&Frame::ZeroPages {
        addr: 8192,
        count: 5,
    })
    .unwrap();
    w.write_frame(&Frame::RoundEnd(round)).unwrap();
    w.write_frame(&Frame::State(big_state.clone())).unwrap();
    w.write_frame(&Frame::End(end)).unwrap();
    w.write_frame(&Frame::Error("the source gave up: ünïcode".into()))
        .unwrap();
    w.flush().unwrap();
    assert_eq!(w.bytes_written(), buf.len() as u64);

    let mut r = StreamReader::new(&buf[..]);
    assert_eq!(
        r.read_header().unwrap(),
        Header {
            version: FORMAT_VERSION,
            flags: 0
        }
    );
    assert_eq!(r.next_frame().unwrap(), Frame::Config(cfg.clone()));
    r.set_ram_ranges(cfg.ram_regions.clone());
    assert_eq!(
        r.next_frame().unwrap(),
        Frame::Pages(PagesHeader {
            addr: R1_BASE + 4096,
            count: 3,
            live: true
        })
    );
    let (got, bad) = r.read_page_data_vec().unwrap();
    assert_eq!(got, data);
    assert!(bad.is_empty());
    assert_eq!(
        r.next_frame().unwrap(),
        Frame::ZeroPages {
            addr: 8192,
            count: 5
        }
    );
    assert_eq!(r.next_frame().unwrap(), Frame::RoundEnd(round));
    // The state is larger than a frame: it comes in two pieces.
    let mut state = Vec::new();
    for _ in 0..2 {
        match r.next_frame().unwrap() {
            Frame::State(s) => state.extend_from_slice(&s),
            f => panic!("expected State, got {f:?}"),
        }
    }
    assert_eq!(state, big_state);
    assert_eq!(r.next_frame().unwrap(), Frame::End(end));
    assert_eq!(
        r.next_frame().unwrap(),
        Frame::Error("the source gave up: ünïcode".into())
    );
    assert!(matches!(
        r.next_frame().unwrap_err(),
        Error::EndedEarly { .. }
    ));

    // The reply channel.
    let mut replies = Vec::new();
    send_reply(&mut replies, &Frame::Ready).unwrap();
    send_reply(&mut replies, &Frame::RoundAck(7)).unwrap();
    send_reply(&mut replies, &Frame::Ack).unwrap();
    send_reply(&mut replies, &Frame::Error("no".into())).unwrap();
    let mut rr = StreamReader::replies(&replies[..]);
    assert_eq!(rr.next_frame().unwrap(), Frame::Ready);
    assert_eq!(rr.next_frame().unwrap(), Frame::RoundAck(7));
    assert_eq!(rr.next_frame().unwrap(), Frame::Ack);
    assert_eq!(rr.next_frame().unwrap(), Frame::Error("no".into()));
    let mut only_ack = &encode_frame(&Frame::Ack).unwrap()[..];
    wait_ack(&mut only_ack).unwrap();
    let mut err = &encode_frame(&Frame::Error("disk full".into())).unwrap()[..];
    let e = wait_ack(&mut err).unwrap_err().to_string();
    assert_eq!(e, "the destination reported an error: disk full");
    // Reply kinds are refused inside a stream, stream kinds on the reply channel.
    let mut s = Vec::new();
    let mut w = StreamWriter::new(&mut s);
    w.write_header().unwrap();
    w.write_frame(&Frame::Ack).unwrap();
    w.flush().unwrap();
    let e = StreamReader::new(&s[..]).next_frame().unwrap_err();
    assert!(matches!(e, Error::UnknownKind { kind: 9, .. }), "{e}");
    let e = StreamReader::replies(&encode_frame(&Frame::End(end)).unwrap()[..])
        .next_frame()
        .unwrap_err();
    assert!(matches!(e, Error::UnknownKind { kind: 6, .. }), "{e}");
}

/// A source RAM with data, zero pages that were touched, and untouched pages.
fn populated() -> (GuestMemoryMmap<()>, Vec<u64>) {
    let mem = ram();
    let mut rng = Lcg(7);
    let mut pages = Vec::new();
    for p in [0u64, 1, 2, 10, 509, 510, 511] {
        fill_page(&mem, p * 4096, &mut rng);
        pages.push(p * 4096);
    }
    fill_page(&mem, R1_BASE, &mut rng);
    fill_page(&mem, R1_BASE + R1 - 4096, &mut rng);
    // Touched, but zero: travels as a ZeroPages marker.
    mem.write_obj(0u64, GuestAddress(20 * 4096)).unwrap();
    (mem, pages)
}

#[test]
fn snapshot_restores_into_fresh_and_used_memory() {
    let (src, _) = populated();
    let cfg = config_of(&src);
    let state = b"vcpu and device state".to_vec();
    let mut file = Vec::new();
    let rep = snapshot(&src, &cfg, &state, &mut file).unwrap();
    assert_eq!(rep.residency_method, ResidencyMethod::Pagemap);
    assert_eq!(rep.round.pages_sent, 9);
    assert_eq!(rep.round.zero_pages, 1);
    assert_eq!(rep.touched_pages, 10);
    assert_eq!(rep.untouched_pages_skipped, 768 - 10);
    assert_eq!(rep.bytes_total, file.len() as u64);
    // Untouched pages are not in the stream at all.
    assert!(file.len() < 10 * 4200 + 1024, "{} bytes", file.len());

    let dst = ram();
    let restored = restore_from(&dst, &file[..], &cfg).unwrap();
    assert_eq!(restored.state, state);
    assert_eq!(restored.config, cfg);
    assert!(diff(&src, &dst).is_empty());
    assert_eq!(restored.report.pages_total, 9);
    assert_eq!(restored.report.preexisting_pages_zeroed, 0);

    // A destination that already holds data: it is zeroed first, so it ends identical too.
    let used = ram();
    let mut rng = Lcg(99);
    for p in [3u64, 20, 100, 300] {
        fill_page(&used, p * 4096, &mut rng);
    }
    let restored = restore_from(&used, &file[..], &cfg).unwrap();
    assert_eq!(restored.report.preexisting_pages_zeroed, 4);
    assert!(diff(&src, &used).is_empty());
}

#[test]
fn zero_pages_clear_data_of_an_earlier_round() {
    let mem = ram();
    let cfg = config_of(&mem);
    let mut rng = Lcg(3);
    let page = rng.page();
    let mut buf = Vec::new();
    let mut w = StreamWriter::new(&mut buf);
    header_and_config(&mut w, &cfg);
    let len = w.write_pages(4096, &page, true).unwrap();
    w.write_frame(&Frame::RoundEnd(RoundEndInfo {
        round: 0,
        pages: 1,
        bytes: len,
        dirty_pages_found: 1,
        ..Default::default()
    }))
    .unwrap();
    w.write_frame(&Frame::ZeroPages {
        addr: 4096,
        count: 1,
    })
    .unwrap();
    w.write_frame(&Frame::RoundEnd(RoundEndInfo {
        round: 1,
        final_round: true,
        zero_pages: 1,
        bytes: ZERO_PAGES_FRAME_LEN,
        ..Default::default()
    }))
    .unwrap();
    w.write_frame(&Frame::State(vec![])).unwrap();
    w.write_frame(&Frame::End(EndInfo {
        rounds: 2,
        total_pages: 1,
        total_zero_pages: 1,
    }))
    .unwrap();
    w.flush().unwrap();
    let dst = ram();
    restore_from(&dst, &buf[..], &cfg).unwrap();
    let mut got = vec![1u8; 4096];
    dst.read_slice(&mut got, GuestAddress(4096)).unwrap();
    assert!(got.iter().all(|&b| b == 0));
}

/// A live stream: page 5 arrives torn in round 0 (its data does not match its CRC) and,
/// depending on `resend`, is sent again in round 1.
fn torn_stream(cfg: &MigrationConfig, resend: bool) -> Vec<u8> {
    torn_stream_at(cfg, resend).0
}

/// The stream and the byte range of the torn page's data.
fn torn_stream_at(cfg: &MigrationConfig, resend: bool) -> (Vec<u8>, std::ops::Range<usize>) {
    let mut rng = Lcg(5);
    let data: Vec<u8> = (0..4).flat_map(|_| rng.page()).collect();
    let mut buf = Vec::new();
    let mut w = StreamWriter::new(&mut buf);
    header_and_config(&mut w, cfg);
    let len = w.write_pages(4 * 4096, &data, true).unwrap();
    w.write_frame(&Frame::RoundEnd(RoundEndInfo {
        round: 0,
        pages: 4,
        bytes: len,
        ..Default::default()
    }))
    .unwrap();
    let (mut pages, mut bytes) = (0, 0);
    if resend {
        bytes = w.write_pages(5 * 4096, &data[4096..8192], false).unwrap();
        pages = 1;
    }
    w.write_frame(&Frame::RoundEnd(RoundEndInfo {
        round: 1,
        final_round: true,
        pages,
        bytes,
        ..Default::default()
    }))
    .unwrap();
    w.write_frame(&Frame::State(vec![1])).unwrap();
    w.write_frame(&Frame::End(EndInfo {
        rounds: 2,
        total_pages: 4 + pages,
        total_zero_pages: 0,
    }))
    .unwrap();
    w.flush().unwrap();
    // Tear page 5 (the second page of the first frame): data starts after the header (20),
    // Config frame, the Pages frame header (8), fixed part (16) and CRC table (16).
    let cfg_len = encode_frame(&Frame::Config(cfg.clone())).unwrap().len();
    let data_at = HEADER_LEN + cfg_len + FRAME_HEADER_LEN + PAGES_FIXED_LEN + 16;
    buf[data_at + 4096 + 100] ^= 0x55;
    (buf, data_at + 4096..data_at + 8192)
}

#[test]
fn torn_live_pages_must_be_sent_again() {
    let mem = ram();
    let cfg = config_of(&mem);
    let dst = ram();
    let r = restore_from(&dst, &torn_stream(&cfg, true)[..], &cfg).unwrap();
    assert_eq!(r.report.torn_pages_recovered, 1);
    let dst = ram();
    let e = restore_from(&dst, &torn_stream(&cfg, false)[..], &cfg).unwrap_err();
    assert_eq!(
        e.to_string(),
        "1 guest pages arrived corrupted (first at guest address 0x5000) and were not sent again before the end of the migration"
    );
}

fn small_snapshot() -> (Vec<u8>, MigrationConfig) {
    let mem = ram();
    let mut rng = Lcg(11);
    fill_page(&mem, 0, &mut rng);
    fill_page(&mem, R1_BASE, &mut rng);
    mem.write_obj(0u8, GuestAddress(4096)).unwrap();
    let cfg = config_of(&mem);
    let mut file = Vec::new();
    snapshot(&mem, &cfg, b"state!", &mut file).unwrap();
    (file, cfg)
}

#[test]
fn every_corrupted_byte_is_refused() {
    let dst = ram();
    let (file, cfg) = small_snapshot();
    restore_from(&dst, &file[..], &cfg).unwrap();
    let (live, torn) = torn_stream_at(&cfg, true);
    restore_from(&dst, &live[..], &cfg).unwrap();
    for (name, stream, tolerated) in [("snapshot", &file, 0..0), ("live stream", &live, torn)] {
        for i in 0..stream.len() {
            if tolerated.contains(&i) {
                // More damage to the torn page: still torn, still replaced by the resend.
                let mut bad = stream.clone();
                bad[i] ^= 0x01;
                restore_from(&dst, &bad[..], &cfg).unwrap();
                continue;
            }
            for flip in [0x01u8, 0x80] {
                let mut bad = stream.clone();
                bad[i] ^= flip;
                match restore_from(&dst, &bad[..], &cfg) {
                    Ok(_) => panic!("{name}: flipping byte {i} ({flip:#x}) went unnoticed"),
                    Err(e) => assert!(!e.to_string().is_empty()),
                }
            }
        }
    }
}

#[test]
fn every_truncation_is_refused() {
    let dst = ram();
    let (file, cfg) = small_snapshot();
    for cut in 0..file.len() {
        let e = restore_from(&dst, &file[..cut], &cfg).unwrap_err();
        assert!(
            matches!(e, Error::Truncated { .. } | Error::EndedEarly { .. }),
            "cut at {cut}: {e}"
        );
        let m = e.to_string();
        assert!(
            m.contains("cut short") || m.contains("before its End"),
            "{m}"
        );
    }
}

#[test]
fn wrong_magic_version_and_flags() {
    let dst = ram();
    let (file, cfg) = small_snapshot();
    for version in [0u32, 2, 3] {
        let mut v = file.clone();
        v[8..12].copy_from_slice(&version.to_le_bytes());
        let e = restore_from(&dst, &v[..], &cfg).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("unsupported migration stream version {version}: this ferrovm reads version 1 only in a migration stream (version 2 is a snapshot file with page images)")
        );
    }
    // A snapshot-file reader takes versions 1 and 2 (and names them).
    let mut v = file.clone();
    v[8..12].copy_from_slice(&3u32.to_le_bytes());
    let e = StreamReader::snapshot_file(&v[..])
        .read_header()
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "unsupported migration stream version 3: this ferrovm reads versions 1 and 2"
    );
    let h = StreamReader::snapshot_file(&file[..])
        .read_header()
        .unwrap();
    assert_eq!(h.version, 1);
    let mut v = file.clone();
    v[0] = b'Q';
    let e = restore_from(&dst, &v[..], &cfg).unwrap_err().to_string();
    assert!(e.starts_with("not a ferrovm migration stream"), "{e}");
    let e = restore_from(&dst, &b""[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("cut short") && e.contains("header"), "{e}");
}

fn raw_frame(kind: u8, flags: u8, payload: &[u8], declared_len: u32) -> Vec<u8> {
    let mut f = vec![kind, flags, 0, 0];
    f.extend_from_slice(&declared_len.to_le_bytes());
    f.extend_from_slice(payload);
    let crc = crc32fast::hash(&f);
    f.extend_from_slice(&crc.to_le_bytes());
    f
}

fn stream_with(cfg: &MigrationConfig, tail: &[u8]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut w = StreamWriter::new(&mut buf);
    header_and_config(&mut w, cfg);
    w.flush().unwrap();
    buf.extend_from_slice(tail);
    buf
}

#[test]
fn oversized_and_malformed_frames() {
    let mem = ram();
    let cfg = config_of(&mem);
    let dst = ram();
    // A State frame claiming 9 MiB: refused from the header alone.
    let s = stream_with(&cfg, &raw_frame(5, 0, &[], 9 << 20));
    let e = restore_from(&dst, &s[..], &cfg).unwrap_err();
    assert!(matches!(e, Error::FrameTooLarge { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("9437184 bytes, more than the 8388608"),
        "{e}"
    );
    // Pages whose length does not match the count.
    let mut p = Vec::new();
    p.extend_from_slice(&0u64.to_le_bytes());
    p.extend_from_slice(&3u32.to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    let s = stream_with(&cfg, &raw_frame(2, 0, &p, 16 + 2 * 4100));
    let e = restore_from(&dst, &s[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("does not match 3 pages"), "{e}");
    // Unknown kind, unknown flags.
    let s = stream_with(&cfg, &raw_frame(42, 0, &[], 0));
    let e = restore_from(&dst, &s[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("unknown frame kind 42"), "{e}");
    let s = stream_with(&cfg, &raw_frame(6, 0x10, &[0; 24], 24));
    let e = restore_from(&dst, &s[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("unknown flags"), "{e}");
    // Bad JSON in Config.
    let mut buf = Vec::new();
    let mut w = StreamWriter::new(&mut buf);
    w.write_header().unwrap();
    w.flush().unwrap();
    buf.extend_from_slice(&raw_frame(1, 0, b"{\"memory_size\":", 15));
    let e = restore_from(&dst, &buf[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("configuration JSON"), "{e}");
}

#[test]
fn pages_outside_ram_are_refused() {
    let mem = ram();
    let cfg = config_of(&mem);
    let dst = ram();
    let zp = |addr: u64, count: u32| {
        let mut f = encode_frame(&Frame::ZeroPages { addr, count }).unwrap();
        f.truncate(f.len());
        f
    };
    for (addr, count, why) in [
        (3 << 20, 1, "not inside one RAM region"),      // the hole
        (R0 - 4096, 2, "not inside one RAM region"),    // straddles a region end
        (R1_BASE + R1, 1, "not inside one RAM region"), // past the end
        (4097, 1, "not 4 KiB aligned"),
        (0, 0, "page count is zero"),
        (u64::MAX - 4095, 2, "overflows"),
    ] {
        let s = stream_with(&cfg, &zp(addr, count));
        let e = restore_from(&dst, &s[..], &cfg).unwrap_err();
        assert!(matches!(e, Error::BadPageRange { .. }), "{addr:#x}: {e}");
        assert!(e.to_string().contains(why), "{addr:#x}: {e}");
    }
    // Same for a Pages frame, before any data is written.
    let mut buf = Vec::new();
    let mut w = StreamWriter::new(&mut buf);
    header_and_config(&mut w, &cfg);
    w.write_pages(3 << 20, &[7u8; 4096], false).unwrap();
    w.flush().unwrap();
    let e = restore_from(&dst, &buf[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("0x300000..0x301000"), "{e}");
    assert!(dump(&dst).iter().all(|&b| b == 0));
}

#[test]
fn config_mismatch_names_both_values_and_tells_the_source() {
    let (file, cfg) = small_snapshot();
    let dst = ram();
    let mut other = cfg.clone();
    other.vcpus = 4;
    let mut ack = Vec::new();
    let e = receive(&dst, &file[..], &mut ack, &other)
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        e,
        "machine mismatch: vCPU count differs: source 2, destination 4"
    );
    // The source reads the reason on the reply channel.
    let mut r = StreamReader::replies(&ack[..]);
    assert_eq!(
        r.next_frame().unwrap(),
        Frame::Error(format!("destination: {e}"))
    );

    let small = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let e = restore_from(&small, &file[..], &config_of(&small))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "machine mismatch: memory size differs: source 3 MiB, destination 1 MiB"
    );
}

#[test]
fn protocol_order_is_enforced() {
    let mem = ram();
    let cfg = config_of(&mem);
    let dst = ram();
    // End without a final round.
    let s = stream_with(
        &cfg,
        &encode_frame(&Frame::End(EndInfo::default())).unwrap(),
    );
    let e = restore_from(&dst, &s[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("End before the final round"), "{e}");
    // Round numbers must follow each other.
    let s = stream_with(
        &cfg,
        &encode_frame(&Frame::RoundEnd(RoundEndInfo {
            round: 3,
            ..Default::default()
        }))
        .unwrap(),
    );
    let e = restore_from(&dst, &s[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("round 3 ends where round 0 was expected"), "{e}");
    // Counts must match what arrived.
    let s = stream_with(
        &cfg,
        &encode_frame(&Frame::RoundEnd(RoundEndInfo {
            pages: 1,
            ..Default::default()
        }))
        .unwrap(),
    );
    let e = restore_from(&dst, &s[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("announces 1 pages"), "{e}");
    // An Error frame from the source.
    let s = stream_with(
        &cfg,
        &encode_frame(&Frame::Error("out of memory".into())).unwrap(),
    );
    let e = restore_from(&dst, &s[..], &cfg).unwrap_err().to_string();
    assert_eq!(e, "the source reported an error: out of memory");
}

#[test]
fn random_damage_never_panics() {
    let dst = ram();
    let (file, cfg) = small_snapshot();
    let (live, _) = torn_stream_at(&cfg, true);
    let mut rng = Lcg(2024);
    for round in 0..3000 {
        let base = if round % 2 == 0 { &file } else { &live };
        let mut s = base.clone();
        match rng.next() % 4 {
            // Overwrite a few random bytes.
            0 => {
                for _ in 0..1 + rng.next() % 8 {
                    let i = (rng.next() as usize) % s.len();
                    s[i] = rng.next() as u8;
                }
            }
            // Insert bytes.
            1 => {
                let i = (rng.next() as usize) % s.len();
                let n = 1 + rng.next() as usize % 16;
                let junk: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                s.splice(i..i, junk);
            }
            // Remove bytes.
            2 => {
                let i = (rng.next() as usize) % s.len();
                let n = (1 + rng.next() as usize % 16).min(s.len() - i);
                s.drain(i..i + n);
            }
            // Valid header and Config, then garbage.
            _ => {
                let keep = HEADER_LEN + encode_frame(&Frame::Config(cfg.clone())).unwrap().len();
                s.truncate(keep);
                let n = rng.next() as usize % 64;
                s.extend((0..n).map(|_| rng.next() as u8));
            }
        }
        if s == *base {
            continue;
        }
        // Either refused, or (damage confined to the torn page) restored correctly.
        if let Ok(r) = restore_from(&dst, &s[..], &cfg) {
            assert_eq!(
                r.state,
                if round % 2 == 0 {
                    b"state!".to_vec()
                } else {
                    vec![1]
                }
            );
        }
    }
}

/// A final round with `page` at 0x1000, then `frames` (each counted as one page of
/// `SAME_PAGE_FRAME_LEN` bytes), the state and `End`.
fn same_page_stream(cfg: &MigrationConfig, page: &[u8], frames: &[Frame]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut w = StreamWriter::new(&mut buf);
    header_and_config(&mut w, cfg);
    let mut bytes = w.write_pages(0x1000, page, false).unwrap();
    for f in frames {
        bytes += w.write_frame(f).unwrap();
    }
    let pages = 1 + frames.len() as u64;
    w.write_frame(&Frame::RoundEnd(RoundEndInfo {
        round: 0,
        final_round: true,
        pages,
        bytes,
        dirty_pages_found: pages,
        ..Default::default()
    }))
    .unwrap();
    w.write_frame(&Frame::State(vec![1])).unwrap();
    w.write_frame(&Frame::End(EndInfo {
        rounds: 1,
        total_pages: pages,
        total_zero_pages: 0,
    }))
    .unwrap();
    w.flush().unwrap();
    buf
}

#[test]
fn same_page_markers_copy_an_earlier_page() {
    let mem = ram();
    let cfg = config_of(&mem);
    let page = Lcg(5).page();
    let crc = page_crc(&page);
    let same = |addr, from| Frame::SamePage {
        addr,
        from,
        crc,
        live: false,
    };
    // Round trip of the frame itself.
    let live = Frame::SamePage {
        addr: 0x5000,
        from: 0x1000,
        crc,
        live: true,
    };
    let bytes = encode_frame(&live).unwrap();
    assert_eq!(bytes.len() as u64, SAME_PAGE_FRAME_LEN);
    let framed = stream_with(&cfg, &bytes);
    let mut r = StreamReader::new(&framed[..]);
    r.read_header().unwrap();
    let Frame::Config(c) = r.next_frame().unwrap() else {
        panic!("no config")
    };
    r.set_ram_ranges(c.ram_regions);
    assert_eq!(r.next_frame().unwrap(), live);
    // Two copies, one of them in the second RAM region.
    let s = same_page_stream(&cfg, &page, &[same(0x5000, 0x1000), same(R1_BASE, 0x5000)]);
    let dst = ram();
    let got = restore_from(&dst, &s[..], &cfg).unwrap();
    assert_eq!(got.report.pages_total, 3);
    for addr in [0x1000, 0x5000, R1_BASE] {
        let mut back = vec![0u8; 4096];
        dst.read_slice(&mut back, GuestAddress(addr)).unwrap();
        assert_eq!(back, page, "{addr:#x}");
    }
}

#[test]
fn bad_same_page_markers_are_refused() {
    let mem = ram();
    let cfg = config_of(&mem);
    let page = Lcg(6).page();
    let crc = page_crc(&page);
    let same = |addr, from, crc| Frame::SamePage {
        addr,
        from,
        crc,
        live: false,
    };
    for (frame, why) in [
        (
            same(0x5000, 0x9000, crc),
            "refers to guest page 0x9000, which this stream has not sent",
        ),
        (same(0x5000, 3 << 20, crc), "not inside one RAM region"),
        (same(3 << 20, 0x1000, crc), "not inside one RAM region"),
        (same(0x5000, 0x1001, crc), "not 4 KiB aligned"),
        (same(0x1000, 0x1000, crc), "refers to itself"),
        (
            same(0x5000, 0x1000, crc ^ 1),
            "checksum mismatch in guest page 0x5000 copied",
        ),
    ] {
        let s = same_page_stream(&cfg, &page, &[frame]);
        let e = restore_from(&ram(), &s[..], &cfg).unwrap_err().to_string();
        assert!(e.contains(why), "{why}: {e}");
    }
    // A marker before any page data, and one with a reserved field set.
    let s = stream_with(&cfg, &encode_frame(&same(0x5000, 0x1000, crc)).unwrap());
    let e = restore_from(&ram(), &s[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("has not sent with data"), "{e}");
    let mut p = vec![0u8; 24];
    p[..8].copy_from_slice(&0x5000u64.to_le_bytes());
    p[8..16].copy_from_slice(&0x1000u64.to_le_bytes());
    p[20] = 1;
    let s = stream_with(&cfg, &raw_frame(17, 0, &p, 24));
    let e = restore_from(&ram(), &s[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("reserved field is not zero"), "{e}");
    // A torn source page in a live round makes the copy torn (sent again or refused at End).
    let s = stream_with(
        &cfg,
        &raw_frame(
            17,
            1,
            &p[..20].iter().chain(&[0; 4]).copied().collect::<Vec<_>>(),
            24,
        ),
    );
    let e = restore_from(&ram(), &s[..], &cfg).unwrap_err().to_string();
    assert!(e.contains("has not sent with data"), "{e}");
}

/// Counts the bytes the receiver reads straight into guest memory (`guest`: host address
/// ranges of the destination's RAM) and into anything else (its read-ahead buffer).
struct ReadTargets<'a> {
    inner: &'a [u8],
    guest: Vec<std::ops::Range<usize>>,
    through_buffer: usize,
    direct: usize,
}

impl std::io::Read for ReadTargets<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let at = buf.as_ptr() as usize;
        if self.guest.iter().any(|r| r.contains(&at)) {
            self.direct += n;
        } else {
            self.through_buffer += n;
        }
        Ok(n)
    }
}

/// Page data goes from the connection straight into guest memory: only what the receiver's
/// small read-ahead buffer took in with a frame header is copied out of a buffer.
#[test]
fn page_data_is_read_straight_into_guest_memory() {
    let src = ram();
    let data: Vec<u8> = (0..R0 as usize).map(|i| (i / 4096 + i) as u8).collect();
    src.write_slice(&data, GuestAddress(0)).unwrap();
    let cfg = config_of(&src);
    let mut buf = Vec::new();
    let mut w = StreamWriter::new(&mut buf);
    header_and_config(&mut w, &cfg);
    let bytes = w.write_pages(0, &data, false).unwrap();
    w.write_frame(&Frame::RoundEnd(RoundEndInfo {
        round: 0,
        final_round: true,
        pages: R0 / 4096,
        zero_pages: 0,
        bytes,
        dirty_pages_found: 0,
        duration_us: 1,
    }))
    .unwrap();
    w.write_frame(&Frame::State(b"state".to_vec())).unwrap();
    w.write_frame(&Frame::End(EndInfo {
        rounds: 1,
        total_pages: R0 / 4096,
        total_zero_pages: 0,
    }))
    .unwrap();
    w.flush().unwrap();
    let dst = ram();
    let mut input = ReadTargets {
        inner: &buf[..],
        guest: GuestRam::regions(&dst)
            .iter()
            .map(|r| r.host_ptr as usize..r.host_ptr as usize + r.size as usize)
            .collect(),
        through_buffer: 0,
        direct: 0,
    };
    let got = receive(&dst, &mut input, Vec::new(), &cfg).unwrap();
    assert_eq!(got.state, b"state");
    assert_eq!(diff(&src, &dst), Vec::<u64>::new());
    assert_eq!(input.through_buffer + input.direct, buf.len());
    assert!(
        input.through_buffer <= 32 << 10 && input.direct >= data.len() - (16 << 10),
        "{} bytes through the read-ahead buffer, {} straight into guest memory",
        input.through_buffer,
        input.direct
    );
}
