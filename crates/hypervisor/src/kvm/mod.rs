//! The Linux KVM backend (kvm-ioctls / kvm-bindings).

mod convert;
mod irqchip;
mod routes;

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::os::unix::io::{FromRawFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_enable_cap, kvm_irqchip, kvm_msi, kvm_msr_entry,
    kvm_pit_config, kvm_run, kvm_userspace_memory_region, kvm_xcr, kvm_xcrs, kvm_xsave, CpuId,
    Msrs, KVM_CPUID_FLAG_SIGNIFCANT_INDEX, KVM_INTERNAL_ERROR_EMULATION, KVM_IRQCHIP_IOAPIC,
    KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES,
    KVM_MEM_READONLY, KVM_PIT_SPEAKER_DUMMY, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN,
};
use kvm_ioctls::{
    Cap, IoEventAddress as KvmIoEventAddress, Kvm, NoDatamatch, VcpuExit as KvmExit, VcpuFd, VmFd,
};
use vmm_sys_util::eventfd::EventFd;

use crate::kick;
use crate::{
    AccelKind, Capabilities, ClockData, CpuidEntry, FpuState, Hypervisor, HypervisorError,
    IoEventAddress, IrqChipMode, IrqChipState, IrqRoute, LapicState, MemoryRegion, MpState,
    MsiMessage, MsrEntry, Result, SpecialRegisters, StandardRegisters, Vcpu, VcpuEvents, VcpuExit,
    VcpuKicker, Vm, Xcr, XsaveState, LAPIC_REGS_SIZE,
};
use convert::*;
use routes::GsiRoutes;

const KVM_DEVICE: &str = "/dev/kvm";

// KVM_INTERRUPT is missing from kvm-ioctls: `_IOW(KVMIO, 0x86, struct kvm_interrupt)`.
vmm_sys_util::ioctl_iow_nr!(
    KVM_INTERRUPT,
    kvm_bindings::KVMIO,
    0x86,
    kvm_bindings::kvm_interrupt
);

// KVM_X86_GET_MCE_CAP_SUPPORTED and KVM_X86_SETUP_MCE are missing from kvm-ioctls:
// `_IOR(KVMIO, 0x9d, __u64)` on the system fd, `_IOW(KVMIO, 0x9c, __u64)` on a vCPU.
vmm_sys_util::ioctl_ior_nr!(
    KVM_X86_GET_MCE_CAP_SUPPORTED,
    kvm_bindings::KVMIO,
    0x9d,
    u64
);
vmm_sys_util::ioctl_iow_nr!(KVM_X86_SETUP_MCE, kvm_bindings::KVMIO, 0x9c, u64);

/// `struct kvm_clear_dirty_log` (x86-64), which kvm-bindings does not carry for x86.
#[repr(C)]
struct KvmClearDirtyLog {
    slot: u32,
    num_pages: u32,
    first_page: u64,
    /// One bit per page from `first_page`, `num_pages` rounded up to 64 bits.
    dirty_bitmap: *mut u64,
}
const _: () = assert!(std::mem::size_of::<KvmClearDirtyLog>() == 24);

// KVM_CLEAR_DIRTY_LOG is missing from kvm-ioctls: `_IOWR(KVMIO, 0xc0, struct
// kvm_clear_dirty_log)`.
vmm_sys_util::ioctl_iowr_nr!(
    KVM_CLEAR_DIRTY_LOG,
    kvm_bindings::KVMIO,
    0xc0,
    KvmClearDirtyLog
);

/// KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 flags (`KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE`,
/// `KVM_DIRTY_LOG_INITIALLY_SET`), absent from kvm-bindings for x86.
const DIRTY_LOG_MANUAL_PROTECT_ENABLE: u64 = 1 << 0;
const DIRTY_LOG_INITIALLY_SET: u64 = 1 << 1;
/// The dirty log has one bit per 4 KiB page on x86.
const DIRTY_PAGE_SIZE: u64 = 4096;

/// Addresses KVM needs on Intel for real-mode emulation; inside the 32-bit MMIO hole, far
/// from anything ferrovm maps.
const TSS_ADDRESS: usize = 0xfffb_d000;
const IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;

fn ioctl_err(op: &'static str) -> impl FnOnce(vmm_sys_util::errno::Error) -> HypervisorError {
    move |e| HypervisorError::ioctl(op, e)
}

pub struct KvmHypervisor {
    kvm: Kvm,
}

