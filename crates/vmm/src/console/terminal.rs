//! Raw mode for the terminal the console reads: every key reaches the guest (Ctrl-C
//! included: the console's own quit is Ctrl-A x), nothing is echoed or line-buffered.
//!
//! The settings found are restored on every way out: when the [`RawMode`] guard is dropped
//! (the machine ends, or an error unwinds past it), from the SIGINT/SIGTERM handler
//! ([`restore`] is async-signal-safe), and by a panic hook before the panic message prints.

use std::io;
use std::os::unix::io::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Once, OnceLock};

/// The terminal and its settings before raw mode.
struct Saved {
    fd: RawFd,
    termios: libc::termios,
}

static SAVED: OnceLock<Saved> = OnceLock::new();
/// The terminal is in raw mode now.
static RAW: AtomicBool = AtomicBool::new(false);
static PANIC_HOOK: Once = Once::new();

/// Whether `fd` is a terminal.
pub fn is_terminal(fd: RawFd) -> bool {
    // SAFETY: isatty only inspects the descriptor.
    unsafe { libc::isatty(fd) == 1 }
}

/// The terminal on `fd` in raw mode until this guard is dropped.
pub struct RawMode(());

impl RawMode {
    /// Puts the terminal on `fd` in raw mode. One terminal per process.
    pub fn enter(fd: RawFd) -> io::Result<RawMode> {
        let saved = get_attributes(fd)?;
        let saved = SAVED.get_or_init(|| Saved { fd, termios: saved });
        if saved.fd != fd {
            return Err(io::Error::other("another terminal is already in raw mode"));
        }
        PANIC_HOOK.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                restore();
                previous(info);
            }));
        });
        let raw = raw_attributes(&saved.termios);
        // SAFETY: `raw` is a valid termios for the duration of the call.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            return Err(io::Error::last_os_error());
        }
        RAW.store(true, Ordering::SeqCst);
        Ok(RawMode(()))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        restore();
    }
}

/// Gives the terminal its settings from before raw mode back, if it is in raw mode.
/// Async-signal-safe: one atomic swap and tcsetattr(3).
pub fn restore() {
    if RAW.swap(false, Ordering::SeqCst) {
        if let Some(saved) = SAVED.get() {
            // SAFETY: the saved termios lives in a static; tcsetattr only reads it.
            unsafe { libc::tcsetattr(saved.fd, libc::TCSANOW, &saved.termios) };
        }
    }
}

fn get_attributes(fd: RawFd) -> io::Result<libc::termios> {
    // SAFETY: an all-zero termios is a valid value for tcgetattr to overwrite.
    let mut termios: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: `termios` is valid for writes for the duration of the call.
    if unsafe { libc::tcgetattr(fd, &mut termios) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(termios)
}

/// QEMU's raw mode for stdio: no input translation, echo, line editing or signal keys;
/// output processing stays on, so the VMM's own messages still start on a new line.
fn raw_attributes(saved: &libc::termios) -> libc::termios {
    let mut raw = *saved;
    raw.c_iflag &= !(libc::IGNBRK
        | libc::BRKINT
        | libc::PARMRK
        | libc::ISTRIP
        | libc::INLCR
        | libc::IGNCR
        | libc::ICRNL
        | libc::IXON);
    raw.c_oflag |= libc::OPOST;
    raw.c_lflag &= !(libc::ECHO | libc::ECHONL | libc::ICANON | libc::ISIG | libc::IEXTEN);
    raw.c_cflag &= !(libc::CSIZE | libc::PARENB);
    raw.c_cflag |= libc::CS8;
    raw.c_cc[libc::VMIN] = 1;
    raw.c_cc[libc::VTIME] = 0;
    raw
}
