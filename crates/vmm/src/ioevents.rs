//! The VMM's side of `virtio::IoEventRegistrar`: a queue's notify address becomes a KVM
//! ioeventfd on the queue's waker, so a guest notification wakes the device's I/O thread
//! inside the kernel and the vCPU never leaves it. Only built where the kernel offers
//! ioeventfds (`Capabilities::ioeventfd`); elsewhere notifications arrive as MMIO exits.

use std::sync::Arc;

use devices::exit::Waker;
use hypervisor::{IoEventAddress, Vm};
use virtio::{IoEventError, IoEventRegistrar};

pub struct VmIoEvents {
    pub vm: Arc<dyn Vm>,
}

impl IoEventRegistrar for VmIoEvents {
    fn register(&self, address: u64, waker: &Waker) -> Result<(), IoEventError> {
        self.vm
            .register_ioeventfd(waker.poll_fd(), IoEventAddress::Mmio(address), 0, None)
            .map_err(|e| IoEventError(e.to_string()))
    }

    fn unregister(&self, address: u64, waker: &Waker) -> Result<(), IoEventError> {
        self.vm
            .unregister_ioeventfd(waker.poll_fd(), IoEventAddress::Mmio(address), 0, None)
            .map_err(|e| IoEventError(e.to_string()))
    }
}
