//! A qcow2 file made of fuzz input, opened as a disk: ferrovm's header checks, then imago's
//! walk of the L1, L2 and refcount tables as it opens the file, reads at the start, middle
//! and end of the disk, and (writable) one write and a flush. Whatever the bytes, this ends
//! in an error or in data, never in a panic or a hang.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

use virtio::block::{parse_header, BlockOptions, Bounce, DiskImage, ImageFormat};
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryMmap, Permissions};

use super::image_dir;

/// Bytes moved by each read or write.
const CHUNK: usize = 64 << 10;

pub fn run(data: &[u8]) {
    let _ = parse_header(data, data.len() as u64);
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = image_dir().join(format!("ferrovm-qfuzz-{}-{n}.qcow2", std::process::id()));
    std::fs::write(&path, data).expect("writing the harness's image");
    for readonly in [true, false] {
        exercise(&path, readonly);
    }
    let _ = std::fs::remove_file(&path);
}

fn exercise(path: &Path, readonly: bool) {
    let mut options = BlockOptions::new(path);
    options.readonly = readonly;
    options.image.format = ImageFormat::Qcow2;
    let Ok(image) = DiskImage::open(&options) else {
        return;
    };
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), CHUNK)]).unwrap();
    let slices: Vec<_> = mem
        .get_slices(GuestAddress(0), CHUNK, Permissions::Write)
        .unwrap()
        .map(|s| s.unwrap())
        .collect();
    let size = image.sectors() * 512;
    let mut bounce = Bounce::default();
    for offset in [0, size / 2, size.saturating_sub(CHUNK as u64)] {
        let offset = offset - offset % 512;
        if offset + CHUNK as u64 <= size {
            let _ = image.read_into(offset, &slices, &mut bounce);
        }
    }
    if !readonly && size >= CHUNK as u64 {
        let _ = image.write_from(size / 2 - (size / 2) % 512, &slices, &mut bounce);
        let _ = image.discard(0, 512);
        let _ = image.flush();
    }
}
