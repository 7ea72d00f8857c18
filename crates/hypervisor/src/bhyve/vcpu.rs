//! One bhyve vCPU: VM_RUN, exit decoding and the completion of the exit's instruction.

use std::cell::{Cell, RefCell, UnsafeCell};
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use zerocopy::FromZeros;

use super::abi::{self, exitcode, intinfo, reg, suspend, SegDesc, VmExit, VmRun};
use super::emul::{self, Dest, Extend, MmioOp, Source};
use super::exit::{self, Decoded, Exit, InoutStr};
use super::segment::{from_seg_desc, to_seg_desc};
use super::vm::{VmShared, SEGMENTS};
use super::{unsupported, MSR_EFER, MSR_FS_BASE, MSR_GS_BASE, MSR_KERNEL_GS_BASE};
use crate::kick;
use crate::{
    CpuidEntry, DescriptorTable, FpuState, HypervisorError, LapicState, MpState, MsrEntry, Result,
    SpecialRegisters, StandardRegisters, Vcpu, VcpuEvents, VcpuExit, VcpuKicker, Xcr, XsaveState,
};

/// Largest string I/O batch (bytes) handed to the VMM in one exit.
const IO_BATCH: usize = 4096;
const PAGE: u64 = 4096;
/// How often a vCPU waiting for its SIPI looks for a kick.
const STARTUP_POLL: Duration = Duration::from_millis(10);
/// RFLAGS.DF.
const RFLAGS_DF: u64 = 1 << 10;
/// IA32_APIC_BASE: the default base, enabled, BSP and x2APIC bits.
const APIC_BASE_DEFAULT: u64 = 0xfee0_0000;
const APIC_BASE_ENABLE: u64 = 1 << 11;
const APIC_BASE_BSP: u64 = 1 << 8;
const APIC_BASE_X2APIC: u64 = 1 << 10;
const IA32_APIC_BASE: u32 = 0x1b;
/// #GP and #UD.
const VECTOR_GP: u8 = 13;

/// `struct vm_run`, the exit it points at and the cpuset storage, in one allocation that
/// never moves (the kernel follows the pointers; the kick handler writes into `run`).
#[repr(C)]
struct RunArea {
    run: VmRun,
    exit: VmExit,
    cpuset: [u8; abi::CPUSET_BYTES],
}

/// What the next `run` (or any state access) must do to complete the last exit.
#[derive(Debug, Default)]
enum Pending {
    #[default]
    None,
    /// IN: RAX gets the data (merged with the access size).
    In { size: usize },
    /// MMIO read: the decoded destination register gets the data.
    MmioRead {
        size: usize,
        extend: Extend,
        dest: Dest,
    },
    /// RDMSR: RAX/RDX get the value, or #GP is injected.
    Rdmsr,
    /// WRMSR: #GP is injected if the VMM refused the write.
    Wrmsr,
    /// INS/OUTS: the data goes to guest memory (INS), RSI/RDI and RCX advance, and the
    /// instruction restarts if the REP count is not exhausted.
    StringIo(StringIo),
}

#[derive(Debug)]
struct StringIo {
    is_in: bool,
    /// Host address and length of each piece of guest memory, in access order.
    pieces: Vec<(u64, usize)>,
    /// Elements done in this batch.
    done: u64,
    step: i64,
    index_reg: i32,
    index: u64,
    /// RCX at the exit, with REP.
    rcx: Option<u64>,
    total: u64,
    addrsize: u8,
}

/// A bhyve vCPU. Owned by the thread that runs it: every ioctl that locks the vCPU
/// (registers, NMI and exception injection, VM_LAPIC_IRQ) is issued from here, never from
/// another thread, so none of them waits for a running vCPU.
pub struct BhyveVcpu {
    id: u32,
    vm: Arc<VmShared>,
    area: Box<UnsafeCell<RunArea>>,
    io_buf: Vec<u8>,
    mmio_buf: [u8; 8],
    msr_value: u64,
    msr_error: u8,
    pending: RefCell<Pending>,
    /// RIP as the kernel advanced it at the last exit (`nextrip`). vmm.ko's RIP register
    /// still holds the exit's instruction until the next VM_RUN; reporting that would make
    /// a read-modify-write of the registers re-execute it.
    nextrip: Cell<Option<u64>>,
    /// VM_ACTIVATE_CPU done (the BSP at creation, an AP at its SIPI).
    active: Cell<bool>,
    kicker_bound: bool,
}

impl Drop for BhyveVcpu {
    fn drop(&mut self) {
        if self.kicker_bound {
            kick::unbind_current_thread();
        }
    }
}

fn exit_bytes(exit: &VmExit) -> &[u8] {
    zerocopy::IntoBytes::as_bytes(exit)
}

