//! The PS/2 controller, reduced to what a VM needs: the CPU reset line, a
//! keyboard that can only press Ctrl+Alt+Del (the operator's
//! `SendCtrlAltDel`), and enough of the controller protocol that a guest
//! driver probing it gets quick, consistent answers instead of waiting for
//! timeouts.
//!
//! Guests reset a PC by pulsing the i8042's reset output (command 0xFE on
//! port 0x64): it is among the methods Linux tries on reboot (`reboot=k`),
//! and what most bare-metal code uses. No mouse is behind it and bytes sent
//! to the devices are dropped (a Linux guest needs `i8042.dumbkbd` to bind
//! its keyboard driver without probing). Key bytes wait in a bounded queue
//! and move one at a time into the output buffer, each raising IRQ 1 (edge)
//! when the configuration byte enables the keyboard interrupt.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::bus::{Bus, BusDeviceMut, BusError};
use crate::exit::{ExitReason, ExitRequest};
use crate::irqchip::IrqPin;
use crate::lifecycle::{DeviceState, Lifecycle, LifecycleError};
use crate::state::StateError;

/// Data port (read: output buffer, write: device data / command parameter).
pub const DATA_PORT: u64 = 0x60;
/// Status (read) / command (write) port.
pub const COMMAND_PORT: u64 = 0x64;

/// Device offsets: the device is inserted at both ports with offsets equal
/// to `port - 0x60`, so port 0x61 (system control port B) stays free.
const DATA_OFFSET: u64 = 0;
const COMMAND_OFFSET: u64 = COMMAND_PORT - DATA_PORT;

// Status register bits.
const STATUS_OBF: u8 = 0x01;
const STATUS_SYS: u8 = 0x04;
const STATUS_CMD: u8 = 0x08;
const STATUS_UNLOCKED: u8 = 0x10;

// Controller configuration byte bits.
const CTR_KBD_INT: u8 = 0x01;
const CTR_SYS: u8 = 0x04;
const CTR_KBD_DISABLE: u8 = 0x10;
const CTR_AUX_DISABLE: u8 = 0x20;
const CTR_XLATE: u8 = 0x40;

// Controller commands.
const CMD_READ_CTR: u8 = 0x20;
const CMD_WRITE_CTR: u8 = 0x60;
const CMD_AUX_DISABLE: u8 = 0xa7;
const CMD_AUX_ENABLE: u8 = 0xa8;
const CMD_AUX_TEST: u8 = 0xa9;
const CMD_SELF_TEST: u8 = 0xaa;
const CMD_KBD_TEST: u8 = 0xab;
const CMD_KBD_DISABLE: u8 = 0xad;
const CMD_KBD_ENABLE: u8 = 0xae;
const CMD_READ_OUTPUT_PORT: u8 = 0xd0;
const CMD_WRITE_OUTPUT_PORT: u8 = 0xd1;
const CMD_WRITE_KBD_OUTBUF: u8 = 0xd2;
const CMD_WRITE_AUX_OUTBUF: u8 = 0xd3;
const CMD_WRITE_AUX: u8 = 0xd4;

/// The keyboard's ISA interrupt line.
pub const KEYBOARD_IRQ: u32 = 1;
/// Key bytes the keyboard holds until the guest reads them.
pub const KEYBOARD_QUEUE_BYTES: usize = 16;

/// Ctrl, Alt, Del pressed, then released, as the guest reads them with
/// translation on (scancode set 1).
const CTRL_ALT_DEL_SET1: [u8; 8] = [0x1d, 0x38, 0xe0, 0x53, 0xe0, 0xd3, 0xb8, 0x9d];
/// The same in set 2, what the keyboard sends with translation off.
const CTRL_ALT_DEL_SET2: [u8; 11] = [
    0x14, 0x11, 0xe0, 0x71, 0xe0, 0xf0, 0x71, 0xf0, 0x11, 0xf0, 0x14,
];

