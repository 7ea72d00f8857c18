//! One bhyve VM: /dev/vmm/NAME, its memory segments, interrupt lines and the hand-over of
//! SIPIs to application processors.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use super::abi::{self, cap, reg, Abi, SegDesc, VmGuestPaging};
use super::transport::{VmmControl, VmmTransport};
use super::vcpu::BhyveVcpu;
use super::{snapshot, unsupported, BhyveOptions};
use crate::{
    ClockData, HypervisorError, IrqChipMode, IrqChipState, MemoryRegion, MsiMessage, Result, Vcpu,
    Vm,
};

/// A memory slot as registered: one system-memory segment mapped at `gpa`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    pub gpa: u64,
    pub size: u64,
    pub host_addr: u64,
}

/// SIPIs waiting for their AP's thread, and which vCPUs are active.
#[derive(Default)]
pub(crate) struct Startup {
    pub pending: HashMap<u32, u64>,
    pub active: HashSet<u32>,
}

/// What the VM and its vCPUs share.
pub(crate) struct VmShared {
    pub name: String,
    pub control: Arc<dyn VmmControl>,
    pub dev: Arc<dyn VmmTransport>,
    pub options: BhyveOptions,
    pub abi: Abi,
    /// FreeBSD 15 kernels built before the NUMA memseg change answer ENOTTY to the 56-byte
    /// VM_ALLOC_MEMSEG; they get the 14 layout from then on.
    memseg_14: AtomicBool,
    /// VM_RUN's direction bits (see abi.rs): `_IOW` unless the kernel refused it.
    pub run_iowr: AtomicBool,
    slots: Mutex<BTreeMap<u32, Slot>>,
    pub startup: Mutex<Startup>,
    pub startup_cv: Condvar,
    /// One more than the highest vCPU id created (the topology's core count).
    vcpus: AtomicU32,
    /// Whether the kernel has VM_SNAPSHOT_REQ (probed when the VM is created).
    pub snapshot: snapshot::Support,
    /// The I/O APIC pin each ISA IRQ also reaches (`NOT_ROUTED`: the 8259 only), as the
    /// VMM's `set_irqchip_routes` wired it.
    isa_ioapic_pins: [AtomicU32; ISA_IRQS as usize],
}

