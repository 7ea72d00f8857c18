//! The third-party-driver test guest: the `virtio-drivers` crate's PCI transport,
//! `VirtIOBlk` and `VirtIORng`, running in ring 3 on top of the C guest kit.
//!
//! `vd-blk.c` finds the ECAM base (ACPI MCFG) and calls [`vd_blk_main`] at CPL 3. The
//! crate enumerates bus 0 itself through its `PciRoot` over `MmioCam` (`Cam::Ecam`),
//! then: virtio-blk write / FLUSH / read back / compare and GET_ID, virtio-rng reads
//! that must differ. Memory is identity-mapped (physical == virtual); DMA pages come
//! from the kit's bump pool and are never freed.
#![no_std]

mod kit;
mod vsock;
mod net;

use core::ffi::{c_char, CStr};
use core::fmt::Write;

use kit::{Console, KitHal};
use virtio_drivers::device::blk::{VirtIOBlk, SECTOR_SIZE};
use virtio_drivers::device::rng::VirtIORng;
use virtio_drivers::transport::pci::bus::{
    Cam, Command, ConfigurationAccess, DeviceFunction, MmioCam, PciRoot,
};
use virtio_drivers::transport::pci::{virtio_device_type, PciTransport};
use virtio_drivers::transport::DeviceType;
use virtio_drivers::Error;

/// A failure: a short reason for the guest's FAIL line (details are printed before).
type Outcome<T> = Result<T, &'static CStr>;

/// Most sectors one run writes and reads back.
const MAX_COUNT: u64 = 1024;
/// Bytes asked of the entropy device per read.
const RNG_BYTES: usize = 32;

/// Ring-3 entry, called by `vd-blk.c` with the ECAM base of bus 0. Returns NULL when
/// everything passed, else a NUL-terminated reason.
#[no_mangle]
pub extern "C" fn vd_blk_main(ecam_base: u64) -> *const c_char {
    kit::install_logger();
    match run(ecam_base) {
        Ok(()) => core::ptr::null(),
        Err(reason) => reason.as_ptr(),
    }
}

fn run(ecam_base: u64) -> Outcome<()> {
    // SAFETY: the kit identity-maps the first 4 GiB uncached-or-not, user-accessible; the
    // ECAM window (256 MiB for buses 0-255 as `Cam::Ecam` assumes, of which bus 0 is read)
    // lies there, and nothing else in this guest touches it while the root lives.
    let cam = unsafe { MmioCam::new(ecam_base as *mut u8, Cam::Ecam) };
    let mut root = PciRoot::new(cam);
    let (mut blk_fn, mut rng_fn) = (None, None);
    for (function, info) in root.enumerate_bus(0) {
        let kind = virtio_device_type(&info);
        outln!("vd-blk: pci {} {} {:?}", function, info, kind);
        match kind {
            Some(DeviceType::Block) if blk_fn.is_none() => blk_fn = Some(function),
            Some(DeviceType::EntropySource) if rng_fn.is_none() => rng_fn = Some(function),
            _ => {}
        }
    }
    let blk_fn = blk_fn.ok_or(c"no virtio-blk device on bus 0")?;
    block(&mut root, blk_fn)?;
    match rng_fn {
        Some(function) => entropy(&mut root, function)?,
        None => outln!("vd-blk: no virtio-rng device: rng skipped"),
    }
    Ok(())
}

/// Memory decode and bus mastering on, then the crate's PCI transport.
fn transport(
    root: &mut PciRoot<impl ConfigurationAccess>,
    function: DeviceFunction,
) -> Outcome<PciTransport> {
    let (_, command) = root.get_status_command(function);
    root.set_command(
        function,
        command | Command::MEMORY_SPACE | Command::BUS_MASTER,
    );
    PciTransport::new::<KitHal, _>(root, function).map_err(|e| {
        outln!("vd-blk: {}: PCI transport: {}", function, e);
        c"virtio-drivers PCI transport failed"
    })
}

fn block(root: &mut PciRoot<impl ConfigurationAccess>, function: DeviceFunction) -> Outcome<()> {
    let transport = transport(root, function)?;
    let mut blk = VirtIOBlk::<KitHal, _>::new(transport).map_err(|e| {
        outln!("vd-blk: VirtIOBlk::new: {}", e);
        c"VirtIOBlk::new failed"
    })?;
    let start = kit::cmdline_uint(c"start", 0);
    let count = kit::cmdline_uint(c"count", 64);
    outln!(
        "vd-blk: virtio-blk at {}: capacity {} sectors, {}, queue size {}",
        function,
        blk.capacity(),
        if blk.readonly() {
            "read-only"
        } else {
            "read-write"
        },
        blk.virt_queue_size()
    );
    if count == 0 || count > MAX_COUNT || start + count > blk.capacity() {
        outln!(
            "vd-blk: start={} count={} (1-{}) do not fit",
            start,
            count,
            MAX_COUNT
        );
        return Err(c"sector range does not fit the disk");
    }
    let bytes = (count as usize) * SECTOR_SIZE;
    let wbuf = kit::dma_buffer(bytes);
    let rbuf = kit::dma_buffer(bytes);
    if kit::cmdline_uint(c"ro", 0) != 0 {
        read_only(&mut blk, start, wbuf, rbuf)?;
    } else {
        write_read(&mut blk, start, wbuf, rbuf)?;
    }
    device_id(&mut blk)
}

type Blk = VirtIOBlk<KitHal, PciTransport>;

/// Chunk sizes in sectors, so requests of several sizes go out.
const CHUNKS: [usize; 5] = [1, 4, 8, 3, 16];

