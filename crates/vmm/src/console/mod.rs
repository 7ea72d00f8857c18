//! COM1 and the host side of the console: where guest output goes and where its input
//! comes from.
//!
//! - `--serial stdio`: output to standard output; when standard input is a terminal, input
//!   from it in raw mode (see [`terminal`]), with QEMU's escape sequences ([`escape`]):
//!   Ctrl-A x ends the VMM with status 0, as QEMU's does.
//! - `--serial socket:PATH`: the VMM listens on a Unix socket (mode 0600; only a stale
//!   socket is ever replaced); one client at a time gets the output and is the input.
//!   Another client that connects meanwhile is closed at once. Output while no client is
//!   connected is discarded, as QEMU's server socket does.
//!
//! Input goes through an [`pump::InputPump`] into the console's device: it waits for the
//! guest, never drops a byte, never blocks a vCPU. With `--console virtio` that device is
//! the virtio console (hvc0), which also writes where `--serial` says, socket included;
//! COM1 then keeps its output and gets no input.

mod escape;
mod pump;
pub mod terminal;

use std::io::{self, Read, Write};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use devices::bus::Bus;
use devices::exit::{ExitReason, ExitRequest, Waker};
use devices::output::{OutputQueue, OUTPUT_QUEUE_BYTES};
use devices::serial::{IrqLine, SerialDevice, SerialOutput as SerialSink};

use crate::config::SerialOutput;
use crate::error::{Error, Result};
use crate::socket::SocketGuard;
use escape::{Command, EscapeFilter, HELP};
use pump::InputPump;
pub use pump::InputTarget;
use terminal::RawMode;

/// COM1, built.
pub struct Com1 {
    pub device: Arc<Mutex<SerialDevice>>,
    /// The queue in front of its output, if it has one.
    pub output: Option<Arc<OutputQueue>>,
    /// Its input, started when the machine runs.
    pub input: Option<SerialInput>,
}

/// Where COM1's input will come from.
pub enum SerialInput {
    /// Standard input, a terminal.
    Terminal,
    Socket {
        listener: UnixListener,
        guard: SocketGuard,
        client: ClientSlot,
    },
}

/// The connected socket client, shared by the input thread and the output writer.
pub type ClientSlot = Arc<Mutex<Option<Arc<UnixStream>>>>;

fn option_error(value: String, reason: String) -> Error {
    Error::Option {
        option: "--serial",
        value,
        reason,
    }
}

/// Creates COM1 as `serial` asks and claims its ports on `pio`.
pub fn build_com1(serial: &SerialOutput, irq: Arc<dyn IrqLine>, pio: &mut Bus) -> Result<Com1> {
    let (device, input) = match serial {
        SerialOutput::Socket(path) => {
            let (listener, guard) = crate::socket::bind_for(path, "--serial")?;
            let client = ClientSlot::default();
            let (_, writer) = OutputQueue::spawn(
                "serial-out",
                Box::new(ClientOutput(client.clone())),
                OUTPUT_QUEUE_BYTES,
            )
            .map_err(|e| option_error(format!("socket:{}", path.display()), e.to_string()))?;
            let input = SerialInput::Socket {
                listener,
                guard,
                client,
            };
            (SerialDevice::with_queue(writer, irq), Some(input))
        }
        other => {
            let (sink, value) = match other {
                SerialOutput::File(path) => (
                    SerialSink::File(path.clone()),
                    format!("file:{}", path.display()),
                ),
                SerialOutput::None => (SerialSink::Sink, "none".into()),
                _ => (SerialSink::Stdout, "stdio".into()),
            };
            let device =
                SerialDevice::new(&sink, irq).map_err(|e| option_error(value, e.to_string()))?;
            let stdin_tty = matches!(other, SerialOutput::Stdio) && terminal::is_terminal(0);
            (device, stdin_tty.then_some(SerialInput::Terminal))
        }
    };
    let output = device.output_queue();
    let device = device
        .register_com1(pio)
        .map_err(|e| Error::Devices(e.to_string()))?;
    Ok(Com1 {
        device,
        output,
        input,
    })
}