impl KvmHypervisor {
    pub fn new() -> Result<Self> {
        if !Path::new(KVM_DEVICE).exists() {
            return Err(HypervisorError::DeviceUnavailable {
                path: KVM_DEVICE.into(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        }
        let kvm = Kvm::new().map_err(|e| HypervisorError::DeviceUnavailable {
            path: KVM_DEVICE.into(),
            source: std::io::Error::from_raw_os_error(e.errno()),
        })?;
        Ok(KvmHypervisor { kvm })
    }

    /// Which vendor module implements KVM here, from the modules the kernel has loaded.
    fn vendor_module() -> &'static str {
        ["kvm_intel", "kvm_amd", "kvm_pvm"]
            .into_iter()
            .find(|m| Path::new("/sys/module").join(m).exists())
            .unwrap_or("unknown")
    }

    fn module_flag(module: &str, param: &str) -> Option<bool> {
        let text =
            std::fs::read_to_string(format!("/sys/module/{module}/parameters/{param}")).ok()?;
        Some(matches!(text.trim(), "Y" | "y" | "1"))
    }
}

impl Hypervisor for KvmHypervisor {
    fn kind(&self) -> AccelKind {
        AccelKind::Kvm
    }

    fn capabilities(&self) -> Capabilities {
        let kvm = &self.kvm;
        let backend = Self::vendor_module();
        // TPR shadowing and APIC virtualisation are hardware features that KVM uses without
        // an API to query them; the vendor module's parameters say whether they are on.
        let (tpr_shadow, apicv, posted) = match backend {
            "kvm_intel" => {
                let apicv = Self::module_flag("kvm_intel", "enable_apicv");
                (Self::module_flag("kvm_intel", "flexpriority"), apicv, apicv)
            }
            "kvm_amd" => {
                let avic = Self::module_flag("kvm_amd", "avic");
                (avic, avic, avic)
            }
            // PVM has no hardware virtualisation: every TPR write is emulated.
            "kvm_pvm" => (Some(false), Some(false), Some(false)),
            _ => (None, None, None),
        };
        Capabilities {
            accelerator: "kvm".into(),
            backend: backend.into(),
            api_version: kvm.get_api_version(),
            max_vcpus: kvm.get_max_vcpus(),
            max_memslots: kvm.get_nr_memslots(),
            irqchip_kernel: kvm.check_extension(Cap::Irqchip),
            irqchip_split: kvm.check_extension(Cap::SplitIrqchip),
            msi_injection: kvm.check_extension(Cap::SignalMsi),
            dirty_log_bitmap: true,
            dirty_log_ring_bytes: kvm.check_extension_int(Cap::DirtyLogRing).max(0) as u64,
            dirty_log_manual_protect: kvm
                .check_extension_raw(kvm_bindings::KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into())
                > 0,
            x2apic_api: kvm.check_extension(Cap::X2ApicApi),
            irqfd: kvm.check_extension(Cap::Irqfd),
            ioeventfd: kvm.check_extension(Cap::Ioeventfd),
            user_space_msr: kvm.check_extension(Cap::X86UserSpaceMsr),
            immediate_exit: kvm.check_extension(Cap::ImmediateExit),
            xsave: kvm.check_extension(Cap::Xsave),
            xcrs: kvm.check_extension(Cap::Xcrs),
            vcpu_events: kvm.check_extension(Cap::VcpuEvents),
            tsc_control: kvm.check_extension(Cap::TscControl),
            // KVM_GET/SET_IRQCHIP and KVM_GET/SET_PIT2 (split mode keeps its chips in user
            // space, where the VMM saves them).
            kernel_snapshot: Some(true),
            tpr_shadow,
            apic_virtualization: apicv,
            posted_interrupts: posted,
            hypercalls: backend != "kvm_pvm",
            // KVM has no in-kernel RTC or PM timer: user space provides both.
            rtc_in_kernel: false,
            pm_timer_port: None,
        }
    }

    fn create_vm(&self) -> Result<Arc<dyn Vm>> {
        let fd = self.kvm.create_vm().map_err(ioctl_err("KVM_CREATE_VM"))?;
        // Only Intel needs these; other vendor modules may refuse them, which is harmless.
        if let Err(e) = fd.set_tss_address(TSS_ADDRESS) {
            log::debug!("KVM_SET_TSS_ADDR not taken: {e}");
        }
        if let Err(e) = fd.set_identity_map_address(IDENTITY_MAP_ADDRESS) {
            log::debug!("KVM_SET_IDENTITY_MAP_ADDR not taken: {e}");
        }
        Ok(Arc::new(KvmVm {
            fd,
            slots: Mutex::new(HashMap::new()),
            carried_dirty: Mutex::new(HashMap::new()),
            routes: Mutex::new(GsiRoutes::default()),
        }))
    }

    fn supported_cpuid(&self) -> Result<Vec<CpuidEntry>> {
        let cpuid = self
            .kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl_err("KVM_GET_SUPPORTED_CPUID"))?;
        Ok(cpuid_from_kvm(&cpuid))
    }

    fn msr_index_list(&self) -> Result<Vec<u32>> {
        let list = self
            .kvm
            .get_msr_index_list()
            .map_err(ioctl_err("KVM_GET_MSR_INDEX_LIST"))?;
        Ok(list.as_slice().to_vec())
    }

    fn feature_msrs(&self, indices: &[u32]) -> Result<Vec<MsrEntry>> {
        if !self.kvm.check_extension(Cap::GetMsrFeatures) {
            return Ok(Vec::new());
        }
        let offered = self
            .kvm
            .get_msr_feature_index_list()
            .map_err(ioctl_err("KVM_GET_MSR_FEATURE_INDEX_LIST"))?;
        let wanted: Vec<MsrEntry> = indices
            .iter()
            .filter(|i| offered.as_slice().contains(i))
            .map(|&index| MsrEntry { index, data: 0 })
            .collect();
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let mut msrs = msr_entries(&wanted)?;
        let read = self
            .kvm
            .get_msrs(&mut msrs)
            .map_err(ioctl_err("KVM_GET_MSRS (feature MSRs)"))?;
        Ok(msrs.as_slice()[..read.min(wanted.len())]
            .iter()
            .map(|e| MsrEntry {
                index: e.index,
                data: e.data,
            })
            .collect())
    }

    fn supported_mcg_cap(&self) -> Result<Option<u64>> {
        // KVM_CAP_MCE answers the number of banks; the ioctl, the other MCG_CAP bits.
        let banks = self.kvm.check_extension_int(Cap::Mce);
        if banks <= 0 {
            return Ok(None);
        }
        let mut cap: u64 = 0;
        // SAFETY: the kernel writes one u64 into `cap`, which outlives the call.
        let rc = unsafe {
            vmm_sys_util::ioctl::ioctl_with_mut_ref(
                &self.kvm,
                KVM_X86_GET_MCE_CAP_SUPPORTED(),
                &mut cap,
            )
        };
        if rc < 0 {
            return Err(HypervisorError::ioctl(
                "KVM_X86_GET_MCE_CAP_SUPPORTED",
                vmm_sys_util::errno::Error::last(),
            ));
        }
        Ok(Some((cap & !0xff) | (banks as u64).min(0xff)))
    }
}

pub struct KvmVm {
    fd: VmFd,
    /// The memory slots as registered, so a slot is only ever re-registered with the host
    /// mapping the caller vouched for in `map_memory`.
    slots: Mutex<HashMap<u32, kvm_userspace_memory_region>>,
    /// Dirty bits of slots that were re-created (a read-only switch drops the kernel's
    /// bitmap), handed out with the slot's next `dirty_log`.
    carried_dirty: Mutex<HashMap<u32, Vec<u64>>>,
    /// The GSI routing table's two parts (interrupt controllers, devices), written whole to
    /// the kernel on every change.
    routes: Mutex<GsiRoutes>,
}

impl KvmVm {
    /// KVM_CLEAR_DIRTY_LOG: clears (and write-protects again) the pages whose bits are set in
    /// `bitmap`, which covers `num_pages` pages from `first_page`.
    fn clear_dirty_bits(
        &self,
        slot: u32,
        first_page: u64,
        num_pages: u32,
        bitmap: &mut [u64],
    ) -> Result<()> {
        if bitmap.len() < (num_pages as usize).div_ceil(64) {
            return Err(HypervisorError::Invalid("dirty bitmap too short".into()));
        }
        let arg = KvmClearDirtyLog {
            slot,
            num_pages,
            first_page,
            dirty_bitmap: bitmap.as_mut_ptr(),
        };
        // SAFETY: the kernel reads `arg` and `num_pages` rounded up to 64 bits from `bitmap`,
        // which holds at least that many (checked above) and outlives the call.
        let rc =
            unsafe { vmm_sys_util::ioctl::ioctl_with_ref(&self.fd, KVM_CLEAR_DIRTY_LOG(), &arg) };
        if rc < 0 {
            return Err(HypervisorError::ioctl(
                "KVM_CLEAR_DIRTY_LOG",
                vmm_sys_util::errno::Error::last(),
            ));
        }
        Ok(())
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<u32, kvm_userspace_memory_region>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The registered slot `region` describes, refused if it describes it differently.
    fn registered_slot(
        slots: &HashMap<u32, kvm_userspace_memory_region>,
        region: &MemoryRegion,
    ) -> Result<kvm_userspace_memory_region> {
        match slots.get(&region.slot) {
            Some(r)
                if r.guest_phys_addr == region.guest_addr
                    && r.memory_size == region.size
                    && r.userspace_addr == region.host_addr =>
            {
                Ok(*r)
            }
            Some(r) => Err(HypervisorError::Invalid(format!(
                "memory slot {} is mapped at {:#x}+{:#x} from host {:#x}, not {:#x}+{:#x} from {:#x}",
                region.slot,
                r.guest_phys_addr,
                r.memory_size,
                r.userspace_addr,
                region.guest_addr,
                region.size,
                region.host_addr
            ))),
            None => Err(HypervisorError::Invalid(format!(
                "memory slot {} is not mapped",
                region.slot
            ))),
        }
    }

    /// Applies `change` to a copy of the GSI routing table, writes the union of its parts to
    /// the kernel, and keeps the copy only if the kernel took it. The lock is held across the
    /// write, so the interrupt controllers and the devices never overwrite each other.
    fn update_routes(&self, change: impl FnOnce(&mut GsiRoutes) -> Result<()>) -> Result<()> {
        let mut routes = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        let mut next = routes.clone();
        change(&mut next)?;
        self.fd
            .set_gsi_routing(&next.table()?)
            .map_err(ioctl_err("KVM_SET_GSI_ROUTING"))?;
        *routes = next;
        Ok(())
    }

    /// KVM_IOEVENTFD, assigning or deassigning. kvm-ioctls takes the access width from the
    /// type of the datamatch value; without one it registers a write of any width.
    fn ioevent(
        &self,
        fd: RawFd,
        addr: IoEventAddress,
        len: u32,
        datamatch: Option<u64>,
        assign: bool,
    ) -> Result<()> {
        let event = borrowed_eventfd(fd)?;
        let addr = match addr {
            IoEventAddress::Pio(port) => KvmIoEventAddress::Pio(port),
            IoEventAddress::Mmio(gpa) => KvmIoEventAddress::Mmio(gpa),
        };
        let op = if assign {
            "KVM_IOEVENTFD"
        } else {
            "KVM_IOEVENTFD (deassign)"
        };
        let too_wide = || {
            HypervisorError::Invalid(format!(
                "ioeventfd datamatch {:#x} does not fit in {len} bytes",
                datamatch.unwrap_or(0)
            ))
        };
        let fd = &self.fd;
        let result = match (len, datamatch) {
            (0 | 1 | 2 | 4 | 8, None) => ioevent_call(fd, &event, &addr, NoDatamatch, assign),
            (1, Some(v)) => ioevent_call(
                fd,
                &event,
                &addr,
                u8::try_from(v).map_err(|_| too_wide())?,
                assign,
            ),
            (2, Some(v)) => ioevent_call(
                fd,
                &event,
                &addr,
                u16::try_from(v).map_err(|_| too_wide())?,
                assign,
            ),
            (4, Some(v)) => ioevent_call(
                fd,
                &event,
                &addr,
                u32::try_from(v).map_err(|_| too_wide())?,
                assign,
            ),
            (8, Some(v)) => ioevent_call(fd, &event, &addr, v, assign),
            _ => {
                return Err(HypervisorError::Invalid(format!(
                    "ioeventfd of {len} bytes (1, 2, 4 or 8; 0 for any width without datamatch)"
                )))
            }
        };
        result.map_err(ioctl_err(op))
    }
}

/// The caller's eventfd `fd` as the `EventFd` kvm-ioctls wants, without taking ownership:
/// the wrapper is never dropped, so the descriptor is never closed here.
fn borrowed_eventfd(fd: RawFd) -> Result<ManuallyDrop<EventFd>> {
    if fd < 0 {
        return Err(HypervisorError::Invalid(format!("eventfd {fd}")));
    }
    // SAFETY: the caller keeps `fd` open for the duration of the call (the `Vm` methods'
    // contract); `ManuallyDrop` keeps the wrapper from closing it. Only its number reaches
    // the kernel, which checks that it is an eventfd.
    Ok(ManuallyDrop::new(unsafe { EventFd::from_raw_fd(fd) }))
}

fn ioevent_call<T: Into<u64>>(
    vm: &VmFd,
    event: &EventFd,
    addr: &KvmIoEventAddress,
    datamatch: T,
    assign: bool,
) -> std::result::Result<(), vmm_sys_util::errno::Error> {
    if assign {
        vm.register_ioevent(event, addr, datamatch)
    } else {
        vm.unregister_ioevent(event, addr, datamatch)
    }
}

impl Vm for KvmVm {
    unsafe fn map_memory(&self, region: &MemoryRegion) -> Result<()> {
        let mut flags = 0;
        if region.readonly {
            flags |= KVM_MEM_READONLY;
        }
        if region.log_dirty {
            flags |= KVM_MEM_LOG_DIRTY_PAGES;
        }
        let kvm_region = kvm_userspace_memory_region {
            slot: region.slot,
            flags,
            guest_phys_addr: region.guest_addr,
            memory_size: region.size,
            userspace_addr: region.host_addr,
        };
        let mut slots = self.slots();
        // SAFETY: the caller guarantees the host range stays mapped for the VM's lifetime.
        unsafe { self.fd.set_user_memory_region(kvm_region) }
            .map_err(ioctl_err("KVM_SET_USER_MEMORY_REGION"))?;
        if region.size == 0 {
            slots.remove(&region.slot);
        } else {
            slots.insert(region.slot, kvm_region);
        }
        Ok(())
    }