impl BhyveVcpu {
    pub(crate) fn new(id: u32, vm: Arc<VmShared>, active: bool) -> Self {
        let mut area = Box::new(UnsafeCell::new(RunArea {
            run: VmRun::default(),
            exit: VmExit::new_zeroed(),
            cpuset: [0; abi::CPUSET_BYTES],
        }));
        let a = area.get_mut();
        a.run.cpuid = id as i32;
        a.run.cpuset = a.cpuset.as_mut_ptr() as u64;
        a.run.cpusetsize = abi::CPUSET_BYTES as u64;
        a.run.vm_exit = ptr::addr_of_mut!(a.exit) as u64;
        BhyveVcpu {
            id,
            vm,
            area,
            io_buf: vec![0; IO_BATCH],
            mmio_buf: [0; 8],
            msr_value: 0,
            msr_error: 0,
            pending: RefCell::new(Pending::None),
            nextrip: Cell::new(None),
            active: Cell::new(active),
            kicker_bound: false,
        }
    }

    /// The high byte of `vm_run.cpuid` (little-endian): the kick flag. Non-zero makes the
    /// vCPU id impossible, so a VM_RUN issued after a kick fails at once with EINVAL.
    pub(crate) fn kick_byte(&self) -> *mut u8 {
        // SAFETY: `run` is the first field of the repr(C) area and `cpuid` the first of
        // `run`; byte 3 is inside the allocation, which lives as long as `self`.
        unsafe { self.area.get().cast::<u8>().add(3) }
    }

    fn take_kick(&self) -> bool {
        // SAFETY: the byte is only written by this thread and its kick signal handler.
        unsafe {
            if ptr::read_volatile(self.kick_byte()) != 0 {
                ptr::write_volatile(self.kick_byte(), 0);
                true
            } else {
                false
            }
        }
    }

