//! The control queue: VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET and VIRTIO_NET_CTRL_ANNOUNCE_ACK.
//! Every other class or command, and every malformed request, is answered
//! VIRTIO_NET_ERR; a chain without a writable byte for the answer gets a used length of 0.

use std::io::{Read, Write};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use virtio_bindings::bindings::virtio_net::{
    VIRTIO_NET_CTRL_ANNOUNCE, VIRTIO_NET_CTRL_ANNOUNCE_ACK, VIRTIO_NET_CTRL_MQ,
    VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET, VIRTIO_NET_ERR, VIRTIO_NET_F_GUEST_ANNOUNCE, VIRTIO_NET_F_MQ,
    VIRTIO_NET_OK, VIRTIO_NET_S_ANNOUNCE,
};
use virtio_queue::DescriptorChain;
use vm_memory::GuestMemory;

use super::Shared;
use crate::worker::QueueHandler;

/// Longest command (class, command, data) the device reads; longer ones are refused.
const MAX_COMMAND: usize = 64;

/// Serves the control queue.
pub struct CtrlHandler {
    pub shared: Arc<Shared>,
    pub acked_features: u64,
    /// Queue pairs the driver may use (VIRTIO_NET_F_MQ acked: the device's maximum).
    pub max_pairs: u16,
}

impl CtrlHandler {
    fn acked(&self, feature: u32) -> bool {
        self.acked_features & (1 << feature) != 0
    }

    /// Carries out one command; whether it succeeded.
    fn execute(&mut self, class: u8, command: u8, data: &[u8]) -> bool {
        match (u32::from(class), u32::from(command)) {
            (VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET)
                if self.acked(VIRTIO_NET_F_MQ) =>
            {
                let Some(pairs) = data.get(..2).map(|b| u16::from_le_bytes([b[0], b[1]])) else {
                    return false;
                };
                if data.len() != 2 || !(1..=self.max_pairs).contains(&pairs) {
                    return false;
                }
                self.shared.set_active_pairs(pairs);
                true
            }
            (VIRTIO_NET_CTRL_ANNOUNCE, VIRTIO_NET_CTRL_ANNOUNCE_ACK)
                if self.acked(VIRTIO_NET_F_GUEST_ANNOUNCE) && data.is_empty() =>
            {
                self.shared
                    .status
                    .fetch_and(!(VIRTIO_NET_S_ANNOUNCE as u16), Ordering::SeqCst);
                true
            }
            _ => {
                log::debug!("virtio-net: control command {class}.{command} refused");
                false
            }
        }
    }
}

impl<M: GuestMemory> QueueHandler<M> for CtrlHandler {
    fn handle(&mut self, mem: &M, _queue: u16, chain: DescriptorChain<&M>) -> u32 {
        let (Ok(mut reader), Ok(mut writer)) = (chain.clone().reader(mem), chain.writer(mem))
        else {
            return 0;
        };
        if writer.available_bytes() == 0 {
            return 0;
        }
        let len = reader.available_bytes();
        let mut command = [0u8; MAX_COMMAND];
        let ok = (2..=MAX_COMMAND).contains(&len)
            && reader.read_exact(&mut command[..len]).is_ok()
            && self.execute(command[0], command[1], &command[2..len]);
        let ack = if ok { VIRTIO_NET_OK } else { VIRTIO_NET_ERR } as u8;
        match writer.write_all(&[ack]) {
            Ok(()) => 1,
            Err(_) => 0,
        }
    }
}
