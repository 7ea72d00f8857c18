//! Several queue pairs served by one I/O thread.
//!
//! Each pair keeps its own [`PairHandler`]; the group hands every call to the pair that owns
//! the queue (queues `2p` and `2p + 1` belong to pair `p`) and gathers what each pair waits
//! on. One thread for several pairs wakes once for work on any of them, which is cheaper than
//! a thread per pair where the host has few CPUs to spare beside the vCPUs.

use std::os::unix::io::RawFd;
use std::sync::Arc;

use devices::exit::Waker;
use virtio_queue::DescriptorChain;
use vm_memory::GuestMemory;

use super::pair::PairHandler;
use crate::worker::QueueHandler;

/// Queue pairs `first..first + pairs.len()` on one thread.
pub struct PairGroup {
    pub first: u16,
    pub pairs: Vec<PairHandler>,
}

impl PairGroup {
    /// The pair that owns `queue`; a queue outside the group is never handed to it (the
    /// worker serves only the queues it was given), so the first pair stands in.
    fn owner(&mut self, queue: u16) -> &mut PairHandler {
        let index = usize::from((queue / 2).saturating_sub(self.first));
        let last = self.pairs.len().saturating_sub(1);
        &mut self.pairs[index.min(last)]
    }
}

impl<M: GuestMemory> QueueHandler<M> for PairGroup {
    fn handle(&mut self, mem: &M, queue: u16, chain: DescriptorChain<&M>) -> u32 {
        self.owner(queue).handle(mem, queue, chain)
    }

    fn multi_chain(&self, queue: u16) -> bool {
        let index = usize::from((queue / 2).saturating_sub(self.first));
        self.pairs
            .get(index)
            .is_some_and(|p| QueueHandler::<M>::multi_chain(p, queue))
    }

    fn handle_chains<'m>(
        &mut self,
        mem: &'m M,
        queue: u16,
        ring_size: u16,
        chains: &mut dyn Iterator<Item = DescriptorChain<&'m M>>,
    ) -> Option<Vec<(u16, u32)>> {
        self.owner(queue)
            .handle_chains(mem, queue, ring_size, chains)
    }

    fn ready(&mut self, queue: u16) -> bool {
        QueueHandler::<M>::ready(self.owner(queue), queue)
    }

    fn notifications_off(&mut self, queue: u16) -> bool {
        QueueHandler::<M>::notifications_off(self.owner(queue), queue)
    }

    fn extra_wakers(&self) -> Vec<Arc<Waker>> {
        self.pairs
            .iter()
            .flat_map(QueueHandler::<M>::extra_wakers)
            .collect()
    }

    fn poll_fds(&mut self) -> Vec<RawFd> {
        self.pairs
            .iter_mut()
            .flat_map(QueueHandler::<M>::poll_fds)
            .collect()
    }

    fn fds_ready(&mut self) {
        self.pairs.iter_mut().for_each(QueueHandler::<M>::fds_ready);
    }
}
