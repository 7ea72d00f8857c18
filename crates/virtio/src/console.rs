//! virtio-console (type 3), a single port without VIRTIO_CONSOLE_F_MULTIPORT: receiveq 0
//! carries input to the guest, transmitq 1 its output.
//!
//! Output goes to a sink given at construction (stdout, a file, any writer). Input, if any,
//! goes into a bounded buffer ([`INPUT_CAPACITY`] bytes) and is handed to the guest as
//! receive buffers become available. It is either read by a thread of the device's own
//! (which waits while the buffer is full) or offered by the VMM through a
//! [`ConsoleInputPort`], which never waits: what does not fit stays with the VMM, which is
//! told when the guest made room.

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use devices::exit::Waker;
use devices::{DeviceState, LifecycleError, StateError};
use serde::{Deserialize, Serialize};
use virtio_queue::DescriptorChain;
use vm_memory::GuestMemory;

use crate::rng::COMMON_FEATURES;
use crate::worker::{QueueHandler, Workers};
use crate::{device_type, ActivateError, ActiveQueue, Interrupt, VirtioDevice};

/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Input bytes held for the guest at most.
pub const INPUT_CAPACITY: usize = 4096;
const RECEIVE_QUEUE: u16 = 0;
const TRANSMIT_QUEUE: u16 = 1;
/// struct virtio_console_config: cols, rows, max_nr_ports, emerg_wr; all zero here (no size,
/// no multiport, no emergency write offered).
const CONFIG_LEN: usize = 12;
const STATE_VERSION: u32 = 1;

/// Where the guest's output goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConsoleOutput {
    Stdout,
    /// Appended to this file (created if missing).
    File(PathBuf),
}

/// Where the guest's input comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ConsoleInput {
    #[default]
    None,
    Stdin,
    /// Whatever the VMM offers through [`Console::input_port`] (a terminal or a socket it
    /// serves).
    Port,
}

/// Shared by the input reader thread and the device's worker.
struct InputBuffer {
    state: Mutex<InputState>,
    space: Condvar,
    /// Tells the worker that bytes arrived.
    arrived: Arc<Waker>,
    /// Tells a [`ConsoleInputPort`]'s owner that the guest took input.
    room: Mutex<Option<Arc<Waker>>>,
}

#[derive(Default)]
struct InputState {
    bytes: VecDeque<u8>,
    closed: bool,
}

impl InputBuffer {
    fn new() -> io::Result<InputBuffer> {
        Ok(InputBuffer {
            state: Mutex::new(InputState::default()),
            space: Condvar::new(),
            arrived: Arc::new(Waker::new()?),
            room: Mutex::new(None),
        })
    }

    fn lock(&self) -> MutexGuard<'_, InputState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reader thread: moves bytes from `source` into the buffer until end of input or
    /// until the device goes away.
    fn pump(&self, mut source: Box<dyn Read + Send>) {
        let mut chunk = [0u8; 1024];
        loop {
            let room = {
                let mut state = self.lock();
                while state.bytes.len() >= INPUT_CAPACITY && !state.closed {
                    state = self.space.wait(state).unwrap_or_else(|e| e.into_inner());
                }
                if state.closed {
                    return;
                }
                INPUT_CAPACITY - state.bytes.len()
            };
            let want = room.min(chunk.len());
            let n = match source.read(&mut chunk[..want]) {
                Ok(0) => return,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::warn!("virtio-console: input failed: {e}");
                    return;
                }
            };
            self.lock().bytes.extend(&chunk[..n]);
            self.wake_worker();
        }
    }

    fn wake_worker(&self) {
        if let Err(e) = self.arrived.wake() {
            log::error!("virtio-console: cannot wake the worker: {e}");
        }
    }

    /// Takes up to `max` bytes.
    fn take(&self, max: usize) -> Vec<u8> {
        let mut state = self.lock();
        let n = state.bytes.len().min(max);
        let taken: Vec<u8> = state.bytes.drain(..n).collect();
        drop(state);
        self.space.notify_all();
        let room = self.room.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let (Some(room), false) = (room, taken.is_empty()) {
            if let Err(e) = room.wake() {
                log::error!("virtio-console: cannot tell the input's owner: {e}");
            }
        }
        taken
    }

    fn is_empty(&self) -> bool {
        self.lock().bytes.is_empty()
    }

    fn close(&self) {
        self.lock().closed = true;
        self.space.notify_all();
    }
}

