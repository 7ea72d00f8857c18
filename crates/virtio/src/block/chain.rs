//! A descriptor chain seen as two byte streams: what the device reads (header, data to
//! write) and what it writes (data read, status byte), whatever way the driver cut them into
//! descriptors.

use std::ops::Deref;

use virtio_queue::DescriptorChain;
use vm_memory::bitmap::BS;
use vm_memory::{
    Address, Bytes, GuestAddress, GuestMemory, GuestMemoryError, Permissions, VolatileSlice,
};

/// Descriptors a request may have before it is refused (more than a 256-entry queue's
/// seg_max + 2 can need, even through an indirect table).
pub const MAX_CHAIN_DESCRIPTORS: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Segment {
    addr: GuestAddress,
    len: u64,
}

/// Bytes spread over guest memory, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Span {
    segments: Vec<Segment>,
    len: u64,
}

impl Span {
    fn push(&mut self, addr: GuestAddress, len: u64) {
        if len > 0 {
            self.segments.push(Segment { addr, len });
            self.len += len;
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first `n` bytes and the rest; None if the span is shorter.
    pub fn split_front(&self, n: u64) -> Option<(Span, Span)> {
        if n > self.len {
            return None;
        }
        let (mut front, mut back) = (Span::default(), Span::default());
        let mut left = n;
        for seg in &self.segments {
            let take = left.min(seg.len);
            front.push(seg.addr, take);
            left -= take;
            if take < seg.len {
                // The guest chose the address; a range that wraps stays invalid when used.
                back.push(seg.addr.unchecked_add(take), seg.len - take);
            }
        }
        Some((front, back))
    }

    /// Everything but the last `n` bytes, and the last `n` bytes.
    pub fn split_back(&self, n: u64) -> Option<(Span, Span)> {
        self.split_front(self.len.checked_sub(n)?)
    }

    /// The address of the first byte.
    pub fn start(&self) -> Option<GuestAddress> {
        self.segments.first().map(|s| s.addr)
    }

    /// Host views of the span; fails if any byte is outside guest RAM.
    pub fn slices<'m, M: GuestMemory + ?Sized>(
        &self,
        mem: &'m M,
        access: Permissions,
    ) -> Result<Vec<VolatileSlice<'m, BS<'m, M::Bitmap>>>, GuestMemoryError> {
        let mut out = Vec::with_capacity(self.segments.len());
        for seg in &self.segments {
            let len =
                usize::try_from(seg.len).map_err(|_| GuestMemoryError::GuestAddressOverflow)?;
            for slice in mem.get_slices(seg.addr, len, access)? {
                out.push(slice?);
            }
        }
        Ok(out)
    }

    /// Reads the whole span into `buf` (which must be as long).
    pub fn read_exact<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        buf: &mut [u8],
    ) -> Result<(), GuestMemoryError> {
        if buf.len() as u64 != self.len {
            return Err(GuestMemoryError::PartialBuffer {
                expected: self.len as usize,
                completed: buf.len(),
            });
        }
        let mut at = 0;
        for seg in &self.segments {
            let end = at + seg.len as usize;
            mem.read_slice(&mut buf[at..end], seg.addr)?;
            at = end;
        }
        Ok(())
    }

    /// Writes `data` (as long as the span) into it.
    pub fn write_exact<M: GuestMemory + ?Sized>(
        &self,
        mem: &M,
        data: &[u8],
    ) -> Result<(), GuestMemoryError> {
        if data.len() as u64 != self.len {
            return Err(GuestMemoryError::PartialBuffer {
                expected: self.len as usize,
                completed: data.len(),
            });
        }
        let mut at = 0;
        for seg in &self.segments {
            let end = at + seg.len as usize;
            mem.write_slice(&data[at..end], seg.addr)?;
            at = end;
        }
        Ok(())
    }
}

/// A chain's buffers, sorted by direction.
#[derive(Debug, Default)]
pub struct ChainLayout {
    pub readable: Span,
    pub writable: Span,
    /// A device-readable buffer came after a device-writable one (the spec forbids it).
    pub misordered: bool,
    /// More than [`MAX_CHAIN_DESCRIPTORS`] descriptors: not even the status byte is known.
    pub too_long: bool,
    /// A buffer runs past the end of the address space, so its last byte (perhaps the status
    /// byte) would wrap to a low address that is not part of it.
    pub wraps: bool,
}

impl ChainLayout {
    /// Walks the chain. virtio-queue bounds the walk (a loop ends after a queue's or an
    /// indirect table's worth of descriptors) and ends it at a bad index or table; zero-length
    /// descriptors carry no bytes and are skipped. The walk stops at a buffer that wraps
    /// around the address space, so every segment of the spans ends at or below `u64::MAX`.
    pub fn parse<T>(chain: DescriptorChain<T>) -> ChainLayout
    where
        T: Deref,
        T::Target: GuestMemory,
    {
        let mut layout = ChainLayout::default();
        for (count, desc) in chain.enumerate() {
            if count == MAX_CHAIN_DESCRIPTORS {
                layout.too_long = true;
                break;
            }
            let len = u64::from(desc.len());
            if desc.addr().checked_add(len).is_none() {
                layout.wraps = true;
                break;
            }
            if desc.is_write_only() {
                layout.writable.push(desc.addr(), len);
            } else {
                if !layout.writable.is_empty() && len > 0 {
                    layout.misordered = true;
                }
                layout.readable.push(desc.addr(), len);
            }
        }
        layout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(parts: &[(u64, u64)]) -> Span {
        let mut s = Span::default();
        for &(a, l) in parts {
            s.push(GuestAddress(a), l);
        }
        s
    }

    #[test]
    fn splits_across_segments() {
        let s = span(&[(0x1000, 10), (0x2000, 0), (0x3000, 6)]);
        assert_eq!(s.len(), 16);
        let (front, back) = s.split_front(12).unwrap();
        assert_eq!(front, span(&[(0x1000, 10), (0x3000, 2)]));
        assert_eq!(back, span(&[(0x3002, 4)]));
        let (rest, last) = s.split_back(1).unwrap();
        assert_eq!(rest.len(), 15);
        assert_eq!(last, span(&[(0x3005, 1)]));
        assert!(s.split_front(17).is_none());
        assert!(s.split_back(17).is_none());
        assert_eq!(Span::default().split_back(0).unwrap().0.len(), 0);
    }
}
