//! Recomputes the CRCs of a migration stream or snapshot file (layout in
//! `docs/migration.md`), written independently of the migration crate from the documented
//! format, so a mutated stream is refused for what the mutation broke, not for its checksum.

const MAGIC: &[u8; 8] = b"FERROVM\0";
const HEADER_LEN: usize = 20;
const FRAME_HEADER_LEN: usize = 8;
const KIND_PAGES: u8 = 2;
const PAGES_FIXED_LEN: usize = 16;
const PAGE_SIZE: usize = 4096;

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    let b = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn put_u32(data: &mut [u8], at: usize, v: u32) -> Option<()> {
    data.get_mut(at..at.checked_add(4)?)?
        .copy_from_slice(&v.to_le_bytes());
    Some(())
}

/// Fixes the stream header's CRC (when the magic is there) and every frame's CRC after it,
/// including the per-page CRC tables of `Pages` frames. Stops at the first frame that runs
/// past the end of `data`.
pub fn fix_stream_crcs(data: &mut [u8]) {
    if data.len() >= HEADER_LEN && data.starts_with(MAGIC) {
        let c = crc32fast::hash(&data[..16]);
        put_u32(data, 16, c);
    }
    fix_frame_crcs(data, HEADER_LEN);
}

/// Fixes the CRCs of the frames from byte `start` on (a reply channel starts at 0).
pub fn fix_frame_crcs(data: &mut [u8], start: usize) {
    let mut pos = start;
    while let Some(next) = fix_one(data, pos) {
        pos = next;
    }
}

/// Fixes the frame at `pos`; returns where the next one starts.
fn fix_one(data: &mut [u8], pos: usize) -> Option<usize> {
    let kind = *data.get(pos)?;
    let len = u32_at(data, pos + 4)? as usize;
    let payload = pos.checked_add(FRAME_HEADER_LEN)?;
    let trailer = payload.checked_add(len)?;
    if trailer.checked_add(4)? > data.len() {
        return None;
    }
    let covered_end = if kind == KIND_PAGES && len >= PAGES_FIXED_LEN {
        let count = u32_at(data, payload + 8)? as usize;
        let table = payload + PAGES_FIXED_LEN;
        let pages = table.checked_add(count.checked_mul(4)?)?;
        if pages > trailer {
            trailer
        } else {
            for i in 0..count {
                let page = pages + i * PAGE_SIZE;
                let Some(bytes) = data.get(page..page + PAGE_SIZE) else {
                    break;
                };
                let c = crc32fast::hash(bytes);
                put_u32(data, table + 4 * i, c);
            }
            pages
        }
    } else {
        trailer
    };
    let c = crc32fast::hash(&data[pos..covered_end]);
    put_u32(data, trailer, c);
    Some(trailer + 4)
}