/// What the keyboard answers: acknowledge, self-test passed, resend (unknown command), echo.
const KBD_ACK: u8 = 0xfa;
const KBD_SELF_TEST_PASSED: u8 = 0xaa;
const KBD_RESEND: u8 = 0xfe;
const KBD_ECHO: u8 = 0xee;
/// Keyboard commands followed by a parameter byte: set LEDs, set typematic rate, get/set
/// scancode set.
const KBD_CMD_SET_LEDS: u8 = 0xed;
const KBD_CMD_SET_RATE: u8 = 0xf3;
const KBD_CMD_SCANCODE_SET: u8 = 0xf0;
const KBD_CMD_GET_ID: u8 = 0xf2;
const KBD_CMD_RESET: u8 = 0xff;
/// An MF2 keyboard's ID, second byte as the guest reads it without and with translation.
const KBD_ID: [u8; 2] = [0xab, 0x83];
const KBD_ID_TRANSLATED: [u8; 2] = [0xab, 0x41];

/// Output port bit 0 drives the CPU reset line (active low).
const OUTPUT_PORT_RESET: u8 = 0x01;
/// Output port as read back: reset line high, A20 enabled.
const OUTPUT_PORT_DEFAULT: u8 = 0x03;

/// Guest-visible state, for snapshots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct I8042State {
    /// Controller configuration byte ("command byte").
    pub ctr: u8,
    /// Byte waiting in the output buffer, if any.
    pub output: Option<u8>,
    /// A command written to port 0x64 that takes a parameter byte on 0x60.
    pub pending_command: Option<u8>,
    /// Whether the last byte written went to the command port.
    pub last_write_was_command: bool,
    /// Key bytes not yet moved into the output buffer (absent in old snapshots).
    #[serde(default)]
    pub keyboard_queue: VecDeque<u8>,
    /// Key bytes dropped because the queue was full.
    #[serde(default)]
    pub keyboard_dropped: u64,
    /// A keyboard command waiting for its parameter byte (absent in old snapshots).
    #[serde(default)]
    pub keyboard_command: Option<u8>,
}

impl Default for I8042State {
    fn default() -> Self {
        I8042State {
            ctr: CTR_KBD_INT | CTR_SYS | CTR_XLATE,
            output: None,
            pending_command: None,
            last_write_was_command: false,
            keyboard_queue: VecDeque::new(),
            keyboard_dropped: 0,
            keyboard_command: None,
        }
    }
}

/// The keyboard queue cannot take a whole key sequence: nothing of it was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyboardQueueFull {
    /// Bytes waiting for the guest.
    pub queued: usize,
}

impl std::fmt::Display for KeyboardQueueFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the i8042 keyboard queue is full ({} bytes the guest has not read)",
            self.queued
        )
    }
}

impl std::error::Error for KeyboardQueueFull {}

/// The i8042 controller.
#[derive(Debug)]
pub struct I8042 {
    state: I8042State,
    exit: Arc<ExitRequest>,
    keyboard_irq: IrqPin,
}

impl I8042 {
    /// A controller whose reset line ends the VM through `exit`.
    pub fn new(exit: Arc<ExitRequest>) -> Self {
        I8042 {
            state: I8042State::default(),
            exit,
            keyboard_irq: IrqPin::disconnected(KEYBOARD_IRQ),
        }
    }

    /// Connects the keyboard interrupt (ISA IRQ 1).
    pub fn with_keyboard_irq(mut self, irq: IrqPin) -> Self {
        self.keyboard_irq = irq;
        self
    }

    /// Presses and releases Ctrl, Alt and Del, in the scancode set the guest
    /// configured (set 1 when the controller translates, else set 2). The
    /// whole sequence is queued or, when it does not fit, none of it.
    pub fn send_ctrl_alt_del(&mut self) -> Result<(), KeyboardQueueFull> {
        let keys: &[u8] = if self.state.ctr & CTR_XLATE != 0 {
            &CTRL_ALT_DEL_SET1
        } else {
            &CTRL_ALT_DEL_SET2
        };
        self.queue_keys(keys)
    }

