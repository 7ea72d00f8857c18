//! The 16550A UART the guest console talks to (COM1, ports 0x3f8-0x3ff).
//!
//! The register model is `vm_superio::Serial`; this module adds what the
//! machine needs around it: where the output goes (`--serial
//! stdio|file:PATH|none`), a pluggable interrupt line (so the UART works
//! before any interrupt controller exists and is wired to IRQ 4 once one
//! does), a host-input path, and state capture for snapshots.

use std::convert::Infallible;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialEvents;
use vm_superio::{Serial, SerialState as UartState, Trigger};

use crate::bus::{Bus, BusDeviceMut, BusError};
use crate::exit::Waker;
use crate::lifecycle::{DeviceState, Lifecycle, LifecycleError};
use crate::output::{OutputQueue, QueuedWriter, OUTPUT_QUEUE_BYTES};
use crate::state::StateError;

/// First port of COM1.
pub const COM1_BASE: u64 = 0x3f8;
/// Number of ports a 16550 decodes (at any base).
pub const UART_LEN: u64 = 8;
/// The ISA IRQ COM1 is wired to on a PC.
pub const COM1_IRQ: u32 = 4;

/// An interrupt line a device can pulse.
///
/// Edge semantics: `trigger` means "the interrupt condition just arose".
/// An implementation for a level-triggered controller input pulses it
/// (assert, then deassert). Errors are the implementation's to report: a
/// device cannot do anything useful about a failed injection.
pub trait IrqLine: Send + Sync {
    /// Signal the interrupt.
    fn trigger(&self);
}

/// An interrupt line connected to nothing, for machines (or tests) without
/// an interrupt controller model yet; the guest then polls the UART.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoIrq;

impl IrqLine for NoIrq {
    fn trigger(&self) {}
}

impl<T: IrqLine + ?Sized> IrqLine for Arc<T> {
    fn trigger(&self) {
        (**self).trigger()
    }
}

/// With KVM, an eventfd registered as an irqfd for a GSI is the interrupt
/// line: writing it injects without leaving the kernel's fast path.
#[cfg(any(target_os = "linux", target_os = "android"))]
impl IrqLine for vmm_sys_util::eventfd::EventFd {
    fn trigger(&self) {
        if let Err(e) = self.write(1) {
            log::warn!("serial: cannot signal interrupt eventfd: {e}");
        }
    }
}

/// Adapts an [`IrqLine`] to `vm_superio`'s `Trigger`.
struct IrqTrigger(Arc<dyn IrqLine>);

impl Trigger for IrqTrigger {
    type E = Infallible;
    fn trigger(&self) -> Result<(), Infallible> {
        self.0.trigger();
        Ok(())
    }
}

/// Tells the host-input feeder that the guest emptied the receive FIFO, so that it can
/// offer the input that did not fit.
#[derive(Clone, Default)]
struct InputRoom(Option<Arc<Waker>>);

impl SerialEvents for InputRoom {
    fn buffer_read(&self) {}
    fn out_byte(&self) {}
    fn tx_lost_byte(&self) {}
    fn in_buffer_empty(&self) {
        if let Some(waker) = &self.0 {
            if let Err(e) = waker.wake() {
                log::warn!("serial: cannot wake the input feeder: {e}");
            }
        }
    }
}

/// Where guest output goes, as chosen on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialOutput {
    /// The VMM's standard output.
    Stdout,
    /// A file, created or truncated when the device is built, then appended to: other
    /// writers of the same file (the virtio console) interleave with it instead of
    /// overwriting each other from separate offsets.
    File(PathBuf),
    /// Discarded (`--serial none`).
    Sink,
}

/// Why a serial device could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SerialError {
    /// The output file could not be created.
    #[error("cannot create serial output file {}: {source}", path.display())]
    OpenOutput {
        /// The file named by `--serial file:PATH`.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The output thread could not be started.
    #[error("cannot start the serial output thread: {source}")]
    Writer {
        /// The underlying error.
        source: io::Error,
    },
}

/// Bytes the receive FIFO holds (vm-superio's FIFO size).
pub const FIFO_SIZE: usize = 64;
/// Interrupt-enable bits a 16550 has (writes to the others are dropped).
const IER_VALID: u8 = 0x0f;
/// The interrupt identifications the UART model produces: none pending (bit 0), and
/// "transmitter empty" (bit 1) and/or "received data" (bit 2) pending.
const IIR_VALID: [u8; 4] = [0x01, 0x02, 0x04, 0x06];

