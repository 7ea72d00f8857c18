//! Host input into the console's device (the UART's receive FIFO, or the virtio console's
//! input buffer), with backpressure: input that does not fit waits here (bounded) until the
//! guest makes room; the reader stops reading its source while this buffer is full. Nothing
//! typed is dropped, and a vCPU never waits.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use devices::exit::Waker;
use devices::serial::SerialDevice;
use virtio::console::ConsoleInputPort;

/// Input held for the guest beyond the FIFO before the source is no longer read.
pub const PENDING_CAP: usize = 4096;

/// A device that takes console input.
pub trait InputTarget: Send {
    /// Takes what fits of `bytes` now and returns how much (raising the device's
    /// interrupt); never waits for the guest.
    fn offer(&self, bytes: &[u8]) -> usize;
    /// `room` is woken whenever the guest makes room.
    fn set_room_waker(&self, room: Arc<Waker>);
}

impl InputTarget for Arc<Mutex<SerialDevice>> {
    fn offer(&self, bytes: &[u8]) -> usize {
        self.lock()
            .unwrap_or_else(|e| e.into_inner())
            .enqueue_raw_bytes(bytes)
    }

    fn set_room_waker(&self, room: Arc<Waker>) {
        self.lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_input_waker(room);
    }
}

impl InputTarget for ConsoleInputPort {
    fn offer(&self, bytes: &[u8]) -> usize {
        ConsoleInputPort::offer(self, bytes)
    }

    fn set_room_waker(&self, room: Arc<Waker>) {
        ConsoleInputPort::set_room_waker(self, room);
    }
}

/// Feeds one console device.
pub struct InputPump {
    device: Box<dyn InputTarget>,
    /// Woken by the UART when the guest empties its FIFO.
    room: Arc<Waker>,
    pending: VecDeque<u8>,
}

impl InputPump {
    pub fn new(device: Box<dyn InputTarget>) -> std::io::Result<Self> {
        let room = Arc::new(Waker::new()?);
        device.set_room_waker(room.clone());
        Ok(InputPump {
            device,
            room,
            pending: VecDeque::new(),
        })
    }

    /// The descriptor that becomes readable when the guest made room.
    pub fn room_fd(&self) -> std::os::unix::io::RawFd {
        self.room.poll_fd()
    }

    /// Whether the source may be read: the pending buffer has room.
    pub fn accepts_more(&self) -> bool {
        self.pending.len() < PENDING_CAP
    }

    /// Whether input is waiting for room in the FIFO.
    pub fn is_waiting(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Queues `bytes` for the guest and offers what fits to the FIFO.
    pub fn push(&mut self, bytes: &[u8]) {
        self.pending.extend(bytes);
        self.flush();
    }

    /// Offers pending input to the FIFO (raising the receive interrupt); never blocks on
    /// the guest.
    pub fn flush(&mut self) {
        // Drained before the FIFO is filled: a read that empties it afterwards wakes us.
        self.room.drain();
        if self.pending.is_empty() {
            return;
        }
        // The buffer may wrap: offer its two halves in turn while the device takes them.
        while !self.pending.is_empty() {
            let (front, _) = self.pending.as_slices();
            let len = front.len();
            let taken = self.device.offer(front);
            self.pending.drain(..taken);
            if taken < len {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devices::bus::BusDeviceMut;
    use devices::serial::{NoIrq, FIFO_SIZE};

    fn uart() -> Arc<Mutex<SerialDevice>> {
        let dev = SerialDevice::with_writer(Box::new(std::io::sink()), Arc::new(NoIrq));
        Arc::new(Mutex::new(dev))
    }

    fn guest_reads(dev: &Arc<Mutex<SerialDevice>>, n: usize) -> Vec<u8> {
        let mut dev = dev.lock().unwrap();
        (0..n)
            .map(|_| {
                let mut b = [0u8];
                dev.read(0, &mut b);
                b[0]
            })
            .collect()
    }

    #[test]
    fn input_beyond_the_fifo_waits_and_arrives_in_order() {
        let dev = uart();
        let mut pump = InputPump::new(Box::new(dev.clone())).unwrap();
        let typed: Vec<u8> = (0..200u8).collect();
        pump.push(&typed);
        assert!(
            pump.is_waiting(),
            "200 bytes do not fit a {FIFO_SIZE}-byte FIFO"
        );
        let mut seen = Vec::new();
        while seen.len() < typed.len() {
            seen.extend(guest_reads(&dev, FIFO_SIZE.min(typed.len() - seen.len())));
            assert!(pump.room.drain(), "emptying the FIFO wakes the pump");
            pump.room.wake().unwrap(); // flush drains it again
            pump.flush();
        }
        assert_eq!(seen, typed);
        assert!(!pump.is_waiting());
    }

    #[test]
    fn the_source_is_no_longer_read_when_the_buffer_is_full() {
        let dev = uart();
        let mut pump = InputPump::new(Box::new(dev)).unwrap();
        pump.push(&vec![b'k'; FIFO_SIZE + PENDING_CAP]);
        assert!(!pump.accepts_more());
        assert!(pump.is_waiting());
    }
}