/// ISA IRQs, which vmm.ko delivers to an 8259 input and an I/O APIC pin together.
const ISA_IRQS: u32 = 16;
/// Pins of vmm.ko's I/O APIC.
const IOAPIC_PINS: u32 = 32;
const NOT_ROUTED: u32 = u32::MAX;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl VmShared {
    /// Issues `request` with `arg`, naming the ioctl in the error.
    pub fn ioctl<T: IntoBytes + FromBytes + KnownLayout + Immutable>(
        &self,
        request: u64,
        arg: &mut T,
    ) -> Result<()> {
        self.dev
            .ioctl(request, arg.as_mut_bytes())
            .map_err(|source| HypervisorError::Ioctl {
                op: abi::ioctl_name(request),
                source,
            })
    }

    pub fn set_register(&self, vcpu: u32, regnum: i32, value: u64) -> Result<()> {
        self.ioctl(
            abi::VM_SET_REGISTER,
            &mut abi::VmRegister {
                cpuid: vcpu as i32,
                regnum,
                regval: value,
            },
        )
    }

    pub fn get_register(&self, vcpu: u32, regnum: i32) -> Result<u64> {
        let mut arg = abi::VmRegister {
            cpuid: vcpu as i32,
            regnum,
            regval: 0,
        };
        self.ioctl(abi::VM_GET_REGISTER, &mut arg)?;
        Ok(arg.regval)
    }

    /// VM_GET_REGISTER_SET: one ioctl for many registers.
    pub fn get_registers(&self, vcpu: u32, regnums: &[i32]) -> Result<Vec<u64>> {
        let mut values = vec![0u64; regnums.len()];
        let mut arg = abi::VmRegisterSet {
            cpuid: vcpu as i32,
            count: regnums.len() as u32,
            regnums: regnums.as_ptr() as u64,
            regvals: values.as_mut_ptr() as u64,
        };
        // The kernel reads `count` ints from `regnums` and writes `count` u64s to
        // `regvals`; both live until the call returns.
        self.ioctl(abi::VM_GET_REGISTER_SET, &mut arg)?;
        Ok(values)
    }

    /// VM_SET_REGISTER_SET; the kernel writes the registers in order.
    pub fn set_registers(&self, vcpu: u32, regs: &[(i32, u64)]) -> Result<()> {
        let regnums: Vec<i32> = regs.iter().map(|r| r.0).collect();
        let mut values: Vec<u64> = regs.iter().map(|r| r.1).collect();
        let mut arg = abi::VmRegisterSet {
            cpuid: vcpu as i32,
            count: regs.len() as u32,
            regnums: regnums.as_ptr() as u64,
            regvals: values.as_mut_ptr() as u64,
        };
        self.ioctl(abi::VM_SET_REGISTER_SET, &mut arg)
    }

    pub fn get_segment(&self, vcpu: u32, regnum: i32) -> Result<SegDesc> {
        let mut arg = abi::VmSegDesc {
            cpuid: vcpu as i32,
            regnum,
            desc: SegDesc::default(),
        };
        self.ioctl(abi::VM_GET_SEGMENT_DESCRIPTOR, &mut arg)?;
        Ok(arg.desc)
    }

    pub fn set_segment(&self, vcpu: u32, regnum: i32, desc: SegDesc) -> Result<()> {
        self.ioctl(
            abi::VM_SET_SEGMENT_DESCRIPTOR,
            &mut abi::VmSegDesc {
                cpuid: vcpu as i32,
                regnum,
                desc,
            },
        )
    }

    pub fn set_capability(&self, vcpu: u32, captype: i32, on: bool) -> Result<()> {
        self.ioctl(
            abi::VM_SET_CAPABILITY,
            &mut abi::VmCapability {
                cpuid: vcpu as i32,
                captype,
                capval: i32::from(on),
                allcpus: 0,
            },
        )
    }

    pub fn get_capability(&self, vcpu: u32, captype: i32) -> Result<bool> {
        let mut arg = abi::VmCapability {
            cpuid: vcpu as i32,
            captype,
            capval: 0,
            allcpus: 0,
        };
        self.ioctl(abi::VM_GET_CAPABILITY, &mut arg)?;
        Ok(arg.capval != 0)
    }

    pub fn x2apic(&self, vcpu: u32) -> Result<bool> {
        let mut arg = abi::VmX2apic {
            cpuid: vcpu as i32,
            state: 0,
        };
        self.ioctl(abi::VM_GET_X2APIC_STATE, &mut arg)?;
        Ok(arg.state == abi::X2APIC_ENABLED)
    }

    pub fn set_x2apic(&self, vcpu: u32, on: bool) -> Result<()> {
        self.ioctl(
            abi::VM_SET_X2APIC_STATE,
            &mut abi::VmX2apic {
                cpuid: vcpu as i32,
                state: if on {
                    abi::X2APIC_ENABLED
                } else {
                    abi::X2APIC_DISABLED
                },
            },
        )
    }

    pub fn activate(&self, vcpu: u32) -> Result<()> {
        self.ioctl(abi::VM_ACTIVATE_CPU, &mut abi::VmInt { value: vcpu as i32 })?;
        lock(&self.startup).active.insert(vcpu);
        Ok(())
    }

    /// VM_INJECT_EXCEPTION. Locks the target vCPU: only its own thread may call this.
    pub fn inject_exception(
        &self,
        vcpu: u32,
        vector: u8,
        error_code: Option<u32>,
        restart: bool,
    ) -> Result<()> {
        self.ioctl(
            abi::VM_INJECT_EXCEPTION,
            &mut abi::VmException {
                cpuid: vcpu as i32,
                vector: i32::from(vector),
                error_code: error_code.unwrap_or(0),
                error_code_valid: i32::from(error_code.is_some()),
                restart_instruction: i32::from(restart),
            },
        )
    }

    pub fn restart_instruction(&self, vcpu: u32) -> Result<()> {
        self.ioctl(
            abi::VM_RESTART_INSTRUCTION,
            &mut abi::VmInt { value: vcpu as i32 },
        )
    }

    /// Translates a guest-linear address with the vCPU's paging state. `None`: the walk
    /// faulted (with `inject`, the kernel has injected #PF and restarts the instruction).
    pub fn gla2gpa(
        &self,
        vcpu: u32,
        paging: VmGuestPaging,
        gla: u64,
        write: bool,
        inject: bool,
    ) -> Result<Option<u64>> {
        let mut arg = abi::VmGla2gpa {
            vcpuid: vcpu as i32,
            prot: if write {
                abi::PROT_WRITE
            } else {
                abi::PROT_READ
            },
            gla,
            paging,
            ..Default::default()
        };
        let request = if inject {
            abi::VM_GLA2GPA
        } else {
            abi::VM_GLA2GPA_NOFAULT
        };
        self.ioctl(request, &mut arg)?;
        Ok((arg.fault == 0).then_some(arg.gpa))
    }

    /// The host address of guest-physical `gpa .. gpa + len`, if it is RAM this VM maps.
    pub fn host_address(&self, gpa: u64, len: u64) -> Option<u64> {
        let slots = lock(&self.slots);
        slots.values().find_map(|s| {
            let end = gpa.checked_add(len)?;
            (gpa >= s.gpa && end <= s.gpa + s.size).then(|| s.host_addr + (gpa - s.gpa))
        })
    }

    /// How many vCPUs the kernel has for this VM (ids 0 .. n-1 are created in order).
    pub fn vcpu_count(&self) -> u32 {
        self.vcpus.load(Ordering::Acquire)
    }

    /// A SIPI for `vcpu` arrived on the BSP (SPINUP_AP exit): wake that vCPU's thread.
    pub fn post_startup(&self, vcpu: u32, rip: u64) {
        let mut startup = lock(&self.startup);
        if startup.active.contains(&vcpu) {
            log::warn!(
                "bhyve: SIPI for vCPU {vcpu}, which is already running; ignored \
                 (restarting an AP is not supported)"
            );
            return;
        }
        startup.pending.insert(vcpu, rip);
        self.startup_cv.notify_all();
    }

    /// Waits up to `timeout` for a SIPI addressed to `vcpu`.
    pub fn take_startup(&self, vcpu: u32, timeout: Duration) -> Option<u64> {
        let mut startup = lock(&self.startup);
        if let Some(rip) = startup.pending.remove(&vcpu) {
            return Some(rip);
        }
        startup = self
            .startup_cv
            .wait_timeout(startup, timeout)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        startup.pending.remove(&vcpu)
    }

    fn alloc_memseg(&self, segid: i32, len: u64) -> io::Result<()> {
        let use_15 = self.abi == Abi::FreeBsd15 && !self.memseg_14.load(Ordering::Relaxed);
        if use_15 {
            let mut arg = abi::VmMemseg15 {
                segid,
                len,
                ..Default::default()
            };
            match self.dev.ioctl(abi::VM_ALLOC_MEMSEG_15, arg.as_mut_bytes()) {
                Err(e) if e.raw_os_error() == Some(libc::ENOTTY) => {
                    self.memseg_14.store(true, Ordering::Relaxed);
                }
                other => return other,
            }
        }
        let mut arg = abi::VmMemseg14 {
            segid,
            len,
            ..Default::default()
        };
        self.dev.ioctl(abi::VM_ALLOC_MEMSEG_14, arg.as_mut_bytes())
    }
}

