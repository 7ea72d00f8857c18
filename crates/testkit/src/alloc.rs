//! A global allocator that records, per thread, the largest single allocation made while a
//! probe is active, and can abort the process on an allocation above a hard cap (the fuzz
//! targets use that: AFL++ reports the abort as a crash).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

thread_local! {
    /// Whether this thread's allocations are being measured.
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    /// Largest single allocation (bytes) since the probe started.
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

/// Hard cap on any single allocation, in bytes (0: none).
static HARD_CAP: AtomicUsize = AtomicUsize::new(0);

/// Wraps the system allocator. Install it in a test binary (or fuzz target) with
/// `#[global_allocator] static ALLOC: testkit::PeakAlloc = testkit::PeakAlloc;`.
pub struct PeakAlloc;

impl PeakAlloc {
    /// Aborts the process on any later single allocation larger than `bytes` (0: no cap).
    pub fn set_hard_cap(bytes: usize) {
        HARD_CAP.store(bytes, Ordering::Relaxed);
    }
}

fn record(size: usize) {
    let cap = HARD_CAP.load(Ordering::Relaxed);
    if cap != 0 && size > cap {
        // No allocation here: write the message with a fixed buffer, then abort.
        let msg = b"testkit::PeakAlloc: single allocation above the hard cap\n";
        // SAFETY: write(2) of a static buffer to stderr; the result is irrelevant before abort.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
        std::process::abort();
    }
    // `try_with`: the thread-locals may be gone while a thread is being torn down.
    let _ = ACTIVE.try_with(|active| {
        if active.get() {
            let _ = PEAK.try_with(|peak| peak.set(peak.get().max(size)));
        }
    });
}

// SAFETY: every call is forwarded unchanged to the system allocator; the bookkeeping only
// touches thread-locals that need no allocation (const-initialised `Cell`s without drop).
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: the caller's contract for `alloc` is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (every path above forwards).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        // SAFETY: as for `dealloc`; `new_size` is the caller's, checked by its contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Starts measuring this thread's allocations (resets the peak).
pub fn start_probe() {
    PEAK.with(|p| p.set(0));
    ACTIVE.with(|a| a.set(true));
}

/// Stops measuring and returns the largest single allocation since [`start_probe`] (0 when
/// [`PeakAlloc`] is not the global allocator).
pub fn stop_probe() -> usize {
    ACTIVE.with(|a| a.set(false));
    PEAK.with(|p| p.get())
}