/// `--console virtio`: hvc0 writes where `--serial` says and, when COM1 would have input
/// (`input`: a terminal or the socket's client), takes that input instead.
pub fn build_virtio_console(
    serial: &SerialOutput,
    input: Option<&SerialInput>,
) -> Result<virtio::console::Console> {
    let refuse = |reason: String| Error::Option {
        option: "--console",
        value: "virtio".into(),
        reason,
    };
    let sink: Box<dyn Write + Send> = match (serial, input) {
        (SerialOutput::Stdio, _) => Box::new(io::stdout()),
        (SerialOutput::File(path), _) => Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| refuse(format!("{}: {e}", path.display())))?,
        ),
        (SerialOutput::Socket(_), Some(SerialInput::Socket { client, .. })) => {
            let output = ClientOutput(client.clone());
            let (_, writer) = OutputQueue::spawn("hvc-out", Box::new(output), OUTPUT_QUEUE_BYTES)
                .map_err(|e| refuse(e.to_string()))?;
            Box::new(writer)
        }
        _ => {
            return Err(refuse(
                "the virtio console writes where --serial does, which must be stdio, a file \
                 or a socket"
                    .into(),
            ))
        }
    };
    virtio::console::Console::with_sink(sink, virtio::console::ConsoleInput::Port)
        .map_err(|e| refuse(e.to_string()))
}

/// A running input thread; dropping it stops the thread, gives the terminal its settings
/// back and removes the socket.
pub struct RunningInput {
    stop: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
    _raw: Option<RawMode>,
    _socket: Option<SocketGuard>,
}

impl Drop for RunningInput {
    fn drop(&mut self) {
        let _ = self.stop.wake();
        if let Some(thread) = self.thread.take() {
            // The thread polls the stop waker with every wait: it ends promptly.
            let _ = thread.join();
        }
    }
}

impl SerialInput {
    /// Starts feeding the console's device (`device`: COM1 or the virtio console); Ctrl-A x
    /// on the terminal requests `exit`.
    pub fn start(
        self,
        device: Box<dyn InputTarget>,
        exit: Arc<ExitRequest>,
    ) -> Result<RunningInput> {
        let stop = Arc::new(Waker::new()?);
        let pump = InputPump::new(device)?;
        let thread_stop = stop.clone();
        let (raw, socket, body): (_, _, Box<dyn FnOnce() + Send>) = match self {
            SerialInput::Terminal => {
                let raw = RawMode::enter(0).map_err(|e| {
                    option_error("stdio".into(), format!("cannot set up the terminal: {e}"))
                })?;
                let body = move || terminal_loop(pump, &thread_stop, &exit);
                (Some(raw), None, Box::new(body))
            }
            SerialInput::Socket {
                listener,
                guard,
                client,
            } => {
                let body = move || socket_loop(pump, &thread_stop, &listener, &client);
                (None, Some(guard), Box::new(body))
            }
        };
        let thread = sandbox::spawn(sandbox::Role::SerialInput, "serial-in", body)?;
        Ok(RunningInput {
            stop,
            thread: Some(thread),
            _raw: raw,
            _socket: socket,
        })
    }
}

/// Which of `fds` are readable (or hung up), after waiting up to `timeout_ms` (-1: no
/// limit). A negative descriptor is skipped.
fn wait_readable(fds: &[RawFd], timeout_ms: i32) -> io::Result<Vec<bool>> {
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `polls` is a valid array of `polls.len()` pollfd structures for the call.
    let rc = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, timeout_ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(vec![false; fds.len()]);
        }
        return Err(e);
    }
    Ok(polls
        .iter()
        .map(|p| p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0)
        .collect())
}

/// Re-offers waiting input at least this often, should the guest make room without the
/// FIFO ever becoming empty (e.g. loopback mode).
const RETRY_MS: i32 = 100;

fn timeout(pump: &InputPump) -> i32 {
    if pump.is_waiting() {
        RETRY_MS
    } else {
        -1
    }
}

