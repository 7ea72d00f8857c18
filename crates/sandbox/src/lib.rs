//! Per-thread seccomp filters for the VMM.
//!
//! Every thread of a running machine has a [`Role`], and each role an allow-list of system
//! calls (the files in `profiles/`, derived from what the threads really call by
//! `scripts/seccomp-profile.sh`, then reviewed). A thread installs its role's filter as it
//! starts ([`spawn`], [`spawn_with_setup`]); the main thread installs its own with [`enter`]
//! once the machine is built.
//!
//! A seccomp filter is inherited by the threads its thread creates, and a thread can only add
//! filters, never drop one. So that no role needs `clone` or the calls of the threads it
//! starts, threads are not created by the thread that asks for them: once the sandbox is
//! started, [`spawn`] hands the creation to one launcher thread, whose filter allows the union
//! of all roles (it runs no code but thread creation). A vCPU that activates a virtio device
//! thus gets an I/O thread without being allowed to `clone`, `pread` or `fsync` itself.
//!
//! [`Mode::Kill`] traps a forbidden call: a SIGSYS handler writes one line naming the thread,
//! its role and the call, and the process exits with status 2. [`Mode::Log`] lets the call
//! through and the kernel logs it (audit log or `dmesg`). [`Mode::Off`] installs nothing.
//!
//! Filters exist on x86-64 Linux only; elsewhere [`start`] refuses any mode but `Off`.

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod filter;
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod names;
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod profile;
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod trap;

mod launcher;
mod thread;

pub use thread::{enter, spawn, spawn_with_setup};

use std::fmt;
use std::str::FromStr;

/// What a filter does with a system call its role does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// No filters.
    Off,
    /// Allow the call; the kernel logs it.
    Log,
    /// Stop the VMM with a message naming the thread and the call (exit status 2).
    Kill,
}

impl Mode {
    /// The mode of `--seccomp` when none is given: `kill` where filters exist, else `off`.
    pub fn platform_default() -> Mode {
        if SUPPORTED {
            Mode::Kill
        } else {
            Mode::Off
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Log => "log",
            Mode::Kill => "kill",
        }
    }
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Mode::Off),
            "log" => Ok(Mode::Log),
            "kill" => Ok(Mode::Kill),
            _ => Err(format!("expected off, log or kill, not {s:?}")),
        }
    }
}

/// Whether this build can install filters.
pub const SUPPORTED: bool = cfg!(all(target_os = "linux", target_arch = "x86_64"));

macro_rules! roles {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// What a thread does, which decides the system calls it may make.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Role {
            $($(#[$doc])* $variant,)*
        }

        impl Role {
            /// Every role.
            pub const ALL: &'static [Role] = &[$(Role::$variant,)*];

            /// The role's name: its profile is `profiles/NAME.txt`.
            pub fn name(self) -> &'static str {
                match self {
                    $(Role::$variant => $name,)*
                }
            }
        }
    };
}

roles! {
    /// The main thread once the machine is built: waits for the end, stops the threads,
    /// reports, tears down.
    Main = "main",
    /// Creates every other thread (see the crate documentation).
    Launcher = "launcher",
    /// A vCPU: KVM_RUN and the devices its exits reach.
    Vcpu = "vcpu",
    /// Device I/O: virtio queue workers (block, rng, console), the virtio console's input
    /// reader, the serial port's output writer.
    DeviceIo = "device-io",
    /// The control API: the HTTP event loop and one thread per request in progress.
    Api = "api",
    /// A snapshot or an outgoing migration (started by an API request).
    Migration = "migration",
    /// Threads that act on time: the PIT/RTC timer thread and the auto-converge throttle.
    Timer = "timer",
    /// The lazy-restore verifier, checking a mapped snapshot's pages while the guest runs.
    RestoreVerify = "restore-verify",
    /// A userfaultfd handler serving a lazily restored guest's page faults.
    RestoreFaults = "restore-faults",
    /// The serial port's input reader (standard input or a socket).
    SerialInput = "serial-input",
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .iter()
            .copied()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("no thread role {s:?}"))
    }
}

/// Why the sandbox could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("--seccomp {0}: seccomp filters exist on x86-64 Linux only; use --seccomp off here")]
    Unsupported(&'static str),
    #[error("seccomp: the {role} filter: {reason}")]
    Filter { role: Role, reason: String },
    #[error("seccomp: {0}")]
    Setup(String),
    #[error("seccomp: {0} is not a thread role (FERROVM_SECCOMP_SELFTEST)")]
    SelfTest(String),
}

/// Starts the sandbox for this process: compiles every role's filter, installs the SIGSYS
/// reporter (`kill`) and starts the launcher thread. Threads spawned before this run
/// unfiltered; call it first. `Off` does nothing.
///
/// `FERROVM_SECCOMP_SELFTEST=ROLE` makes each thread of that role make one forbidden,
/// harmless system call (`getpgid(0)`) right after installing its filter, to test that
/// forbidden calls are caught.
pub fn start(mode: Mode) -> Result<(), Error> {
    start_with(mode, &[])
}

/// [`start`], with lines added to roles' profiles (the syntax of `profiles/ROLE.txt`): what
/// the VMM's device kinds need, each kind declaring its own.
pub fn start_with(mode: Mode, extra: &[(Role, &str)]) -> Result<(), Error> {
    let selftest = match std::env::var("FERROVM_SECCOMP_SELFTEST") {
        Ok(name) if !name.is_empty() => {
            Some(name.parse::<Role>().map_err(|_| Error::SelfTest(name))?)
        }
        _ => None,
    };
    thread::start(mode, selftest, extra)
}

/// The mode in force (`Off` before [`start`]).
pub fn mode() -> Mode {
    thread::mode()
}