    fn create_irqchip(&self, mode: IrqChipMode) -> Result<()> {
        match mode {
            IrqChipMode::Kernel => {
                self.fd
                    .create_irq_chip()
                    .map_err(ioctl_err("KVM_CREATE_IRQCHIP"))?;
                let pit = kvm_pit_config {
                    flags: KVM_PIT_SPEAKER_DUMMY,
                    ..Default::default()
                };
                self.fd
                    .create_pit2(pit)
                    .map_err(ioctl_err("KVM_CREATE_PIT2"))
            }
            IrqChipMode::Split { ioapic_pins } => {
                let mut cap = kvm_enable_cap {
                    cap: kvm_bindings::KVM_CAP_SPLIT_IRQCHIP,
                    ..Default::default()
                };
                cap.args[0] = u64::from(ioapic_pins);
                self.fd
                    .enable_cap(&cap)
                    .map_err(ioctl_err("KVM_ENABLE_CAP(KVM_CAP_SPLIT_IRQCHIP)"))
            }
        }
    }

    fn set_irqchip_routes(&self, routes: &[IrqRoute]) -> Result<()> {
        self.update_routes(|table| table.set_irqchip_routes(routes))
    }

    fn create_vcpu(&self, id: u32) -> Result<Box<dyn Vcpu>> {
        let mut fd = self
            .fd
            .create_vcpu(u64::from(id))
            .map_err(ioctl_err("KVM_CREATE_VCPU"))?;
        let run: *mut kvm_run = fd.get_kvm_run();
        Ok(Box::new(KvmVcpu {
            fd,
            id,
            run,
            kicker_bound: false,
        }))
    }