/// The guest-visible UART registers and pending input, for snapshots: the fields of
/// `vm_superio::SerialState` (which has no serde support), one for one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialState {
    /// Divisor latch, low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch, high byte.
    pub baud_divisor_high: u8,
    /// Interrupt enable register.
    pub interrupt_enable: u8,
    /// Interrupt identification register.
    pub interrupt_identification: u8,
    /// Line control register.
    pub line_control: u8,
    /// Line status register.
    pub line_status: u8,
    /// Modem control register.
    pub modem_control: u8,
    /// Modem status register.
    pub modem_status: u8,
    /// Scratch register.
    pub scratch: u8,
    /// Received bytes the guest has not read yet (at most [`FIFO_SIZE`]).
    pub in_buffer: Vec<u8>,
}

impl Default for SerialState {
    /// The UART after reset.
    fn default() -> Self {
        UartState::default().into()
    }
}

impl From<UartState> for SerialState {
    fn from(s: UartState) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialState> for UartState {
    fn from(s: &SerialState) -> Self {
        UartState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

impl SerialState {
    /// Refuses what the UART model could never hold.
    pub fn validate(&self) -> Result<(), StateError> {
        let err = |detail: String| Err(StateError::new("serial", detail));
        if self.in_buffer.len() > FIFO_SIZE {
            return err(format!(
                "{} bytes of pending input, more than the {FIFO_SIZE}-byte FIFO",
                self.in_buffer.len()
            ));
        }
        if self.interrupt_enable & !IER_VALID != 0 {
            return err(format!("IER {:#04x}", self.interrupt_enable));
        }
        if !IIR_VALID.contains(&self.interrupt_identification) {
            return err(format!("IIR {:#04x}", self.interrupt_identification));
        }
        Ok(())
    }
}

/// The writer behind the UART. Standard output and files are written by a thread of their
/// own through a bounded queue: a reader that stops reading never blocks a vCPU (bytes that
/// do not fit are dropped and counted).
enum Out {
    Queued(QueuedWriter),
    Writer(Box<dyn Write + Send>),
    Discard,
}

impl Write for Out {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Out::Queued(q) => q.write(buf),
            Out::Writer(w) => w.write(buf),
            Out::Discard => Ok(buf.len()),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Out::Queued(q) => q.flush(),
            Out::Writer(w) => w.flush(),
            Out::Discard => Ok(()),
        }
    }
}

/// A 16550A UART on the I/O bus.
pub struct SerialDevice {
    uart: Serial<IrqTrigger, InputRoom, Out>,
    /// The queue in front of standard output or a file.
    output: Option<Arc<OutputQueue>>,
    /// Output errors are logged once, not once per byte.
    output_error_logged: bool,
    /// Woken when the guest empties the receive FIFO.
    input_room: InputRoom,
}

impl std::fmt::Debug for SerialDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialDevice")
            .field("state", &self.uart.state())
            .finish_non_exhaustive()
    }
}

impl SerialDevice {
    /// A UART writing to `output`, interrupting through `irq`.
    pub fn new(output: &SerialOutput, irq: Arc<dyn IrqLine>) -> Result<Self, SerialError> {
        let out: Box<dyn Write + Send> = match output {
            SerialOutput::Stdout => Box::new(io::stdout()),
            SerialOutput::File(path) => Box::new(open_output(path)?),
            SerialOutput::Sink => return Ok(Self::from_sink(Out::Discard, irq)),
        };
        let (queue, writer) = OutputQueue::spawn("serial-out", out, OUTPUT_QUEUE_BYTES)
            .map_err(|source| SerialError::Writer { source })?;
        let mut dev = Self::from_sink(Out::Queued(writer), irq);
        dev.output = Some(queue);
        Ok(dev)
    }

    /// The queue in front of standard output or a file (not for `with_writer` or `none`):
    /// for the count of bytes dropped, and to drain it at exit.
    pub fn output_queue(&self) -> Option<Arc<OutputQueue>> {
        self.output.clone()
    }

