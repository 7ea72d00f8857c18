//! vCPU threads and the exit loop.
//!
//! Each vCPU runs on its own thread and owns its `Vcpu`. The fast path — an exit, a bus
//! lookup, one device lock, re-entry — takes no lock shared by all vCPUs: the buses are
//! immutable after start-up and each device has its own mutex. Interrupt injection goes
//! through the VM (a single kernel call), never through another vCPU's thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use devices::bus::IoDispatcher;
use devices::exit::{ExitReason, ExitRequest};
use hypervisor::{Vcpu, VcpuExit, VcpuKicker};

use crate::control::RunControl;
use crate::error::{Error, Result};
use crate::irqchip::MachineIrqChip;
use crate::power::PowerControl;

/// What every vCPU thread shares with the rest of the machine.
pub struct VcpuContext {
    pub pio: Arc<IoDispatcher>,
    pub mmio: Arc<IoDispatcher>,
    pub exit: Arc<ExitRequest>,
    /// Set by the main thread when the machine stops; vCPUs see it after a kick.
    pub stop: Arc<AtomicBool>,
    /// Log each vCPU's RIP when it is kicked (`FERROVM_SAMPLE_RIP_MS`), to see where a guest
    /// that prints nothing spends its time.
    pub sample_rip: bool,
    /// The interrupt controllers: the BSP services them before each entry (split mode's
    /// ExtINT), IOAPIC EOI exits go to them.
    pub irqchip: Arc<dyn MachineIrqChip>,
    pub control: Arc<RunControl>,
    /// ACPI sleep states: a vCPU sleeps there while the machine is in S3.
    pub power: Arc<PowerControl>,
    /// Completes instructions the kernel's emulator rejected, against guest RAM.
    pub completer: Arc<complete::Completer>,
    pub ram: Arc<dyn complete::GuestRam>,
}

pub struct VcpuThread {
    pub id: u32,
    pub kicker: VcpuKicker,
    pub handle: JoinHandle<Result<()>>,
}

/// Starts the thread that runs `vcpu` until the machine stops or the vCPU fails. A failure
/// is returned from the thread and also requests the machine's exit.
pub fn spawn(vcpu: Box<dyn Vcpu>, ctx: Arc<VcpuContext>) -> Result<VcpuThread> {
    let id = vcpu.id();
    let (tx, rx) = std::sync::mpsc::channel();
    // The kick handler is installed before the vCPU's filter, which has no rt_sigaction.
    let bind = move || {
        let mut vcpu = vcpu;
        let bound = vcpu.bind_kicker();
        let ok = bound.is_ok();
        let _ = tx.send(bound);
        ok.then_some(vcpu)
    };
    let handle = sandbox::spawn_with_setup(
        sandbox::Role::Vcpu,
        format!("vcpu{id}"),
        bind,
        move |bound| {
            let Some(mut vcpu) = bound else {
                return Ok(());
            };
            let result = run_loop(vcpu.as_mut(), &ctx);
            if result.is_err() {
                ctx.exit.request(ExitReason::VcpuFailed(id));
            }
            result
        },
    )?;
    let kicker = rx
        .recv()
        .map_err(|_| Error::Vcpu {
            id,
            reason: "thread ended during start-up".into(),
        })?
        .map_err(Error::Hypervisor)?;
    Ok(VcpuThread { id, kicker, handle })
}

fn failure(vcpu: &dyn Vcpu, what: String) -> Error {
    let rip = vcpu
        .regs()
        .map(|r| format!("{:#x}", r.rip))
        .unwrap_or_else(|_| "unknown".into());
    Error::Vcpu {
        id: vcpu.id(),
        reason: format!("{what} at RIP {rip}"),
    }
}

fn run_loop(vcpu: &mut dyn Vcpu, ctx: &VcpuContext) -> Result<()> {
    let id = vcpu.id();
    loop {
        if ctx.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        if ctx.control.pause_requested() {
            ctx.control.park(&ctx.stop, vcpu);
            continue;
        }
        if ctx.power.suspend_requested() {
            ctx.power.sleep(vcpu, &ctx.stop)?;
            continue;
        }
        if id == 0 {
            ctx.irqchip.service_bsp(vcpu);
        }
        let exit = match vcpu.run() {
            Ok(exit) => exit,
            Err(e) => return Err(failure(vcpu, e.to_string())),
        };
        let problem = match exit {
            VcpuExit::IoIn { port, size, data } => {
                for chunk in data.chunks_mut(size) {
                    ctx.pio.read(u64::from(port), chunk);
                }
                None
            }
            VcpuExit::IoOut { port, size, data } => {
                for chunk in data.chunks(size) {
                    ctx.pio.write(u64::from(port), chunk);
                }
                None
            }
            VcpuExit::MmioRead { addr, data } => {
                ctx.mmio.read(addr, data);
                None
            }
            VcpuExit::MmioWrite { addr, data } => {
                ctx.mmio.write(addr, data);
                None
            }
            VcpuExit::MsrRead { index, value, .. } => {
                // Only MSRs the kernel does not implement get here; reading them as zero
                // keeps guests probing platform MSRs alive (see the MSR policy in docs).
                log::debug!("vCPU {id}: RDMSR {index:#x} not implemented, reads 0");
                *value = 0;
                None
            }
            VcpuExit::MsrWrite { index, value, .. } => {
                log::debug!("vCPU {id}: WRMSR {index:#x} <- {value:#x} ignored");
                None
            }
            VcpuExit::Reset => {
                ctx.exit.request(ExitReason::Reset);
                None
            }
            VcpuExit::PowerOff => {
                ctx.exit.request(ExitReason::PowerOff);
                None
            }
            VcpuExit::Interrupted => {
                ctx.control.throttle_pause();
                if ctx.sample_rip && !ctx.stop.load(Ordering::Acquire) {
                    if let Ok(regs) = vcpu.regs() {
                        log::info!("vCPU {id}: RIP {:#x} RSP {:#x}", regs.rip, regs.rsp);
                    }
                }
                None
            }
            VcpuExit::Halt | VcpuExit::Spurious => None,
            VcpuExit::IoapicEoi { vector } => {
                ctx.irqchip.eoi(vector);
                None
            }
            VcpuExit::Shutdown => Some("triple fault (shutdown)".to_string()),
            VcpuExit::InstructionNotEmulated { bytes } => ctx
                .completer
                .complete(vcpu, ctx.ram.as_ref(), &bytes)
                .err()
                .map(|refusal| refusal.to_string()),
            VcpuExit::InternalError { detail } => Some(format!("KVM internal error: {detail}")),
            VcpuExit::FailEntry { reason } => Some(format!(
                "the kernel refused to enter the guest (hardware reason {reason:#x})"
            )),
            VcpuExit::Unsupported(what) => Some(format!("unsupported exit {what}")),
        };
        if let Some(what) = problem {
            return Err(failure(vcpu, what));
        }
    }
}
