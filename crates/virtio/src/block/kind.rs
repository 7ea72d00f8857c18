//! The disk as a device kind: `--disk PATH[,readonly][,serial=S][,cache=C][,queues=N]`.

use vm_memory::GuestMemory;

use super::{Block, BlockOptions};
use crate::kind::{BuildContext, DeviceKind, OptionShape, Start};
use crate::VirtioDevice;

impl<M: GuestMemory + Send + Sync + 'static> DeviceKind<M> for BlockOptions {
    const SYNTAX: &'static str = "PATH[,readonly][,serial=S][,cache=writeback|none][,queues=N]";
    const HELP: &'static str = "A virtio-blk disk on a raw image (file or block device)";
    const SHAPE: OptionShape = OptionShape::Repeated;
    /// Positioned and vectored I/O (O_DIRECT with cache=none), flush, discard and
    /// write-zeroes (fallocate on a file, BLKDISCARD and BLKZEROOUT on a block device).
    // Positioned and vectored I/O, flush, discard and write-zeroes (fallocate on a file,
    // the BLK ioctls on a block device); for qcow2 (imago's file driver) fsync to flush
    // and ftruncate to grow the file by a cluster.
    const SANDBOX: &'static str = "pread64\npwrite64\npreadv\npwritev\nfdatasync\nfallocate\n\
        fsync\nftruncate\nioctl BLKDISCARD\nioctl BLKZEROOUT";

    fn parse(text: &str) -> Result<Option<Self>, String> {
        text.parse().map(Some)
    }

    fn label(&self) -> String {
        self.path.display().to_string()
    }

    fn create(&self, ctx: &BuildContext<M>) -> Result<Box<dyn VirtioDevice<M>>, String> {
        let mut options = self.clone();
        // A migration destination takes the lock from its source at the hand-over.
        options.defer_lock = ctx.start == Start::Incoming;
        options.expect_unchanged = ctx.start
            == Start::Restore {
                images_may_change: false,
            };
        let block = Block::new(options).map_err(|e| e.what)?;
        Ok(Box::new(block))
    }

    fn guest_difference(&self, recorded: &Self) -> Option<String> {
        if self.readonly != recorded.readonly {
            let mode = if recorded.readonly {
                "read-only"
            } else {
                "writable"
            };
            return Some(mode.to_string());
        }
        if self.serial != recorded.serial {
            let serial = recorded.serial.as_deref().unwrap_or("(none)");
            return Some(format!("with serial={serial}"));
        }
        (self.queues != recorded.queues).then(|| format!("with queues={}", recorded.queues))
    }
}
