//! One virtio-blk request: parsed from its chain, checked, carried out on the image, and
//! completed with a status byte.

use std::sync::Arc;

use virtio_bindings::bindings::virtio_blk::{
    virtio_blk_discard_write_zeroes, virtio_blk_outhdr, VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR,
    VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestMemory, Permissions};
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, KnownLayout};

use super::chain::{ChainLayout, Span};
use super::image::{Bounce, DiskImage, SECTOR_SIZE};
use crate::worker::QueueHandler;

/// Most segments one DISCARD or WRITE_ZEROES request may carry (max_*_seg).
pub const MAX_RANGE_SEGMENTS: u32 = 32;
/// Most sectors one DISCARD or WRITE_ZEROES segment may cover (max_*_sectors): 2 GiB.
pub const MAX_RANGE_SECTORS: u32 = 1 << 22;

/// The request header (struct virtio_blk_outhdr), little-endian as virtio 1.x says.
#[derive(FromBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RequestHeader {
    request_type: U32,
    ioprio: U32,
    sector: U64,
}
const HEADER_LEN: usize = std::mem::size_of::<RequestHeader>();
const _: () = assert!(HEADER_LEN == std::mem::size_of::<virtio_blk_outhdr>());

/// One DISCARD or WRITE_ZEROES segment (struct virtio_blk_discard_write_zeroes).
#[derive(FromBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RangeSegment {
    sector: U64,
    num_sectors: U32,
    flags: U32,
}
const SEGMENT_LEN: usize = std::mem::size_of::<RangeSegment>();
const _: () = assert!(SEGMENT_LEN == std::mem::size_of::<virtio_blk_discard_write_zeroes>());

/// Why a request did not succeed: the status the driver gets, and a note for the log.
#[derive(Debug)]
struct Failure {
    status: u8,
    why: String,
}

fn ioerr(why: impl Into<String>) -> Failure {
    Failure {
        status: VIRTIO_BLK_S_IOERR as u8,
        why: why.into(),
    }
}

fn unsupported(why: impl Into<String>) -> Failure {
    Failure {
        status: VIRTIO_BLK_S_UNSUPP as u8,
        why: why.into(),
    }
}

/// A host I/O error: logged louder than a malformed request, as it is not the guest's doing.
fn host_error(what: &str, image: &DiskImage, e: std::io::Error) -> Failure {
    log::warn!("disk {}: {what} failed: {e}", image.path().display());
    ioerr(format!("{what}: {e}"))
}

/// Serves a block device's queue on a worker thread; one per queue.
pub struct BlockHandler {
    image: Arc<DiskImage>,
    /// VIRTIO_BLK_F_FLUSH negotiated; otherwise every write is synced before it completes.
    flush_negotiated: bool,
    serial: [u8; VIRTIO_BLK_ID_BYTES as usize],
    bounce: Bounce,
}

impl BlockHandler {
    pub fn new(image: Arc<DiskImage>, flush_negotiated: bool, serial: &str) -> BlockHandler {
        let mut id = [0; VIRTIO_BLK_ID_BYTES as usize];
        let n = serial.len().min(id.len());
        id[..n].copy_from_slice(&serial.as_bytes()[..n]);
        BlockHandler {
            image,
            flush_negotiated,
            serial: id,
            bounce: Bounce::default(),
        }
    }

    /// Carries out the request; returns the data bytes written to the guest.
    fn execute<M: GuestMemory>(
        &mut self,
        mem: &M,
        layout: &ChainLayout,
        data_in: &Span,
    ) -> Result<u32, Failure> {
        if layout.misordered {
            return Err(ioerr(
                "a device-readable buffer follows a device-writable one",
            ));
        }
        let (header_span, data_out) = layout
            .readable
            .split_front(HEADER_LEN as u64)
            .ok_or_else(|| ioerr("header shorter than 16 bytes"))?;
        let mut raw = [0u8; HEADER_LEN];
        header_span
            .read_exact(mem, &mut raw)
            .map_err(|e| ioerr(format!("header unreadable: {e}")))?;
        let header = RequestHeader::read_from_bytes(&raw).map_err(|_| ioerr("header size"))?;
        let sector = header.sector.get();
        match header.request_type.get() {
            VIRTIO_BLK_T_IN => self.read(mem, sector, &data_out, data_in),
            VIRTIO_BLK_T_OUT => self.write(mem, sector, &data_out, data_in),
            VIRTIO_BLK_T_FLUSH => self.flush(&data_out, data_in),
            VIRTIO_BLK_T_GET_ID => self.get_id(mem, &data_out, data_in),
            t @ (VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES) => {
                self.ranges(mem, t == VIRTIO_BLK_T_WRITE_ZEROES, &data_out, data_in)
            }
            other => Err(unsupported(format!("request type {other}"))),
        }
    }