    fn vm_run(&self) -> std::io::Result<()> {
        let request = if self.vm.run_iowr.load(std::sync::atomic::Ordering::Relaxed) {
            abi::VM_RUN_IOWR
        } else {
            abi::VM_RUN
        };
        // SAFETY: the area outlives the call; `run` points the kernel at `exit` and
        // `cpuset` inside the same allocation. The kick handler may write byte 3 of `run`
        // concurrently from this same thread (a signal), as with kvm_run.immediate_exit.
        let run = unsafe {
            std::slice::from_raw_parts_mut(
                self.area.get().cast::<u8>(),
                std::mem::size_of::<VmRun>(),
            )
        };
        match self.vm.dev.ioctl(request, run) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTTY) && request == abi::VM_RUN => {
                // A kernel whose VM_RUN has both direction bits (see abi.rs).
                self.vm
                    .run_iowr
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                self.vm_run()
            }
            other => other,
        }
    }

    fn exit_copy(&self) -> [u8; abi::VM_EXIT_SIZE] {
        let mut b = [0u8; abi::VM_EXIT_SIZE];
        // SAFETY: the kernel has finished writing the exit (VM_RUN returned).
        b.copy_from_slice(exit_bytes(unsafe { &(*self.area.get()).exit }));
        b
    }

    fn set_reg(&self, regnum: i32, value: u64) -> Result<()> {
        self.vm.set_register(self.id, regnum, value)
    }

    fn get_reg(&self, regnum: i32) -> Result<u64> {
        self.vm.get_register(self.id, regnum)
    }

    /// Writes `value` into `regnum` as an operand of `size` bytes would.
    fn update_reg(&self, regnum: i32, value: u64, size: u8) -> Result<()> {
        let merged = match size {
            1 | 2 => emul::merge_register(self.get_reg(regnum)?, value, size),
            _ => emul::merge_register(0, value, size),
        };
        self.set_reg(regnum, merged)
    }

    /// Completes the instruction of the last exit with the data the VMM filled in.
    fn complete_pending(&self) -> Result<()> {
        let pending = self.pending.replace(Pending::None);
        match pending {
            Pending::None => Ok(()),
            Pending::In { size } => {
                let value = emul::extend_value(&self.io_buf[..size], Extend::Zero);
                self.update_reg(reg::RAX, value, size as u8)
            }
            Pending::MmioRead { size, extend, dest } => {
                let value = emul::extend_value(&self.mmio_buf[..size], extend);
                match dest {
                    Dest::Gpr { reg, size } => self.update_reg(reg, value, size),
                    Dest::Byte { reg, high } => {
                        let old = self.get_reg(reg)?;
                        self.set_reg(reg, emul::merge_byte_register(old, value as u8, high))
                    }
                }
            }
            Pending::Rdmsr => {
                if self.msr_error != 0 {
                    self.vm
                        .inject_exception(self.id, VECTOR_GP, Some(0), true)?;
                    self.nextrip.set(None);
                    Ok(())
                } else {
                    self.vm.set_registers(
                        self.id,
                        &[
                            (reg::RAX, self.msr_value & 0xffff_ffff),
                            (reg::RDX, self.msr_value >> 32),
                        ],
                    )
                }
            }
            Pending::Wrmsr => {
                if self.msr_error != 0 {
                    self.vm
                        .inject_exception(self.id, VECTOR_GP, Some(0), true)?;
                    self.nextrip.set(None);
                }
                Ok(())
            }
            Pending::StringIo(s) => self.complete_string_io(s),
        }
    }

    fn complete_string_io(&self, s: StringIo) -> Result<()> {
        if s.is_in {
            let mut at = 0;
            for &(host, len) in &s.pieces {
                // SAFETY: `host .. host + len` lies in a RAM slot the VM maps (checked when
                // the exit was decoded); the slot's mapping lives as long as the VM.
                unsafe {
                    ptr::copy_nonoverlapping(self.io_buf[at..].as_ptr(), host as *mut u8, len)
                };
                at += len;
            }
        }
        let advanced = s
            .index
            .wrapping_add((s.done as i64).wrapping_mul(s.step) as u64);
        let mut regs = vec![(
            s.index_reg,
            emul::merge_register(s.index, advanced, s.addrsize),
        )];
        let remaining = s.total - s.done;
        if let Some(rcx) = s.rcx {
            regs.push((reg::RCX, emul::merge_register(rcx, remaining, s.addrsize)));
        }
        self.vm.set_registers(self.id, &regs)?;
        if s.rcx.is_some() && remaining > 0 {
            // The rest of the REP runs when the instruction executes again.
            self.vm.restart_instruction(self.id)?;
            self.nextrip.set(None);
        }
        Ok(())
    }

    /// Puts an AP in the state a SIPI with `rip = vector << 12` leaves it in (real mode,
    /// CS = vector << 8, IP = 0) and activates it. Runs on the AP's own thread.
    fn start_ap(&self, rip: u64) -> Result<()> {
        let id = self.id;
        let vm = &self.vm;
        let data = SegDesc {
            base: 0,
            limit: 0xffff,
            access: 0x93,
        };
        let descs = [
            (
                reg::CS,
                SegDesc {
                    base: rip,
                    limit: 0xffff,
                    access: 0x9b,
                },
            ),
            (reg::DS, data),
            (reg::ES, data),
            (reg::FS, data),
            (reg::GS, data),
            (reg::SS, data),
            (
                reg::LDTR,
                SegDesc {
                    base: 0,
                    limit: 0xffff,
                    access: 0x82,
                },
            ),
            (
                reg::TR,
                SegDesc {
                    base: 0,
                    limit: 0xffff,
                    access: 0x8b,
                },
            ),
            (
                reg::GDTR,
                SegDesc {
                    base: 0,
                    limit: 0xffff,
                    access: 0,
                },
            ),
            (
                reg::IDTR,
                SegDesc {
                    base: 0,
                    limit: 0xffff,
                    access: 0,
                },
            ),
        ];
        for (r, d) in descs {
            vm.set_segment(id, r, d)?;
        }
        let mut regs = vec![
            (reg::CS, (rip >> 4) & 0xffff),
            (reg::DS, 0),
            (reg::ES, 0),
            (reg::FS, 0),
            (reg::GS, 0),
            (reg::SS, 0),
            (reg::LDTR, 0),
            (reg::TR, 0),
            // CD | NW | ET: the power-up value.
            (reg::CR0, 0x6000_0010),
            (reg::CR3, 0),
            (reg::CR4, 0),
            (reg::EFER, 0),
            (reg::CR2, 0),
            (reg::DR7, 0x400),
            (reg::RFLAGS, 0x2),
            (reg::RIP, 0),
            (reg::RSP, 0),
        ];
        for r in [
            reg::RAX,
            reg::RBX,
            reg::RCX,
            reg::RDX,
            reg::RSI,
            reg::RDI,
            reg::RBP,
            reg::R8,
            reg::R9,
            reg::R10,
            reg::R11,
            reg::R12,
            reg::R13,
            reg::R14,
            reg::R15,
        ] {
            regs.push((r, 0));
        }
        vm.set_registers(id, &regs)?;
        vm.activate(id)?;
        self.active.set(true);
        self.nextrip.set(None);
        log::debug!("bhyve: vCPU {id} started at {:#x}", rip);
        Ok(())
    }

    /// Turns a decoded exit into the backend-neutral form, setting up its completion.
    fn translate(&mut self, d: Decoded) -> Result<VcpuExit<'_>> {
        Ok(match d.exit {
            Exit::Inout(io) => {
                let size = usize::from(io.bytes);
                if !matches!(size, 1 | 2 | 4) || io.string {
                    return Ok(VcpuExit::InternalError {
                        detail: format!("malformed INOUT exit {io:?}"),
                    });
                }
                if io.is_in {
                    self.io_buf[..size].fill(0xff);
                    *self.pending.get_mut() = Pending::In { size };
                    VcpuExit::IoIn {
                        port: io.port,
                        size,
                        data: &mut self.io_buf[..size],
                    }
                } else {
                    self.io_buf[..size].copy_from_slice(&io.eax.to_le_bytes()[..size]);
                    VcpuExit::IoOut {
                        port: io.port,
                        size,
                        data: &self.io_buf[..size],
                    }
                }
            }
            Exit::InoutStr(s) => return self.string_io(s),
            Exit::InstEmul(e) => match emul::decode_mmio(&e) {
                Ok(MmioOp::Read { size, extend, dest }) => {
                    let size = usize::from(size);
                    self.mmio_buf = [0xff; 8];
                    *self.pending.get_mut() = Pending::MmioRead { size, extend, dest };
                    VcpuExit::MmioRead {
                        addr: e.gpa,
                        data: &mut self.mmio_buf[..size],
                    }
                }
                Ok(MmioOp::Write { size, source }) => {
                    let value = match source {
                        Source::Gpr { reg } => self.get_reg(reg)?,
                        Source::Byte { reg, high } => {
                            let v = self.get_reg(reg)?;
                            if high {
                                v >> 8
                            } else {
                                v
                            }
                        }
                        Source::Imm(v) => v,
                    };
                    let size = usize::from(size);
                    self.mmio_buf = value.to_le_bytes();
                    VcpuExit::MmioWrite {
                        addr: e.gpa,
                        data: &self.mmio_buf[..size],
                    }
                }
                Err(emul::Unemulated(why)) => VcpuExit::Unsupported(why),
            },
            Exit::Rdmsr { code } => {
                self.msr_value = 0;
                self.msr_error = 0;
                *self.pending.get_mut() = Pending::Rdmsr;
                VcpuExit::MsrRead {
                    index: code,
                    value: &mut self.msr_value,
                    error: &mut self.msr_error,
                }
            }
            Exit::Wrmsr { code, value } => {
                self.msr_error = 0;
                *self.pending.get_mut() = Pending::Wrmsr;
                VcpuExit::MsrWrite {
                    index: code,
                    value,
                    error: &mut self.msr_error,
                }
            }
            Exit::Hlt { .. } => VcpuExit::Halt,
            Exit::Suspended { how } => match how {
                suspend::RESET => VcpuExit::Reset,
                suspend::POWEROFF => VcpuExit::PowerOff,
                // Every vCPU halted with interrupts disabled: nothing can wake the guest.
                suspend::HALT => {
                    log::info!("bhyve: every vCPU halted with interrupts disabled");
                    VcpuExit::PowerOff
                }
                suspend::TRIPLEFAULT => VcpuExit::Shutdown,
                suspend::DESTROY => VcpuExit::InternalError {
                    detail: "the VM is being destroyed".into(),
                },
                other => VcpuExit::Unsupported(format!("VM suspended with reason {other}")),
            },
            Exit::SpinupAp { vcpu, rip } => {
                match u32::try_from(vcpu) {
                    Ok(target) => self.vm.post_startup(target, rip),
                    Err(_) => log::warn!("bhyve: SIPI for vCPU {vcpu} ignored"),
                }
                VcpuExit::Spurious
            }
            Exit::Vmx {
                status,
                reason,
                qualification,
                inst_error,
                ..
            } => {
                if status != 0 {
                    VcpuExit::FailEntry {
                        reason: inst_error as u32 as u64,
                    }
                } else if reason & 0x8000_0000 != 0 {
                    VcpuExit::FailEntry {
                        reason: u64::from(reason & 0xffff),
                    }
                } else {
                    VcpuExit::InternalError {
                        detail: format!(
                            "VMX exit reason {} (qualification {qualification:#x}) not \
                             handled by vmm.ko",
                            reason & 0xffff
                        ),
                    }
                }
            }
            Exit::Svm {
                exitcode,
                info1,
                info2,
            } => VcpuExit::InternalError {
                detail: format!(
                    "SVM exit {exitcode:#x} (info {info1:#x}, {info2:#x}) not handled by vmm.ko"
                ),
            },
            Exit::Paging { gpa, fault_type } => VcpuExit::InternalError {
                detail: format!(
                    "nested page fault at guest-physical {gpa:#x} (type {fault_type}) that \
                     vmm.ko could not resolve"
                ),
            },
            Exit::NoWork { code } => {
                if code == exitcode::BOGUS && self.take_kick() {
                    VcpuExit::Interrupted
                } else {
                    VcpuExit::Spurious
                }
            }
            Exit::Other { code } => VcpuExit::Unsupported(format!(
                "bhyve exit {} ({code}) at RIP {:#x}",
                exit::exit_name(code),
                d.rip
            )),
        })
    }

    /// INS/OUTS: walks the guest's linear addresses (VM_GLA2GPA), hands one batch of
    /// elements to the VMM, and leaves the register updates for completion.
    fn string_io(&mut self, s: InoutStr) -> Result<VcpuExit<'_>> {
        let io = s.inout;
        let size = usize::from(io.bytes);
        let (addr_mask, addrsize) = match s.addrsize {
            2 => (0xffff_u64, 2u8),
            4 => (0xffff_ffff, 4),
            8 => (u64::MAX, 8),
            other => {
                return Ok(VcpuExit::InternalError {
                    detail: format!("string I/O with address size {other}"),
                })
            }
        };
        if !matches!(size, 1 | 2 | 4) {
            return Ok(VcpuExit::InternalError {
                detail: format!("string I/O of {size} bytes"),
            });
        }
        let total = if io.rep { s.count & addr_mask } else { 1 };
        if total == 0 {
            // REP with RCX = 0 does nothing; the kernel already stepped over it.
            return Ok(VcpuExit::Spurious);
        }
        let step: i64 = if s.rflags & RFLAGS_DF != 0 {
            -(size as i64)
        } else {
            size as i64
        };
        let long_mode = s.paging.cpu_mode == abi::CPU_MODE_64BIT;
        // In 64-bit mode only FS and GS have a base.
        let seg_base = if long_mode && !matches!(s.seg_name, reg::FS | reg::GS) {
            0
        } else {
            s.seg_desc.base
        };
        let max = (total as usize).min(IO_BATCH / size);
        let mut pieces: Vec<(u64, usize)> = Vec::new();
        let mut done = 0u64;
        let mut cached: Option<(u64, u64)> = None;
        'elements: for i in 0..max {
            let offset = (i as i64).wrapping_mul(step) as u64;
            let index = s.index.wrapping_add(offset) & addr_mask;
            let mut gla = seg_base.wrapping_add(index);
            if !long_mode {
                gla &= 0xffff_ffff;
            }
            let mut element = Vec::with_capacity(2);
            let mut left = size as u64;
            while left > 0 {
                let page = gla & !(PAGE - 1);
                let chunk = left.min(PAGE - (gla & (PAGE - 1)));
                let gpa_page = match cached {
                    Some((p, g)) if p == page => g,
                    _ => {
                        // The first element may fault: then the kernel injects #PF and
                        // restarts the instruction. Later ones only end the batch early.
                        match self.vm.gla2gpa(self.id, s.paging, page, io.is_in, i == 0)? {
                            Some(gpa) => {
                                let g = gpa & !(PAGE - 1);
                                cached = Some((page, g));
                                g
                            }
                            None if i == 0 => {
                                self.nextrip.set(None);
                                return Ok(VcpuExit::Spurious);
                            }
                            None => break 'elements,
                        }
                    }
                };
                let gpa = gpa_page + (gla & (PAGE - 1));
                match self.vm.host_address(gpa, chunk) {
                    Some(host) => element.push((host, chunk as usize)),
                    None if i == 0 => {
                        return Ok(VcpuExit::Unsupported(format!(
                            "string I/O on port {:#x} with guest-physical {gpa:#x}, which is \
                             not RAM",
                            io.port
                        )))
                    }
                    None => break 'elements,
                }
                gla = gla.wrapping_add(chunk);
                left -= chunk;
            }
            pieces.extend(element);
            done += 1;
        }
        let bytes = done as usize * size;
        if !io.is_in {
            let mut at = 0;
            for &(host, len) in &pieces {
                // SAFETY: `host .. host + len` is RAM of a slot this VM maps (checked above).
                unsafe {
                    ptr::copy_nonoverlapping(host as *const u8, self.io_buf[at..].as_mut_ptr(), len)
                };
                at += len;
            }
        } else {
            self.io_buf[..bytes].fill(0xff);
        }
        *self.pending.get_mut() = Pending::StringIo(StringIo {
            is_in: io.is_in,
            pieces,
            done,
            step,
            index_reg: if io.is_in { reg::RDI } else { reg::RSI },
            index: s.index,
            rcx: io.rep.then_some(s.count),
            total,
            addrsize,
        });
        Ok(if io.is_in {
            VcpuExit::IoIn {
                port: io.port,
                size,
                data: &mut self.io_buf[..bytes],
            }
        } else {
            VcpuExit::IoOut {
                port: io.port,
                size,
                data: &self.io_buf[..bytes],
            }
        })
    }

    /// VM_INJECT_NMI on this vCPU (locks it: call only from its own thread, which owning
    /// the `BhyveVcpu` guarantees).
    pub fn inject_nmi(&self) -> Result<()> {
        self.vm.ioctl(
            abi::VM_INJECT_NMI,
            &mut abi::VmInt {
                value: self.id as i32,
            },
        )
    }

    /// VM_INJECT_EXCEPTION on this vCPU. `restart` re-executes the current instruction
    /// after the handler (fault semantics); otherwise the exception is delivered after it.
    pub fn inject_exception(
        &self,
        vector: u8,
        error_code: Option<u32>,
        restart: bool,
    ) -> Result<()> {
        self.complete_pending()?;
        self.vm
            .inject_exception(self.id, vector, error_code, restart)
    }

    /// VM_LAPIC_IRQ to this vCPU's own LAPIC (fixed, edge). Other vCPUs are reached with
    /// `Vm::signal_msi`, which never waits for them.
    pub fn lapic_irq(&self, vector: u8) -> Result<()> {
        self.vm.ioctl(
            abi::VM_LAPIC_IRQ,
            &mut abi::VmLapicIrq {
                cpuid: self.id as i32,
                vector: i32::from(vector),
            },
        )
    }

    /// VM_GET_X2APIC_STATE: whether this vCPU's LAPIC is in x2APIC mode.
    pub fn x2apic(&self) -> Result<bool> {
        self.vm.x2apic(self.id)
    }

    /// VM_SET_X2APIC_STATE. vmm.ko resets the mode-dependent LAPIC registers; set it
    /// before the vCPU first runs.
    pub fn set_x2apic(&self, on: bool) -> Result<()> {
        self.vm.set_x2apic(self.id, on)
    }

    /// VM_SET_CAPABILITY (`abi::cap::*`) on this vCPU.
    pub fn set_capability(&self, captype: i32, on: bool) -> Result<()> {
        self.vm.set_capability(self.id, captype, on)
    }

    /// VM_GET_CAPABILITY.
    pub fn capability(&self, captype: i32) -> Result<bool> {
        self.vm.get_capability(self.id, captype)
    }

    fn apic_base(&self) -> Result<u64> {
        let mut base = APIC_BASE_DEFAULT | APIC_BASE_ENABLE;
        if self.id == 0 {
            base |= APIC_BASE_BSP;
        }
        if self.vm.x2apic(self.id)? {
            base |= APIC_BASE_X2APIC;
        }
        Ok(base)
    }
}

