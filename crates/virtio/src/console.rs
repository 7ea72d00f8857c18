//! virtio-console (type 3), a single port without VIRTIO_CONSOLE_F_MULTIPORT: receiveq 0
//! carries input to the guest, transmitq 1 its output.
//!
//! Output goes to a sink given at construction (stdout, a file, any writer). Input, if any,
//! is read by a thread of its own into a bounded buffer ([`INPUT_CAPACITY`] bytes: the reader
//! waits while it is full) and handed to the guest as receive buffers become available.

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
}

/// Shared by the input reader thread and the device's worker.
struct InputBuffer {
    state: Mutex<InputState>,
    space: Condvar,
    /// Tells the worker that bytes arrived.
    arrived: Arc<Waker>,
}

#[derive(Default)]
struct InputState {
    bytes: VecDeque<u8>,
    closed: bool,
}

impl InputBuffer {
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
            if let Err(e) = self.arrived.wake() {
                log::error!("virtio-console: cannot wake the worker: {e}");
            }
        }
    }

    /// Takes up to `max` bytes.
    fn take(&self, max: usize) -> Vec<u8> {
        let mut state = self.lock();
        let n = state.bytes.len().min(max);
        let taken = state.bytes.drain(..n).collect();
        drop(state);
        self.space.notify_all();
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
        let source: Option<Box<dyn Read + Send>> = match input {
            ConsoleInput::None => None,
            ConsoleInput::Stdin => Some(Box::new(io::stdin())),
        };
        Console::with_io(sink, source)
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
                let buffer = Arc::new(InputBuffer {
                    state: Mutex::new(InputState::default()),
                    space: Condvar::new(),
                    arrived: Arc::new(Waker::new()?),
                });
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
    const HELP: &'static str =
        "`virtio`: add a virtio console (hvc0) writing where --serial writes";
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
        let output = ctx.console_output.clone()?;
        let console = Console::new(output, ConsoleInput::None).map_err(|e| e.to_string())?;
        Ok(Box::new(console))
    }

    fn guest_difference(&self, _recorded: &Self) -> Option<String> {
        None
    }
}
