//! Making a running vCPU return to user space.
//!
//! A kick is a real-time signal sent to the vCPU's thread. The handler sets the vCPU's
//! "immediate exit" byte (`kvm_run.immediate_exit` on KVM), so a kick that lands just
//! before the thread enters the guest is not lost: the next entry returns at once.

use std::cell::Cell;
use std::ptr;
use std::sync::Once;

use crate::{HypervisorError, Result};

thread_local! {
    // The immediate-exit byte of the vCPU this thread runs; null on other threads.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(ptr::null_mut()) };
}

#[cfg(target_os = "linux")]
fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN()
}

/// FreeBSD's first real-time signal (`SIGRTMIN` in sys/signal.h); libc does not name it.
#[cfg(not(target_os = "linux"))]
fn kick_signal() -> i32 {
    65
}

type KickHandler = extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);

#[cfg(target_os = "linux")]
fn register_signal_handler(signum: i32, handler: KickHandler) -> std::io::Result<()> {
    vmm_sys_util::signal::register_signal_handler(signum, handler)
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}

/// vmm-sys-util's signal helpers are Linux-only; elsewhere install the handler directly.
#[cfg(not(target_os = "linux"))]
fn register_signal_handler(signum: i32, handler: KickHandler) -> std::io::Result<()> {
    // SAFETY: an all-zero sigaction is a valid value to fill in; the handler only does an
    // async-signal-safe volatile store.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = handler as usize;
        act.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut act.sa_mask);
        if libc::sigaction(signum, &act, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

extern "C" fn handle_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // `try_with` cannot allocate for a const-initialised cell without destructor, which
    // keeps this async-signal-safe.
    let _ = IMMEDIATE_EXIT.try_with(|byte| {
        let byte = byte.get();
        if !byte.is_null() {
            // SAFETY: the pointer was registered by this thread's vCPU in `bind_current_thread`
            // and stays valid while that vCPU (which owns the mapping) lives on this thread.
            unsafe { ptr::write_volatile(byte, 1) };
        }
    });
}

/// Registers `immediate_exit` as the byte the kick handler sets on the calling thread.
///
/// # Safety
/// `immediate_exit` must stay valid until the calling thread exits or calls this again.
pub(crate) unsafe fn bind_current_thread(immediate_exit: *mut u8) -> Result<VcpuKicker> {
    static INSTALL: Once = Once::new();
    let mut installed = Ok(());
    INSTALL.call_once(|| {
        installed = register_signal_handler(kick_signal(), handle_kick).map_err(|source| {
            HypervisorError::Ioctl {
                op: "installing the vCPU kick signal handler",
                source,
            }
        });
    });
    installed?;
    IMMEDIATE_EXIT.with(|byte| byte.set(immediate_exit));
    Ok(VcpuKicker {
        // SAFETY: pthread_self has no preconditions.
        thread: unsafe { libc::pthread_self() },
    })
}

/// Unregisters the calling thread's immediate-exit byte (before its vCPU is dropped).
pub(crate) fn unbind_current_thread() {
    let _ = IMMEDIATE_EXIT.try_with(|byte| byte.set(ptr::null_mut()));
}

/// A handle that makes one vCPU's `run` return with `VcpuExit::Interrupted`.
#[derive(Clone, Copy, Debug)]
pub struct VcpuKicker {
    thread: libc::pthread_t,
}

// SAFETY: a pthread_t is an opaque thread identifier; signalling it from any thread is allowed.
unsafe impl Send for VcpuKicker {}
// SAFETY: as above; `kick` only reads the identifier.
unsafe impl Sync for VcpuKicker {}

impl VcpuKicker {
    /// Kicks the vCPU. Fails only if its thread is gone.
    pub fn kick(&self) -> Result<()> {
        // SAFETY: the thread id came from pthread_self on a vCPU thread, and the VMM kicks a
        // vCPU only while its thread has not been joined.
        let rc = unsafe { libc::pthread_kill(self.thread, kick_signal()) };
        if rc == 0 {
            Ok(())
        } else {
            Err(HypervisorError::Ioctl {
                op: "kicking a vCPU thread",
                source: std::io::Error::from_raw_os_error(rc),
            })
        }
    }
}