    /// A UART writing through a bounded queue the caller made (e.g. to a socket client):
    /// [`SerialDevice::output_queue`] returns that queue.
    pub fn with_queue(writer: QueuedWriter, irq: Arc<dyn IrqLine>) -> Self {
        let queue = writer.queue().clone();
        let mut dev = Self::from_sink(Out::Queued(writer), irq);
        dev.output = Some(queue);
        dev
    }

    /// A UART writing to any writer, from the vCPU thread: one that never blocks (an
    /// in-memory buffer, a [`QueuedWriter`]).
    pub fn with_writer(out: Box<dyn Write + Send>, irq: Arc<dyn IrqLine>) -> Self {
        Self::from_sink(Out::Writer(out), irq)
    }

    fn from_sink(sink: Out, irq: Arc<dyn IrqLine>) -> Self {
        SerialDevice {
            uart: Serial::with_events(IrqTrigger(irq), InputRoom::default(), sink),
            output: None,
            output_error_logged: false,
            input_room: InputRoom::default(),
        }
    }

    /// Moves the device into an `Arc<Mutex<_>>` claiming COM1's ports on
    /// `bus`; keep the returned handle for input and snapshots.
    pub fn register_com1(self, bus: &mut Bus) -> Result<Arc<Mutex<Self>>, BusError> {
        self.register_at(bus, COM1_BASE)
    }

    /// Like [`SerialDevice::register_com1`], at another base (COM2 is 0x2f8).
    pub fn register_at(self, bus: &mut Bus, base: u64) -> Result<Arc<Mutex<Self>>, BusError> {
        let dev = Arc::new(Mutex::new(self));
        bus.insert(dev.clone(), base, UART_LEN)?;
        Ok(dev)
    }

    /// Connects the UART to a (new) interrupt line, keeping its registers
    /// and pending input. An interrupt already pending and enabled is
    /// signalled on the new line.
    pub fn set_irq_line(&mut self, irq: Arc<dyn IrqLine>) {
        let state = self.uart.state();
        self.rebuild(&state, irq);
    }

    /// Queues host input (e.g. from stdin) for the guest to read; returns
    /// how many bytes fit in the FIFO. The rest must be offered again later,
    /// when [`SerialDevice::fifo_capacity`] says there is room.
    pub fn enqueue_raw_bytes(&mut self, input: &[u8]) -> usize {
        // The only possible error is a full FIFO (the trigger is infallible),
        // which means nothing was taken.
        self.uart.enqueue_raw_bytes(input).unwrap_or(0)
    }

    /// Wakes `waker` whenever the guest empties the receive FIFO: the moment to offer
    /// input that [`SerialDevice::enqueue_raw_bytes`] could not take.
    pub fn set_input_waker(&mut self, waker: Arc<Waker>) {
        self.input_room = InputRoom(Some(waker));
        let state = self.uart.state();
        let irq = self.uart.interrupt_evt().0.clone();
        self.rebuild(&state, irq);
    }

    /// Free space in the receive FIFO.
    pub fn fifo_capacity(&self) -> usize {
        self.uart.fifo_capacity()
    }

    /// The guest-visible state, for snapshots.
    pub fn state(&self) -> SerialState {
        self.uart.state().into()
    }

    /// Restores a state captured by [`SerialDevice::state`], keeping the
    /// current output and interrupt line. A state the UART could not hold is
    /// refused and the device left as it was.
    pub fn restore(&mut self, state: &SerialState) -> Result<(), StateError> {
        state.validate()?;
        let irq = self.uart.interrupt_evt().0.clone();
        self.rebuild(&state.into(), irq);
        Ok(())
    }

    /// Recreates the `vm_superio` model from `state`, moving the sink over.
    fn rebuild(&mut self, state: &UartState, irq: Arc<dyn IrqLine>) {
        let placeholder = Serial::with_events(
            IrqTrigger(Arc::new(NoIrq)),
            InputRoom::default(),
            Out::Discard,
        );
        let old = std::mem::replace(&mut self.uart, placeholder);
        let sink = old.into_writer();
        let events = self.input_room.clone();
        self.uart = match Serial::from_state(state, IrqTrigger(irq.clone()), events, sink) {
            Ok(uart) => uart,
            Err(e) => {
                // Unreachable: the caller checked the FIFO size, the trigger
                // cannot fail, and the sink was moved into the failed call,
                // so fall back to a reset UART rather than panic.
                log::error!("serial: cannot rebuild UART ({e}); resetting it");
                Serial::with_events(IrqTrigger(irq), self.input_room.clone(), Out::Discard)
            }
        };
    }

