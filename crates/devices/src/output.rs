//! Device output that never blocks the VMM.
//!
//! A guest console writes byte by byte from a vCPU thread, with the device locked. If that
//! thread wrote to stdout itself, a reader that stopped reading (`ferrovm run | less`, a full
//! pipe) would hold the vCPU in `write(2)`: no pause, no snapshot, no shutdown until the reader
//! went away. Here the device only appends to a bounded in-memory queue; a writer thread
//! drains it to the real output. When the queue is full, new bytes are dropped and counted
//! ([`OutputQueue::dropped`]), and the guest runs on.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes held for a slow reader before output is dropped.
pub const OUTPUT_QUEUE_BYTES: usize = 1 << 20;

#[derive(Default)]
struct Queue {
    bytes: VecDeque<u8>,
    /// The writer thread holds bytes taken from the queue that are not written yet.
    writing: bool,
    dropped: u64,
    closed: bool,
}

/// The bounded queue between a device and its writer thread.
pub struct OutputQueue {
    queue: Mutex<Queue>,
    cond: Condvar,
    capacity: usize,
}

fn lock(m: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl OutputQueue {
    /// Starts a thread named `name` that writes whatever is queued to `out`; returns the
    /// queue and the writer that feeds it.
    pub fn spawn(
        name: &str,
        out: Box<dyn Write + Send>,
        capacity: usize,
    ) -> io::Result<(Arc<Self>, QueuedWriter)> {
        let queue = Arc::new(OutputQueue {
            queue: Mutex::new(Queue::default()),
            cond: Condvar::new(),
            capacity,
        });
        let q = queue.clone();
        sandbox::spawn(sandbox::Role::DeviceIo, name, move || q.write_out(out))?;
        let writer = QueuedWriter {
            queue: queue.clone(),
        };
        Ok((queue, writer))
    }

    /// Bytes dropped so far because the queue was full.
    pub fn dropped(&self) -> u64 {
        lock(&self.queue).dropped
    }

    /// Waits up to `limit` for everything queued to be written; true if it was.
    pub fn drain(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut q = lock(&self.queue);
        while !q.bytes.is_empty() || q.writing {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            q = self
                .cond
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Queues what fits of `data`, drops and counts the rest.
    fn push(&self, data: &[u8]) {
        let mut q = lock(&self.queue);
        if q.closed {
            q.dropped += data.len() as u64;
            return;
        }
        let was_empty = q.bytes.is_empty();
        let room = self.capacity.saturating_sub(q.bytes.len());
        let take = data.len().min(room);
        q.bytes.extend(&data[..take]);
        q.dropped += (data.len() - take) as u64;
        if was_empty && take > 0 {
            self.cond.notify_all();
        }
    }

    /// The writer thread: takes everything queued, writes it without the lock held.
    fn write_out(&self, mut out: Box<dyn Write + Send>) {
        let mut failed = false;
        loop {
            let chunk: Vec<u8> = {
                let mut q = lock(&self.queue);
                q.writing = false;
                self.cond.notify_all();
                while q.bytes.is_empty() && !q.closed {
                    q = self.cond.wait(q).unwrap_or_else(|e| e.into_inner());
                }
                if q.bytes.is_empty() {
                    return;
                }
                q.writing = true;
                q.bytes.drain(..).collect()
            };
            if failed {
                continue;
            }
            if let Err(e) = out.write_all(&chunk).and_then(|()| out.flush()) {
                // A reader that went away: the guest runs on, its output is lost.
                log::warn!("guest output lost: {e}");
                failed = true;
            }
        }
    }
}

/// The device side of an [`OutputQueue`]: writes never block and never fail.
pub struct QueuedWriter {
    queue: Arc<OutputQueue>,
}

impl QueuedWriter {
    /// The queue this writer feeds.
    pub fn queue(&self) -> &Arc<OutputQueue> {
        &self.queue
    }
}

impl Write for QueuedWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.queue.push(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for QueuedWriter {
    /// The writer thread ends once the queue is empty.
    fn drop(&mut self) {
        lock(&self.queue.queue).closed = true;
        self.queue.cond.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_that_stops_reading_never_blocks_the_writer() {
        // A socket nobody reads: writes block once its buffer (a few hundred KiB) is full.
        let (reader, stalled) = std::os::unix::net::UnixStream::pair().unwrap();
        let (queue, mut writer) =
            OutputQueue::spawn("test-output", Box::new(stalled), 4096).unwrap();
        let started = Instant::now();
        let total = 8u32 << 20;
        // Far more than the socket and the queue hold, one byte at a time as a UART.
        for i in 0..total {
            writer.write_all(&[i as u8]).unwrap();
        }
        assert!(started.elapsed() < Duration::from_secs(20));
        assert!(!queue.drain(Duration::from_millis(50)));
        let dropped = queue.dropped();
        assert!(
            dropped > u64::from(total) / 2 && dropped < u64::from(total),
            "{dropped}"
        );
        drop(reader);
    }

    #[test]
    fn everything_arrives_when_the_reader_reads() {
        let path = std::env::temp_dir().join(format!("ferrovm-output-{}", std::process::id()));
        let file = std::fs::File::create(&path).unwrap();
        let (queue, mut writer) =
            OutputQueue::spawn("test-output", Box::new(file), 1 << 20).unwrap();
        for b in b"hello, queue\n" {
            writer.write_all(&[*b]).unwrap();
        }
        assert!(queue.drain(Duration::from_secs(5)));
        assert_eq!(queue.dropped(), 0);
        assert_eq!(std::fs::read(&path).unwrap(), b"hello, queue\n");
        std::fs::remove_file(&path).unwrap();
    }
}