impl Drop for VmShared {
    fn drop(&mut self) {
        if let Err(e) = self.control.destroy_vm(&self.name) {
            log::warn!("bhyve: destroying VM {}: {e}", self.name);
        }
    }
}

/// A bhyve VM. Destroyed when it and all its vCPUs are dropped.
pub struct BhyveVm {
    pub(crate) shared: Arc<VmShared>,
}

impl BhyveVm {
    pub(crate) fn new(
        name: String,
        control: Arc<dyn VmmControl>,
        dev: Arc<dyn VmmTransport>,
        options: BhyveOptions,
    ) -> Self {
        let abi = control.abi();
        BhyveVm {
            shared: Arc::new(VmShared {
                name,
                control,
                dev,
                options,
                abi,
                memseg_14: AtomicBool::new(false),
                run_iowr: AtomicBool::new(false),
                slots: Mutex::new(BTreeMap::new()),
                startup: Mutex::new(Startup::default()),
                startup_cv: Condvar::new(),
                vcpus: AtomicU32::new(0),
                snapshot: snapshot::Support::default(),
                isa_ioapic_pins: std::array::from_fn(|_| AtomicU32::new(NOT_ROUTED)),
            }),
        }
    }

    /// The VM's name (its device is /dev/vmm/NAME).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Creates a vCPU with its concrete type.
    pub fn create_bhyve_vcpu(&self, id: u32) -> Result<BhyveVcpu> {
        let vm = &self.shared;
        let opts = vm.options;
        // The first ioctl naming a vCPU makes the kernel allocate it (and its LAPIC), so
        // every vCPU exists before the BSP sends INIT/SIPI to it.
        if opts.unrestricted_guest {
            if let Err(e) = vm.set_capability(id, cap::UNRESTRICTED_GUEST, true) {
                log::warn!(
                    "bhyve: vCPU {id}: no unrestricted guest ({e}); real-mode code and AP \
                     start-up will fail"
                );
            }
        }
        if let Err(e) = vm.set_capability(id, cap::HALT_EXIT, opts.halt_exit) {
            log::warn!("bhyve: vCPU {id}: HALT_EXIT not taken: {e}");
        }
        if opts.pause_exit {
            vm.set_capability(id, cap::PAUSE_EXIT, true)?;
        }
        vm.set_x2apic(id, opts.x2apic)?;
        // CPUID's topology: one socket of as many cores as vCPUs exist.
        let count = vm.vcpus.fetch_max(id + 1, Ordering::AcqRel).max(id + 1);
        let cores =
            u16::try_from(count).map_err(|_| HypervisorError::Invalid(format!("{count} vCPUs")))?;
        vm.ioctl(
            abi::VM_SET_TOPOLOGY,
            &mut abi::VmCpuTopology {
                sockets: 1,
                cores,
                threads: 1,
                maxcpus: 0,
            },
        )?;
        // The BSP runs from the start; APs wait for their SIPI.
        if id == 0 {
            vm.activate(0)?;
        }
        Ok(BhyveVcpu::new(id, vm.clone(), id == 0))
    }