/// The VMM's end of a console's input (see [`ConsoleInput::Port`]).
#[derive(Clone)]
pub struct ConsoleInputPort(Arc<InputBuffer>);

impl ConsoleInputPort {
    /// Takes what fits of `bytes` now and returns how much; never waits for the guest.
    pub fn offer(&self, bytes: &[u8]) -> usize {
        let mut state = self.0.lock();
        let n = bytes
            .len()
            .min(INPUT_CAPACITY - state.bytes.len().min(INPUT_CAPACITY));
        state.bytes.extend(&bytes[..n]);
        drop(state);
        if n > 0 {
            self.0.wake_worker();
        }
        n
    }

    /// `room` is woken whenever the guest takes input.
    pub fn set_room_waker(&self, room: Arc<Waker>) {
        *self.0.room.lock().unwrap_or_else(|e| e.into_inner()) = Some(room);
    }
}

type Sink = Arc<Mutex<Box<dyn Write + Send>>>;

/// Nothing to save: pending input stays with the host.
#[derive(Serialize, Deserialize)]
struct ConsoleState {}

/// A virtio-console device.
pub struct Console {
    output: Sink,
    input: Option<Arc<InputBuffer>>,
    workers: Workers,
}

impl Console {
    /// A console writing to `output` and, if given, reading from `input`.
    pub fn new(output: ConsoleOutput, input: ConsoleInput) -> io::Result<Console> {
        let sink: Box<dyn Write + Send> = match output {
            ConsoleOutput::Stdout => Box::new(io::stdout()),
            ConsoleOutput::File(path) => Box::new(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?,
            ),
        };
        Console::with_sink(sink, input)
    }

    /// A console writing to `output`, its input as `input` says.
    pub fn with_sink(output: Box<dyn Write + Send>, input: ConsoleInput) -> io::Result<Console> {
        match input {
            ConsoleInput::None => Console::with_io(output, None),
            ConsoleInput::Stdin => Console::with_io(output, Some(Box::new(io::stdin()))),
            ConsoleInput::Port => {
                let mut console = Console::with_io(output, None)?;
                console.input = Some(Arc::new(InputBuffer::new()?));
                Ok(console)
            }
        }
    }

    /// Where the VMM offers input, for a console made with [`ConsoleInput::Port`].
    pub fn input_port(&self) -> Option<ConsoleInputPort> {
        self.input.clone().map(ConsoleInputPort)
    }

    /// A console over any writer and reader. A thread reads `input`; it ends at end of
    /// input, or after the console is dropped once its current read returns.
    pub fn with_io(
        output: Box<dyn Write + Send>,
        input: Option<Box<dyn Read + Send>>,
    ) -> io::Result<Console> {
        let input = match input {
            None => None,
            Some(source) => {
                let buffer = Arc::new(InputBuffer::new()?);
                let pump = buffer.clone();
                sandbox::spawn(sandbox::Role::DeviceIo, "virtio-con-in", move || {
                    pump.pump(source)
                })?;
                Some(buffer)
            }
        };
        Ok(Console {
            output: Arc::new(Mutex::new(output)),
            input,
            workers: Workers::default(),
        })
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        if let Some(input) = &self.input {
            input.close();
        }
    }
}

struct ConsoleHandler {
    output: Sink,
    input: Option<Arc<InputBuffer>>,
}

impl ConsoleHandler {
    fn receive<M: GuestMemory>(&mut self, mem: &M, chain: DescriptorChain<&M>) -> u32 {
        let (Some(input), Ok(mut writer)) = (&self.input, chain.writer(mem)) else {
            return 0;
        };
        let bytes = input.take(writer.available_bytes());
        // The writer's buffers were checked when it was made: this cannot fall short.
        if writer.write_all(&bytes).is_err() {
            log::warn!("virtio-console: lost input bytes");
        }
        writer.bytes_written() as u32
    }

    fn transmit<M: GuestMemory>(&mut self, mem: &M, chain: DescriptorChain<&M>) -> u32 {
        let Ok(mut reader) = chain.reader(mem) else {
            return 0;
        };
        let mut sink = self.output.lock().unwrap_or_else(|e| e.into_inner());
        let result = io::copy(&mut reader, &mut *sink).and_then(|_| sink.flush());
        if let Err(e) = result {
            log::warn!("virtio-console: output failed: {e}");
        }
        0
    }
}

impl<M: GuestMemory> QueueHandler<M> for ConsoleHandler {
    fn handle(&mut self, mem: &M, queue: u16, chain: DescriptorChain<&M>) -> u32 {
        match queue {
            RECEIVE_QUEUE => self.receive(mem, chain),
            TRANSMIT_QUEUE => self.transmit(mem, chain),
            _ => 0,
        }
    }

