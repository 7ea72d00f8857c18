//! virtio-blk driven through real split queues in guest memory, on temporary images.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use virtio_bindings::bindings::virtio_blk::*;
use virtio_bindings::bindings::virtio_ring::{
    VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::*;
use crate::test_driver::{Buf, TestDriver, RAM_SIZE};

const W: u16 = VRING_DESC_F_WRITE as u16;
const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;
const ALL_FEATURES: u64 = u64::MAX;

/// A directory removed when the test ends.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(name: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!("ferrovm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }
    pub(crate) fn join(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn make_image(path: &Path, bytes: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(bytes).unwrap();
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

/// What a request moves besides its header and status.
enum Data<'a> {
    None,
    Out(&'a [u8]),
    In(u32),
}

struct Rig {
    driver: TestDriver,
    dev: Block,
    _dir: TempDir,
    path: PathBuf,
}

impl Rig {
    fn new(name: &str, image_bytes: u64, configure: impl FnOnce(&mut BlockOptions)) -> Rig {
        Rig::with_features(name, image_bytes, configure, ALL_FEATURES)
    }

    fn with_features(
        name: &str,
        image_bytes: u64,
        configure: impl FnOnce(&mut BlockOptions),
        acked: u64,
    ) -> Rig {
        let dir = TempDir::new(name);
        let path = dir.join("disk.img");
        make_image(&path, image_bytes);
        let mut options = BlockOptions::new(&path);
        configure(&mut options);
        let mut dev = Block::new(options).unwrap();
        let sizes = VirtioDevice::<GuestMemoryMmap>::queue_max_sizes(&dev);
        let driver = TestDriver::new(&sizes);
        let offered = VirtioDevice::<GuestMemoryMmap>::features(&dev);
        dev.activate(
            driver.mem.clone(),
            offered & acked,
            driver.active_queues(),
            driver.interrupt(),
        )
        .unwrap();
        Rig {
            driver,
            dev,
            _dir: dir,
            path,
        }
    }

    fn header(&mut self, request_type: u32, sector: u64) -> GuestAddress {
        let addr = self.driver.alloc(16);
        let mut raw = [0u8; 16];
        raw[..4].copy_from_slice(&request_type.to_le_bytes());
        raw[8..].copy_from_slice(&sector.to_le_bytes());
        self.driver.write(addr, &raw);
        addr
    }

    /// Publishes raw descriptors (addr, len, flags) as one chain, kicks, waits; (id, len).
    fn submit_raw(&mut self, q: usize, descs: &[(u64, u32, u16)]) -> (u32, u32) {
        let head = self.driver.write_linked(q, descs);
        self.driver.publish(q, head);
        self.driver.kick(q);
        let used = self.driver.wait_used(q, 1);
        assert_eq!(used[0].0, u32::from(head));
        used[0]
    }

    /// A well-formed request; returns (status, used len, data read).
    fn request(
        &mut self,
        q: usize,
        request_type: u32,
        sector: u64,
        data: Data,
    ) -> (u8, u32, Vec<u8>) {
        let header = self.header(request_type, sector);
        let status = self.driver.alloc(1);
        self.driver.write(status, &[0xff]);
        let mut descs = vec![(header.0, 16, 0)];
        let mut read_back = None;
        match data {
            Data::None => {}
            Data::Out(bytes) => {
                let buf = self.driver.alloc(bytes.len() as u64);
                self.driver.write(buf, bytes);
                descs.push((buf.0, bytes.len() as u32, 0));
            }
            Data::In(len) => {
                let buf = self.driver.alloc(u64::from(len));
                descs.push((buf.0, len, W));
                read_back = Some((buf, len));
            }
        }
        descs.push((status.0, 1, W));
        let (_, used_len) = self.submit_raw(q, &descs);
        let data = read_back.map_or(Vec::new(), |(b, l)| self.driver.read(b, l as usize));
        (self.driver.read(status, 1)[0], used_len, data)
    }

    fn write(&mut self, sector: u64, bytes: &[u8]) {
        let (status, len, _) = self.request(0, VIRTIO_BLK_T_OUT, sector, Data::Out(bytes));
        assert_eq!((status, len), (OK, 1));
    }

    fn read(&mut self, sector: u64, len: u32) -> Vec<u8> {
        let (status, used, data) = self.request(0, VIRTIO_BLK_T_IN, sector, Data::In(len));
        assert_eq!((status, used), (OK, len + 1));
        data
    }

    fn flush(&mut self) {
        assert_eq!(self.request(0, VIRTIO_BLK_T_FLUSH, 0, Data::None).0, OK);
    }

    /// DISCARD or WRITE_ZEROES with segments (sector, sectors, flags).
    fn ranges(&mut self, request_type: u32, segments: &[(u64, u32, u32)]) -> u8 {
        let mut raw = Vec::new();
        for &(sector, count, flags) in segments {
            raw.extend_from_slice(&sector.to_le_bytes());
            raw.extend_from_slice(&count.to_le_bytes());
            raw.extend_from_slice(&flags.to_le_bytes());
        }
        let (status, len, _) = self.request(0, request_type, 0, Data::Out(&raw));
        assert_eq!(len, 1);
        status
    }

    /// The device still works: a write and a read back.
    fn assert_usable(&mut self) {
        let data = pattern(512, 0x5a);
        self.write(3, &data);
        assert_eq!(self.read(3, 512), data);
    }

    fn file_bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        std::fs::File::open(&self.path)
            .unwrap()
            .read_exact_at(&mut buf, offset)
            .unwrap();
        buf
    }

    fn allocated_bytes(&self) -> u64 {
        std::fs::metadata(&self.path).unwrap().blocks() * 512
    }
}

#[test]
fn config_space_and_features() {
    let rig = Rig::new("blk-config", (8 << 20) + 300, |o| o.queues = 3);
    let dev = &rig.dev;
    let mut cfg = [0u8; 64];
    VirtioDevice::<GuestMemoryMmap>::read_config(dev, 0, &mut cfg);
    let u32_at = |o: usize| u32::from_le_bytes(cfg[o..o + 4].try_into().unwrap());
    // The partial sector at the end is not shown.
    assert_eq!(u64::from_le_bytes(cfg[..8].try_into().unwrap()), 8 << 11);
    assert_eq!(u32_at(12), u32::from(QUEUE_SIZE - 2));
    assert_eq!(u32_at(20), 512);
    assert_eq!(u16::from_le_bytes([cfg[34], cfg[35]]), 3);
    assert_eq!(u32_at(36), MAX_RANGE_SECTORS);
    assert_eq!(u32_at(40), MAX_RANGE_SEGMENTS);
    assert_eq!(cfg[56], 1);
    let mut tail = [0xffu8; 4];
    VirtioDevice::<GuestMemoryMmap>::read_config(dev, 200, &mut tail);
    assert_eq!(tail, [0; 4]);

    let features = VirtioDevice::<GuestMemoryMmap>::features(dev);
    for bit in [
        32,
        VIRTIO_BLK_F_SEG_MAX,
        VIRTIO_BLK_F_BLK_SIZE,
        VIRTIO_BLK_F_FLUSH,
        VIRTIO_BLK_F_MQ,
        VIRTIO_BLK_F_DISCARD,
        VIRTIO_BLK_F_WRITE_ZEROES,
        28,
        29,
    ] {
        assert!(features & 1 << bit != 0, "feature {bit} missing");
    }
    assert_eq!(features & 1 << VIRTIO_BLK_F_RO, 0);
    assert_eq!(
        VirtioDevice::<GuestMemoryMmap>::queue_max_sizes(dev),
        vec![256; 3]
    );
}

#[test]
fn write_flush_read_get_id() {
    let mut rig = Rig::new("blk-rw", 4 << 20, |o| {
        o.serial = Some("ferro-serial-01".into())
    });
    let data = pattern(8192, 7);
    // Data split over descriptors of odd sizes: only the total must be whole sectors.
    let header = rig.header(VIRTIO_BLK_T_OUT, 16);
    let bufs: Vec<GuestAddress> = [1000u64, 3000, 4192]
        .iter()
        .map(|&l| rig.driver.alloc(l))
        .collect();
    rig.driver.write(bufs[0], &data[..1000]);
    rig.driver.write(bufs[1], &data[1000..4000]);
    rig.driver.write(bufs[2], &data[4000..]);
    let status = rig.driver.alloc(1);
    let descs = [
        (header.0, 16, 0),
        (bufs[0].0, 1000, 0),
        (bufs[1].0, 3000, 0),
        (bufs[2].0, 4192, 0),
        (status.0, 1, W),
    ];
    assert_eq!(rig.submit_raw(0, &descs).1, 1);
    assert_eq!(rig.driver.read(status, 1), [OK]);
    rig.flush();
    assert_eq!(rig.file_bytes(16 * 512, 8192), data);
    assert_eq!(rig.read(16, 8192), data);
    // Reads into scattered buffers.
    let header = rig.header(VIRTIO_BLK_T_IN, 17);
    let (a, b) = (rig.driver.alloc(100), rig.driver.alloc(412));
    let status = rig.driver.alloc(1);
    let used = rig.submit_raw(
        0,
        &[
            (header.0, 16, 0),
            (a.0, 100, W),
            (b.0, 412, W),
            (status.0, 1, W),
        ],
    );
    assert_eq!(used.1, 513);
    assert_eq!(rig.driver.read(a, 100), data[512..612]);
    assert_eq!(rig.driver.read(b, 412), data[612..1024]);

    let (status, used, id) = rig.request(0, VIRTIO_BLK_T_GET_ID, 0, Data::In(20));
    assert_eq!((status, used), (OK, 21));
    assert_eq!(&id[..15], b"ferro-serial-01");
    assert_eq!(&id[15..], [0; 5]);
    let (status, used, id) = rig.request(0, VIRTIO_BLK_T_GET_ID, 0, Data::In(5));
    assert_eq!((status, used, id), (OK, 6, b"ferro".to_vec()));
}

#[test]
fn discard_punches_a_hole_and_reads_zeroes() {
    let mut rig = Rig::new("blk-discard", 8 << 20, |_| {});
    let data = pattern(1 << 20, 3);
    rig.write(0, &data);
    rig.flush();
    let before = rig.allocated_bytes();
    assert!(before >= 1 << 20, "only {before} bytes allocated");
    assert_eq!(
        rig.ranges(VIRTIO_BLK_T_DISCARD, &[(0, 1024, 0), (1024, 1024, 0)]),
        OK
    );
    let after = rig.allocated_bytes();
    assert!(
        before - after >= 1 << 20,
        "discard freed {} bytes",
        before - after
    );
    assert_eq!(rig.read(0, 1 << 20), vec![0; 1 << 20]);
}

#[test]
fn write_zeroes_with_and_without_unmap() {
    let mut rig = Rig::new("blk-zeroes", 8 << 20, |_| {});
    let data = pattern(1 << 20, 9);
    rig.write(0, &data);
    rig.write(2048, &data);
    rig.flush();
    let before = rig.allocated_bytes();
    // Keep the allocation: a 4 KiB range in the middle.
    assert_eq!(rig.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(8, 8, 0)]), OK);
    let mut expect = data.clone();
    expect[4096..8192].fill(0);
    assert_eq!(rig.read(0, 1 << 20), expect);
    // May unmap: the whole second MiB, which is freed.
    let unmap = VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;
    assert_eq!(
        rig.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(2048, 2048, unmap)]),
        OK
    );
    assert_eq!(rig.read(2048, 1 << 20), vec![0; 1 << 20]);
    assert!(before - rig.allocated_bytes() >= 1 << 20);
}