    fn set_irq_line(&self, gsi: u32, level: bool) -> Result<()> {
        self.fd
            .set_irq_line(gsi, level)
            .map_err(ioctl_err("KVM_IRQ_LINE"))
    }

    fn signal_msi(&self, msi: MsiMessage) -> Result<()> {
        let msg = kvm_msi {
            address_lo: msi.address as u32,
            address_hi: (msi.address >> 32) as u32,
            data: msi.data,
            ..Default::default()
        };
        // A return of 0 means the interrupt was blocked by the guest (e.g. masked); that is
        // the guest's choice, not an error.
        self.fd
            .signal_msi(msg)
            .map(|_| ())
            .map_err(ioctl_err("KVM_SIGNAL_MSI"))
    }

    fn set_msi_routes(&self, routes: &[(u32, MsiMessage)]) -> Result<()> {
        self.update_routes(|table| table.set_ioapic_msis(routes))
    }

    fn set_msi_route(&self, gsi: u32, msi: Option<MsiMessage>) -> Result<()> {
        self.update_routes(|table| table.set_device_msi(gsi, msi))
    }

    fn register_irqfd(&self, fd: RawFd, gsi: u32) -> Result<()> {
        let event = borrowed_eventfd(fd)?;
        self.fd
            .register_irqfd(&event, gsi)
            .map_err(ioctl_err("KVM_IRQFD"))
    }

    fn unregister_irqfd(&self, fd: RawFd, gsi: u32) -> Result<()> {
        let event = borrowed_eventfd(fd)?;
        self.fd
            .unregister_irqfd(&event, gsi)
            .map_err(ioctl_err("KVM_IRQFD (deassign)"))
    }

    fn register_ioeventfd(
        &self,
        fd: RawFd,
        addr: IoEventAddress,
        len: u32,
        datamatch: Option<u64>,
    ) -> Result<()> {
        self.ioevent(fd, addr, len, datamatch, true)
    }

    fn unregister_ioeventfd(
        &self,
        fd: RawFd,
        addr: IoEventAddress,
        len: u32,
        datamatch: Option<u64>,
    ) -> Result<()> {
        self.ioevent(fd, addr, len, datamatch, false)
    }

    fn dirty_log(&self, slot: u32, size: u64) -> Result<Vec<u64>> {
        let mut bits = self
            .fd
            .get_dirty_log(slot, size as usize)
            .map_err(ioctl_err("KVM_GET_DIRTY_LOG"))?;
        let carried = self
            .carried_dirty
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&slot);
        for (word, old) in bits.iter_mut().zip(carried.unwrap_or_default()) {
            *word |= old;
        }
        Ok(bits)
    }

    fn set_memory_readonly(&self, region: &MemoryRegion, readonly: bool) -> Result<()> {
        let mut slots = self.slots();
        let old = Self::registered_slot(&slots, region)?;
        if (old.flags & KVM_MEM_READONLY != 0) == readonly {
            return Ok(());
        }
        if old.flags & KVM_MEM_LOG_DIRTY_PAGES != 0 {
            // Deleting the slot drops its dirty bitmap: keep the bits for the next dirty_log.
            let bits = self
                .fd
                .get_dirty_log(old.slot, old.memory_size as usize)
                .map_err(ioctl_err("KVM_GET_DIRTY_LOG"))?;
            let mut carried = self.carried_dirty.lock().unwrap_or_else(|e| e.into_inner());
            let entry = carried.entry(old.slot).or_default();
            entry.resize(bits.len().max(entry.len()), 0);
            for (word, new) in entry.iter_mut().zip(bits) {
                *word |= new;
            }
        }
        // KVM changes only the dirty-logging flag in place: the slot is deleted and added
        // again with the other read-only setting.
        let gone = kvm_userspace_memory_region {
            memory_size: 0,
            flags: 0,
            ..old
        };
        let mut new = old;
        new.flags ^= KVM_MEM_READONLY;
        // SAFETY: deleting a slot takes nothing from the guest's host mapping; it is added
        // back with the guest range and host mapping it was mapped with (checked above),
        // which the `map_memory` caller vouched for.
        unsafe { self.fd.set_user_memory_region(gone) }
            .map_err(ioctl_err("KVM_SET_USER_MEMORY_REGION (delete)"))?;
        // SAFETY: as above.
        let added = unsafe { self.fd.set_user_memory_region(new) };
        if let Err(e) = added {
            slots.remove(&old.slot);
            return Err(ioctl_err("KVM_SET_USER_MEMORY_REGION (read-only)")(e));
        }
        slots.insert(new.slot, new);
        Ok(())
    }