/// Reads the terminal on standard input until the machine stops or Ctrl-A x.
fn terminal_loop(mut pump: InputPump, stop: &Waker, exit: &ExitRequest) {
    let mut filter = EscapeFilter::default();
    let mut buf = [0u8; 256];
    let mut guest = Vec::new();
    loop {
        let stdin = if pump.accepts_more() { 0 } else { -1 };
        let ready = match wait_readable(&[stop.poll_fd(), stdin, pump.room_fd()], timeout(&pump)) {
            Ok(r) => r,
            Err(e) => return log::warn!("serial: console input stops: {e}"),
        };
        if ready[0] {
            return;
        }
        if ready[1] {
            let n = match read_stdin(&mut buf) {
                Ok(0) => return log::info!("serial: the terminal closed"),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                Err(e) => return log::warn!("serial: cannot read the terminal: {e}"),
            };
            let mut input = &buf[..n];
            while !input.is_empty() {
                guest.clear();
                let (used, command) = filter.filter(input, &mut guest);
                pump.push(&guest);
                input = &input[used..];
                match command {
                    Some(Command::Quit) => {
                        exit.request(ExitReason::ConsoleQuit);
                        return;
                    }
                    Some(Command::Help) => eprint!("{HELP}"),
                    None => {}
                }
            }
        }
        pump.flush();
    }
}

/// One read(2) of standard input, unbuffered: what is read is all there is (a buffered
/// reader could keep bytes that poll(2) then never reports).
fn read_stdin(buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the duration of the call.
    let n = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Serves the socket: one client at a time is the console's input and output.
fn socket_loop(mut pump: InputPump, stop: &Waker, listener: &UnixListener, slot: &ClientSlot) {
    let mut client: Option<Arc<UnixStream>> = None;
    let mut buf = [0u8; 4096];
    loop {
        let client_fd = match &client {
            Some(c) if pump.accepts_more() => c.as_raw_fd(),
            _ => -1,
        };
        let fds = [
            stop.poll_fd(),
            listener.as_raw_fd(),
            client_fd,
            pump.room_fd(),
        ];
        let ready = match wait_readable(&fds, timeout(&pump)) {
            Ok(r) => r,
            Err(e) => return log::warn!("serial: socket console stops: {e}"),
        };
        if ready[0] {
            return;
        }
        // The client first: one that left makes room for one waiting to connect.
        if ready[2] {
            if let Some(c) = &client {
                match (&**c).read(&mut buf) {
                    Ok(0) | Err(_) => {
                        log::info!("serial: the socket client left");
                        client = None;
                        *lock(slot) = None;
                    }
                    Ok(n) => pump.push(&buf[..n]),
                }
            }
        }
        if ready[1] {
            accept_client(listener, &mut client, slot);
        }
        pump.flush();
    }
}

fn lock(slot: &ClientSlot) -> std::sync::MutexGuard<'_, Option<Arc<UnixStream>>> {
    slot.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes a new connection as the client, or closes it if there is one already (or it is
/// another user's).
fn accept_client(listener: &UnixListener, client: &mut Option<Arc<UnixStream>>, slot: &ClientSlot) {
    let stream = match listener.accept() {
        Ok((stream, _)) => stream,
        Err(e) => return log::warn!("serial: cannot accept a socket client: {e}"),
    };
    if client.is_some() {
        return log::info!("serial: a second socket client was refused (one at a time)");
    }
    if !crate::socket::peer_allowed(&stream).unwrap_or(false) {
        return log::warn!("serial: a socket client of another user was refused");
    }
    let stream = Arc::new(stream);
    *client = Some(stream.clone());
    *lock(slot) = Some(stream);
}

/// The output writer's end: the current client, or nowhere.
struct ClientOutput(ClientSlot);

impl Write for ClientOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let client = lock(&self.0).clone();
        if let Some(stream) = client {
            if let Err(e) = (&*stream).write_all(buf) {
                log::info!("serial: output to the socket client failed: {e}");
                let mut slot = lock(&self.0);
                if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, &stream)) {
                    *slot = None;
                }
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