/// Transfers `buf` at `start` in requests of CHUNKS sectors (rotated by `phase`).
fn transfer(
    blk: &mut Blk,
    start: u64,
    buf: &mut [u8],
    write: bool,
    phase: usize,
) -> Outcome<usize> {
    let sectors = buf.len() / SECTOR_SIZE;
    let (mut done, mut requests) = (0, 0);
    while done < sectors {
        let n = CHUNKS[(requests + phase) % CHUNKS.len()].min(sectors - done);
        let piece = &mut buf[done * SECTOR_SIZE..(done + n) * SECTOR_SIZE];
        let block = (start as usize) + done;
        let r = if write {
            blk.write_blocks(block, piece)
        } else {
            blk.read_blocks(block, piece)
        };
        r.map_err(|e| {
            outln!(
                "vd-blk: {} of {} sectors at {}: {}",
                if write { "write" } else { "read" },
                n,
                block,
                e
            );
            if write {
                c"write failed"
            } else {
                c"read failed"
            }
        })?;
        done += n;
        requests += 1;
    }
    Ok(requests)
}

fn write_read(blk: &mut Blk, start: u64, wbuf: &mut [u8], rbuf: &mut [u8]) -> Outcome<()> {
    let mut seed = kit::rdtsc() | 1;
    for (i, chunk) in wbuf.chunks_exact_mut(8).enumerate() {
        let word = if i % (SECTOR_SIZE / 8) == 0 {
            start + (i / (SECTOR_SIZE / 8)) as u64 // each sector names itself
        } else {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    let written = transfer(blk, start, wbuf, true, 0)?;
    blk.flush().map_err(|e| {
        outln!("vd-blk: flush: {}", e);
        c"flush failed"
    })?;
    rbuf.fill(0xa5);
    let read = transfer(blk, start, rbuf, false, 2)?;
    if let Some(at) = wbuf.iter().zip(rbuf.iter()).position(|(w, r)| w != r) {
        outln!(
            "vd-blk: sector {} byte {}: read 0x{:02x}, wrote 0x{:02x}",
            start + (at / SECTOR_SIZE) as u64,
            at % SECTOR_SIZE,
            rbuf[at],
            wbuf[at]
        );
        return Err(c"data read back differs from what was written");
    }
    outln!(
        "vd-blk: wrote {} sectors at {} in {} requests, flushed, read back in {} requests: identical",
        wbuf.len() / SECTOR_SIZE,
        start,
        written,
        read
    );
    Ok(())
}

fn read_only(blk: &mut Blk, start: u64, before: &mut [u8], after: &mut [u8]) -> Outcome<()> {
    if !blk.readonly() {
        return Err(c"ro=1 but the device does not offer VIRTIO_BLK_F_RO");
    }
    transfer(blk, start, before, false, 0)?;
    let one = [0x5au8; SECTOR_SIZE];
    match blk.write_blocks(start as usize, &one) {
        Err(Error::IoError) => {}
        other => {
            outln!(
                "vd-blk: write to a read-only disk: {:?}, expected IoError",
                other
            );
            return Err(c"write to a read-only disk was not refused with IOERR");
        }
    }
    transfer(blk, start, after, false, 1)?;
    if before != after {
        return Err(c"read-only data changed after a refused write");
    }
    outln!("vd-blk: read-only: write refused with IOERR, data unchanged");
    Ok(())
}

fn device_id(blk: &mut Blk) -> Outcome<()> {
    let mut id = [0u8; 20];
    let len = blk.device_id(&mut id).map_err(|e| {
        outln!("vd-blk: GET_ID: {}", e);
        c"GET_ID failed"
    })?;
    let id = &id[..len];
    outln!(
        "vd-blk: GET_ID \"{}\"",
        core::str::from_utf8(id).unwrap_or("<not UTF-8>")
    );
    match kit::cmdline_arg(c"serial") {
        Some(want) if want.get(..want.len().min(20)) != Some(id) => {
            Err(c"GET_ID differs from serial= on the command line")
        }
        _ => Ok(()),
    }
}

fn entropy(root: &mut PciRoot<impl ConfigurationAccess>, function: DeviceFunction) -> Outcome<()> {
    let transport = transport(root, function)?;
    let mut rng = VirtIORng::<KitHal, _>::new(transport).map_err(|e| {
        outln!("vd-blk: VirtIORng::new: {}", e);
        c"VirtIORng::new failed"
    })?;
    let mut reads = [[0u8; RNG_BYTES]; 2];
    for (i, buf) in reads.iter_mut().enumerate() {
        let mut got = 0;
        for _ in 0..16 {
            if got == RNG_BYTES {
                break;
            }
            got += rng.request_entropy(&mut buf[got..]).map_err(|e| {
                outln!("vd-blk: rng read {}: {}", i, e);
                c"virtio-rng read failed"
            })?;
        }
        if got < RNG_BYTES {
            return Err(c"virtio-rng returned too few bytes");
        }
        if buf.iter().all(|&b| b == buf[0]) {
            return Err(c"virtio-rng read is one repeated byte");
        }
        outln!("vd-blk: rng read {}: {:02x?}", i, &buf[..8]);
    }
    if reads[0] == reads[1] {
        return Err(c"two virtio-rng reads are identical");
    }
    outln!(
        "vd-blk: virtio-rng: 2 reads of {} bytes, not constant, different",
        RNG_BYTES
    );
    Ok(())
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    let _ = writeln!(Console, "FAIL: virtio-drivers-blk: Rust panic: {}", info);
    kit::exit_vm(1)
}