const GPRS: [i32; 18] = [
    reg::RAX,
    reg::RBX,
    reg::RCX,
    reg::RDX,
    reg::RSI,
    reg::RDI,
    reg::RSP,
    reg::RBP,
    reg::R8,
    reg::R9,
    reg::R10,
    reg::R11,
    reg::R12,
    reg::R13,
    reg::R14,
    reg::R15,
    reg::RIP,
    reg::RFLAGS,
];

/// MSRs that bhyve exposes as registers.
fn msr_register(index: u32) -> Option<i32> {
    match index {
        MSR_EFER => Some(reg::EFER),
        MSR_FS_BASE => Some(reg::FS_BASE),
        MSR_GS_BASE => Some(reg::GS_BASE),
        MSR_KERNEL_GS_BASE => Some(reg::KGS_BASE),
        _ => None,
    }
}

impl Vcpu for BhyveVcpu {
    fn id(&self) -> u32 {
        self.id
    }

    fn run(&mut self) -> Result<VcpuExit<'_>> {
        self.complete_pending()?;
        if self.take_kick() {
            return Ok(VcpuExit::Interrupted);
        }
        // An AP waits here for its SIPI, and a kick still gets it out promptly.
        while !self.active.get() {
            if let Some(rip) = self.vm.take_startup(self.id, STARTUP_POLL) {
                self.start_ap(rip)?;
            } else if self.take_kick() {
                return Ok(VcpuExit::Interrupted);
            }
        }
        self.nextrip.set(None);
        if let Err(e) = self.vm_run() {
            // A kick before the kernel read `vm_run` left an impossible vCPU id (EINVAL).
            if self.take_kick() {
                return Ok(VcpuExit::Interrupted);
            }
            return match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) => Ok(VcpuExit::Interrupted),
                _ => Err(HypervisorError::Ioctl {
                    op: "VM_RUN",
                    source: e,
                }),
            };
        }
        let bytes = self.exit_copy();
        let d = exit::decode(&bytes);
        if d.inst_length > 0 {
            self.nextrip
                .set(Some(d.rip.wrapping_add(d.inst_length as u64)));
        }
        self.translate(d)
    }

    fn bind_kicker(&mut self) -> Result<VcpuKicker> {
        // SAFETY: the byte lives in the vCPU's boxed run area; Drop unbinds it before the
        // box goes away, and the vCPU runs on this thread from now on.
        let kicker = unsafe { kick::bind_current_thread(self.kick_byte()) }?;
        self.kicker_bound = true;
        Ok(kicker)
    }

    fn finish_pending_exit(&mut self) -> Result<()> {
        self.complete_pending()
    }

    /// The 8259 pair is always in the kernel on bhyve: no user-space ExtINT path.
    fn ready_for_interrupt(&self) -> bool {
        false
    }

    fn request_interrupt_window(&mut self, _on: bool) {}

    fn inject_external_interrupt(&self, _vector: u8) -> Result<()> {
        unsupported(
            "injecting a user-space 8259 interrupt",
            "the 8259 pair is always in the kernel (raise its line with set_irq_line)",
        )
    }

    fn regs(&self) -> Result<StandardRegisters> {
        self.complete_pending()?;
        let v = self.vm.get_registers(self.id, &GPRS)?;
        Ok(StandardRegisters {
            rax: v[0],
            rbx: v[1],
            rcx: v[2],
            rdx: v[3],
            rsi: v[4],
            rdi: v[5],
            rsp: v[6],
            rbp: v[7],
            r8: v[8],
            r9: v[9],
            r10: v[10],
            r11: v[11],
            r12: v[12],
            r13: v[13],
            r14: v[14],
            r15: v[15],
            rip: self.nextrip.get().unwrap_or(v[16]),
            rflags: v[17],
        })
    }

    fn set_regs(&self, r: &StandardRegisters) -> Result<()> {
        self.complete_pending()?;
        let values = [
            r.rax, r.rbx, r.rcx, r.rdx, r.rsi, r.rdi, r.rsp, r.rbp, r.r8, r.r9, r.r10, r.r11,
            r.r12, r.r13, r.r14, r.r15, r.rip, r.rflags,
        ];
        let regs: Vec<(i32, u64)> = GPRS.iter().copied().zip(values).collect();
        self.vm.set_registers(self.id, &regs)?;
        // Writing RIP also sets the kernel's nextrip.
        self.nextrip.set(None);
        Ok(())
    }

    fn sregs(&self) -> Result<SpecialRegisters> {
        self.complete_pending()?;
        let mut names: Vec<i32> = SEGMENTS.iter().map(|s| s.0).collect();
        names.extend([reg::CR0, reg::CR2, reg::CR3, reg::CR4, reg::EFER]);
        let v = self.vm.get_registers(self.id, &names)?;
        let mut segs = [crate::SegmentRegister::default(); 8];
        for (i, (r, _)) in SEGMENTS.iter().enumerate() {
            let desc = self.vm.get_segment(self.id, *r)?;
            segs[i] = from_seg_desc(&desc, v[i] as u16);
        }
        let table = |r| -> Result<DescriptorTable> {
            let d = self.vm.get_segment(self.id, r)?;
            Ok(DescriptorTable {
                base: d.base,
                limit: d.limit as u16,
            })
        };
        // CR8 mirrors the in-kernel LAPIC's TPR; kernels without the TPR register say 0.
        let cr8 = self.get_reg(reg::TPR).unwrap_or(0);
        Ok(SpecialRegisters {
            cs: segs[0],
            ds: segs[1],
            es: segs[2],
            fs: segs[3],
            gs: segs[4],
            ss: segs[5],
            tr: segs[6],
            ldt: segs[7],
            gdt: table(reg::GDTR)?,
            idt: table(reg::IDTR)?,
            cr0: v[8],
            cr2: v[9],
            cr3: v[10],
            cr4: v[11],
            efer: v[12],
            cr8,
            apic_base: self.apic_base()?,
        })
    }

    fn set_sregs(&self, s: &SpecialRegisters) -> Result<()> {
        self.complete_pending()?;
        let segs = [s.cs, s.ds, s.es, s.fs, s.gs, s.ss, s.tr, s.ldt];
        for ((r, _), seg) in SEGMENTS.iter().zip(&segs) {
            self.vm.set_segment(self.id, *r, to_seg_desc(seg))?;
        }
        for (r, t) in [(reg::GDTR, s.gdt), (reg::IDTR, s.idt)] {
            self.vm.set_segment(
                self.id,
                r,
                SegDesc {
                    base: t.base,
                    limit: u32::from(t.limit),
                    access: 0,
                },
            )?;
        }
        // Control registers first (EFER after CR0/CR4, as a guest would switch modes),
        // then the selectors.
        let mut regs = vec![
            (reg::CR0, s.cr0),
            (reg::CR4, s.cr4),
            (reg::EFER, s.efer),
            (reg::CR3, s.cr3),
            (reg::CR2, s.cr2),
        ];
        for ((r, _), seg) in SEGMENTS.iter().zip(&segs) {
            regs.push((*r, u64::from(seg.selector)));
        }
        self.vm.set_registers(self.id, &regs)?;
        // The APIC mode is the only part of IA32_APIC_BASE vmm.ko lets user space choose;
        // the TPR (CR8) lives in the in-kernel LAPIC.
        let x2apic = s.apic_base & APIC_BASE_X2APIC != 0;
        if s.apic_base != 0 && x2apic != self.vm.x2apic(self.id)? {
            self.vm.set_x2apic(self.id, x2apic)?;
        }
        Ok(())
    }

    fn fpu(&self) -> Result<FpuState> {
        unsupported(
            "reading the FPU state",
            "vmm.ko has no ioctl for the guest FPU (only VM_SNAPSHOT_REQ on BHYVE_SNAPSHOT \
             kernels)",
        )
    }

    fn set_fpu(&self, _fpu: &FpuState) -> Result<()> {
        unsupported(
            "writing the FPU state",
            "vmm.ko has no ioctl for the guest FPU",
        )
    }

    fn xsave(&self) -> Result<XsaveState> {
        unsupported(
            "reading the XSAVE area",
            "vmm.ko has no ioctl for the guest XSAVE state",
        )
    }

    fn set_xsave(&self, _xsave: &XsaveState) -> Result<()> {
        unsupported(
            "writing the XSAVE area",
            "vmm.ko has no ioctl for the guest XSAVE state",
        )
    }

    fn xcrs(&self) -> Result<Vec<Xcr>> {
        unsupported("reading XCR0", "vmm.ko has no ioctl for the guest XCRs")
    }

    fn set_xcrs(&self, _xcrs: &[Xcr]) -> Result<()> {
        unsupported("writing XCR0", "vmm.ko has no ioctl for the guest XCRs")
    }

    /// The MSRs bhyve exposes as registers (EFER, FS/GS base, kernel GS base) and
    /// IA32_APIC_BASE; the rest are left out, as the trait allows.
    fn msrs(&self, indices: &[u32]) -> Result<Vec<MsrEntry>> {
        self.complete_pending()?;
        let mut out = Vec::new();
        for &index in indices {
            let data = if index == IA32_APIC_BASE {
                self.apic_base().ok()
            } else {
                msr_register(index).and_then(|r| self.get_reg(r).ok())
            };
            if let Some(data) = data {
                out.push(MsrEntry { index, data });
            }
        }
        Ok(out)
    }

    /// EFER, FS/GS base and kernel GS base through their registers. IA32_APIC_BASE only
    /// as `msrs` reports it (restoring a snapshot writes it back; the x2APIC mode travels
    /// in the special registers): vmm.ko lets nobody move, disable or re-mode the LAPIC
    /// through it.
    fn set_msrs(&self, msrs: &[MsrEntry]) -> Result<()> {
        self.complete_pending()?;
        for m in msrs {
            if m.index == IA32_APIC_BASE {
                let current = self.apic_base()?;
                if m.data != current {
                    return Err(HypervisorError::Invalid(format!(
                        "bhyve cannot set IA32_APIC_BASE of vCPU {} to {:#x} (it is {current:#x}; \
                         vmm.ko fixes the LAPIC's base and mode)",
                        self.id, m.data
                    )));
                }
                continue;
            }
            match msr_register(m.index) {
                Some(r) => self.set_reg(r, m.data)?,
                None => {
                    return Err(HypervisorError::Invalid(format!(
                        "bhyve cannot write MSR {:#x}: vmm.ko has no MSR ioctl",
                        m.index
                    )))
                }
            }
        }
        Ok(())
    }

    /// vmm.ko emulates CPUID itself (topology from VM_SET_TOPOLOGY, set at vCPU creation);
    /// there is no ioctl to install a table, so the entries are not applied.
    fn set_cpuid(&self, entries: &[CpuidEntry]) -> Result<()> {
        if !entries.is_empty() {
            log::debug!(
                "bhyve: vCPU {}: CPUID is emulated by vmm.ko; {} entries not applied",
                self.id,
                entries.len()
            );
        }
        Ok(())
    }

    /// Empty: vmm.ko cannot report the CPUID it presents (and an empty list in a
    /// `VcpuState` means "leave the destination's CPUID alone").
    fn cpuid(&self) -> Result<Vec<CpuidEntry>> {
        Ok(Vec::new())
    }

    fn lapic(&self) -> Result<LapicState> {
        unsupported(
            "reading the local APIC",
            "vmm.ko has no ioctl for the LAPIC page (only VM_SNAPSHOT_REQ on BHYVE_SNAPSHOT \
             kernels)",
        )
    }

    fn set_lapic(&self, _lapic: &LapicState) -> Result<()> {
        unsupported(
            "writing the local APIC",
            "vmm.ko has no ioctl for the LAPIC page",
        )
    }

    fn mp_state(&self) -> Result<MpState> {
        Ok(if self.active.get() {
            MpState::Runnable
        } else {
            MpState::Uninitialized
        })
    }

    fn set_mp_state(&self, state: MpState) -> Result<()> {
        match state {
            MpState::Runnable | MpState::Halted => {
                if !self.active.get() {
                    self.vm.activate(self.id)?;
                    self.active.set(true);
                }
                Ok(())
            }
            MpState::Uninitialized | MpState::InitReceived | MpState::SipiReceived => {
                if self.active.get() {
                    Err(HypervisorError::Invalid(format!(
                        "bhyve cannot return the running vCPU {} to wait-for-SIPI",
                        self.id
                    )))
                } else {
                    Ok(())
                }
            }
        }
    }

    /// The event being delivered (VM_GET_INTINFO) and the interrupt shadow.
    fn vcpu_events(&self) -> Result<VcpuEvents> {
        self.complete_pending()?;
        let mut ii = abi::VmIntinfo {
            vcpuid: self.id as i32,
            ..Default::default()
        };
        self.vm.ioctl(abi::VM_GET_INTINFO, &mut ii)?;
        let shadow = self.get_reg(reg::INTR_SHADOW)?;
        let mut e = VcpuEvents {
            interrupt_shadow: u8::from(shadow != 0),
            ..Default::default()
        };
        let info = ii.info1;
        if info & intinfo::VALID != 0 {
            let vector = (info & intinfo::VECTOR_MASK) as u8;
            match info & intinfo::TYPE_MASK {
                intinfo::HWEXCEPTION => {
                    e.exception_injected = true;
                    e.exception_nr = vector;
                    e.exception_has_error_code = info & intinfo::DEL_ERRCODE != 0;
                    e.exception_error_code = (info >> intinfo::ERRCODE_SHIFT) as u32;
                }
                intinfo::NMI => e.nmi_injected = true,
                t => {
                    e.interrupt_injected = true;
                    e.interrupt_nr = vector;
                    e.interrupt_soft = t == intinfo::SWINTR;
                }
            }
        }
        Ok(e)
    }

    fn set_vcpu_events(&self, e: &VcpuEvents) -> Result<()> {
        self.complete_pending()?;
        let mut info = 0u64;
        if e.exception_injected {
            info = intinfo::VALID | intinfo::HWEXCEPTION | u64::from(e.exception_nr);
            if e.exception_has_error_code {
                info |= intinfo::DEL_ERRCODE
                    | u64::from(e.exception_error_code) << intinfo::ERRCODE_SHIFT;
            }
        } else if e.nmi_injected {
            info = intinfo::VALID | intinfo::NMI | 2;
        } else if e.interrupt_injected {
            let kind = if e.interrupt_soft {
                intinfo::SWINTR
            } else {
                intinfo::HWINTR
            };
            info = intinfo::VALID | kind | u64::from(e.interrupt_nr);
        }
        self.vm.ioctl(
            abi::VM_SET_INTINFO,
            &mut abi::VmIntinfo {
                vcpuid: self.id as i32,
                info1: info,
                ..Default::default()
            },
        )?;
        if e.interrupt_shadow == 0 {
            self.set_reg(reg::INTR_SHADOW, 0)?;
        } else {
            log::debug!("bhyve: vCPU {}: an interrupt shadow cannot be set", self.id);
        }
        if e.nmi_pending {
            self.inject_nmi()?;
        }
        Ok(())
    }
}
