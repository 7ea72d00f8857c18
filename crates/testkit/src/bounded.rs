//! Runs a parser under bounds: on its own thread, with a deadline, measuring its largest
//! single allocation.

use std::sync::mpsc;
use std::time::Duration;

use crate::alloc::{start_probe, stop_probe};

/// What a parser run may use.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Wall-clock time after which the run counts as a hang (generous: the machine may be
    /// loaded; a real hang never ends).
    pub deadline: Duration,
    /// Largest single allocation allowed, in bytes.
    pub max_alloc: usize,
}

impl Bounds {
    /// `max_alloc` bytes, 20 s.
    pub fn alloc(max_alloc: usize) -> Self {
        Bounds {
            deadline: Duration::from_secs(20),
            max_alloc,
        }
    }
}

/// Runs `f` on a new thread and returns its result. Panics (so the property fails) when `f`
/// panics (with its message), when it does not return within `bounds.deadline`, or when a
/// single allocation it made was larger than `bounds.max_alloc`. Needs [`crate::PeakAlloc`] as
/// the global allocator of the test binary, and says so when it is not.
pub fn bounded<R, F>(bounds: Bounds, f: F) -> R
where
    R: Send + 'static,
    F: FnOnce() -> R + Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::Builder::new()
        .name("bounded".into())
        .spawn(move || {
            start_probe();
            // Proves the probe sees this thread's allocations.
            let canary = std::hint::black_box(Vec::<u8>::with_capacity(1));
            drop(canary);
            let result = f();
            let peak = stop_probe();
            let _ = tx.send((result, peak));
        })
        .expect("spawning the bounded runner thread");
    match rx.recv_timeout(bounds.deadline) {
        Ok((result, peak)) => {
            let _ = worker.join();
            assert!(
                peak > 0,
                "testkit::PeakAlloc is not the global allocator of this test binary"
            );
            assert!(
                peak <= bounds.max_alloc,
                "the parser made a single allocation of {peak} bytes, more than the {} allowed",
                bounds.max_alloc
            );
            result
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the runner thread ended without sending its result"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => panic!(
            "the parser did not finish within {:?} (a hang); its thread is left running",
            bounds.deadline
        ),
    }
}
