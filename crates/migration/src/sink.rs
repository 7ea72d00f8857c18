//! The sending side's output path: frames are gathered into an I/O vector (small headers in
//! an arena, page data as pointers into the guest mapping) and written with
//! `write_vectored`, through an optional token-bucket bandwidth limit. On Linux, a batch
//! with guest pages bound for a socket goes out without a copy instead: the pages are
//! spliced into the socket by reference (`crate::splice`).

use std::io::{self, IoSlice, Write};
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
#[cfg(target_os = "linux")]
use crate::splice::{unsupported, Piece, SplicePipe};
#[cfg(target_os = "linux")]
use std::os::fd::RawFd;

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
    /// Bytes of guest memory sent by reference (zero-copy), part of `bytes`.
    pub spliced: u64,
    #[cfg(target_os = "linux")]
    zero_copy: ZeroCopy,
}

/// Whether and how an [`Out`] sends guest pages without copying them.
#[cfg(target_os = "linux")]
enum ZeroCopy {
    Off,
    /// `inner` writes to this socket; the pipe is made at the first batch of pages.
    Socket(RawFd),
    Spliced(RawFd, SplicePipe),
}

impl<W: Write> Out<W> {
    pub fn new(inner: W, max_bandwidth: Option<u64>) -> Self {
        Out {
            inner,
            limiter: max_bandwidth.map(TokenBucket::new),
            bytes: 0,
            broken: false,
            write_time: Duration::ZERO,
            spliced: 0,
            #[cfg(target_os = "linux")]
            zero_copy: ZeroCopy::Off,
        }
    }

    /// Sends guest pages by reference into `socket`, the socket that `inner` writes to (its
    /// descriptor stays open while `inner` lives). Only without a bandwidth limit (the
    /// limiter paces `writev`); elsewhere than on Linux, nothing changes.
    pub fn zero_copy_into(&mut self, socket: Option<i32>) {
        #[cfg(target_os = "linux")]
        if let (Some(fd), None) = (socket, &self.limiter) {
            self.zero_copy = ZeroCopy::Socket(fd);
        }
        #[cfg(not(target_os = "linux"))]
        let _ = socket;
    }