    fn queue_keys(&mut self, keys: &[u8]) -> Result<(), KeyboardQueueFull> {
        let queue = &mut self.state.keyboard_queue;
        if queue.len() + keys.len() > KEYBOARD_QUEUE_BYTES {
            self.state.keyboard_dropped += keys.len() as u64;
            return Err(KeyboardQueueFull {
                queued: queue.len(),
            });
        }
        queue.extend(keys);
        self.deliver_key_byte();
        Ok(())
    }

    /// Key bytes dropped because the queue was full.
    pub fn keyboard_dropped(&self) -> u64 {
        self.state.keyboard_dropped
    }

    /// Moves the next key byte into an empty output buffer, unless the guest
    /// disabled the keyboard, and interrupts if it enabled that.
    fn deliver_key_byte(&mut self) {
        if self.state.output.is_some() || self.state.ctr & CTR_KBD_DISABLE != 0 {
            return;
        }
        let Some(byte) = self.state.keyboard_queue.pop_front() else {
            return;
        };
        self.state.output = Some(byte);
        if self.state.ctr & CTR_KBD_INT != 0 {
            self.keyboard_irq.pulse();
        }
    }

    /// Moves the controller onto `bus` at ports 0x60 and 0x64 (only those).
    pub fn register(self, bus: &mut Bus) -> Result<Arc<Mutex<Self>>, BusError> {
        let dev = Arc::new(Mutex::new(self));
        bus.insert_with_offset(dev.clone(), DATA_PORT, 1, DATA_OFFSET)?;
        bus.insert_with_offset(dev.clone(), COMMAND_PORT, 1, COMMAND_OFFSET)?;
        Ok(dev)
    }

    /// The guest-visible state.
    pub fn state(&self) -> I8042State {
        self.state.clone()
    }

    /// Restores a state captured by [`I8042::state`]. A pending command that
    /// takes no parameter byte is refused (the controller never holds one), as
    /// is a keyboard queue longer than the controller's.
    pub fn restore(&mut self, state: &I8042State) -> Result<(), StateError> {
        if state.keyboard_queue.len() > KEYBOARD_QUEUE_BYTES {
            return Err(StateError::new(
                "i8042",
                format!(
                    "{} queued key bytes, more than {KEYBOARD_QUEUE_BYTES}",
                    state.keyboard_queue.len()
                ),
            ));
        }
        if let Some(cmd) = state.keyboard_command {
            if !keyboard_takes_parameter(cmd) {
                return Err(StateError::new(
                    "i8042",
                    format!("pending keyboard command {cmd:#04x} takes no parameter"),
                ));
            }
        }
        if let Some(cmd) = state.pending_command {
            if !takes_parameter(cmd) {
                return Err(StateError::new(
                    "i8042",
                    format!("pending command {cmd:#04x} takes no parameter"),
                ));
            }
        }
        self.state = state.clone();
        Ok(())
    }

    fn status(&self) -> u8 {
        let mut s = STATUS_UNLOCKED;
        if self.state.output.is_some() {
            s |= STATUS_OBF;
        }
        if self.state.ctr & CTR_SYS != 0 {
            s |= STATUS_SYS;
        }
        if self.state.last_write_was_command {
            s |= STATUS_CMD;
        }
        s
    }

    fn pulse_cpu_reset(&self) {
        log::debug!("i8042: guest pulsed the CPU reset line");
        self.exit.request(ExitReason::Reset);
    }