    fn write_byte(&mut self, offset: u8, value: u8) {
        if let Err(e) = self.uart.write(offset, value) {
            if !self.output_error_logged {
                self.output_error_logged = true;
                log::warn!("serial: guest output lost: {e}");
            }
        }
    }
}

fn open_output(path: &Path) -> Result<File, SerialError> {
    let error = |source| SerialError::OpenOutput {
        path: path.to_path_buf(),
        source,
    };
    // O_APPEND and O_TRUNC do not go together in std's OpenOptions: truncate once opened.
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(error)?;
    file.set_len(0).map_err(error)?;
    Ok(file)
}

impl BusDeviceMut for SerialDevice {
    /// A wider-than-byte access is split into byte accesses to consecutive
    /// registers, as an 8-bit ISA device sees it.
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = match reg(offset, i) {
                Some(r) => self.uart.read(r),
                None => 0xff,
            };
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        for (i, &b) in data.iter().enumerate() {
            if let Some(r) = reg(offset, i) {
                self.write_byte(r, b);
            }
        }
    }
}

/// The register index of byte `i` of an access at `offset`, if it is one.
fn reg(offset: u64, i: usize) -> Option<u8> {
    let r = offset.checked_add(u64::try_from(i).ok()?)?;
    if r < UART_LEN {
        u8::try_from(r).ok()
    } else {
        None
    }
}

/// Layout version of the state [`Lifecycle::save`] writes: a [`SerialState`].
pub const SERIAL_STATE_VERSION: u32 = 1;

/// The UART has no thread of its own (its output is written on the vCPU thread that writes
/// THR), so pause and resume have nothing to do.
impl Lifecycle for SerialDevice {
    fn id(&self) -> String {
        "serial".into()
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(SERIAL_STATE_VERSION, &self.state())
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        SerialDevice::restore(self, &state.parse("serial", SERIAL_STATE_VERSION)?)
    }

    /// The UART's reset values (interrupts disabled, FIFO empty), same output and line.
    fn reset(&mut self) {
        let irq = self.uart.interrupt_evt().0.clone();
        self.rebuild(&UartState::default(), irq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Default)]
    struct CountIrq(AtomicUsize);
    impl IrqLine for CountIrq {
        fn trigger(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[derive(Clone, Default)]
    struct SharedBuf(Arc<Mutex<Vec<u8>>>);
    impl Write for SharedBuf {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn tmp_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("ferrovm-devices-{}-{name}", std::process::id()))
    }

    #[test]
    fn file_sink_gets_bytes() {
        let path = tmp_path("serial.txt");
        std::fs::write(&path, b"old contents that must go").unwrap();
        let mut bus = Bus::new();
        let dev = SerialDevice::new(&SerialOutput::File(path.clone()), Arc::new(NoIrq))
            .unwrap()
            .register_com1(&mut bus)
            .unwrap();
        for &b in b"Hello, ferrovm\n" {
            assert!(bus.write(COM1_BASE, &[b]));
        }
        // Line status: transmitter empty, so a polling guest keeps going.
        let mut lsr = [0u8];
        assert!(bus.read(COM1_BASE + 5, &mut lsr));
        assert_eq!(lsr[0] & 0x60, 0x60);
        let queue = dev.lock().unwrap().output_queue().unwrap();
        assert!(queue.drain(std::time::Duration::from_secs(10)));
        drop(dev);
        drop(bus);
        assert_eq!(std::fs::read(&path).unwrap(), b"Hello, ferrovm\n");
        std::fs::remove_file(&path).unwrap();
    }