#[test]
fn range_requests_are_checked() {
    let mut rig = Rig::new("blk-ranges", 1 << 20, |_| {});
    let unmap = VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;
    assert_eq!(rig.ranges(VIRTIO_BLK_T_DISCARD, &[(0, 8, unmap)]), UNSUPP);
    assert_eq!(rig.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 8, 4)]), UNSUPP);
    assert_eq!(rig.ranges(VIRTIO_BLK_T_DISCARD, &[(2040, 16, 0)]), IOERR);
    assert_eq!(rig.ranges(VIRTIO_BLK_T_DISCARD, &[(u64::MAX, 1, 0)]), IOERR);
    assert_eq!(
        rig.ranges(VIRTIO_BLK_T_DISCARD, &[(0, MAX_RANGE_SECTORS + 1, 0)]),
        IOERR
    );
    let too_many = vec![(0, 1, 0); MAX_RANGE_SEGMENTS as usize + 1];
    assert_eq!(rig.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &too_many), IOERR);
    assert_eq!(rig.ranges(VIRTIO_BLK_T_DISCARD, &[]), IOERR);
    // A partial segment.
    let (status, _, _) = rig.request(0, VIRTIO_BLK_T_DISCARD, 0, Data::Out(&[0; 20]));
    assert_eq!(status, IOERR);
    // A valid segment after a bad one: nothing done.
    rig.write(0, &pattern(512, 1));
    assert_eq!(
        rig.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 1, 0), (4096, 1, 0)]),
        IOERR
    );
    assert_eq!(rig.read(0, 512), pattern(512, 1));
    rig.assert_usable();
}