    fn command(&mut self, cmd: u8) {
        self.state.last_write_was_command = true;
        self.state.pending_command = None;
        match cmd {
            CMD_READ_CTR => self.state.output = Some(self.state.ctr),
            // The rest of the controller RAM reads as zero.
            0x21..=0x3f => self.state.output = Some(0),
            _ if takes_parameter(cmd) => self.state.pending_command = Some(cmd),
            CMD_AUX_DISABLE => self.state.ctr |= CTR_AUX_DISABLE,
            CMD_AUX_ENABLE => self.state.ctr &= !CTR_AUX_DISABLE,
            // No mouse: report "clock line stuck low" so the probe fails fast.
            CMD_AUX_TEST => self.state.output = Some(0x01),
            CMD_SELF_TEST => self.state.output = Some(0x55),
            CMD_KBD_TEST => self.state.output = Some(0x00),
            CMD_KBD_DISABLE => self.state.ctr |= CTR_KBD_DISABLE,
            CMD_KBD_ENABLE => self.state.ctr &= !CTR_KBD_DISABLE,
            CMD_READ_OUTPUT_PORT => self.state.output = Some(OUTPUT_PORT_DEFAULT),
            // 0xf0-0xff pulse output port bits 0-3 where the command has a 0;
            // bit 0 is the reset line. 0xfe is the classic reset.
            0xf0..=0xff if cmd & OUTPUT_PORT_RESET == 0 => self.pulse_cpu_reset(),
            _ => {}
        }
        self.deliver_key_byte();
    }

    fn data(&mut self, value: u8) {
        self.state.last_write_was_command = false;
        match self.state.pending_command.take() {
            Some(CMD_WRITE_CTR) => self.state.ctr = value,
            Some(CMD_WRITE_OUTPUT_PORT) if value & OUTPUT_PORT_RESET == 0 => self.pulse_cpu_reset(),
            Some(CMD_WRITE_KBD_OUTBUF) => self.state.output = Some(value),
            // RAM bytes other than the CTR, output port writes that keep
            // the reset line high, bytes for the (absent) mouse.
            Some(_) => {}
            None => self.keyboard_byte(value),
        }
        self.deliver_key_byte();
    }

    /// A byte for the keyboard: a command or a command's parameter. The keyboard answers
    /// what an MF2 keyboard answers (ACK, its ID, its self-test result), which is what a
    /// driver (Linux's atkbd) probes before it takes the keyboard, and so before a
    /// Ctrl+Alt+Del from the API can reach it.
    fn keyboard_byte(&mut self, value: u8) {
        if let Some(cmd) = self.state.keyboard_command.take() {
            let asks_for_set = cmd == KBD_CMD_SCANCODE_SET && value == 0;
            self.keyboard_reply(if asks_for_set {
                &[KBD_ACK, 2]
            } else {
                &[KBD_ACK]
            });
            return;
        }
        match value {
            cmd if keyboard_takes_parameter(cmd) => {
                self.state.keyboard_command = Some(cmd);
                self.keyboard_reply(&[KBD_ACK]);
            }
            KBD_CMD_GET_ID => {
                let id = if self.state.ctr & CTR_XLATE != 0 {
                    KBD_ID_TRANSLATED
                } else {
                    KBD_ID
                };
                self.keyboard_reply(&[KBD_ACK, id[0], id[1]]);
            }
            KBD_ECHO => self.keyboard_reply(&[KBD_ECHO]),
            KBD_CMD_RESET => {
                self.state.keyboard_queue.clear();
                self.keyboard_reply(&[KBD_ACK, KBD_SELF_TEST_PASSED]);
            }
            // Enable, disable, defaults and the typematic/make-break modes.
            0xf4..=0xfe => self.keyboard_reply(&[KBD_ACK]),
            _ => self.keyboard_reply(&[KBD_RESEND]),
        }
    }

    /// Queues the keyboard's answer; if the queue is full, the oldest key bytes give way
    /// (a driver waiting for an answer must get it).
    fn keyboard_reply(&mut self, bytes: &[u8]) {
        let queue = &mut self.state.keyboard_queue;
        while queue.len() + bytes.len() > KEYBOARD_QUEUE_BYTES {
            queue.pop_front();
            self.state.keyboard_dropped += 1;
        }
        queue.extend(bytes);
    }
}

/// Keyboard commands followed by a parameter byte.
fn keyboard_takes_parameter(cmd: u8) -> bool {
    matches!(
        cmd,
        KBD_CMD_SET_LEDS | KBD_CMD_SET_RATE | KBD_CMD_SCANCODE_SET
    )
}