    /// VM_SUSPEND: ends the VM (every vCPU's next VM_RUN returns a SUSPENDED exit).
    pub fn suspend(&self, how: i32) -> Result<()> {
        self.shared
            .ioctl(abi::VM_SUSPEND, &mut abi::VmInt { value: how })
    }

    /// VM_SUSPEND_CPU: stops a vCPU (or all with `None`) at its next exit; its VM_RUN then
    /// returns DEBUG exits (`VcpuExit::Spurious`) until VM_RESUME_CPU.
    pub fn suspend_vcpus(&self, vcpu: Option<u32>) -> Result<()> {
        self.shared.ioctl(
            abi::VM_SUSPEND_CPU,
            &mut abi::VmInt {
                value: vcpu.map_or(-1, |v| v as i32),
            },
        )
    }

    /// VM_RESUME_CPU: resumes a vCPU (or all with `None`).
    pub fn resume_vcpus(&self, vcpu: Option<u32>) -> Result<()> {
        self.shared.ioctl(
            abi::VM_RESUME_CPU,
            &mut abi::VmInt {
                value: vcpu.map_or(-1, |v| v as i32),
            },
        )
    }

    /// VM_IOAPIC_PULSE_IRQ: an edge on IOAPIC pin `pin`.
    pub fn pulse_ioapic_pin(&self, pin: u32) -> Result<()> {
        self.shared.ioctl(
            abi::VM_IOAPIC_PULSE_IRQ,
            &mut abi::VmInt { value: pin as i32 },
        )
    }