    fn set_dirty_logging(&self, region: &MemoryRegion, enabled: bool) -> Result<()> {
        // Held across the check and the ioctl, so the slot cannot change in between.
        let mut slots = self.slots();
        let mut slot = Self::registered_slot(&slots, region)?;
        if enabled {
            slot.flags |= KVM_MEM_LOG_DIRTY_PAGES;
        } else {
            slot.flags &= !KVM_MEM_LOG_DIRTY_PAGES;
        }
        // SAFETY: the slot is re-registered with the guest range and host mapping it was
        // mapped with (checked above), which the `map_memory` caller vouched for; only the
        // flags change.
        unsafe { self.fd.set_user_memory_region(slot) }
            .map_err(ioctl_err("KVM_SET_USER_MEMORY_REGION (dirty logging)"))?;
        slots.insert(slot.slot, slot);
        Ok(())
    }

    fn enable_manual_dirty_protect(&self) -> Result<bool> {
        let offered = self
            .fd
            .check_extension_raw(kvm_bindings::KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into());
        let offered = u64::try_from(offered).unwrap_or(0);
        if offered & DIRTY_LOG_MANUAL_PROTECT_ENABLE == 0 {
            return Ok(false);
        }
        let mut cap = kvm_enable_cap {
            cap: kvm_bindings::KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
            ..Default::default()
        };
        cap.args[0] = offered & (DIRTY_LOG_MANUAL_PROTECT_ENABLE | DIRTY_LOG_INITIALLY_SET);
        self.fd.enable_cap(&cap).map_err(ioctl_err(
            "KVM_ENABLE_CAP(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2)",
        ))?;
        Ok(true)
    }

    fn clear_dirty_log(&self, slot: u32, first_page: u64, num_pages: u64) -> Result<()> {
        if num_pages == 0 {
            return Ok(());
        }
        let slot_pages = self
            .slots()
            .get(&slot)
            .map(|r| r.memory_size.div_ceil(DIRTY_PAGE_SIZE))
            .ok_or_else(|| HypervisorError::Invalid(format!("memory slot {slot} is not mapped")))?;
        let end = first_page.checked_add(num_pages);
        let fits = end.is_some_and(|end| end <= slot_pages);
        let aligned = first_page.is_multiple_of(64)
            && (num_pages.is_multiple_of(64) || end == Some(slot_pages));
        let count = u32::try_from(num_pages).ok();
        let (true, true, Some(count)) = (fits, aligned, count) else {
            return Err(HypervisorError::Invalid(format!(
                "cannot clear pages {first_page}+{num_pages} of the dirty log of slot {slot} \
                 ({slot_pages} pages; the start must be a multiple of 64 pages, and so must \
                 the count unless the range ends the slot)"
            )));
        };
        // Every page of the range: the kernel only re-protects those whose bit it had set.
        let words = usize::try_from(num_pages.div_ceil(64))
            .map_err(|_| HypervisorError::Invalid(format!("{num_pages} pages")))?;
        let mut bitmap = vec![u64::MAX; words];
        let tail = num_pages % 64;
        if tail != 0 {
            if let Some(last) = bitmap.last_mut() {
                *last = (1u64 << tail) - 1;
            }
        }
        self.clear_dirty_bits(slot, first_page, count, &mut bitmap)
    }

    fn clear_dirty_pages(&self, slot: u32, bitmap: &[u64]) -> Result<()> {
        let slot_pages = self
            .slots()
            .get(&slot)
            .map(|r| r.memory_size.div_ceil(DIRTY_PAGE_SIZE))
            .ok_or_else(|| HypervisorError::Invalid(format!("memory slot {slot} is not mapped")))?;
        let words = usize::try_from(slot_pages.div_ceil(64))
            .map_err(|_| HypervisorError::Invalid(format!("{slot_pages} pages")))?;
        if bitmap.len() != words {
            return Err(HypervisorError::Invalid(format!(
                "dirty bitmap of {} words for slot {slot} of {slot_pages} pages",
                bitmap.len()
            )));
        }
        let count = u32::try_from(slot_pages)
            .map_err(|_| HypervisorError::Invalid(format!("{slot_pages} pages")))?;
        let mut bitmap = bitmap.to_vec();
        self.clear_dirty_bits(slot, 0, count, &mut bitmap)
    }

    fn irqchip_state(&self) -> Result<IrqChipState> {
        let get = |chip_id| {
            let mut chip = kvm_irqchip {
                chip_id,
                ..Default::default()
            };
            self.fd
                .get_irqchip(&mut chip)
                .map_err(ioctl_err("KVM_GET_IRQCHIP"))?;
            Ok::<_, HypervisorError>(chip)
        };
        let master = get(KVM_IRQCHIP_PIC_MASTER)?;
        let slave = get(KVM_IRQCHIP_PIC_SLAVE)?;
        let ioapic = get(KVM_IRQCHIP_IOAPIC)?;
        let pit = self.fd.get_pit2().map_err(ioctl_err("KVM_GET_PIT2"))?;
        Ok(IrqChipState {
            backend: irqchip::BACKEND.into(),
            pic_master: irqchip::pic_blob(&master),
            pic_slave: irqchip::pic_blob(&slave),
            ioapic: irqchip::ioapic_blob(&ioapic),
            pit: irqchip::pit_blob(&pit),
            blobs: Vec::new(),
        })
    }