#[test]
fn unknown_requests_are_unsupported() {
    let mut rig = Rig::new("blk-unsupp", 1 << 20, |_| {});
    for t in [VIRTIO_BLK_T_SCSI_CMD, VIRTIO_BLK_T_ZONE_REPORT, 0xdead_beef] {
        let (status, len, _) = rig.request(0, t, 0, Data::None);
        assert_eq!((status, len), (UNSUPP, 1), "type {t}");
    }
    rig.assert_usable();
}

#[test]
fn readonly_disks_refuse_changes() {
    let mut rig = Rig::new("blk-ro", 1 << 20, |o| o.readonly = true);
    let features = VirtioDevice::<GuestMemoryMmap>::features(&rig.dev);
    assert!(features & 1 << VIRTIO_BLK_F_RO != 0);
    assert_eq!(
        features & (1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES),
        0
    );
    let (status, _, _) = rig.request(0, VIRTIO_BLK_T_OUT, 0, Data::Out(&pattern(512, 1)));
    assert_eq!(status, IOERR);
    assert_eq!(rig.ranges(VIRTIO_BLK_T_DISCARD, &[(0, 1, 0)]), IOERR);
    assert_eq!(rig.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 1, 0)]), IOERR);
    assert_eq!(rig.read(0, 512), vec![0; 512]);
    assert_eq!(rig.file_bytes(0, 512), vec![0; 512]);
    rig.flush();
}

#[test]
fn the_lock_is_handed_over_and_taken_back() {
    let dir = TempDir::new("blk-handover");
    let path = dir.join("disk.img");
    make_image(&path, 1 << 20);
    let mut source = Block::new(BlockOptions::new(&path)).unwrap();
    // A migration destination opens the image without its lock...
    let deferred = BlockOptions {
        defer_lock: true,
        ..BlockOptions::new(&path)
    };
    let mut destination = Block::new(deferred).unwrap();
    let dest = |d: &mut Block| VirtioDevice::<GuestMemoryMmap>::take_over(d);
    // ...and cannot take it while the source holds it.
    assert!(dest(&mut destination).unwrap_err().0.contains("locked"));
    VirtioDevice::<GuestMemoryMmap>::hand_over(&mut source).unwrap();
    dest(&mut destination).unwrap();
    // Now the source cannot take it back, nor can a third VMM open the image.
    let back = VirtioDevice::<GuestMemoryMmap>::take_over(&mut source).unwrap_err();
    assert!(back.0.contains("locked by another process"), "{}", back.0);
    assert!(Block::new(BlockOptions::new(&path)).is_err());
    drop(destination);
    VirtioDevice::<GuestMemoryMmap>::take_over(&mut source).unwrap();
}

#[test]
fn images_are_locked() {
    let dir = TempDir::new("blk-lock");
    let path = dir.join("disk.img");
    make_image(&path, 1 << 20);
    let first = Block::new(BlockOptions::new(&path)).unwrap();
    // OFD locks conflict between two opens even in one process.
    let err = Block::new(BlockOptions::new(&path)).err().unwrap();
    assert_eq!(err.kind, ImageErrorKind::Locked);
    assert!(
        err.to_string().contains("locked by another process"),
        "{err}"
    );
    assert!(err.to_string().contains(path.to_str().unwrap()), "{err}");
    let ro = |p: &Path| BlockOptions {
        readonly: true,
        ..BlockOptions::new(p)
    };
    assert_eq!(
        Block::new(ro(&path)).err().unwrap().kind,
        ImageErrorKind::Locked
    );
    drop(first);
    // Readers share.
    let a = Block::new(ro(&path)).unwrap();
    let _b = Block::new(ro(&path)).unwrap();
    assert_eq!(
        Block::new(BlockOptions::new(&path)).err().unwrap().kind,
        ImageErrorKind::Locked
    );
    drop(a);
}

#[test]
fn bad_images_are_named_in_errors() {
    let dir = TempDir::new("blk-open");
    let missing = dir.join("missing.img");
    let err = Block::new(BlockOptions::new(&missing)).err().unwrap();
    let msg = err.to_string();
    assert!(
        msg.contains(missing.to_str().unwrap()) && msg.contains("No such file"),
        "{msg}"
    );
    let err = Block::new(BlockOptions::new(&dir.0)).err().unwrap();
    assert!(err.to_string().contains("is a directory"), "{err}");
    let err = Block::new(BlockOptions::new("/dev/null")).err().unwrap();
    assert!(
        err.to_string()
            .contains("not a regular file or a block device"),
        "{err}"
    );
    let mut bad = BlockOptions::new(dir.join("x"));
    bad.queues = 0;
    assert!(Block::new(bad).is_err());
}