    fn slots(&self) -> MutexGuard<'_, BTreeMap<u32, Slot>> {
        lock(&self.shared.slots)
    }
}

impl BhyveVm {
    /// The I/O APIC pin ISA IRQ `irq` reaches, -1 for none (vmm.ko's convention).
    fn ioapic_pin_of_isa_irq(&self, irq: u32) -> i32 {
        let pins = &self.shared.isa_ioapic_pins;
        match pins.get(irq as usize).map(|p| p.load(Ordering::Acquire)) {
            Some(pin) if pin != NOT_ROUTED => pin as i32,
            _ => -1,
        }
    }
}

/// Checks `routes` against what vmm.ko can wire: ISA IRQ n on 8259 input n (its ISA
/// ioctls pair them) and at most one I/O APIC pin; a higher GSI on the pin of its number.
/// Returns the I/O APIC pin of each ISA IRQ.
fn isa_wiring(routes: &[crate::IrqRoute]) -> Result<[u32; ISA_IRQS as usize]> {
    use crate::IrqChipPin::*;
    let mut pins = [NOT_ROUTED; ISA_IRQS as usize];
    for route in routes {
        let gsi = route.gsi;
        let fits = match route.pin {
            PicMaster(pin) => gsi < 8 && pin == gsi,
            PicSlave(pin) => (8..ISA_IRQS).contains(&gsi) && pin == gsi - 8,
            Ioapic(pin) if gsi < ISA_IRQS && pin < IOAPIC_PINS => {
                let first = pins[gsi as usize] == NOT_ROUTED;
                pins[gsi as usize] = pin;
                first
            }
            Ioapic(pin) => pin == gsi && pin < IOAPIC_PINS,
        };
        if !fits {
            return unsupported(
                &format!("the interrupt route {route:?}"),
                "vmm.ko pairs ISA IRQ n with 8259 input n and a GSI above 15 with its own pin",
            );
        }
    }
    Ok(pins)
}