    fn set_irqchip_state(&self, state: &IrqChipState) -> Result<()> {
        // Everything is checked before anything is written.
        let k = irqchip::to_kernel(state)?;
        for chip in &k.chips {
            self.fd
                .set_irqchip(chip)
                .map_err(ioctl_err("KVM_SET_IRQCHIP"))?;
        }
        self.fd.set_pit2(&k.pit).map_err(ioctl_err("KVM_SET_PIT2"))
    }

    fn clock(&self) -> Result<ClockData> {
        let c = self.fd.get_clock().map_err(ioctl_err("KVM_GET_CLOCK"))?;
        Ok(ClockData {
            clock_ns: c.clock,
            flags: c.flags,
        })
    }

    fn set_clock(&self, clock: &ClockData) -> Result<()> {
        let c = kvm_clock_data {
            clock: clock.clock_ns,
            ..Default::default()
        };
        self.fd.set_clock(&c).map_err(ioctl_err("KVM_SET_CLOCK"))
    }

    fn init_kernel_rtc(&self, _unix_secs: i64, _cmos: &[(u8, u8)]) -> Result<()> {
        Err(HypervisorError::Unsupported(
            "KVM has no in-kernel RTC (the VMM models it)".into(),
        ))
    }
}

pub struct KvmVcpu {
    fd: VcpuFd,
    id: u32,
    /// The vCPU's shared `kvm_run` page; lives as long as `fd`.
    run: *mut kvm_run,
    kicker_bound: bool,
}

// SAFETY: `run` points into the mmap owned by `fd`, which moves with the struct; the page is
// only written by this vCPU's thread and, for `immediate_exit`, by the kick signal handler
// running on that same thread.
unsafe impl Send for KvmVcpu {}

impl Drop for KvmVcpu {
    fn drop(&mut self) {
        if self.kicker_bound {
            kick::unbind_current_thread();
        }
    }
}

/// The width of each access of a KVM_EXIT_IO (kvm-ioctls hands out only the whole buffer).
///
/// # Safety
/// `run` must be a live `kvm_run` page right after a KVM_EXIT_IO.
unsafe fn io_access_size(run: *const kvm_run) -> usize {
    // SAFETY: guaranteed by the caller.
    let io = unsafe { (*run).__bindgen_anon_1.io };
    usize::from(io.size).max(1)
}

/// The instruction KVM's emulator failed on: `Some(bytes)` for an emulation failure (empty
/// when the kernel did not include the bytes), `None` for any other internal error.
///
/// Layout of `emulation_failure` (KVM API): `data[0]` holds the flags (bit 0: instruction
/// bytes present), then one byte of length and up to 15 bytes of instruction.
///
/// # Safety
/// `run` must be a live `kvm_run` page right after a KVM_EXIT_INTERNAL_ERROR.
unsafe fn emulation_failure_bytes(run: *const kvm_run) -> Option<Vec<u8>> {
    // SAFETY: guaranteed by the caller.
    let internal = unsafe { (*run).__bindgen_anon_1.internal };
    if internal.suberror != KVM_INTERNAL_ERROR_EMULATION {
        return None;
    }
    let has_bytes = internal.ndata >= 3 && internal.data[0] & 1 != 0;
    if !has_bytes {
        return Some(Vec::new());
    }
    let raw: Vec<u8> = internal.data[1..3]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let len = usize::from(raw[0]).min(15);
    Some(raw[1..=len].to_vec())
}

/// Reads the kernel's description of an internal error out of the `kvm_run` page.
///
/// # Safety
/// `run` must be a live `kvm_run` page right after a KVM_EXIT_INTERNAL_ERROR.
unsafe fn internal_error_detail(run: *const kvm_run) -> String {
    {
        // SAFETY: guaranteed by the caller.
        let internal = unsafe { (*run).__bindgen_anon_1.internal };
        let n = (internal.ndata as usize).min(internal.data.len());
        let kind = if internal.suberror == KVM_INTERNAL_ERROR_EMULATION {
            "instruction emulation failed"
        } else {
            "internal error"
        };
        format!(
            "{kind} (suberror {}, data {:x?})",
            internal.suberror,
            &internal.data[..n]
        )
    }
}

fn cpuid_from_kvm(cpuid: &CpuId) -> Vec<CpuidEntry> {
    cpuid
        .as_slice()
        .iter()
        .map(|e| CpuidEntry {
            function: e.function,
            index: e.index,
            significant_index: e.flags & KVM_CPUID_FLAG_SIGNIFCANT_INDEX != 0,
            eax: e.eax,
            ebx: e.ebx,
            ecx: e.ecx,
            edx: e.edx,
        })
        .collect()
}

fn msr_entries(msrs: &[MsrEntry]) -> Result<Msrs> {
    let entries: Vec<kvm_msr_entry> = msrs
        .iter()
        .map(|m| kvm_msr_entry {
            index: m.index,
            data: m.data,
            ..Default::default()
        })
        .collect();
    Msrs::from_entries(&entries).map_err(|_| HypervisorError::Invalid("too many MSRs".into()))
}

impl Vcpu for KvmVcpu {
    fn id(&self) -> u32 {
        self.id
    }

    fn setup_machine_check(&self, mcg_cap: u64) -> Result<()> {
        // SAFETY: the kernel reads one u64 from `mcg_cap`, which outlives the call.
        let rc =
            unsafe { vmm_sys_util::ioctl::ioctl_with_ref(&self.fd, KVM_X86_SETUP_MCE(), &mcg_cap) };
        if rc < 0 {
            return Err(HypervisorError::ioctl(
                "KVM_X86_SETUP_MCE",
                vmm_sys_util::errno::Error::last(),
            ));
        }
        Ok(())
    }