/// Commands followed by a parameter byte on the data port.
fn takes_parameter(cmd: u8) -> bool {
    matches!(
        cmd,
        CMD_WRITE_CTR
            ..=0x7f
                | CMD_WRITE_OUTPUT_PORT
                | CMD_WRITE_KBD_OUTBUF
                | CMD_WRITE_AUX_OUTBUF
                | CMD_WRITE_AUX
    )
}

impl BusDeviceMut for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let Some((first, rest)) = data.split_first_mut() else {
            return;
        };
        *first = match offset {
            // Real hardware repeats the last byte when the buffer is empty;
            // nobody should rely on it, and 0 reads as "no key".
            DATA_OFFSET => {
                let byte = self.state.output.take().unwrap_or(0);
                self.deliver_key_byte();
                byte
            }
            COMMAND_OFFSET => self.status(),
            _ => 0xff,
        };
        rest.fill(0xff);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else {
            return;
        };
        match offset {
            DATA_OFFSET => self.data(value),
            COMMAND_OFFSET => self.command(value),
            _ => {}
        }
    }
}

/// Layout version of the state [`Lifecycle::save`] writes: an [`I8042State`].
pub const I8042_STATE_VERSION: u32 = 1;

/// The controller only answers port accesses: pause and resume have nothing to do.
impl Lifecycle for I8042 {
    fn id(&self) -> String {
        "i8042".into()
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(I8042_STATE_VERSION, &self.state())
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        I8042::restore(self, &state.parse("i8042", I8042_STATE_VERSION)?)
    }