impl Vm for BhyveVm {
    unsafe fn map_memory(&self, region: &MemoryRegion) -> Result<()> {
        let vm = &self.shared;
        let mut slots = self.slots();
        if region.size == 0 {
            // Removal: unmap from the guest. The segment stays allocated (vmm.ko frees
            // segments with the VM) and the host range keeps showing it.
            if let Some(old) = slots.remove(&region.slot) {
                vm.ioctl(
                    abi::VM_MUNMAP_MEMSEG,
                    &mut abi::VmMunmap {
                        gpa: old.gpa,
                        len: old.size,
                    },
                )?;
            }
            return Ok(());
        }
        if region.log_dirty {
            return unsupported(
                "dirty-page logging",
                "upstream FreeBSD's vmm.ko has no dirty-page tracking",
            );
        }
        if region.slot >= vm.abi.max_sysmem_segments() {
            return Err(HypervisorError::Invalid(format!(
                "memory slot {}: FreeBSD {} has {} system-memory segments",
                region.slot,
                vm.abi.major(),
                vm.abi.max_sysmem_segments()
            )));
        }
        if slots.contains_key(&region.slot) {
            return Err(HypervisorError::Invalid(format!(
                "memory slot {} is already mapped (bhyve cannot move a segment)",
                region.slot
            )));
        }
        let page = 4096;
        if !region.guest_addr.is_multiple_of(page)
            || !region.size.is_multiple_of(page)
            || !region.host_addr.is_multiple_of(page)
        {
            return Err(HypervisorError::Invalid(format!(
                "memory slot {}: guest {:#x}, size {:#x} and host {:#x} must be page-aligned",
                region.slot, region.guest_addr, region.size, region.host_addr
            )));
        }
        let segid = region.slot as i32;
        match vm.alloc_memseg(segid, region.size) {
            Ok(()) => {}
            // Re-adding a removed slot of the same size finds its segment still there.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(source) => {
                return Err(HypervisorError::Ioctl {
                    op: "VM_ALLOC_MEMSEG",
                    source,
                })
            }
        }
        let mut prot = abi::PROT_READ | abi::PROT_EXEC;
        if !region.readonly {
            prot |= abi::PROT_WRITE;
        }
        vm.ioctl(
            abi::VM_MMAP_MEMSEG,
            &mut abi::VmMemmap {
                gpa: region.guest_addr,
                segid,
                segoff: 0,
                len: region.size,
                prot,
                flags: if vm.options.wired {
                    abi::VM_MEMMAP_F_WIRED
                } else {
                    0
                },
                ..Default::default()
            },
        )?;
        // SAFETY: the caller guarantees the host range is its own mapping and stays valid
        // for the VM's lifetime; from now on it shows the guest's memory.
        unsafe {
            vm.dev
                .map_guest_memory(region.host_addr, region.size, region.guest_addr)
        }
        .map_err(|source| HypervisorError::Ioctl {
            op: "mmap of the VM device (guest memory)",
            source,
        })?;
        slots.insert(
            region.slot,
            Slot {
                gpa: region.guest_addr,
                size: region.size,
                host_addr: region.host_addr,
            },
        );
        Ok(())
    }

    fn create_irqchip(&self, mode: IrqChipMode) -> Result<()> {
        match mode {
            // Always there: created with the VM.
            IrqChipMode::Kernel => Ok(()),
            IrqChipMode::Split { .. } => unsupported(
                "a split irqchip",
                "vmm.ko always models the 8259 pair, IOAPIC and PIT in the kernel",
            ),
        }
    }

    /// vmm.ko's 8259 pair and I/O APIC are wired by each ISA ioctl's arguments: the routes
    /// are kept here and given with every line change.
    fn set_irqchip_routes(&self, routes: &[crate::IrqRoute]) -> Result<()> {
        let pins = isa_wiring(routes)?;
        for (slot, pin) in self.shared.isa_ioapic_pins.iter().zip(pins) {
            slot.store(pin, Ordering::Release);
        }
        Ok(())
    }

    fn create_vcpu(&self, id: u32) -> Result<Box<dyn Vcpu>> {
        Ok(Box::new(self.create_bhyve_vcpu(id)?))
    }

    /// ISA IRQs 0-15 go to the 8259 pair and the IOAPIC together (VM_ISA_ASSERT_IRQ, IRQ 0
    /// on IOAPIC pin 2 as the MADT says; IRQ 2 is the cascade and does nothing); higher
    /// GSIs are IOAPIC pins (VM_IOAPIC_ASSERT_IRQ). Neither locks a vCPU.
    fn set_irq_line(&self, gsi: u32, level: bool) -> Result<()> {
        let vm = &self.shared;
        if gsi < 16 {
            if gsi == 2 {
                return Ok(());
            }
            let request = if level {
                abi::VM_ISA_ASSERT_IRQ
            } else {
                abi::VM_ISA_DEASSERT_IRQ
            };
            vm.ioctl(
                request,
                &mut abi::VmIsaIrq {
                    atpic_irq: gsi as i32,
                    ioapic_irq: self.ioapic_pin_of_isa_irq(gsi),
                },
            )
        } else {
            let request = if level {
                abi::VM_IOAPIC_ASSERT_IRQ
            } else {
                abi::VM_IOAPIC_DEASSERT_IRQ
            };
            vm.ioctl(request, &mut abi::VmInt { value: gsi as i32 })
        }
    }

    /// VM_LAPIC_MSI: the kernel routes the message to the destination LAPIC and wakes or
    /// kicks that vCPU itself; no vCPU lock is taken.
    fn signal_msi(&self, msi: MsiMessage) -> Result<()> {
        self.shared.ioctl(
            abi::VM_LAPIC_MSI,
            &mut abi::VmLapicMsi {
                msg: u64::from(msi.data),
                addr: msi.address,
            },
        )
    }

    fn set_msi_routes(&self, _routes: &[(u32, MsiMessage)]) -> Result<()> {
        unsupported(
            "MSI routes for a user-space IOAPIC",
            "the IOAPIC is always in the kernel (no split irqchip)",
        )
    }

    // `set_msi_route`, `register_irqfd` and `register_ioeventfd` keep the trait's
    // Unsupported defaults: vmm.ko has no eventfd-driven injection and no in-kernel
    // notification of guest writes (no irqfd, no ioeventfd, no GSI routing table). Devices
    // inject with `signal_msi` (VM_LAPIC_MSI), and queue notifications reach them as exits.

    fn dirty_log(&self, _slot: u32, _size: u64) -> Result<Vec<u64>> {
        unsupported(
            "dirty-page tracking",
            "upstream FreeBSD's vmm.ko has none (use snapshot or stop-and-copy migration)",
        )
    }

    fn set_dirty_logging(&self, _region: &MemoryRegion, _enabled: bool) -> Result<()> {
        unsupported(
            "dirty-page tracking",
            "upstream FreeBSD's vmm.ko has none (use snapshot or stop-and-copy migration)",
        )
    }

    fn enable_manual_dirty_protect(&self) -> Result<bool> {
        Ok(false)
    }

    fn clear_dirty_log(&self, _slot: u32, _first_page: u64, _num_pages: u64) -> Result<()> {
        unsupported("dirty-page tracking", "upstream FreeBSD's vmm.ko has none")
    }

    fn clear_dirty_pages(&self, _slot: u32, _bitmap: &[u64]) -> Result<()> {
        unsupported("dirty-page tracking", "upstream FreeBSD's vmm.ko has none")
    }

    /// bhyve has no paravirtual clock: guests keep time with the TSC, HPET, PM timer and
    /// RTC that vmm.ko models. There is nothing to save; a restored clock is ignored.
    fn clock(&self) -> Result<ClockData> {
        Ok(ClockData::default())
    }

    fn set_clock(&self, clock: &ClockData) -> Result<()> {
        if clock.clock_ns != 0 {
            log::debug!(
                "bhyve: no paravirtual clock; clock {} ns ignored",
                clock.clock_ns
            );
        }
        Ok(())
    }

    fn init_kernel_rtc(&self, unix_secs: i64, cmos: &[(u8, u8)]) -> Result<()> {
        self.shared
            .ioctl(abi::VM_RTC_SETTIME, &mut abi::VmRtcTime { secs: unix_secs })?;
        for &(offset, value) in cmos {
            self.shared.ioctl(
                abi::VM_RTC_WRITE,
                &mut abi::VmRtcData {
                    offset: i32::from(offset),
                    value,
                    ..Default::default()
                },
            )?;
        }
        Ok(())
    }

    /// Everything vmm.ko saves for the VM, through VM_SNAPSHOT_REQ (see `snapshot.rs`):
    /// the 8259 pair, IOAPIC, PIT, HPET, RTC and PM timer, and every vCPU's VMCS/VMCB and
    /// local APIC. Needs a kernel built with `options BHYVE_SNAPSHOT`.
    fn irqchip_state(&self) -> Result<IrqChipState> {
        snapshot::save(&self.shared)
    }

    /// Checks the blobs, hands them back to vmm.ko in bhyve(8)'s order, then re-bases the
    /// guest's time (VM_RESTORE_TIME). Every vCPU must exist and none may have run.
    fn set_irqchip_state(&self, state: &IrqChipState) -> Result<()> {
        snapshot::restore(&self.shared, state)
    }
}

// The register numbers segment code uses, in `SpecialRegisters` order.
pub(crate) const SEGMENTS: [(i32, &str); 8] = [
    (reg::CS, "cs"),
    (reg::DS, "ds"),
    (reg::ES, "es"),
    (reg::FS, "fs"),
    (reg::GS, "gs"),
    (reg::SS, "ss"),
    (reg::TR, "tr"),
    (reg::LDTR, "ldt"),
];