    /// True if a batch with guest pages goes out spliced.
    #[cfg(target_os = "linux")]
    fn splices(&self) -> bool {
        !matches!(self.zero_copy, ZeroCopy::Off)
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

/// Where a spliced batch stopped because the socket or kernel cannot splice: the rest, from
/// this piece and byte within it, goes out with `writev`.
type Resume = Option<(usize, usize)>;

#[cfg(target_os = "linux")]
impl<W: Write> Out<W> {
    /// Sends `pieces` in order through the pipe into the socket. Returns where to resume with
    /// `writev` if splicing is not supported (zero-copy is then off for good).
    fn splice_pieces(&mut self, pieces: &[Piece<'_>]) -> Result<Resume> {
        if self.broken {
            return Err(Error::io(
                "writing the migration stream",
                io::Error::other("an earlier write failed"),
            ));
        }
        // Bytes buffered by `inner` (small batches) go before the spliced ones.
        self.flush()?;
        let (sock, mut pipe) = match std::mem::replace(&mut self.zero_copy, ZeroCopy::Off) {
            ZeroCopy::Spliced(sock, pipe) => (sock, pipe),
            ZeroCopy::Socket(sock) => match SplicePipe::new() {
                Ok(pipe) => (sock, pipe),
                Err(e) => {
                    log::debug!("migration: no pipe for zero-copy sending ({e}); using writev");
                    return Ok(Some((0, 0)));
                }
            },
            ZeroCopy::Off => return Ok(Some((0, 0))),
        };
        let mut references = 0u64;
        for (i, piece) in pieces.iter().enumerate() {
            let mut done = 0;
            while done < piece.len() {
                match pipe.put(&piece.from(done)) {
                    Ok(0) => {
                        if !self.drain(sock, &mut pipe, true)? {
                            return Ok(Some((i, done)));
                        }
                    }
                    Ok(n) => {
                        if matches!(piece, Piece::Reference(..)) {
                            references += n as u64;
                        }
                        done += n;
                    }
                    Err(e) if unsupported(&e) => {
                        log_fallback("vmsplice", &e);
                        self.drain(sock, &mut pipe, false)?;
                        return Ok(Some((i, done)));
                    }
                    Err(e) => return Err(self.failed(e)),
                }
            }
        }
        if self.drain(sock, &mut pipe, false)? {
            self.spliced += references;
            self.zero_copy = ZeroCopy::Spliced(sock, pipe);
        }
        Ok(None)
    }

    /// Moves everything in the pipe into the socket. If the socket refuses `splice`, reads
    /// the rest back and writes it instead, and returns false (zero-copy is then off).
    fn drain(&mut self, sock: RawFd, pipe: &mut SplicePipe, more: bool) -> Result<bool> {
        while pipe.queued() > 0 {
            match pipe.splice_into(sock, more) {
                Ok(n) => self.bytes += n as u64,
                Err(e) if unsupported(&e) => {
                    log_fallback("splice", &e);
                    self.copy_back(pipe)?;
                    return Ok(false);
                }
                Err(e) => return Err(self.failed(e)),
            }
        }
        Ok(true)
    }

    fn copy_back(&mut self, pipe: &mut SplicePipe) -> Result<()> {
        let mut buf = vec![0u8; 64 << 10];
        while pipe.queued() > 0 {
            let n = pipe.read_back(&mut buf).map_err(|e| self.failed(e))?;
            self.inner
                .write_all(&buf[..n])
                .map_err(|e| self.failed(e))?;
            self.bytes += n as u64;
        }
        self.flush()
    }

    fn failed(&mut self, e: io::Error) -> Error {
        self.broken = true;
        Error::io("writing the migration stream", e)
    }
}

/// Logs once per process that zero-copy sending fell back to `writev`.
#[cfg(target_os = "linux")]
fn log_fallback(call: &str, e: &io::Error) {
    static LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        log::debug!("migration: {call} into the socket failed ({e}); sending with writev");
    }
}

/// The socket a migration writer writes to, if it is one the engine can splice into: a
/// `TcpStream` or `UnixStream`, bare or in a `BufWriter` (what the VMM passes). The engine is
/// generic over `Write`; this looks at the concrete type. `FERROVM_MIGRATION_SPLICE=off`
/// turns zero-copy sending off (to measure what it saves).
pub(crate) fn socket_of<W: Write + 'static>(w: &W) -> Option<i32> {
    #[cfg(target_os = "linux")]
    {
        use std::any::Any;
        use std::io::BufWriter;
        use std::net::TcpStream;
        use std::os::fd::AsRawFd;
        use std::os::unix::net::UnixStream;
        static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let enabled = *ENABLED
            .get_or_init(|| std::env::var("FERROVM_MIGRATION_SPLICE").map_or(true, |v| v != "off"));
        let any = w as &dyn Any;
        let fd = if let Some(s) = any.downcast_ref::<TcpStream>() {
            s.as_raw_fd()
        } else if let Some(s) = any.downcast_ref::<BufWriter<TcpStream>>() {
            s.get_ref().as_raw_fd()
        } else if let Some(s) = any.downcast_ref::<UnixStream>() {
            s.as_raw_fd()
        } else if let Some(s) = any.downcast_ref::<BufWriter<UnixStream>>() {
            s.get_ref().as_raw_fd()
        } else {
            return None;
        };
        enabled.then_some(fd)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = w;
        None
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

    /// Bytes queued.
    pub fn len(&self) -> usize {
        self.bytes
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

    /// Writes everything queued: spliced into the socket when the writer is set up for it
    /// and the batch holds guest pages, else with as few `writev` calls as the writer allows.
    pub fn flush_to<W: Write>(&mut self, out: &mut Out<W>) -> Result<()> {
        if self.segs.is_empty() {
            return Ok(());
        }
        let res = match self.splice_to(out) {
            Ok(None) => Ok(()),
            Ok(Some(from)) => self.writev_from(out, from),
            Err(e) => Err(e),
        };
        self.clear();
        res
    }

    /// Splices the batch into the socket if the writer is set up for it and the batch holds
    /// guest pages; returns where `writev` must take over (all of it when not splicing).
    fn splice_to<W: Write>(&self, out: &mut Out<W>) -> Result<Resume> {
        #[cfg(target_os = "linux")]
        if out.splices() && self.segs.iter().any(|s| matches!(s, Seg::Guest(..))) {
            let t = Instant::now();
            let res = out.splice_pieces(&self.pieces());
            out.write_time += t.elapsed();
            return res;
        }
        #[cfg(not(target_os = "linux"))]
        let _ = out;
        Ok(Some((0, 0)))
    }

    /// The batch as pieces for the pipe: arena bytes to copy, guest memory by reference.
    #[cfg(target_os = "linux")]
    fn pieces(&self) -> Vec<Piece<'_>> {
        self.segs
            .iter()
            .map(|s| match s {
                Seg::Arena(r) => Piece::Copy(&self.arena[r.clone()]),
                // By the invariant of `push_guest`, the range stays mapped until the batch
                // is flushed or cleared, which is after the pieces are sent.
                Seg::Guest(p, l) => Piece::Reference(*p, *l),
            })
            .collect()
    }

    /// Writes the batch from segment `from.0`, byte `from.1` on, with `writev`.
    fn writev_from<W: Write>(&self, out: &mut Out<W>, from: (usize, usize)) -> Result<()> {
        let arena = &self.arena;
        let mut iov: Vec<IoSlice<'_>> = self.segs[from.0..]
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
        let mut rest: &mut [IoSlice<'_>] = &mut iov;
        IoSlice::advance_slices(&mut rest, from.1);
        out.write_all_vectored(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_os = "linux")]
    use std::io::Read;

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

    /// A descriptor that refuses `splice` (a file opened for appending: EINVAL): the bytes
    /// already in the pipe are read back and written, the rest goes through `writev`, and
    /// later batches use `writev` only.
    #[cfg(target_os = "linux")]
    #[test]
    fn zero_copy_falls_back_to_writev() {
        use std::os::fd::AsRawFd;
        let path = std::env::temp_dir().join(format!("zc-fallback-{}", std::process::id()));
        std::fs::write(&path, b"").unwrap();
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        let fd = file.as_raw_fd();
        let mut out = Out::new(file, None);
        out.zero_copy_into(Some(fd));
        let pages: Vec<u8> = (0..3 << 20).map(|i| (i % 251) as u8).collect();
        let mut want = Vec::new();
        for round in 0..2u8 {
            let mut batch = Batch::new();
            for chunk in pages.chunks(1 << 20) {
                batch.push_bytes(&[round; 40]);
                // SAFETY: `pages` outlives the flush below.
                unsafe { batch.push_guest(chunk.as_ptr(), chunk.len()) };
                batch.push_bytes(&[0xee; 8]);
                want.extend_from_slice(&[round; 40]);
                want.extend_from_slice(chunk);
                want.extend_from_slice(&[0xee; 8]);
            }
            batch.flush_to(&mut out).unwrap();
            assert!(!out.splices(), "zero-copy is off after the first refusal");
        }
        assert_eq!(out.spliced, 0);
        assert_eq!(out.bytes, want.len() as u64);
        let got = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(got == want, "the file holds the stream in order");
    }

    /// Over a socket pair, a batch of guest pages goes through the pipe by reference, in
    /// order with the headers around it, across several pipe fills.
    #[cfg(target_os = "linux")]
    #[test]
    fn zero_copy_into_a_socket_keeps_the_order() {
        use std::os::fd::AsRawFd;
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = a.as_raw_fd();
        let pages: Vec<u8> = (0..5 << 20).map(|i| (i % 253) as u8).collect();
        let mut want = Vec::new();
        for chunk in pages.chunks(1 << 20) {
            want.extend_from_slice(b"head");
            want.extend_from_slice(chunk);
            want.extend_from_slice(b"tail");
        }
        let expected = want.len();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; expected];
            b.read_exact(&mut got).unwrap();
            got
        });
        let mut out = Out::new(std::io::BufWriter::new(a), None);
        out.zero_copy_into(Some(fd));
        let mut batch = Batch::new();
        for chunk in pages.chunks(1 << 20) {
            batch.push_bytes(b"head");
            // SAFETY: `pages` outlives the flush below.
            unsafe { batch.push_guest(chunk.as_ptr(), chunk.len()) };
            batch.push_bytes(b"tail");
        }
        batch.flush_to(&mut out).unwrap();
        assert_eq!(out.spliced, pages.len() as u64);
        assert_eq!(out.bytes, want.len() as u64);
        assert!(reader.join().unwrap() == want);
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