    /// The byte offset of `sector`, checking that `len` bytes from there fit the image.
    fn byte_range(&self, sector: u64, len: u64) -> Result<u64, Failure> {
        if !len.is_multiple_of(SECTOR_SIZE) {
            return Err(ioerr(format!(
                "length {len} is not a whole number of sectors"
            )));
        }
        let offset = sector
            .checked_mul(SECTOR_SIZE)
            .filter(|o| {
                o.checked_add(len)
                    .is_some_and(|end| end <= self.image.sectors() * SECTOR_SIZE)
            })
            .ok_or_else(|| {
                ioerr(format!(
                    "sectors {sector}+{} beyond the disk's {}",
                    len / SECTOR_SIZE,
                    self.image.sectors()
                ))
            })?;
        Ok(offset)
    }

    fn read<M: GuestMemory>(
        &mut self,
        mem: &M,
        sector: u64,
        data_out: &Span,
        data_in: &Span,
    ) -> Result<u32, Failure> {
        if !data_out.is_empty() {
            return Err(ioerr("device-readable data buffer in a read"));
        }
        let len = u32::try_from(data_in.len()).map_err(|_| ioerr("read longer than 4 GiB"))?;
        let offset = self.byte_range(sector, data_in.len())?;
        let slices = data_in
            .slices(mem, Permissions::Write)
            .map_err(|e| ioerr(format!("read buffer: {e}")))?;
        self.image
            .read_into(offset, &slices, &mut self.bounce)
            .map_err(|e| host_error("read", &self.image, e))?;
        Ok(len)
    }

    fn write<M: GuestMemory>(
        &mut self,
        mem: &M,
        sector: u64,
        data_out: &Span,
        data_in: &Span,
    ) -> Result<u32, Failure> {
        if !data_in.is_empty() {
            return Err(ioerr("device-writable data buffer in a write"));
        }
        if self.image.readonly() {
            return Err(ioerr("write to a read-only disk"));
        }
        let offset = self.byte_range(sector, data_out.len())?;
        let slices = data_out
            .slices(mem, Permissions::Read)
            .map_err(|e| ioerr(format!("write buffer: {e}")))?;
        self.image
            .write_from(offset, &slices, &mut self.bounce)
            .map_err(|e| host_error("write", &self.image, e))?;
        self.sync_if_writethrough()?;
        Ok(0)
    }

    fn sync_if_writethrough(&self) -> Result<(), Failure> {
        if self.flush_negotiated {
            return Ok(());
        }
        self.image
            .flush()
            .map_err(|e| host_error("flush", &self.image, e))
    }

    fn flush(&mut self, data_out: &Span, data_in: &Span) -> Result<u32, Failure> {
        if !data_out.is_empty() || !data_in.is_empty() {
            return Err(ioerr("data buffers in a flush"));
        }
        self.image
            .flush()
            .map_err(|e| host_error("flush", &self.image, e))?;
        Ok(0)
    }

    fn get_id<M: GuestMemory>(
        &mut self,
        mem: &M,
        data_out: &Span,
        data_in: &Span,
    ) -> Result<u32, Failure> {
        if !data_out.is_empty() || data_in.is_empty() {
            return Err(ioerr("GET_ID needs one device-writable buffer"));
        }
        let n = data_in.len().min(self.serial.len() as u64);
        let (target, _) = data_in
            .split_front(n)
            .ok_or_else(|| ioerr("GET_ID buffer"))?;
        target
            .write_exact(mem, &self.serial[..n as usize])
            .map_err(|e| ioerr(format!("GET_ID buffer: {e}")))?;
        Ok(n as u32)
    }

