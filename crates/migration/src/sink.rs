//! The sending side's output path: frames are gathered into an I/O vector (small headers in
//! an arena, page data as pointers into the guest mapping) and written with
//! `write_vectored`, through an optional token-bucket bandwidth limit.

use std::io::{self, IoSlice, Write};
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Flush a batch once it holds this many I/O vector entries (Linux's IOV_MAX is 1024).
const MAX_SEGS: usize = 512;
/// Flush a batch once it holds this many bytes.
const MAX_BATCH_BYTES: usize = 8 << 20;

/// Token bucket: `rate` bytes per second, bursts of at most `burst` bytes.
#[derive(Debug)]
pub(crate) struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(rate: u64) -> Self {
        let rate = rate.max(1) as f64;
        // 20 ms worth of bytes per burst, at least one page, at most 16 MiB.
        let burst = (rate / 50.0).clamp(4096.0, 16.0 * 1048576.0);
        TokenBucket {
            rate,
            burst,
            tokens: 0.0,
            last: Instant::now(),
        }
    }

    fn refill(&mut self) {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
    }

    /// Waits until some bytes may be sent; returns how many (1..=want).
    pub fn acquire(&mut self, want: usize) -> usize {
        let want = want.max(1);
        let chunk = (want as f64).min(self.burst);
        self.refill();
        if self.tokens < chunk {
            let wait = (chunk - self.tokens) / self.rate;
            std::thread::sleep(Duration::from_secs_f64(wait));
            self.refill();
        }
        let grant = (self.tokens.floor() as usize).clamp(1, want);
        self.tokens -= grant as f64;
        grant
    }

    /// Gives back tokens that were granted but not used.
    pub fn refund(&mut self, n: usize) {
        self.tokens = (self.tokens + n as f64).min(self.burst);
    }
}

/// A writer with byte counting, the bandwidth limit and a "broken" flag (set once a write
/// failed: the stream may then end inside a frame, so nothing more is written to it).
pub(crate) struct Out<W: Write> {
    pub inner: W,
    pub limiter: Option<TokenBucket>,
    pub bytes: u64,
    pub broken: bool,
    /// Time spent in writes (stage timing).
    pub write_time: Duration,
}

impl<W: Write> Out<W> {
    pub fn new(inner: W, max_bandwidth: Option<u64>) -> Self {
        Out {
            inner,
            limiter: max_bandwidth.map(TokenBucket::new),
            bytes: 0,
            broken: false,
            write_time: Duration::ZERO,
        }
    }

