use std::path::PathBuf;

/// Why a VM could not be built or run. Every variant names the file, option or value at
/// fault, so the command line can print one line that tells the user what to fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{option} {value}: {reason}")]
    Option {
        option: &'static str,
        value: String,
        reason: String,
    },
    #[error("{option}: not supported yet")]
    NotSupportedYet { option: &'static str },
    #[error("{}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
    #[error("accelerator: {0}")]
    Hypervisor(#[from] hypervisor::HypervisorError),
    #[error("guest memory: {0}")]
    Memory(String),
    #[error("kernel {}: {source}", path.display())]
    Kernel {
        path: PathBuf,
        source: boot::LoadError,
    },
    #[error("firmware tables: {0}")]
    Firmware(String),
    #[error("devices: {0}")]
    Devices(String),
    #[error("vCPU {id}: {reason}")]
    Vcpu { id: u32, reason: String },
    #[error("{0}")]
    Control(String),
    /// A request that conflicts with the machine's state or with an operation in progress
    /// (HTTP's 409): "a snapshot is in progress".
    #[error("{0}")]
    Conflict(String),
    #[error("migration: {0}")]
    Migration(String),
    /// The guest's final state was sent but the destination never said whether it runs the
    /// guest: the guest stays paused here.
    #[error("migration: {0}")]
    MigrationOutcomeUnknown(String),
    /// Post-copy failed after the destination ran the guest: neither copy is whole, the
    /// guest is lost and this machine stops.
    #[error("migration: {0}")]
    MigrationGuestLost(String),
    #[error("machine state: {0}")]
    State(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Sandbox(#[from] sandbox::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
