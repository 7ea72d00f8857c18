//! The process's sandbox state, and starting threads inside it.

use std::io;
use std::sync::OnceLock;
use std::thread::JoinHandle;

use crate::launcher::Launcher;
use crate::{Error, Mode, Role};

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
type Programs = std::collections::HashMap<Role, seccompiler::BpfProgram>;

struct Sandbox {
    mode: Mode,
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    programs: Programs,
    /// Present unless the mode is `Off`.
    launcher: Option<Launcher>,
    selftest: Option<Role>,
}

static SANDBOX: OnceLock<Sandbox> = OnceLock::new();

pub(crate) fn mode() -> Mode {
    SANDBOX.get().map_or(Mode::Off, |s| s.mode)
}

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
pub(crate) fn start(
    mode: Mode,
    selftest: Option<Role>,
    extra: &[(Role, &str)],
) -> Result<(), Error> {
    keep_malloc_heaps();
    let programs = match mode {
        Mode::Off => Programs::new(),
        _ => crate::filter::compile_all(mode, extra)?,
    };
    if mode == Mode::Kill {
        crate::trap::install_reporter()
            .map_err(|e| Error::Setup(format!("cannot install the SIGSYS handler: {e}")))?;
    }
    let launcher = match programs.get(&Role::Launcher) {
        Some(program) => {
            let program = program.clone();
            let prepare = move || {
                crate::trap::label_thread(Role::Launcher, "launcher");
                seccompiler::apply_filter(&program).map_err(|e| e.to_string())?;
                run_selftest(selftest, mode, Role::Launcher, "launcher");
                Ok(())
            };
            Some(
                Launcher::start(prepare)
                    .map_err(|e| Error::Setup(format!("cannot start the thread launcher: {e}")))?,
            )
        }
        None => None,
    };
    let sandbox = Sandbox {
        mode,
        programs,
        launcher,
        selftest,
    };
    SANDBOX
        .set(sandbox)
        .map_err(|_| Error::Setup("the sandbox is started once per process".into()))?;
    if mode == Mode::Log {
        log::info!("seccomp: forbidden system calls are allowed and logged by the kernel");
    }
    Ok(())
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
pub(crate) fn start(
    mode: Mode,
    selftest: Option<Role>,
    _extra: &[(Role, &str)],
) -> Result<(), Error> {
    if mode != Mode::Off {
        return Err(Error::Unsupported(mode.name()));
    }
    let sandbox = Sandbox {
        mode,
        launcher: None,
        selftest,
    };
    SANDBOX
        .set(sandbox)
        .map_err(|_| Error::Setup("the sandbox is started once per process".into()))
}

/// Installs `role`'s filter on the calling thread (named `name` in reports).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn install(sandbox: &Sandbox, role: Role, name: &str) -> Result<(), Error> {
    let Some(program) = sandbox.programs.get(&role) else {
        return Ok(());
    };
    crate::trap::label_thread(role, name);
    seccompiler::apply_filter(program).map_err(|e| Error::Filter {
        role,
        reason: format!("cannot install it on thread {name}: {e}"),
    })
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
fn install(_: &Sandbox, _: Role, _: &str) -> Result<(), Error> {
    Ok(())
}

/// `FERROVM_SECCOMP_SELFTEST`: a forbidden, harmless call from the thread that just entered
/// `role`'s sandbox.
fn selftest(sandbox: &Sandbox, role: Role, name: &str) {
    run_selftest(sandbox.selftest, sandbox.mode, role, name);
}

fn run_selftest(wanted: Option<Role>, mode: Mode, role: Role, name: &str) {
    if wanted != Some(role) {
        return;
    }
    // SAFETY: getpgid(0) only reads the caller's process group; no role allows it.
    unsafe { libc::getpgid(0) };
    log::warn!(
        "seccomp self-test: thread {name} (role {role}) made a forbidden call and runs on \
         (--seccomp {})",
        mode.name()
    );
}

/// Puts the calling thread in `role`'s sandbox: installs its filter (nothing before
/// [`crate::start`] or with `--seccomp off`). For the main thread, once the machine is built;
/// threads started with [`spawn`] do it themselves.
pub fn enter(role: Role) -> Result<(), Error> {
    let Some(sandbox) = SANDBOX.get() else {
        return Ok(());
    };
    let current = std::thread::current();
    let name = current.name().unwrap_or("unnamed");
    install(sandbox, role, name)?;
    selftest(sandbox, role, name);
    Ok(())
}

/// glibc shrinks a thread's malloc heap when a free leaves a large top chunk, and the first
/// time it does, it reads /proc/sys/vm/overcommit_memory (openat). A thread whose role may not
/// open files (a device or API thread freeing what another thread allocated) would then be
/// stopped by its filter: heaps are never shrunk (their free memory is reused, and what the
/// process holds goes at exit).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn keep_malloc_heaps() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes an allocator tunable.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
    }
}

/// A thread whose filter cannot be installed must not run unfiltered: the VMM stops.
fn enter_or_exit(role: Role, name: &str) {
    let Some(sandbox) = SANDBOX.get() else {
        return;
    };
    if let Err(e) = install(sandbox, role, name) {
        eprintln!("ferrovm: {e}");
        // SAFETY: _exit ends the process at once; nothing is left half-done that matters
        // more than not running unfiltered.
        unsafe { libc::_exit(2) };
    }
    selftest(sandbox, role, name);
}

/// Starts a thread named `name` in `role`'s sandbox: it installs the role's filter, then
/// runs `body`. Once the sandbox is started the thread is created by the launcher.
pub fn spawn<T, B>(role: Role, name: impl Into<String>, body: B) -> io::Result<JoinHandle<T>>
where
    T: Send + 'static,
    B: FnOnce() -> T + Send + 'static,
{
    spawn_with_setup(role, name, || (), move |()| body())
}

/// Like [`spawn`], for a thread with set-up to do before its filter is in force (under the
/// launcher's wider filter): runs `setup`, installs the filter, runs `body` with what
/// `setup` returned.
pub fn spawn_with_setup<P, T, S, B>(
    role: Role,
    name: impl Into<String>,
    setup: S,
    body: B,
) -> io::Result<JoinHandle<T>>
where
    P: 'static,
    T: Send + 'static,
    S: FnOnce() -> P + Send + 'static,
    B: FnOnce(P) -> T + Send + 'static,
{
    let name = name.into();
    let label = name.clone();
    let run = move || {
        let prepared = setup();
        enter_or_exit(role, &label);
        body(prepared)
    };
    match SANDBOX.get().and_then(|s| s.launcher.as_ref()) {
        Some(launcher) => launcher.spawn(name, run),
        None => std::thread::Builder::new().name(name).spawn(run),
    }
}