#[test]
fn malformed_data_requests_fail_with_ioerr() {
    let mut rig = Rig::new("blk-bad-data", 1 << 20, |_| {});
    let sectors = 2048;
    // Out of range, overflowing, partial sectors.
    for (sector, len) in [
        (sectors, 512),
        (sectors - 1, 1024),
        (u64::MAX, 512),
        (u64::MAX / 512 + 1, 512),
        (0, 100),
    ] {
        let (status, used, _) = rig.request(0, VIRTIO_BLK_T_IN, sector, Data::In(len));
        assert_eq!((status, used), (IOERR, 1), "read {sector}+{len}");
        let (status, _, _) = rig.request(
            0,
            VIRTIO_BLK_T_OUT,
            sector,
            Data::Out(&vec![1; len as usize]),
        );
        assert_eq!(status, IOERR, "write {sector}+{len}");
    }
    // A read with a device-readable data buffer; a write with a device-writable one.
    let header = rig.header(VIRTIO_BLK_T_IN, 0);
    let (buf, status) = (rig.driver.alloc(512), rig.driver.alloc(1));
    rig.submit_raw(0, &[(header.0, 16, 0), (buf.0, 512, 0), (status.0, 1, W)]);
    assert_eq!(rig.driver.read(status, 1), [IOERR]);
    let header = rig.header(VIRTIO_BLK_T_OUT, 0);
    rig.driver.write(buf, &[0xee; 512]);
    rig.submit_raw(0, &[(header.0, 16, 0), (buf.0, 512, W), (status.0, 1, W)]);
    assert_eq!(rig.driver.read(status, 1), [IOERR]);
    assert_eq!(rig.file_bytes(0, 512), vec![0; 512]);
    // Flush and GET_ID with buffers they do not take.
    let header = rig.header(VIRTIO_BLK_T_FLUSH, 0);
    rig.submit_raw(0, &[(header.0, 16, 0), (buf.0, 512, 0), (status.0, 1, W)]);
    assert_eq!(rig.driver.read(status, 1), [IOERR]);
    let (st, used, _) = rig.request(0, VIRTIO_BLK_T_GET_ID, 0, Data::None);
    assert_eq!((st, used), (IOERR, 1));
    rig.assert_usable();
}

