//! A device kind as the machine's configuration sees it: one serde type per kind that the
//! command line parses into, the API's bodies convert into, a snapshot records as is and
//! `GET /vm/config` reports; and how the kind builds its device from it. The VMM's registry
//! of kinds (crates/vmm/src/devices.rs) lists the types that implement [`DeviceKind`];
//! nothing else in the VMM names a kind.

use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::console::Console;
use crate::VirtioDevice;

/// How the machine starts, as far as a device's host resources care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// A fresh boot.
    Boot,
    /// A snapshot restore; `images_may_change`: `--restore-allow-changed-disks`.
    Restore { images_may_change: bool },
    /// An incoming migration: the source holds the host locks until the hand-over.
    Incoming,
}

/// What a kind's constructor gets from the machine.
pub struct BuildContext<'a, M> {
    pub memory: &'a Arc<M>,
    pub start: Start,
    pub vcpus: u32,
    /// CPUs of the host, for the kinds that choose their thread count.
    pub host_cpus: usize,
    /// The accelerator's irqfd and ioeventfd serve the queues (a vhost back end needs both).
    pub kernel_queues: bool,
    /// The virtio console the machine made as its console (it writes where the serial port
    /// does and takes the console's input), for the console kind to take.
    pub console: Mutex<Option<Console>>,
}

/// How the command line spells a kind's option `--NAME`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptionShape {
    /// `--NAME VALUE`, repeatable: one device each.
    Repeated,
    /// `--NAME VALUE`, at most once.
    Once,
    /// `--NAME` alone.
    Flag,
}

/// One kind of device. `M` is the guest memory its device works on.
pub trait DeviceKind<M>:
    Serialize + DeserializeOwned + Clone + PartialEq + Debug + Send + Sync + 'static
{
    /// The option's value as its help shows it.
    const SYNTAX: &'static str;
    /// The option's help.
    const HELP: &'static str;
    const SHAPE: OptionShape;
    /// What the device's I/O threads call beyond what every device I/O thread may (the
    /// `sandbox` crate's profile syntax: one system call a line, `ioctl NAME`...).
    const SANDBOX: &'static str = "";

    /// Parses the option's value (empty for a flag); `None`: the value asks for no device
    /// (`--console serial`). Errors are the reason alone; the caller names the option.
    fn parse(text: &str) -> Result<Option<Self>, String>;

    /// A short description of the device for messages (a path, a tap name).
    fn label(&self) -> String;

    /// Opens the device's host resources and makes the device model.
    fn create(&self, ctx: &BuildContext<M>) -> Result<Box<dyn VirtioDevice<M>>, String>;

    /// What the guest would notice if this device stood in for `recorded` (the one a
    /// snapshot was taken with), if anything: host-side bindings (paths, taps, sockets)
    /// may differ, what the guest sees may not. Said as it completes "the snapshot's
    /// machine has disk0 ...": "read-only", "with queues=2".
    fn guest_difference(&self, recorded: &Self) -> Option<String>;
}

/// Fails, naming the key, if one of `items` is given twice (the last would win silently).
pub fn refuse_repeated_keys<'a>(
    items: impl IntoIterator<Item = &'a str>,
    aliases: &[(&str, &'a str)],
) -> Result<(), String> {
    match crate::block::repeated_key(items, aliases) {
        Some(key) => Err(format!("{key} is given twice")),
        None => Ok(()),
    }
}