    /// DISCARD (`zeroes` false) or WRITE_ZEROES.
    fn ranges<M: GuestMemory>(
        &mut self,
        mem: &M,
        zeroes: bool,
        data_out: &Span,
        data_in: &Span,
    ) -> Result<u32, Failure> {
        if !data_in.is_empty() {
            return Err(ioerr(
                "device-writable data buffer in a discard or write-zeroes",
            ));
        }
        if self.image.readonly() {
            return Err(ioerr("discard or write-zeroes on a read-only disk"));
        }
        let count = data_out.len() / SEGMENT_LEN as u64;
        if !data_out.len().is_multiple_of(SEGMENT_LEN as u64)
            || count == 0
            || count > u64::from(MAX_RANGE_SEGMENTS)
        {
            return Err(ioerr(format!("{} bytes of segments", data_out.len())));
        }
        let mut raw = vec![0u8; data_out.len() as usize];
        data_out
            .read_exact(mem, &mut raw)
            .map_err(|e| ioerr(format!("segments unreadable: {e}")))?;
        // Check every segment before touching the disk.
        let mut checked = Vec::with_capacity(count as usize);
        for chunk in raw.chunks_exact(SEGMENT_LEN) {
            let seg = RangeSegment::read_from_bytes(chunk).map_err(|_| ioerr("segment size"))?;
            checked.push(self.check_segment(&seg, zeroes)?);
        }
        for (offset, len, unmap) in checked {
            let result = if zeroes {
                self.image
                    .write_zeroes(offset, len, unmap, &mut self.bounce)
            } else {
                self.image.discard(offset, len)
            };
            let what = if zeroes { "write-zeroes" } else { "discard" };
            result.map_err(|e| host_error(what, &self.image, e))?;
        }
        self.sync_if_writethrough()?;
        Ok(0)
    }

    /// (offset, length, unmap) of a valid segment.
    fn check_segment(&self, seg: &RangeSegment, zeroes: bool) -> Result<(u64, u64, bool), Failure> {
        let flags = seg.flags.get();
        let known = if zeroes {
            VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
        } else {
            0
        };
        if flags & !known != 0 {
            return Err(unsupported(format!("segment flags {flags:#x}")));
        }
        let sectors = seg.num_sectors.get();
        if sectors > MAX_RANGE_SECTORS {
            return Err(ioerr(format!("segment of {sectors} sectors")));
        }
        let len = u64::from(sectors) * SECTOR_SIZE;
        let offset = self.byte_range(seg.sector.get(), len)?;
        Ok((offset, len, flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0))
    }
}

impl Drop for BlockHandler {
    /// The queue's thread ends (a reset, the VMM stopping): a qcow2 image writes back the
    /// metadata it caches, as QEMU does when it closes one, so a guest's unflushed writes are
    /// not dropped by a clean stop. Here, on the queue's own thread and its filter.
    fn drop(&mut self) {
        if let Err(e) = self.image.settle() {
            log::warn!(
                "disk {}: write-back at stop: {e}",
                self.image.path().display()
            );
        }
    }
}

impl<M: GuestMemory> QueueHandler<M> for BlockHandler {
    fn handle(&mut self, mem: &M, queue: u16, chain: DescriptorChain<&M>) -> u32 {
        let head = chain.head_index();
        let layout = ChainLayout::parse(chain);
        // The status byte is the last device-writable byte; without one, nothing can be
        // reported and the chain is only given back.
        let status_at = (!layout.too_long && !layout.wraps)
            .then(|| layout.writable.split_back(1))
            .flatten()
            .and_then(|(data_in, status)| Some((data_in, status.start()?)))
            .filter(|(_, addr)| mem.check_range(*addr, 1, Permissions::Write));
        let Some((data_in, status_addr)) = status_at else {
            log::debug!(
                "virtio-blk queue {queue}: chain {head} has no writable status byte; skipped"
            );
            return 0;
        };
        let (status, written) = match self.execute(mem, &layout, &data_in) {
            Ok(written) => (VIRTIO_BLK_S_OK as u8, written),
            Err(failure) => {
                log::debug!("virtio-blk queue {queue}: request {head}: {}", failure.why);
                (failure.status, 0)
            }
        };
        if mem.write_obj(status, status_addr).is_err() {
            return 0;
        }
        written.saturating_add(1)
    }
}