    fn ready(&mut self, queue: u16) -> bool {
        queue != RECEIVE_QUEUE || self.input.as_ref().is_some_and(|i| !i.is_empty())
    }

    fn extra_wakers(&self) -> Vec<Arc<Waker>> {
        self.input.iter().map(|i| i.arrived.clone()).collect()
    }
}

impl<M: GuestMemory + Send + Sync + 'static> VirtioDevice<M> for Console {
    fn device_type(&self) -> u32 {
        device_type::CONSOLE
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE; 2]
    }

    fn features(&self) -> u64 {
        COMMON_FEATURES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        crate::block::read_config_bytes(&[0; CONFIG_LEN], offset, data);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // emerg_wr is only writable with VIRTIO_CONSOLE_F_EMERG_WRITE, not offered.
    }

    fn activate(
        &mut self,
        mem: Arc<M>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        interrupt: Arc<dyn Interrupt>,
    ) -> Result<(), ActivateError> {
        if queues.is_empty() || queues.iter().any(|q| q.index > TRANSMIT_QUEUE) {
            return Err(ActivateError(
                "virtio-console: expected receiveq 0 and transmitq 1".into(),
            ));
        }
        self.workers.stop();
        let handler = ConsoleHandler {
            output: self.output.clone(),
            input: self.input.clone(),
        };
        self.workers.spawn(
            "virtio-console".into(),
            mem,
            acked_features,
            queues,
            interrupt,
            handler,
        )
    }

    fn workers(&self) -> Option<&Workers> {
        Some(&self.workers)
    }

    fn workers_mut(&mut self) -> Option<&mut Workers> {
        Some(&mut self.workers)
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(STATE_VERSION, &ConsoleState {})
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        state
            .parse::<ConsoleState>("virtio-console", STATE_VERSION)
            .map(drop)
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::time::{Duration, Instant};

    use vm_memory::{Address, GuestMemoryMmap};

    use super::*;
    use crate::test_driver::{Buf, TestDriver};

    /// A writer tests can read back.
    #[derive(Clone, Default)]
    struct SharedSink(Arc<Mutex<Vec<u8>>>);

    impl Write for SharedSink {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn activate(console: &mut Console, driver: &TestDriver) {
        let features = VirtioDevice::<GuestMemoryMmap>::features(console);
        console
            .activate(
                driver.mem.clone(),
                features,
                driver.active_queues(),
                driver.interrupt(),
            )
            .unwrap();
    }

    fn transmit(driver: &mut TestDriver, text: &[u8]) {
        let buf = driver.alloc(text.len() as u64);
        driver.write(buf, text);
        let split = text.len() as u32 / 2;
        driver.add_chain(
            1,
            &[
                Buf::r(buf, split),
                Buf::r(buf.unchecked_add(split.into()), text.len() as u32 - split),
            ],
        );
        driver.kick(1);
        assert_eq!(driver.wait_used(1, 1)[0].1, 0);
    }

    #[test]
    fn transmitted_bytes_reach_the_sink() {
        let sink = SharedSink::default();
        let mut console = Console::with_io(Box::new(sink.clone()), None).unwrap();
        let mut driver = TestDriver::new(&[QUEUE_SIZE, QUEUE_SIZE]);
        activate(&mut console, &driver);
        transmit(&mut driver, b"hello, ");
        transmit(&mut driver, b"virtio console\n");
        assert_eq!(
            sink.0.lock().unwrap().as_slice(),
            b"hello, virtio console\n"
        );
        // Without input, receive buffers stay with the device.
        let rx = driver.alloc(16);
        driver.add_chain(0, &[Buf::w(rx, 16)]);
        driver.kick(0);
        driver.assert_no_used(0, Duration::from_millis(30));
    }

    #[test]
    fn transmitted_bytes_reach_a_file() {
        let path = std::env::temp_dir().join(format!("ferrovm-console-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut console =
            Console::new(ConsoleOutput::File(path.clone()), ConsoleInput::None).unwrap();
        let mut driver = TestDriver::new(&[QUEUE_SIZE, QUEUE_SIZE]);
        activate(&mut console, &driver);
        transmit(&mut driver, b"to a file\n");
        drop(console);
        assert_eq!(std::fs::read(&path).unwrap(), b"to a file\n");
        let _ = std::fs::remove_file(&path);
        let err = Console::new(
            ConsoleOutput::File("/nonexistent/dir/x".into()),
            ConsoleInput::None,
        );
        assert!(err
            .err()
            .unwrap()
            .to_string()
            .contains("/nonexistent/dir/x"));
    }

    /// The VMM's port takes what fits, says when the guest made room, and what it offered
    /// reaches the guest in order.
    #[test]
    fn offered_input_is_bounded_and_room_is_signalled() {
        let mut console = Console::with_sink(Box::new(io::sink()), ConsoleInput::Port).unwrap();
        let port = console.input_port().unwrap();
        let room = Arc::new(Waker::new().unwrap());
        port.set_room_waker(room.clone());
        let typed: Vec<u8> = (0..INPUT_CAPACITY as u32 + 500).map(|i| i as u8).collect();
        let taken = port.offer(&typed);
        assert_eq!(taken, INPUT_CAPACITY, "the buffer is bounded");
        assert_eq!(
            port.offer(&typed[taken..]),
            0,
            "a full buffer takes nothing"
        );
        assert!(!room.drain(), "no room before the guest took anything");

        let mut driver = TestDriver::new(&[QUEUE_SIZE, QUEUE_SIZE]);
        activate(&mut console, &driver);
        let first = driver.alloc(1000);
        driver.add_chain(0, &[Buf::w(first, 1000)]);
        driver.kick(0);
        assert_eq!(driver.wait_used(0, 1)[0].1, 1000);
        assert!(room.drain(), "the guest's read made room and said so");
        let rest = &typed[taken..];
        assert_eq!(port.offer(rest), rest.len());
        let mut received = driver.read(first, 1000);
        while received.len() < typed.len() {
            let b = driver.alloc(2048);
            driver.add_chain(0, &[Buf::w(b, 2048)]);
            driver.kick(0);
            let (_, len) = driver.wait_used(0, 1)[0];
            received.extend(driver.read(b, len as usize));
        }
        assert_eq!(received, typed);
    }

    #[test]
    fn input_fills_receive_buffers_in_order_and_stays_bounded() {
        let input: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        let mut console = Console::with_io(
            Box::new(io::sink()),
            Some(Box::new(io::Cursor::new(input.clone()))),
        )
        .unwrap();
        let buffer = console.input.clone().unwrap();
        // Before any receive buffer, the reader stops at the bound.
        let deadline = Instant::now() + Duration::from_secs(5);
        while buffer.lock().bytes.len() < INPUT_CAPACITY {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(buffer.lock().bytes.len(), INPUT_CAPACITY);

        let mut driver = TestDriver::new(&[QUEUE_SIZE, QUEUE_SIZE]);
        activate(&mut console, &driver);
        let mut received = Vec::new();
        // Each buffer completes once some input is there, with what is there.
        while received.len() < input.len() {
            let b = driver.alloc(1000);
            driver.add_chain(0, &[Buf::w(b, 1000)]);
            driver.kick(0);
            let (_, len) = driver.wait_used(0, 1)[0];
            assert!(len > 0 && len <= 1000);
            received.extend(driver.read(b, len as usize));
        }
        assert_eq!(received, input);
    }
}

/// The virtio console as a device kind (`--console virtio`): it writes where the serial
/// port does. Nothing to configure.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleConfig {}

impl<M: GuestMemory + Send + Sync + 'static> crate::kind::DeviceKind<M> for ConsoleConfig {
    const SYNTAX: &'static str = "virtio|serial";
    const HELP: &'static str = "`virtio`: add a virtio console (hvc0) that writes where \
        --serial writes and takes the console's input (the terminal or the socket client) \
        instead of COM1";
    const SHAPE: crate::kind::OptionShape = crate::kind::OptionShape::Once;

    fn parse(text: &str) -> Result<Option<Self>, String> {
        match text {
            "virtio" => Ok(Some(ConsoleConfig {})),
            "serial" => Ok(None),
            _ => Err("expected virtio or serial".into()),
        }
    }

    fn label(&self) -> String {
        "virtio".into()
    }

    fn create(
        &self,
        ctx: &crate::kind::BuildContext<M>,
    ) -> Result<Box<dyn VirtioDevice<M>>, String> {
        let mut made = ctx.console.lock().unwrap_or_else(|e| e.into_inner());
        let console = made
            .take()
            .ok_or("the machine made no console for the virtio console")?;
        Ok(Box::new(console))
    }

    fn guest_difference(&self, _recorded: &Self) -> Option<String> {
        None
    }
}