    /// The power-on configuration byte, nothing buffered, queued or pending.
    fn reset(&mut self) {
        self.state = I8042State::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (Arc<ExitRequest>, Bus, Arc<Mutex<I8042>>) {
        let exit = Arc::new(ExitRequest::new().unwrap());
        let mut bus = Bus::new();
        let dev = I8042::new(exit.clone()).register(&mut bus).unwrap();
        (exit, bus, dev)
    }

    fn inb(bus: &Bus, port: u64) -> u8 {
        let mut d = [0u8];
        assert!(bus.read(port, &mut d), "port {port:#x} unclaimed");
        d[0]
    }

    #[test]
    fn reset_via_fe() {
        let (exit, bus, _) = setup();
        assert!(bus.write(COMMAND_PORT, &[0xff])); // pulses nothing
        assert!(!exit.is_requested());
        assert!(bus.write(COMMAND_PORT, &[0xfe]));
        assert_eq!(exit.reason(), Some(ExitReason::Reset));
    }

    #[test]
    fn reset_via_output_port() {
        let (exit, bus, _) = setup();
        bus.write(COMMAND_PORT, &[CMD_WRITE_OUTPUT_PORT]);
        bus.write(DATA_PORT, &[0x03]);
        assert!(!exit.is_requested());
        bus.write(COMMAND_PORT, &[CMD_WRITE_OUTPUT_PORT]);
        bus.write(DATA_PORT, &[0x02]);
        assert_eq!(exit.reason(), Some(ExitReason::Reset));
    }

    #[test]
    fn status_and_probe() {
        let (exit, bus, dev) = setup();
        let st = inb(&bus, COMMAND_PORT);
        assert_eq!(st & (STATUS_OBF | 0x02), 0, "no data, input buffer empty");
        assert_ne!(st, 0xff, "present");
        assert!(!bus.is_claimed(0x61) && !bus.is_claimed(0x62));

        bus.write(COMMAND_PORT, &[CMD_SELF_TEST]);
        assert_eq!(inb(&bus, COMMAND_PORT) & STATUS_OBF, STATUS_OBF);
        assert_eq!(inb(&bus, DATA_PORT), 0x55);
        assert_eq!(inb(&bus, COMMAND_PORT) & STATUS_OBF, 0);

        bus.write(COMMAND_PORT, &[CMD_READ_CTR]);
        let ctr = inb(&bus, DATA_PORT);
        bus.write(COMMAND_PORT, &[CMD_WRITE_CTR]);
        bus.write(DATA_PORT, &[ctr & !CTR_KBD_INT]);
        bus.write(COMMAND_PORT, &[CMD_READ_CTR]);
        assert_eq!(inb(&bus, DATA_PORT), ctr & !CTR_KBD_INT);

        // The keyboard answers its ID (the interrupt is off, so the driver polls).
        bus.write(DATA_PORT, &[0xf2]);
        let id: Vec<u8> = (0..3).map(|_| inb(&bus, DATA_PORT)).collect();
        assert_eq!(id, [KBD_ACK, 0xab, 0x41], "translated MF2 ID");
        assert_eq!(inb(&bus, COMMAND_PORT) & STATUS_OBF, 0);
        assert!(!exit.is_requested());

        let s = dev.lock().unwrap().state();
        let mut other = I8042::new(Arc::new(ExitRequest::new().unwrap()));
        other.restore(&s).unwrap();
        assert_eq!(other.state(), s);
    }

    #[test]
    fn state_survives_serde_after_activity() {
        let (_exit, bus, dev) = setup();
        bus.write(COMMAND_PORT, &[CMD_KBD_DISABLE]);
        bus.write(COMMAND_PORT, &[CMD_SELF_TEST]); // 0x55 waits in the output buffer
        bus.write(COMMAND_PORT, &[CMD_WRITE_KBD_OUTBUF]); // waits for its parameter
        let s = dev.lock().unwrap().state();
        assert_eq!(s.output, Some(0x55));
        assert_eq!(s.pending_command, Some(CMD_WRITE_KBD_OUTBUF));
        let json = serde_json::to_string(&s).unwrap();
        let back: I8042State = serde_json::from_str(&json).unwrap();

        let (_exit2, bus2, dev2) = setup();
        dev2.lock().unwrap().restore(&back).unwrap();
        assert_eq!(dev2.lock().unwrap().state(), s);
        assert_eq!(inb(&bus2, COMMAND_PORT) & STATUS_CMD, STATUS_CMD);
        // The restored controller finishes the command it was in.
        bus2.write(DATA_PORT, &[0x99]);
        assert_eq!(inb(&bus2, DATA_PORT), 0x99);
        bus2.write(COMMAND_PORT, &[CMD_READ_CTR]);
        assert_ne!(inb(&bus2, DATA_PORT) & CTR_KBD_DISABLE, 0);

        let mut bad = s;
        bad.pending_command = Some(CMD_SELF_TEST);
        assert!(dev2.lock().unwrap().restore(&bad).is_err());
        assert!(serde_json::from_str::<I8042State>("{\"ctr\": 1}").is_err());
    }

    /// Counts pulses of one line.
    #[derive(Default)]
    struct CountingChip(std::sync::atomic::AtomicUsize);

    impl crate::irqchip::IrqChip for CountingChip {
        fn set_irq(&self, gsi: u32, level: bool) {
            if gsi == KEYBOARD_IRQ && level {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
    }

    impl CountingChip {
        fn count(&self) -> usize {
            self.0.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    fn keyboard_setup() -> (Arc<CountingChip>, Bus, Arc<Mutex<I8042>>) {
        let chip = Arc::new(CountingChip::default());
        let mut bus = Bus::new();
        let pin = IrqPin::new(chip.clone(), KEYBOARD_IRQ);
        let dev = I8042::new(Arc::new(ExitRequest::new().unwrap()))
            .with_keyboard_irq(pin)
            .register(&mut bus)
            .unwrap();
        (chip, bus, dev)
    }

    fn write_ctr(bus: &Bus, ctr: u8) {
        bus.write(COMMAND_PORT, &[CMD_WRITE_CTR]);
        bus.write(DATA_PORT, &[ctr]);
    }

    /// Reads key bytes while the status says one is there (bounded).
    fn read_keys(bus: &Bus) -> Vec<u8> {
        let mut keys = Vec::new();
        for _ in 0..64 {
            if inb(bus, COMMAND_PORT) & STATUS_OBF == 0 {
                break;
            }
            keys.push(inb(bus, DATA_PORT));
        }
        keys
    }

    #[test]
    fn ctrl_alt_del_set1_one_interrupt_per_byte() {
        let (chip, bus, dev) = keyboard_setup();
        assert_eq!(inb(&bus, COMMAND_PORT) & STATUS_OBF, 0);
        dev.lock().unwrap().send_ctrl_alt_del().unwrap();
        assert_eq!(inb(&bus, COMMAND_PORT) & STATUS_OBF, STATUS_OBF);
        assert_eq!(chip.count(), 1, "one edge for the first byte");
        assert_eq!(read_keys(&bus), CTRL_ALT_DEL_SET1);
        assert_eq!(chip.count(), 8, "one edge per byte");
        assert!(dev.lock().unwrap().state().keyboard_queue.is_empty());
        assert_eq!(inb(&bus, DATA_PORT), 0, "empty buffer");
    }

    #[test]
    fn ctrl_alt_del_set2_without_translation() {
        let (chip, bus, dev) = keyboard_setup();
        write_ctr(&bus, CTR_KBD_INT | CTR_SYS);
        dev.lock().unwrap().send_ctrl_alt_del().unwrap();
        assert_eq!(read_keys(&bus), CTRL_ALT_DEL_SET2);
        assert_eq!(chip.count(), CTRL_ALT_DEL_SET2.len());
    }

    #[test]
    fn command_byte_gates_interrupt_and_keyboard() {
        let (chip, bus, dev) = keyboard_setup();
        // Interrupt off: the byte is there to poll, no edge.
        write_ctr(&bus, CTR_SYS | CTR_XLATE);
        dev.lock().unwrap().send_ctrl_alt_del().unwrap();
        assert_eq!(chip.count(), 0);
        assert_eq!(read_keys(&bus), CTRL_ALT_DEL_SET1);
        assert_eq!(chip.count(), 0);
        // Keyboard disabled (command 0xad): bytes wait in the queue.
        write_ctr(&bus, CTR_KBD_INT | CTR_SYS | CTR_XLATE);
        bus.write(COMMAND_PORT, &[CMD_KBD_DISABLE]);
        dev.lock().unwrap().send_ctrl_alt_del().unwrap();
        assert_eq!(inb(&bus, COMMAND_PORT) & STATUS_OBF, 0);
        assert_eq!(chip.count(), 0);
        // A controller reply goes first; keys follow once the keyboard is enabled.
        bus.write(COMMAND_PORT, &[CMD_SELF_TEST]);
        assert_eq!(inb(&bus, DATA_PORT), 0x55);
        assert_eq!(inb(&bus, COMMAND_PORT) & STATUS_OBF, 0);
        bus.write(COMMAND_PORT, &[CMD_KBD_ENABLE]);
        assert_eq!(chip.count(), 1);
        assert_eq!(read_keys(&bus), CTRL_ALT_DEL_SET1);
        // Disabled through the command byte (bit 4), enabled by rewriting it.
        write_ctr(&bus, CTR_KBD_INT | CTR_KBD_DISABLE | CTR_XLATE);
        dev.lock().unwrap().send_ctrl_alt_del().unwrap();
        assert_eq!(inb(&bus, COMMAND_PORT) & STATUS_OBF, 0);
        write_ctr(&bus, CTR_KBD_INT | CTR_XLATE);
        assert_eq!(read_keys(&bus), CTRL_ALT_DEL_SET1);
    }

    #[test]
    fn full_queue_drops_whole_sequence_and_counts() {
        let (_chip, bus, dev) = keyboard_setup();
        write_ctr(&bus, CTR_KBD_INT | CTR_KBD_DISABLE | CTR_XLATE);
        let mut d = dev.lock().unwrap();
        d.send_ctrl_alt_del().unwrap();
        d.send_ctrl_alt_del().unwrap(); // 16 bytes: exactly full
        let err = d.send_ctrl_alt_del().unwrap_err();
        assert_eq!(err.queued, KEYBOARD_QUEUE_BYTES);
        assert_eq!(d.keyboard_dropped(), 8);
        assert_eq!(d.state().keyboard_queue.len(), KEYBOARD_QUEUE_BYTES);
        drop(d);
        write_ctr(&bus, CTR_KBD_INT | CTR_XLATE);
        let keys = read_keys(&bus);
        assert_eq!(keys.len(), 16);
        assert_eq!(keys[..8], keys[8..]);
    }

    #[test]
    fn keyboard_queue_saved_restored_and_reset() {
        let (_chip, bus, dev) = keyboard_setup();
        bus.write(COMMAND_PORT, &[CMD_KBD_DISABLE]);
        dev.lock().unwrap().send_ctrl_alt_del().unwrap();
        let saved = dev.lock().unwrap().save().unwrap();
        let (_chip2, bus2, dev2) = keyboard_setup();
        Lifecycle::restore(&mut *dev2.lock().unwrap(), &saved).unwrap();
        bus2.write(COMMAND_PORT, &[CMD_KBD_ENABLE]);
        assert_eq!(read_keys(&bus2), CTRL_ALT_DEL_SET1);
        // An old snapshot, without the queue, restores with an empty one.
        let old: I8042State = serde_json::from_str(
            r#"{"ctr":69,"output":null,"pending_command":null,"last_write_was_command":false}"#,
        )
        .unwrap();
        assert!(old.keyboard_queue.is_empty());
        // Too long a queue is refused.
        let mut bad = dev.lock().unwrap().state();
        bad.keyboard_queue.extend([0u8; KEYBOARD_QUEUE_BYTES]);
        assert!(dev2.lock().unwrap().restore(&bad).is_err());
        // Reset empties it.
        dev.lock().unwrap().reset();
        assert!(dev.lock().unwrap().state().keyboard_queue.is_empty());
        assert_eq!(dev.lock().unwrap().state(), I8042State::default());
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = crate::test_util::XorShift(42);
        let (exit, bus, dev) = setup();
        let mut buf = [0u8; 8];
        for _ in 0..20_000 {
            let port = 0x5e + rng.next() % 10;
            let size = (rng.next() % 5) as usize;
            for b in buf.iter_mut() {
                *b = rng.next() as u8;
            }
            if rng.next() & 1 == 0 {
                bus.read(port, &mut buf[..size]);
            } else {
                bus.write(port, &buf[..size]);
            }
        }
        let mut d = dev.lock().unwrap();
        d.read(u64::MAX, &mut buf);
        d.write(2, &buf);
        d.read(0, &mut []);
        d.write(4, &[]);
        drop(d);
        // Random commands may well have pulsed the reset line; fine.
        let _ = exit.reason();
        // Whatever the guest did, the state it left restores.
        let st = dev.lock().unwrap().state();
        let mut other = I8042::new(Arc::new(ExitRequest::new().unwrap()));
        other.restore(&st).unwrap();
        assert_eq!(other.state(), st);
    }

    /// What Linux's atkbd sends when it probes and activates the keyboard, and what an MF2
    /// keyboard answers (with translation off: the ID's second byte untranslated).
    #[test]
    fn keyboard_answers_a_drivers_probe() {
        let (_chip, bus, _dev) = keyboard_setup();
        write_ctr(&bus, CTR_KBD_INT | CTR_SYS);
        let exchange = |bytes: &[u8]| -> Vec<u8> {
            for &b in bytes {
                bus.write(DATA_PORT, &[b]);
            }
            read_keys(&bus)
        };
        assert_eq!(exchange(&[0xff]), [KBD_ACK, KBD_SELF_TEST_PASSED]);
        assert_eq!(exchange(&[0xf2]), [KBD_ACK, 0xab, 0x83]);
        assert_eq!(exchange(&[0xed, 0x00]), [KBD_ACK, KBD_ACK]);
        assert_eq!(exchange(&[0xf3, 0x20]), [KBD_ACK, KBD_ACK]);
        assert_eq!(exchange(&[0xf0, 0x00]), [KBD_ACK, KBD_ACK, 2]);
        assert_eq!(exchange(&[0xf4]), [KBD_ACK]);
        assert_eq!(exchange(&[0xee]), [KBD_ECHO]);
        assert_eq!(exchange(&[0x01]), [KBD_RESEND]);
    }
}