#[test]
fn hostile_chains_never_hang_or_break_the_device() {
    let mut rig = Rig::new("blk-hostile", 1 << 20, |_| {});
    let outside = RAM_SIZE + 0x1000;
    let header = rig.header(VIRTIO_BLK_T_IN, 0);
    let buf = rig.driver.alloc(4096);
    let status = rig.driver.alloc(1);
    type Case = (&'static str, Vec<(u64, u32, u16)>, Option<u8>);
    let cases: Vec<Case> = vec![
        (
            "short header",
            vec![(header.0, 8, 0), (status.0, 1, W)],
            Some(IOERR),
        ),
        (
            "header split in two",
            vec![
                (header.0, 8, 0),
                (header.0 + 8, 8, 0),
                (buf.0, 512, W),
                (status.0, 1, W),
            ],
            Some(OK),
        ),
        (
            "no writable buffer",
            vec![(header.0, 16, 0), (status.0, 1, 0)],
            None,
        ),
        (
            "zero-length status",
            vec![(header.0, 16, 0), (status.0, 0, W)],
            None,
        ),
        (
            "status outside RAM",
            vec![(header.0, 16, 0), (outside, 1, W)],
            None,
        ),
        (
            "header outside RAM",
            vec![(outside, 16, 0), (status.0, 1, W)],
            Some(IOERR),
        ),
        (
            "data outside RAM",
            vec![(header.0, 16, 0), (outside, 512, W), (status.0, 1, W)],
            Some(IOERR),
        ),
        (
            "data straddling RAM's end",
            vec![
                (header.0, 16, 0),
                (RAM_SIZE - 256, 512, W),
                (status.0, 1, W),
            ],
            Some(IOERR),
        ),
        (
            "readable after writable",
            vec![
                (header.0, 16, 0),
                (buf.0, 512, W),
                (buf.0, 512, 0),
                (status.0, 1, W),
            ],
            Some(IOERR),
        ),
        (
            "zero-length descriptors",
            vec![
                (header.0, 16, 0),
                (buf.0, 0, 0),
                (buf.0, 512, W),
                (buf.0, 0, W),
                (status.0, 1, W),
            ],
            Some(OK),
        ),
        // virtio-queue ends the chain where it passes 4 GiB: the status byte is then the
        // last byte of the huge buffer, outside guest RAM.
        (
            "over 4 GiB",
            vec![
                (header.0, 16, 0),
                (buf.0, u32::MAX - 16, W),
                (status.0, 1, W),
            ],
            None,
        ),
        (
            "huge but under 4 GiB",
            vec![
                (header.0, 16, 0),
                (buf.0, u32::MAX - 17, W),
                (status.0, 1, W),
            ],
            Some(IOERR),
        ),
    ];
    for (name, descs, expect) in cases {
        rig.driver.write(status, &[0xff]);
        let (_, used) = rig.submit_raw(0, &descs);
        match expect {
            Some(code) => assert_eq!(rig.driver.read(status, 1), [code], "{name}"),
            None => assert_eq!(used, 0, "{name}"),
        }
        rig.assert_usable();
    }
}

#[test]
fn looping_and_dangling_chains_end() {
    let mut rig = Rig::new("blk-loops", 1 << 20, |_| {});
    let header = rig.header(VIRTIO_BLK_T_IN, 0);
    let status = rig.driver.alloc(1);
    let next = VRING_DESC_F_NEXT as u16;
    // 200 -> 201 -> 200 -> ...: bounded by the queue size.
    rig.driver.store_desc(0, 200, header.0, 16, next, 201);
    rig.driver.store_desc(0, 201, status.0, 1, next | W, 200);
    rig.driver.publish(0, 200);
    // A self loop of writable descriptors.
    rig.driver.store_desc(0, 202, status.0, 1, next | W, 202);
    rig.driver.publish(0, 202);
    // A next index past the table.
    rig.driver.store_desc(0, 203, header.0, 16, next, 9999);
    rig.driver.publish(0, 203);
    rig.driver.kick(0);
    let used = rig.driver.wait_used(0, 3);
    assert_eq!(used[0], (200, 1));
    assert_eq!(used[1], (202, 1));
    assert_eq!(rig.driver.read(status, 1), [IOERR]);
    assert_eq!(used[2], (203, 0));
    rig.assert_usable();
    let states = VirtioDevice::<GuestMemoryMmap>::queue_states(&rig.dev).unwrap_or_default();
    assert!(
        states.is_empty(),
        "a running device publishes no queue state"
    );
}

#[test]
fn a_buffer_wrapping_the_address_space_gets_no_status() {
    let mut rig = Rig::new("blk-wrap", 1 << 20, |_| {});
    let header = rig.header(VIRTIO_BLK_T_IN, 0);
    // Its last byte, where the status would go, is u64::MAX + 0x800: guest address 0x7ff, in
    // the descriptor table. The chain is given back untouched.
    let table = rig.driver.read(GuestAddress(0), 0x1000);
    let used = rig.submit_raw(0, &[(header.0, 16, 0), (u64::MAX - 0xfff, 0x1800, W)]);
    assert_eq!(used.1, 0);
    let mut after = rig.driver.read(GuestAddress(0), 0x1000);
    // Only the chain's own two descriptors changed (the driver wrote them).
    after[..32].copy_from_slice(&table[..32]);
    assert_eq!(after, table, "the device wrote into the descriptor table");
    rig.assert_usable();
}

#[test]
fn a_head_beyond_the_queue_needs_reset() {
    let mut rig = Rig::new("blk-bad-head", 1 << 20, |_| {});
    // No used entry could name this chain: the device asks for a reset and stops the queue.
    rig.driver.publish(0, 4000);
    rig.driver.kick(0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !rig
        .driver
        .interrupt
        .broken
        .load(std::sync::atomic::Ordering::SeqCst)
    {
        assert!(std::time::Instant::now() < deadline, "no NEEDS_RESET");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let header = rig.header(VIRTIO_BLK_T_IN, 0);
    let (buf, status) = (rig.driver.alloc(512), rig.driver.alloc(1));
    rig.driver.add_chain(
        0,
        &[Buf::r(header, 16), Buf::w(buf, 512), Buf::w(status, 1)],
    );
    rig.driver.kick(0);
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(rig.driver.used_idx(0), 0, "a halted queue served a request");
}

#[test]
fn indirect_chains() {
    let mut rig = Rig::new("blk-indirect", 1 << 20, |_| {});
    let data = pattern(1024, 77);
    rig.write(4, &data);
    let header = rig.header(VIRTIO_BLK_T_IN, 4);
    let (buf, status) = (rig.driver.alloc(1024), rig.driver.alloc(1));
    let head = rig.driver.add_indirect_chain(
        0,
        &[Buf::r(header, 16), Buf::w(buf, 1024), Buf::w(status, 1)],
    );
    rig.driver.kick(0);
    assert_eq!(rig.driver.wait_used(0, 1), vec![(u32::from(head), 1025)]);
    assert_eq!(rig.driver.read(buf, 1024), data);
    assert_eq!(rig.driver.read(status, 1), [OK]);

    // A table whose length is not a whole number of descriptors, and a nested table.
    let table = rig.driver.alloc(64);
    let indirect = VRING_DESC_F_INDIRECT as u16;
    rig.submit_raw(0, &[(table.0, 20, indirect)]);
    let nested = RawTable::write(&rig.driver, table, &[(table.0, 16, indirect)]);
    assert_eq!(rig.submit_raw(0, &[(nested, 16, indirect)]).1, 0);
    // A table outside guest RAM.
    let outside = RAM_SIZE + 0x1000;
    assert_eq!(rig.submit_raw(0, &[(outside, 64, indirect)]).1, 0);
    // Over-long: more descriptors than any request may have.
    let count = chain::MAX_CHAIN_DESCRIPTORS + 8;
    let big = rig.driver.alloc(16 * count as u64);
    let mut descs = vec![(header.0, 16, 0)];
    descs.extend(std::iter::repeat_n((buf.0, 1, W), count - 1));
    RawTable::write(&rig.driver, big, &descs);
    assert_eq!(
        rig.submit_raw(0, &[(big.0, 16 * count as u32, indirect)]).1,
        0
    );
    rig.assert_usable();
}

/// Writes an indirect table of linked descriptors.
struct RawTable;

impl RawTable {
    fn write(driver: &TestDriver, at: GuestAddress, descs: &[(u64, u32, u16)]) -> u64 {
        for (i, &(addr, len, flags)) in descs.iter().enumerate() {
            let flags = if i + 1 < descs.len() {
                flags | VRING_DESC_F_NEXT as u16
            } else {
                flags
            };
            let mut raw = [0u8; 16];
            raw[..8].copy_from_slice(&addr.to_le_bytes());
            raw[8..12].copy_from_slice(&len.to_le_bytes());
            raw[12..14].copy_from_slice(&flags.to_le_bytes());
            raw[14..].copy_from_slice(&(i as u16 + 1).to_le_bytes());
            driver
                .mem
                .write_slice(&raw, GuestAddress(at.0 + 16 * i as u64))
                .unwrap();
        }
        at.0
    }
}

#[test]
fn pause_completes_requests_in_flight_then_saves() {
    // Write-through (FLUSH not negotiated): each write syncs, so requests are still in
    // flight when the pause comes.
    let acked = !(1u64 << VIRTIO_BLK_F_FLUSH);
    let mut rig = Rig::with_features("blk-pause", 16 << 20, |_| {}, acked);
    let count = 64u16;
    let data = pattern(64 << 10, 5);
    let buf = rig.driver.alloc(data.len() as u64);
    rig.driver.write(buf, &data);
    for i in 0..count {
        let header = rig.header(VIRTIO_BLK_T_OUT, u64::from(i) * 128);
        let status = rig.driver.alloc(1);
        rig.driver.add_chain(
            0,
            &[
                Buf::r(header, 16),
                Buf::r(buf, data.len() as u32),
                Buf::w(status, 1),
            ],
        );
    }
    rig.driver.kick(0);
    std::thread::sleep(Duration::from_millis(2));
    VirtioDevice::<GuestMemoryMmap>::pause(&mut rig.dev).unwrap();
    let used_at_pause = rig.driver.used_idx(0);
    let states = VirtioDevice::<GuestMemoryMmap>::queue_states(&rig.dev).unwrap_or_default();
    assert_eq!(states.len(), 1);
    // Quiescent: everything taken is completed and nothing moves while paused.
    assert_eq!(states[0].1.next_used, used_at_pause);
    assert_eq!(states[0].1.next_avail, used_at_pause);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(rig.driver.used_idx(0), used_at_pause);
    let saved = VirtioDevice::<GuestMemoryMmap>::save(&rig.dev).unwrap();
    let state: BlockState = saved.parse("virtio-blk", STATE_VERSION).unwrap();
    assert_eq!(state.capacity_sectors, 16 << 11);
    VirtioDevice::<GuestMemoryMmap>::resume(&mut rig.dev).unwrap();
    let all = rig.driver.wait_used(0, count);
    assert!(all.iter().all(|&(_, len)| len == 1));
    assert_eq!(rig.file_bytes(63 * 128 * 512, data.len()), data);
}

/// With `expect_unchanged` (a snapshot restore) an image file written since the save, or
/// another file, is refused naming it; without (a migration) only the size counts.
#[test]
fn a_restore_refuses_an_image_changed_since_the_save() {
    let dir = TempDir::new("blk-stamp");
    let (path, copy) = (dir.join("disk.img"), dir.join("copy.img"));
    make_image(&path, 1 << 20);
    make_image(&copy, 1 << 20);
    let dev = Block::new(BlockOptions::new(&path)).unwrap();
    let saved = VirtioDevice::<GuestMemoryMmap>::save(&dev).unwrap();
    drop(dev);
    let strict = |p: &Path| BlockOptions {
        expect_unchanged: true,
        ..BlockOptions::new(p)
    };
    let restore = |options: BlockOptions| {
        let mut dev = Block::new(options).unwrap();
        VirtioDevice::<GuestMemoryMmap>::restore(&mut dev, &saved).map_err(|e| e.to_string())
    };
    restore(strict(&path)).unwrap();
    let other = restore(strict(&copy)).unwrap_err();
    assert!(
        other.contains("copy.img") && other.contains("another file"),
        "{other}"
    );
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .write_all_at(b"x", 4096)
        .unwrap();
    let written = restore(strict(&path)).unwrap_err();
    assert!(
        written.contains("disk.img") && written.contains("written since"),
        "{written}"
    );
    restore(BlockOptions::new(&path)).unwrap();
}

#[test]
fn restore_checks_the_image() {
    let rig = Rig::new("blk-restore", 4 << 20, |_| {});
    let saved = VirtioDevice::<GuestMemoryMmap>::save(&rig.dev).unwrap();
    let dir = TempDir::new("blk-restore-other");
    let (same, other) = (dir.join("same.img"), dir.join("other.img"));
    make_image(&same, 4 << 20);
    make_image(&other, 8 << 20);
    let mut dev = Block::new(BlockOptions::new(&same)).unwrap();
    VirtioDevice::<GuestMemoryMmap>::restore(&mut dev, &saved).unwrap();
    drop(dev);
    let mut dev = Block::new(BlockOptions::new(&other)).unwrap();
    let err = VirtioDevice::<GuestMemoryMmap>::restore(&mut dev, &saved).unwrap_err();
    assert!(err.to_string().contains("not the same image"), "{err}");
    let ro = BlockOptions {
        readonly: true,
        ..BlockOptions::new(&same)
    };
    let mut dev = Block::new(ro.clone()).unwrap();
    let err = VirtioDevice::<GuestMemoryMmap>::restore(&mut dev, &saved).unwrap_err();
    assert!(
        err.to_string()
            .contains("the saved disk was writable, this one is read-only"),
        "{err}"
    );
    // Even when the driver acked none of the features a read-only disk withdraws.
    let mut state: BlockState = saved.parse("virtio-blk", STATE_VERSION).unwrap();
    state.acked_features &= VirtioDevice::<GuestMemoryMmap>::features(&dev);
    let narrow = DeviceState::new(STATE_VERSION, &state).unwrap();
    assert!(VirtioDevice::<GuestMemoryMmap>::restore(&mut dev, &narrow).is_err());
    drop(dev);
    // And the other way round.
    let dev = Block::new(ro).unwrap();
    let saved_ro = VirtioDevice::<GuestMemoryMmap>::save(&dev).unwrap();
    drop(dev);
    let mut dev = Block::new(BlockOptions::new(&same)).unwrap();
    let err = VirtioDevice::<GuestMemoryMmap>::restore(&mut dev, &saved_ro).unwrap_err();
    assert!(err.to_string().contains("was read-only"), "{err}");
}

fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

#[test]
fn each_queue_has_its_own_thread() {
    let mut rig = Rig::new("blk-mq", 8 << 20, |o| o.queues = 4);
    // Threads name themselves once running.
    let wanted: Vec<String> = (0..4).map(|q| format!("virtio-blk-q{q}")).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let names = thread_names();
        if wanted.iter().all(|w| names.contains(w)) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{names:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut expected = Vec::new();
    for q in 0..4usize {
        let data = pattern(4096, q as u8);
        let header = rig.header(VIRTIO_BLK_T_OUT, q as u64 * 8);
        let (buf, status) = (rig.driver.alloc(4096), rig.driver.alloc(1));
        rig.driver.write(buf, &data);
        rig.driver.add_chain(
            q,
            &[Buf::r(header, 16), Buf::r(buf, 4096), Buf::w(status, 1)],
        );
        expected.push((status, data));
    }
    for q in 0..4 {
        rig.driver.kick(q);
    }
    for (q, (status, _)) in expected.iter().enumerate() {
        assert_eq!(rig.driver.wait_used(q, 1)[0].1, 1);
        assert_eq!(rig.driver.read(*status, 1), [OK]);
        rig.driver.interrupt.wait_count(q as u16, 1);
    }
    for (q, (_, data)) in expected.iter().enumerate() {
        assert_eq!(&rig.read(q as u64 * 8, 4096), data);
    }
    let queues = VirtioDevice::<GuestMemoryMmap>::reset(&mut rig.dev);
    assert_eq!(queues.len(), 4);
    assert!(queues.iter().all(|q| q.queue.next_used() >= 1));
}

#[test]
fn requests_published_while_the_device_works_are_all_served() {
    let mut rig = Rig::new("blk-race", 4 << 20, |_| {});
    let data = pattern(4 << 20, 31);
    rig.write(0, &data);
    let (buf, status) = (rig.driver.alloc(4096), rig.driver.alloc(1));
    // 80 chains of 3 descriptors fill most of the 256-entry table.
    let headers: Vec<_> = (0..80u64)
        .map(|i| rig.header(VIRTIO_BLK_T_IN, i * 8))
        .collect();
    // Rounds of chains, each kicked as it is published, racing the worker's re-enabling of
    // notifications; the ring indices wrap many times.
    for _ in 0..50 {
        for &header in &headers {
            rig.driver.add_chain(
                0,
                &[Buf::r(header, 16), Buf::w(buf, 4096), Buf::w(status, 1)],
            );
            rig.driver.kick(0);
        }
        let used = rig.driver.wait_used(0, 80);
        let bad: Vec<_> = used.iter().filter(|u| u.1 != 4097).collect();
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(rig.driver.read(status, 1), [OK]);
    }
}

#[test]
fn writethrough_without_flush_feature() {
    let acked = !(1u64 << VIRTIO_BLK_F_FLUSH);
    let mut rig = Rig::with_features("blk-wt", 1 << 20, |_| {}, acked);
    let data = pattern(4096, 11);
    rig.write(0, &data);
    assert_eq!(rig.file_bytes(0, 4096), data);
    assert_eq!(rig.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(0, 8, 0)]), OK);
    assert_eq!(rig.read(0, 4096), vec![0; 4096]);
}

#[test]
fn event_idx_suppresses_interrupts_the_driver_did_not_ask_for() {
    let mut rig = Rig::new("blk-evidx", 1 << 20, |_| {});
    let irq = rig.driver.interrupt.clone();
    rig.flush();
    irq.wait_count(0, 1);
    // "Interrupt me when used index 10 is passed": completions 2..=10 stay silent.
    rig.driver.set_used_event(0, 10);
    for _ in 2..=10 {
        rig.flush();
    }
    assert_eq!(irq.settled_count(0), 1);
    rig.flush();
    irq.wait_count(0, 2);
    assert_eq!(irq.settled_count(0), 2);

    // Without EVENT_IDX every completion interrupts.
    let acked = !(1u64 << 29);
    let mut rig = Rig::with_features("blk-noevidx", 1 << 20, |_| {}, acked);
    rig.driver.set_used_event(0, 10);
    for _ in 0..3 {
        rig.flush();
    }
    assert_eq!(rig.driver.interrupt.settled_count(0), 3);
}

#[test]
fn cache_none_uses_direct_io_with_bounce_for_unaligned_buffers() {
    let mut rig = Rig::new("blk-direct", 4 << 20, |o| o.cache = CacheMode::None);
    let data = pattern(8192, 21);
    // Aligned guest buffers (page-aligned allocations) go straight through.
    rig.write(8, &data);
    assert_eq!(rig.read(8, 8192), data);
    // Unaligned: buffers at odd addresses and of odd sizes.
    let header = rig.header(VIRTIO_BLK_T_OUT, 64);
    let base = rig.driver.alloc(8192 + 8);
    rig.driver.write(GuestAddress(base.0 + 3), &data);
    let status = rig.driver.alloc(1);
    let descs = [
        (header.0, 16, 0),
        (base.0 + 3, 1001, 0),
        (base.0 + 1004, 7191, 0),
        (status.0, 1, W),
    ];
    rig.submit_raw(0, &descs);
    assert_eq!(rig.driver.read(status, 1), [OK]);
    assert_eq!(rig.file_bytes(64 * 512, 8192), data);
    let header = rig.header(VIRTIO_BLK_T_IN, 64);
    let out = rig.driver.alloc(8192 + 8);
    let descs = [
        (header.0, 16, 0),
        (out.0 + 5, 3000, W),
        (out.0 + 3005, 5192, W),
        (status.0, 1, W),
    ];
    assert_eq!(rig.submit_raw(0, &descs).1, 8193);
    assert_eq!(rig.driver.read(GuestAddress(out.0 + 5), 8192), data);
    assert_eq!(rig.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(64, 16, 0)]), OK);
    assert_eq!(rig.read(64, 8192), vec![0; 8192]);
}

