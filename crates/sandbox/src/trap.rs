//! `--seccomp kill`: the SIGSYS handler that reports a forbidden system call and ends the
//! process with status 2.
//!
//! A filter returns SECCOMP_RET_TRAP for a call its role does not allow; the kernel then
//! delivers SIGSYS to the calling thread, with the call's number in the signal information.
//! The handler formats one line on its stack (core::fmt, no allocation, no lock), writes it
//! to standard error and calls `_exit(2)`: write and exit_group are in every role's list.
//! SECCOMP_RET_KILL_PROCESS would give no chance to say which thread made which call.

use std::cell::Cell;
use std::fmt::Write as _;

use syscalls::Sysno;

use crate::Role;

/// The status of a VMM error (see DESIGN.md).
const STATUS_ERROR: i32 = 2;
/// Thread names are at most 15 bytes on Linux.
const NAME_MAX: usize = 16;

thread_local! {
    // The calling thread's role and name, for the report. Const-initialised and without
    // destructor, so reading them from a signal handler allocates nothing.
    static ROLE: Cell<Option<Role>> = const { Cell::new(None) };
    static NAME: Cell<[u8; NAME_MAX]> = const { Cell::new([0; NAME_MAX]) };
}

/// Records the calling thread's role and name for a report.
pub(crate) fn label_thread(role: Role, name: &str) {
    let mut buf = [0u8; NAME_MAX];
    let len = name.len().min(NAME_MAX);
    buf[..len].copy_from_slice(&name.as_bytes()[..len]);
    ROLE.with(|r| r.set(Some(role)));
    NAME.with(|n| n.set(buf));
}

/// The part of the kernel's `siginfo_t` that SIGSYS fills (`_sigsys` in
/// asm-generic/siginfo.h, x86-64 layout: the union starts at byte 16).
#[repr(C)]
struct SigsysInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad: i32,
    call_addr: *mut libc::c_void,
    syscall: i32,
    arch: u32,
}

/// A fixed buffer that `write!` fills, truncating.
struct LineBuffer {
    bytes: [u8; 256],
    len: usize,
}

impl std::fmt::Write for LineBuffer {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let room = self.bytes.len() - self.len;
        let take = s.len().min(room);
        self.bytes[self.len..self.len + take].copy_from_slice(&s.as_bytes()[..take]);
        self.len += take;
        Ok(())
    }
}

/// The report line for a forbidden call `nr` made by the current thread.
fn report(nr: i32, out: &mut LineBuffer) {
    let role = ROLE.try_with(Cell::get).ok().flatten();
    let name = NAME.try_with(Cell::get).unwrap_or([0; NAME_MAX]);
    let name_len = name.iter().position(|&b| b == 0).unwrap_or(NAME_MAX);
    let name = std::str::from_utf8(&name[..name_len]).unwrap_or("?");
    let call = usize::try_from(nr)
        .ok()
        .and_then(Sysno::new)
        .map_or("an unknown system call", |s| s.name());
    let role = role.map_or("none", Role::name);
    let _ = writeln!(
        out,
        "ferrovm: seccomp: thread {name} (role {role}) made the forbidden system call \
         {call} (number {nr}); stopping the VMM (--seccomp log would let it run)"
    );
}

extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for SA_SIGINFO handlers; for SIGSYS its
    // layout begins as `SigsysInfo`, which is no larger than siginfo_t.
    let nr = unsafe { (*info.cast::<SigsysInfo>()).syscall };
    let mut line = LineBuffer {
        bytes: [0; 256],
        len: 0,
    };
    report(nr, &mut line);
    // SAFETY: write(2) of a live stack buffer and _exit(2) are async-signal-safe.
    unsafe {
        libc::write(2, line.bytes.as_ptr().cast(), line.len);
        libc::_exit(STATUS_ERROR);
    }
}

/// Installs the SIGSYS reporter for the whole process.
pub(crate) fn install_reporter() -> std::io::Result<()> {
    // SAFETY: an all-zero sigaction is a valid value to fill in; the pointers are to this live
    // local; the handler makes only async-signal-safe calls.
    let rc = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            on_sigsys;
        action.sa_sigaction = handler as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigfillset(&mut action.sa_mask);
        libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut())
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_names_the_thread_its_role_and_the_call() {
        label_thread(Role::Vcpu, "vcpu3");
        let mut line = LineBuffer {
            bytes: [0; 256],
            len: 0,
        };
        report(Sysno::socket.id(), &mut line);
        let text = std::str::from_utf8(&line.bytes[..line.len]).unwrap();
        assert!(
            text.starts_with("ferrovm: seccomp: thread vcpu3 (role vcpu)"),
            "{text}"
        );
        assert!(text.contains("socket (number 41)"), "{text}");
        assert!(text.ends_with('\n'));
    }
}