    fn run(&mut self) -> Result<VcpuExit<'_>> {
        // Raw pointer copy: the exit borrows `fd`, and the page must still be reachable.
        let run = self.run;
        let interrupted = match self.fd.run() {
            Ok(exit) => Some(exit),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => None,
            Err(e) => return Err(HypervisorError::ioctl("KVM_RUN", e)),
        };
        let Some(exit) = interrupted else {
            // SAFETY: `run` is valid for the life of `fd` (see the field's comment).
            unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(0) };
            return Ok(VcpuExit::Interrupted);
        };
        Ok(match exit {
            KvmExit::IoIn(port, data) => VcpuExit::IoIn {
                // SAFETY: `run` is live and the exit is KVM_EXIT_IO.
                size: unsafe { io_access_size(run) },
                port,
                data,
            },
            KvmExit::IoOut(port, data) => VcpuExit::IoOut {
                // SAFETY: as above.
                size: unsafe { io_access_size(run) },
                port,
                data,
            },
            KvmExit::MmioRead(addr, data) => VcpuExit::MmioRead { addr, data },
            KvmExit::MmioWrite(addr, data) => VcpuExit::MmioWrite { addr, data },
            KvmExit::X86Rdmsr(msr) => VcpuExit::MsrRead {
                index: msr.index,
                value: msr.data,
                error: msr.error,
            },
            KvmExit::X86Wrmsr(msr) => VcpuExit::MsrWrite {
                index: msr.index,
                value: msr.data,
                error: msr.error,
            },
            KvmExit::Hlt => VcpuExit::Halt,
            KvmExit::Shutdown => VcpuExit::Shutdown,
            KvmExit::SystemEvent(kind, _) => match kind {
                KVM_SYSTEM_EVENT_RESET => VcpuExit::Reset,
                KVM_SYSTEM_EVENT_SHUTDOWN => VcpuExit::PowerOff,
                other => VcpuExit::Unsupported(format!("KVM system event {other}")),
            },
            KvmExit::IoapicEoi(vector) => VcpuExit::IoapicEoi { vector },
            KvmExit::Intr | KvmExit::IrqWindowOpen => VcpuExit::Spurious,
            KvmExit::FailEntry(reason, _) => VcpuExit::FailEntry { reason },
            // SAFETY: `run` is live and the exit is KVM_EXIT_INTERNAL_ERROR.
            KvmExit::InternalError => match unsafe { emulation_failure_bytes(run) } {
                Some(bytes) => VcpuExit::InstructionNotEmulated { bytes },
                // SAFETY: as above.
                None => VcpuExit::InternalError {
                    detail: unsafe { internal_error_detail(run) },
                },
            },
            other => VcpuExit::Unsupported(format!("{other:?}")),
        })
    }

    fn finish_pending_exit(&mut self) -> Result<()> {
        let run = self.run;
        // SAFETY: `run` is valid for the life of `fd`. With immediate_exit set, KVM_RUN
        // completes a pending user-space I/O or MMIO access and returns EINTR before
        // entering the guest.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
        let result = self.fd.run().map(|_| ());
        // SAFETY: as above.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(0) };
        match result {
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Ok(()),
            Err(e) => Err(HypervisorError::ioctl("KVM_RUN (completing an exit)", e)),
            Ok(()) => Ok(()),
        }
    }

    fn bind_kicker(&mut self) -> Result<VcpuKicker> {
        // SAFETY: the byte lives in the kvm_run page owned by `fd`; Drop unbinds it before
        // the page goes away, and the vCPU is run on this thread from now on.
        let kicker = unsafe {
            kick::bind_current_thread(std::ptr::addr_of_mut!((*self.run).immediate_exit))
        }?;
        self.kicker_bound = true;
        Ok(kicker)
    }

    fn ready_for_interrupt(&self) -> bool {
        // SAFETY: `run` is valid for the life of `fd`; these fields are plain bytes the
        // kernel updates on every exit.
        unsafe { (*self.run).ready_for_interrupt_injection != 0 && (*self.run).if_flag != 0 }
    }

    fn request_interrupt_window(&mut self, on: bool) {
        // SAFETY: as above; the kernel reads the byte on the next KVM_RUN.
        unsafe { (*self.run).request_interrupt_window = u8::from(on) };
    }

    fn inject_external_interrupt(&self, vector: u8) -> Result<()> {
        let irq = kvm_bindings::kvm_interrupt {
            irq: u32::from(vector),
        };
        // SAFETY: KVM_INTERRUPT reads one `kvm_interrupt` from the pointer, which outlives
        // the call; the fd is this vCPU's.
        let rc = unsafe { vmm_sys_util::ioctl::ioctl_with_ref(&self.fd, KVM_INTERRUPT(), &irq) };
        if rc < 0 {
            return Err(HypervisorError::ioctl(
                "KVM_INTERRUPT",
                vmm_sys_util::errno::Error::last(),
            ));
        }
        Ok(())
    }

    fn regs(&self) -> Result<StandardRegisters> {
        let r = self.fd.get_regs().map_err(ioctl_err("KVM_GET_REGS"))?;
        Ok(regs_from_kvm(&r))
    }

    fn set_regs(&self, regs: &StandardRegisters) -> Result<()> {
        self.fd
            .set_regs(&regs_to_kvm(regs))
            .map_err(ioctl_err("KVM_SET_REGS"))
    }

    fn sregs(&self) -> Result<SpecialRegisters> {
        let s = self.fd.get_sregs().map_err(ioctl_err("KVM_GET_SREGS"))?;
        Ok(sregs_from_kvm(&s))
    }

    fn set_sregs(&self, sregs: &SpecialRegisters) -> Result<()> {
        let current = self.fd.get_sregs().map_err(ioctl_err("KVM_GET_SREGS"))?;
        self.fd
            .set_sregs(&sregs_to_kvm(sregs, &current))
            .map_err(ioctl_err("KVM_SET_SREGS"))
    }

    fn fpu(&self) -> Result<FpuState> {
        let f = self.fd.get_fpu().map_err(ioctl_err("KVM_GET_FPU"))?;
        Ok(fpu_from_kvm(&f))
    }

    fn set_fpu(&self, fpu: &FpuState) -> Result<()> {
        self.fd
            .set_fpu(&fpu_to_kvm(fpu))
            .map_err(ioctl_err("KVM_SET_FPU"))
    }

    fn xsave(&self) -> Result<XsaveState> {
        let x = self.fd.get_xsave().map_err(ioctl_err("KVM_GET_XSAVE"))?;
        Ok(XsaveState {
            region: x.region.to_vec(),
        })
    }

    fn set_xsave(&self, xsave: &XsaveState) -> Result<()> {
        let mut x = kvm_xsave::default();
        if xsave.region.len() > x.region.len() {
            return Err(HypervisorError::Invalid(format!(
                "XSAVE area of {} bytes (KVM takes at most {})",
                xsave.region.len() * 4,
                x.region.len() * 4
            )));
        }
        for (dst, src) in x.region.iter_mut().zip(&xsave.region) {
            *dst = *src;
        }
        // SAFETY: `x` is a plain 4 KiB XSAVE buffer with no trailing flexible data.
        unsafe { self.fd.set_xsave(&x) }.map_err(ioctl_err("KVM_SET_XSAVE"))
    }

    fn xcrs(&self) -> Result<Vec<Xcr>> {
        let x = self.fd.get_xcrs().map_err(ioctl_err("KVM_GET_XCRS"))?;
        let n = (x.nr_xcrs as usize).min(x.xcrs.len());
        Ok(x.xcrs[..n]
            .iter()
            .map(|x| Xcr {
                index: x.xcr,
                value: x.value,
            })
            .collect())
    }

    fn set_xcrs(&self, xcrs: &[Xcr]) -> Result<()> {
        let mut k = kvm_xcrs::default();
        if xcrs.len() > k.xcrs.len() {
            return Err(HypervisorError::Invalid(format!("{} XCRs", xcrs.len())));
        }
        k.nr_xcrs = xcrs.len() as u32;
        for (dst, src) in k.xcrs.iter_mut().zip(xcrs) {
            *dst = kvm_xcr {
                xcr: src.index,
                reserved: 0,
                value: src.value,
            };
        }
        self.fd.set_xcrs(&k).map_err(ioctl_err("KVM_SET_XCRS"))
    }

    fn msrs(&self, indices: &[u32]) -> Result<Vec<MsrEntry>> {
        let mut out = Vec::with_capacity(indices.len());
        let mut rest: Vec<MsrEntry> = indices
            .iter()
            .map(|&index| MsrEntry { index, data: 0 })
            .collect();
        // KVM_GET_MSRS stops at the first MSR it cannot read: keep what was read, skip the
        // offender, and go on with the rest.
        while !rest.is_empty() {
            let chunk: Vec<MsrEntry> = rest
                .iter()
                .take(kvm_bindings::KVM_MAX_MSR_ENTRIES)
                .copied()
                .collect();
            let mut msrs = msr_entries(&chunk)?;
            let read = self
                .fd
                .get_msrs(&mut msrs)
                .map_err(ioctl_err("KVM_GET_MSRS"))?;
            out.extend(msrs.as_slice()[..read].iter().map(|e| MsrEntry {
                index: e.index,
                data: e.data,
            }));
            let consumed = if read < chunk.len() { read + 1 } else { read };
            rest.drain(..consumed);
        }
        Ok(out)
    }

    fn set_msrs(&self, msrs: &[MsrEntry]) -> Result<()> {
        for chunk in msrs.chunks(kvm_bindings::KVM_MAX_MSR_ENTRIES) {
            let entries = msr_entries(chunk)?;
            let written = self
                .fd
                .set_msrs(&entries)
                .map_err(ioctl_err("KVM_SET_MSRS"))?;
            if written != chunk.len() {
                return Err(HypervisorError::Invalid(format!(
                    "the kernel refused MSR {:#x}",
                    chunk[written].index
                )));
            }
        }
        Ok(())
    }

    fn set_cpuid(&self, entries: &[CpuidEntry]) -> Result<()> {
        let entries: Vec<kvm_cpuid_entry2> = entries
            .iter()
            .map(|e| kvm_cpuid_entry2 {
                function: e.function,
                index: e.index,
                flags: if e.significant_index {
                    KVM_CPUID_FLAG_SIGNIFCANT_INDEX
                } else {
                    0
                },
                eax: e.eax,
                ebx: e.ebx,
                ecx: e.ecx,
                edx: e.edx,
                ..Default::default()
            })
            .collect();
        let cpuid = CpuId::from_entries(&entries)
            .map_err(|_| HypervisorError::Invalid("too many CPUID entries".into()))?;
        self.fd
            .set_cpuid2(&cpuid)
            .map_err(ioctl_err("KVM_SET_CPUID2"))
    }

    fn cpuid(&self) -> Result<Vec<CpuidEntry>> {
        let cpuid = self
            .fd
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl_err("KVM_GET_CPUID2"))?;
        Ok(cpuid_from_kvm(&cpuid))
    }

    fn lapic(&self) -> Result<LapicState> {
        let l = self.fd.get_lapic().map_err(ioctl_err("KVM_GET_LAPIC"))?;
        Ok(lapic_from_kvm(&l))
    }

    fn set_lapic(&self, lapic: &LapicState) -> Result<()> {
        if lapic.regs.len() > LAPIC_REGS_SIZE {
            return Err(HypervisorError::Invalid(format!(
                "LAPIC page of {} bytes",
                lapic.regs.len()
            )));
        }
        self.fd
            .set_lapic(&lapic_to_kvm(lapic))
            .map_err(ioctl_err("KVM_SET_LAPIC"))
    }

    fn mp_state(&self) -> Result<MpState> {
        let m = self
            .fd
            .get_mp_state()
            .map_err(ioctl_err("KVM_GET_MP_STATE"))?;
        Ok(mp_state_from_kvm(m))
    }

    fn set_mp_state(&self, state: MpState) -> Result<()> {
        self.fd
            .set_mp_state(mp_state_to_kvm(state))
            .map_err(ioctl_err("KVM_SET_MP_STATE"))
    }

    fn vcpu_events(&self) -> Result<VcpuEvents> {
        let e = self
            .fd
            .get_vcpu_events()
            .map_err(ioctl_err("KVM_GET_VCPU_EVENTS"))?;
        Ok(events_from_kvm(&e))
    }

    fn set_vcpu_events(&self, events: &VcpuEvents) -> Result<()> {
        self.fd
            .set_vcpu_events(&events_to_kvm(events))
            .map_err(ioctl_err("KVM_SET_VCPU_EVENTS"))
    }
}