#[test]
fn cache_none_refused_by_the_file_system_is_a_clear_error() {
    // tmpfs has no O_DIRECT; skip where /dev/shm is not tmpfs.
    let path = Path::new("/dev/shm").join(format!("ferrovm-blk-direct-{}", std::process::id()));
    if std::fs::write(&path, vec![0; 4096]).is_err() {
        return;
    }
    let mut options = BlockOptions::new(&path);
    options.cache = CacheMode::None;
    let result = Block::new(options);
    let _ = std::fs::remove_file(&path);
    if let Err(err) = result {
        assert_eq!(err.kind, ImageErrorKind::DirectIo, "{err}");
        assert!(err.to_string().contains("cache=writeback"), "{err}");
    }
}

const CHILD_ENV: &str = "FERROVM_BLK_DURABILITY_IMAGE";
const CHILD_MARK: &str = "FLUSHED-AND-WAITING";

/// Runs only as the child of `flushed_writes_survive_a_killed_process`: writes and flushes
/// through the device, says so, and waits to be killed.
#[test]
fn durability_child_helper() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut dev = Block::new(BlockOptions::new(&path)).unwrap();
    let mut driver = TestDriver::new(&[QUEUE_SIZE]);
    let features = VirtioDevice::<GuestMemoryMmap>::features(&dev);
    dev.activate(
        driver.mem.clone(),
        features,
        driver.active_queues(),
        driver.interrupt(),
    )
    .unwrap();
    let data = pattern(64 << 10, 42);
    let (buf, status) = (driver.alloc(data.len() as u64), driver.alloc(1));
    driver.write(buf, &data);
    for (i, request_type) in [VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_FLUSH]
        .into_iter()
        .enumerate()
    {
        let header = driver.alloc(16);
        let mut raw = [0u8; 16];
        raw[..4].copy_from_slice(&request_type.to_le_bytes());
        raw[8..].copy_from_slice(&100u64.to_le_bytes());
        driver.write(header, &raw);
        let mut bufs = vec![Buf::r(header, 16)];
        if i == 0 {
            bufs.push(Buf::r(buf, data.len() as u32));
        }
        bufs.push(Buf::w(status, 1));
        driver.add_chain(0, &bufs);
        driver.kick(0);
        driver.wait_used(0, 1);
        assert_eq!(driver.read(status, 1), [OK]);
    }
    println!("{CHILD_MARK}");
    std::thread::sleep(Duration::from_secs(60));
    panic!("not killed");
}

