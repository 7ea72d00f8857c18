//! RARP announcements after a restore or an incoming migration, spaced in time.
//!
//! A switch that missed one frame (its port still coming up, a burst lost) learns from the
//! next. As QEMU's announce timer does (first round at once, then rounds 50 ms apart and
//! 100 ms further apart each time), the first frame goes out on the resuming thread and
//! the others from a short-lived thread of their own, so neither the device's I/O threads
//! nor the guest wait for the gaps. A pause, reset or drop of the device cancels what is
//! left.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::tap::Tap;

/// Gap before the first spaced frame; each later gap is [`GAP_STEP`] longer.
pub const FIRST_GAP: Duration = Duration::from_millis(50);
/// How much longer each gap is than the one before.
pub const GAP_STEP: Duration = Duration::from_millis(100);
/// How often the sending thread looks at the cancel flag while it waits.
const CANCEL_CHECK: Duration = Duration::from_millis(10);

/// When frame `k` (0-based) of an announcement goes out, after the first.
pub fn send_time(k: usize) -> Duration {
    (1..=k).map(|i| FIRST_GAP + GAP_STEP * (i as u32 - 1)).sum()
}

/// An announcement in progress; cancelled when dropped.
#[derive(Default)]
pub struct Announcer {
    cancel: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Announcer {
    /// Writes `frames` copies of `frame` on `tap`: the first now, the others at
    /// [`send_time`] from a thread of their own.
    pub fn start(tap: Arc<Tap>, frame: Vec<u8>, frames: usize) -> Announcer {
        write(&tap, &frame);
        if frames < 2 {
            return Announcer::default();
        }
        let cancel = Arc::new(AtomicBool::new(false));
        let stop = cancel.clone();
        let spawned = sandbox::spawn(sandbox::Role::DeviceIo, "virtio-net-announce", move || {
            let start = Instant::now();
            for k in 1..frames {
                if !wait_until(start + send_time(k), &stop) {
                    return;
                }
                write(&tap, &frame);
            }
        });
        match spawned {
            Ok(thread) => Announcer {
                cancel,
                thread: Some(thread),
            },
            Err(e) => {
                log::warn!("virtio-net: no thread for the later announcements: {e}");
                Announcer::default()
            }
        }
    }

    /// Stops the frames not yet sent and waits for the thread (at most one
    /// [`CANCEL_CHECK`]).
    pub fn cancel(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Announcer {
    fn drop(&mut self) {
        self.cancel();
    }
}

fn write(tap: &Tap, frame: &[u8]) {
    if let Err(e) = tap.write_frame(frame) {
        log::warn!("virtio-net: announcing on {}: {e}", tap.name());
    }
}

/// Sleeps until `when`; false if cancelled meanwhile.
fn wait_until(when: Instant, cancel: &AtomicBool) -> bool {
    loop {
        if cancel.load(Ordering::SeqCst) {
            return false;
        }
        let now = Instant::now();
        if now >= when {
            return true;
        }
        std::thread::sleep((when - now).min(CANCEL_CHECK));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_grow_as_qemus_announce_timer() {
        let ms: Vec<u128> = (0..4).map(|k| send_time(k).as_millis()).collect();
        assert_eq!(ms, [0, 50, 200, 450]);
    }
}