    /// The virtio console appends to the serial's file through its own handle: both
    /// outputs survive, each in its own order (the serial's bytes reach the file through
    /// its writer thread, so the two interleave in any order).
    #[test]
    fn file_sink_shares_its_file_with_another_appender() {
        let path = tmp_path("shared.txt");
        std::fs::write(&path, b"old contents that must go").unwrap();
        let mut dev =
            SerialDevice::new(&SerialOutput::File(path.clone()), Arc::new(NoIrq)).unwrap();
        let mut other = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        let queue = dev.output_queue().unwrap();
        for chunk in [&b"serial 1\n"[..], b"serial 2\n"] {
            for &b in chunk {
                dev.write(0, &[b]);
            }
            // The UART's writer thread appends asynchronously: wait for it.
            assert!(queue.drain(std::time::Duration::from_secs(10)));
            other.write_all(b"console\n").unwrap();
        }
        let queue = dev.output_queue().expect("a file sink has an output queue");
        assert!(queue.drain(std::time::Duration::from_secs(10)));
        drop(dev);
        let text = std::fs::read_to_string(&path).unwrap();
        let serial: Vec<&str> = text.lines().filter(|l| l.starts_with("serial")).collect();
        assert_eq!(serial, ["serial 1", "serial 2"], "{text:?}");
        assert_eq!(
            text.lines().filter(|l| *l == "console").count(),
            2,
            "{text:?}"
        );
        assert_eq!(text.len(), 34, "{text:?}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn bad_output_path_is_named() {
        let path = PathBuf::from("/nonexistent-dir/ferrovm/serial.log");
        let err = SerialDevice::new(&SerialOutput::File(path), Arc::new(NoIrq)).unwrap_err();
        assert!(err
            .to_string()
            .contains("/nonexistent-dir/ferrovm/serial.log"));
    }

    #[test]
    fn none_and_stdout_sinks() {
        let mut none = SerialDevice::new(&SerialOutput::Sink, Arc::new(NoIrq)).unwrap();
        none.write(0, b"dropped");
        let mut out = SerialDevice::new(&SerialOutput::Stdout, Arc::new(NoIrq)).unwrap();
        out.write(7, &[0x5a]); // scratch register, no output
        let mut d = [0u8];
        out.read(7, &mut d);
        assert_eq!(d[0], 0x5a);
    }

    #[test]
    fn input_and_interrupts() {
        let irq = Arc::new(CountIrq::default());
        let buf = SharedBuf::default();
        let mut dev = SerialDevice::with_writer(Box::new(buf.clone()), irq.clone());
        // Enable the received-data interrupt.
        dev.write(1, &[0x01]);
        assert_eq!(dev.enqueue_raw_bytes(b"ab"), 2);
        assert_eq!(irq.0.load(Ordering::SeqCst), 1);
        let mut d = [0u8];
        dev.read(5, &mut d);
        assert_eq!(d[0] & 1, 1, "data ready");
        dev.read(0, &mut d);
        assert_eq!(d[0], b'a');
        dev.read(0, &mut d);
        assert_eq!(d[0], b'b');
        dev.read(5, &mut d);
        assert_eq!(d[0] & 1, 0);

        // Fill the FIFO: the excess is refused, not dropped silently.
        let big = vec![b'x'; 1000];
        let took = dev.enqueue_raw_bytes(&big);
        assert!(took < big.len());
        assert_eq!(dev.fifo_capacity(), 0);
        assert_eq!(dev.enqueue_raw_bytes(b"y"), 0);

        // Swap the interrupt line; the pending RX interrupt is re-signalled.
        let irq2 = Arc::new(CountIrq::default());
        dev.set_irq_line(irq2.clone());
        assert_eq!(irq2.0.load(Ordering::SeqCst), 1);
        assert_eq!(dev.fifo_capacity(), 0);

        dev.write(0, b"z");
        assert_eq!(&*buf.0.lock().unwrap(), b"z");
    }

    #[test]
    fn the_guest_emptying_the_fifo_wakes_the_input_feeder() {
        let mut dev = SerialDevice::with_writer(Box::new(io::sink()), Arc::new(NoIrq));
        let waker = Arc::new(Waker::new().unwrap());
        dev.enqueue_raw_bytes(b"ab");
        dev.set_input_waker(waker.clone());
        assert!(!waker.drain(), "nothing read yet");
        let mut d = [0u8];
        dev.read(0, &mut d);
        assert!(!waker.drain(), "one byte still in the FIFO");
        dev.read(0, &mut d);
        assert!(waker.drain(), "the FIFO is empty: room for more input");
        // A restored state keeps the waker.
        dev.restore(&SerialState::default()).unwrap();
        dev.enqueue_raw_bytes(b"c");
        dev.read(0, &mut d);
        assert!(waker.drain());
    }

    #[test]
    fn state_round_trip() {
        let mut dev = SerialDevice::new(&SerialOutput::Sink, Arc::new(NoIrq)).unwrap();
        dev.write(3, &[0x83]); // DLAB
        dev.write(0, &[0x01]);
        dev.write(3, &[0x03]);
        dev.write(7, &[0x42]);
        dev.enqueue_raw_bytes(b"q");
        let s = dev.state();
        let mut other = SerialDevice::new(&SerialOutput::Sink, Arc::new(NoIrq)).unwrap();
        other.restore(&s).unwrap();
        assert_eq!(other.state(), s);
        let mut bad = s.clone();
        bad.in_buffer = vec![0; 100_000];
        assert!(other.restore(&bad).is_err());
        let mut bad = s.clone();
        bad.in_buffer = vec![0; FIFO_SIZE + 1];
        assert!(other.restore(&bad).is_err());
        let mut bad = s.clone();
        bad.interrupt_enable = 0x10;
        assert!(other.restore(&bad).is_err());
        let mut bad = s.clone();
        bad.interrupt_identification = 0xc1;
        assert!(other.restore(&bad).is_err());
        assert_eq!(other.state(), s);
        let mut full = s.clone();
        full.in_buffer = vec![b'f'; FIFO_SIZE];
        other.restore(&full).unwrap();
        assert_eq!(other.fifo_capacity(), 0);
    }

    #[test]
    fn state_survives_serde_after_activity() {
        let irq = Arc::new(CountIrq::default());
        let mut dev = SerialDevice::new(&SerialOutput::Sink, irq.clone()).unwrap();
        dev.write(3, &[0x80]); // DLAB
        dev.write(0, &[0x01]); // 115200 baud
        dev.write(1, &[0x00]);
        dev.write(3, &[0x1b]); // 8E1
        dev.write(4, &[0x0b]); // DTR, RTS, OUT2
        dev.write(7, &[0xa5]);
        dev.write(1, &[0x03]); // RX and THR interrupts
        dev.enqueue_raw_bytes(b"pending");
        let mut d = [0u8];
        dev.read(0, &mut d); // the guest reads one byte
        let s = dev.state();
        assert_eq!(s.in_buffer, b"ending");
        let json = serde_json::to_string(&s).unwrap();
        let back: SerialState = serde_json::from_str(&json).unwrap();
        let irq2 = Arc::new(CountIrq::default());
        let mut other = SerialDevice::new(&SerialOutput::Sink, irq2.clone()).unwrap();
        other.restore(&back).unwrap();
        assert_eq!(other.state(), s);
        assert!(
            irq2.0.load(Ordering::SeqCst) >= 1,
            "pending interrupt re-signalled"
        );
        other.read(0, &mut d);
        assert_eq!(d[0], b'e');
        assert!(serde_json::from_str::<SerialState>("{\"scratch\": 300}").is_err());
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = crate::test_util::XorShift(12345);
        let mut bus = Bus::new();
        let irq = Arc::new(CountIrq::default());
        let dev = SerialDevice::with_writer(Box::new(io::sink()), irq)
            .register_com1(&mut bus)
            .unwrap();
        let mut buf = [0u8; 16];
        for _ in 0..50_000 {
            let port = COM1_BASE - 2 + rng.next() % 12;
            let size = (rng.next() % 9) as usize;
            for b in buf.iter_mut() {
                *b = rng.next() as u8;
            }
            if rng.next() & 1 == 0 {
                bus.read(port, &mut buf[..size]);
            } else {
                bus.write(port, &buf[..size]);
            }
            if rng.next().is_multiple_of(64) {
                dev.lock().unwrap().enqueue_raw_bytes(&buf[..size]);
            }
        }
        // Direct calls with offsets the bus would never produce.
        let mut d = dev.lock().unwrap();
        d.read(u64::MAX, &mut buf);
        d.write(u64::MAX - 3, &buf);
        d.write(6, &buf);
        // Whatever the guest did, the state it left restores.
        let st = d.state();
        let mut other = SerialDevice::new(&SerialOutput::Sink, Arc::new(NoIrq)).unwrap();
        other.restore(&st).unwrap();
        assert_eq!(other.state(), st);
    }
}