#[test]
fn flushed_writes_survive_a_killed_process() {
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    let dir = TempDir::new("blk-durable");
    let path = dir.join("disk.img");
    make_image(&path, 1 << 20);
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "block::tests::durability_child_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains(CHILD_MARK) {
                let _ = tx.send(());
            }
        }
    });
    let flushed = rx.recv_timeout(Duration::from_secs(30));
    child.kill().unwrap();
    let status = child.wait().unwrap();
    flushed.expect("the child never reported its flush");
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    let image = std::fs::read(&path).unwrap();
    assert_eq!(
        &image[100 * 512..100 * 512 + (64 << 10)],
        pattern(64 << 10, 42).as_slice()
    );
}

/// A loop device over a file, detached when dropped.
struct LoopDevice(PathBuf);

impl LoopDevice {
    /// None where loop devices cannot be set up (not root, no losetup, in a sandbox).
    fn attach(backing: &Path) -> Option<LoopDevice> {
        let out = std::process::Command::new("losetup")
            .args(["-f", "--show"])
            .arg(backing)
            .output()
            .ok()?;
        let dev = String::from_utf8(out.stdout).ok()?.trim().to_string();
        (out.status.success() && !dev.is_empty()).then(|| LoopDevice(dev.into()))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .arg("-d")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn block_device_images_discard_and_zero_with_ioctls() {
    let dir = TempDir::new("blk-loopdev");
    let backing = dir.join("backing.img");
    std::fs::write(&backing, pattern(8 << 20, 13)).unwrap();
    let Some(loopdev) = LoopDevice::attach(&backing) else {
        eprintln!("no loop device available: block device path not exercised");
        return;
    };
    for cache in [CacheMode::Writeback, CacheMode::None] {
        let mut options = BlockOptions::new(&loopdev.0);
        options.cache = cache;
        let mut dev = Block::new(options).unwrap();
        assert_eq!(dev.image.kind(), ImageKind::BlockDevice);
        assert_eq!(dev.capacity_sectors(), 8 << 11);
        let driver = TestDriver::new(&[QUEUE_SIZE]);
        let features = VirtioDevice::<GuestMemoryMmap>::features(&dev);
        dev.activate(
            driver.mem.clone(),
            features,
            driver.active_queues(),
            driver.interrupt(),
        )
        .unwrap();
        let mut rig = Rig {
            driver,
            dev,
            _dir: TempDir::new(&format!("blk-loopdev-{cache}")),
            path: loopdev.0.clone(),
        };
        // (Sector 3 is where `assert_usable` writes.)
        assert!(
            rig.read(0, 1024) == pattern(8 << 20, 13)[..1024],
            "read on {cache}"
        );
        rig.assert_usable();
        assert_eq!(rig.ranges(VIRTIO_BLK_T_DISCARD, &[(2048, 2048, 0)]), OK);
        assert!(
            rig.read(2048, 1 << 20).iter().all(|&b| b == 0),
            "discard on {cache}"
        );
        assert_eq!(rig.ranges(VIRTIO_BLK_T_WRITE_ZEROES, &[(4096, 16, 0)]), OK);
        assert!(
            rig.read(4096, 8192).iter().all(|&b| b == 0),
            "zeroes on {cache}"
        );
        rig.flush();
    }
    // The loop device forwards discards to its file as holes.
    let mut discarded = vec![0u8; 1 << 20];
    std::fs::File::open(&backing)
        .unwrap()
        .read_exact_at(&mut discarded, 1 << 20)
        .unwrap();
    assert!(discarded.iter().all(|&b| b == 0));
}

/// Not a test but a measurement (`cargo test -p virtio --release -- --ignored --nocapture
/// blk_throughput`): 4 KiB reads from the page cache at depth 32 per queue, through real
/// split queues, on 1 and on 4 queues.
#[test]
#[ignore]
fn blk_throughput() {
    for queues in [1u16, 4] {
        let mut rig = Rig::new("blk-bench", 64 << 20, |o| o.queues = queues);
        let depth = 32u16;
        let rounds = 400;
        let mut chains = Vec::new();
        for q in 0..usize::from(queues) {
            for i in 0..depth {
                let header = rig.header(VIRTIO_BLK_T_IN, (u64::from(i) * 8 * 997) % (64 << 11));
                let (buf, status) = (rig.driver.alloc(4096), rig.driver.alloc(1));
                chains.push((
                    q,
                    [Buf::r(header, 16), Buf::w(buf, 4096), Buf::w(status, 1)],
                ));
            }
        }
        let start = std::time::Instant::now();
        for _ in 0..rounds {
            for (q, bufs) in &chains {
                rig.driver.add_chain(*q, bufs);
            }
            for q in 0..usize::from(queues) {
                rig.driver.kick(q);
            }
            for q in 0..usize::from(queues) {
                rig.driver.wait_used(q, depth);
            }
        }
        let total = f64::from(rounds) * f64::from(depth) * f64::from(queues);
        let secs = start.elapsed().as_secs_f64();
        eprintln!("{queues} queue(s): {:.0} 4 KiB reads/s", total / secs);
    }
}