    /// Writes every byte of `bufs`, handling short writes, EINTR and the bandwidth limit.
    pub fn write_all_vectored(&mut self, bufs: &mut [IoSlice<'_>]) -> Result<()> {
        let t = Instant::now();
        let res = self.write_all_vectored_untimed(bufs);
        self.write_time += t.elapsed();
        res
    }

    fn write_all_vectored_untimed(&mut self, mut bufs: &mut [IoSlice<'_>]) -> Result<()> {
        if self.broken {
            return Err(Error::io(
                "writing the migration stream",
                io::Error::other("an earlier write failed"),
            ));
        }
        IoSlice::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            let total: usize = bufs.iter().map(|b| b.len()).sum();
            let allowed = match &mut self.limiter {
                Some(l) => l.acquire(total),
                None => total,
            };
            let res = if allowed < total {
                let mut part: Vec<IoSlice<'_>> = Vec::new();
                let mut left = allowed;
                for b in bufs.iter() {
                    if left == 0 {
                        break;
                    }
                    let n = b.len().min(left);
                    part.push(IoSlice::new(&b[..n]));
                    left -= n;
                }
                self.inner.write_vectored(&part)
            } else {
                self.inner.write_vectored(bufs)
            };
            match res {
                Ok(0) => {
                    self.broken = true;
                    return Err(Error::io(
                        "writing the migration stream",
                        io::Error::new(io::ErrorKind::WriteZero, "the peer accepts no more data"),
                    ));
                }
                Ok(n) => {
                    let n = n.min(allowed);
                    if let Some(l) = &mut self.limiter {
                        l.refund(allowed - n);
                    }
                    self.bytes += n as u64;
                    IoSlice::advance_slices(&mut bufs, n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    if let Some(l) = &mut self.limiter {
                        l.refund(allowed);
                    }
                }
                Err(e) => {
                    self.broken = true;
                    return Err(Error::io("writing the migration stream", e));
                }
            }
        }
        Ok(())
    }

    pub fn flush(&mut self) -> Result<()> {
        if let Err(e) = self.inner.flush() {
            self.broken = true;
            return Err(Error::io("flushing the migration stream", e));
        }
        Ok(())
    }
}

enum Seg {
    Arena(Range<usize>),
    /// Bytes of guest memory, written straight from the mapping.
    Guest(*const u8, usize),
}

/// Frames waiting to be written: headers in `arena`, page data by reference.
///
/// Invariant: every `Seg::Guest` points into guest memory that stays mapped until the batch
/// is flushed or cleared; the only producers are the page senders, which flush before their
/// borrow of the RAM ends.
pub(crate) struct Batch {
    arena: Vec<u8>,
    segs: Vec<Seg>,
    bytes: usize,
}

impl Batch {
    pub fn new() -> Self {
        Batch {
            arena: Vec::with_capacity(64 << 10),
            segs: Vec::with_capacity(MAX_SEGS + 2),
            bytes: 0,
        }
    }

    pub fn is_full(&self) -> bool {
        self.segs.len() >= MAX_SEGS || self.bytes >= MAX_BATCH_BYTES
    }

    /// Queues a copy of `bytes` (headers, trailers, small frames).
    pub fn push_bytes(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let start = self.arena.len();
        self.arena.extend_from_slice(bytes);
        let end = self.arena.len();
        self.bytes += bytes.len();
        if let Some(Seg::Arena(r)) = self.segs.last_mut() {
            if r.end == start {
                r.end = end;
                return;
            }
        }
        self.segs.push(Seg::Arena(start..end));
    }

    /// Queues `len` bytes of guest memory at `ptr`, by reference.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must stay mapped and readable until the batch is flushed or cleared.
    pub unsafe fn push_guest(&mut self, ptr: *const u8, len: usize) {
        if len == 0 {
            return;
        }
        self.bytes += len;
        if let Some(Seg::Guest(p, l)) = self.segs.last_mut() {
            if p.wrapping_add(*l) == ptr {
                *l += len;
                return;
            }
        }
        self.segs.push(Seg::Guest(ptr, len));
    }

    pub fn clear(&mut self) {
        self.arena.clear();
        self.segs.clear();
        self.bytes = 0;
    }

    /// Writes everything queued with as few `writev` calls as the writer allows.
    pub fn flush_to<W: Write>(&mut self, out: &mut Out<W>) -> Result<()> {
        if self.segs.is_empty() {
            return Ok(());
        }
        let arena = &self.arena;
        let mut iov: Vec<IoSlice<'_>> = self
            .segs
            .iter()
            .map(|s| match s {
                Seg::Arena(r) => IoSlice::new(&arena[r.clone()]),
                Seg::Guest(p, l) => {
                    // SAFETY: by the invariant of `push_guest`, `p..p+l` is mapped and
                    // readable until this flush returns. The slice is only handed to
                    // `write_vectored`; a vCPU may write the page concurrently during a live
                    // round, which can tear the bytes sent, and the per-page checksum lets
                    // the receiver detect that (the page is dirty and is sent again).
                    IoSlice::new(unsafe { std::slice::from_raw_parts(*p, *l) })
                }
            })
            .collect();
        let res = out.write_all_vectored(&mut iov);
        drop(iov);
        self.clear();
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that accepts at most 7 bytes per call and fails with EINTR every other call.
    struct Choppy {
        data: Vec<u8>,
        calls: usize,
    }

    impl Write for Choppy {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.calls += 1;
            if self.calls.is_multiple_of(2) {
                return Err(io::Error::from(io::ErrorKind::Interrupted));
            }
            let n = buf.len().min(7);
            self.data.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn short_writes_and_eintr() {
        let mut out = Out::new(
            Choppy {
                data: vec![],
                calls: 0,
            },
            None,
        );
        let mut batch = Batch::new();
        batch.push_bytes(b"hello ");
        let page = vec![7u8; 100];
        // SAFETY: `page` outlives the flush below.
        unsafe { batch.push_guest(page.as_ptr(), page.len()) };
        batch.push_bytes(b" world");
        batch.flush_to(&mut out).unwrap();
        let mut want = b"hello ".to_vec();
        want.extend_from_slice(&page);
        want.extend_from_slice(b" world");
        assert_eq!(out.inner.data, want);
        assert_eq!(out.bytes, want.len() as u64);
    }

    #[test]
    fn token_bucket_rate() {
        // 2 MiB at 16 MiB/s: about 125 ms.
        let mut out = Out::new(Vec::new(), Some(16 << 20));
        let data = vec![1u8; 2 << 20];
        let t = Instant::now();
        for chunk in data.chunks(256 << 10) {
            out.write_all_vectored(&mut [IoSlice::new(chunk)]).unwrap();
        }
        let el = t.elapsed().as_secs_f64();
        assert_eq!(out.inner.len(), 2 << 20);
        assert!(el >= 0.125 * 0.9, "too fast: {el}");
        assert!(el < 0.125 * 4.0, "too slow: {el}");
    }
}
