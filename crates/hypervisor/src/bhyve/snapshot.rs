//! Snapshots of what vmm.ko keeps for a VM, through VM_SNAPSHOT_REQ (kernels built with
//! `options BHYVE_SNAPSHOT`), carried in the backend-neutral [`IrqChipState`] as named blobs.
//!
//! What the kernel saves (FreeBSD 14.x/15.x, see abi.rs for the sources): the HPET, the VM
//! (per vCPU: x2APIC mode, the event being delivered, XCR0, `nextrip` and the absolute TSC;
//! the vCPUs waiting for a SIPI), the IOAPIC, every vCPU's local APIC, every vCPU's VMCS or
//! VMCB fields with the registers kept beside them, the PIT, the 8259 pair, the PM timer and
//! the RTC. The blobs are vmm.ko's own structures, opaque here and to everything above:
//! they only restore on the same FreeBSD release with the same vCPUs, and only the kernel
//! can check their contents. What is checked here, before anything reaches the kernel:
//! the backend tag, the names and their order, each size (non-empty, at most 16 MiB) and
//! the FreeBSD release that saved them; afterwards, that the kernel consumed every byte.
//!
//! Not saved by vmm.ko at all, as far as the sources read show: the guest's x87/SSE/AVX
//! registers (`vcpu->guestfpu` appears in neither 14.x's `vm_snapshot_vcpus` nor
//! `svm_vcpu_snapshot`, nor the VMX vCPU snapshot of the 13.x tree). bhyve(8)'s own
//! snapshots have the same gap; a restored guest continues with the destination vCPU's FPU
//! registers.
//!
//! Order, as bhyve(8) does it: save and restore walk `abi::KERNEL_STRUCTS`; VM_RESTORE_TIME
//! follows the last structure, before any vCPU runs. Every request freezes all vCPUs in
//! the kernel, so the VMM pauses its vCPU threads first (a save) or has not started them
//! (a restore; the vCPUs must all exist, because the `vm`, `vlapic` and `vmcx` structures
//! hold one record per vCPU the kernel has).

use std::io;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Once;

use zerocopy::IntoBytes;

use super::abi::{self, VmSnapshotMeta, KERNEL_STRUCTS, SNAPSHOT_RESTORE, SNAPSHOT_SAVE};
use super::vm::VmShared;
use crate::{HypervisorError, IrqChipState, KernelBlob, Result};

/// The `backend` tag of bhyve's state.
pub(crate) const BACKEND: &str = "bhyve";
/// The first blob: `kern.osrelease` of the host that saved the state.
pub(crate) const RELEASE_BLOB: &str = "osrelease";
/// Largest structure accepted from or handed to the kernel (bhyve(8) uses one 20 MB
/// buffer for every structure).
pub(crate) const MAX_BLOB: usize = 16 << 20;
/// The save buffer starts at this size (or 16 KiB per vCPU, if more) and doubles on E2BIG.
const MIN_BUFFER: usize = 64 << 10;
const PER_VCPU_BUFFER: usize = 16 << 10;
const MAX_RELEASE: usize = 64;

/// What the kernel answered to the probe at VM creation.
#[derive(Debug, Default)]
pub(crate) struct Support(AtomicU8);

const UNKNOWN: u8 = 0;
const PRESENT: u8 = 1;
const ABSENT: u8 = 2;

impl Support {
    /// `Some(false)` only when the kernel said ENOTTY (no `BHYVE_SNAPSHOT`).
    pub fn get(&self) -> Option<bool> {
        match self.0.load(Ordering::Relaxed) {
            PRESENT => Some(true),
            ABSENT => Some(false),
            _ => None,
        }
    }

    pub fn set(&self, present: Option<bool>) {
        let v = match present {
            Some(true) => PRESENT,
            Some(false) => ABSENT,
            None => UNKNOWN,
        };
        self.0.store(v, Ordering::Relaxed);
    }
}

/// The error of a kernel without `options BHYVE_SNAPSHOT`.
pub(crate) fn not_built_in() -> HypervisorError {
    HypervisorError::Unsupported(
        "snapshots and migration on bhyve need a kernel built with `options BHYVE_SNAPSHOT` \
         (this one lacks VM_SNAPSHOT_REQ)"
            .into(),
    )
}

fn invalid<T>(what: String) -> Result<T> {
    Err(HypervisorError::Invalid(format!(
        "bhyve kernel state: {what}"
    )))
}

/// One VM_SNAPSHOT_REQ over `buf`. Returns how many bytes the kernel wrote (save) or read
/// (restore), from the `buf_rem` it copies back.
fn request(vm: &VmShared, dev_req: i32, op: i32, buf: &mut [u8]) -> io::Result<usize> {
    let start = buf.as_mut_ptr() as u64;
    let len = buf.len() as u64;
    let mut meta = VmSnapshotMeta {
        dev_req,
        op,
        buf_start: start,
        buf_size: len,
        buf: start,
        buf_rem: len,
        ..Default::default()
    };
    // The kernel copies out to (save) or in from (restore) `buf .. buf + buf_rem`, which is
    // `buf`, exclusively borrowed until the call returns. `dev_name` stays null: the kernel
    // dispatches on `dev_req` only.
    vm.dev.ioctl(abi::VM_SNAPSHOT_REQ, meta.as_mut_bytes())?;
    if meta.buf_rem > len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the kernel reports {} bytes left of a {len}-byte buffer",
                meta.buf_rem
            ),
        ));
    }
    Ok((len - meta.buf_rem) as usize)
}

/// At VM creation: does this kernel have VM_SNAPSHOT_REQ? Asks for the PM timer's state (a
/// few bytes; a read that changes nothing). `None` if the kernel failed in another way.
pub(crate) fn probe(vm: &VmShared) -> Option<bool> {
    let mut buf = [0u8; 256];
    let answer = match request(
        vm,
        abi::snapshot_req::STRUCT_VPMTMR,
        SNAPSHOT_SAVE,
        &mut buf,
    ) {
        Ok(_) => Some(true),
        Err(e) if e.raw_os_error() == Some(libc::E2BIG) => Some(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOTTY) => Some(false),
        Err(e) => {
            log::debug!("bhyve: VM_SNAPSHOT_REQ probe: {e}");
            None
        }
    };
    vm.snapshot.set(answer);
    answer
}

fn check_support(vm: &VmShared) -> Result<()> {
    match vm.snapshot.get() {
        Some(false) => Err(not_built_in()),
        _ => Ok(()),
    }
}

/// Maps a failed request to the error the caller sees (and remembers an ENOTTY).
fn request_error(vm: &VmShared, doing: &str, name: &str, e: io::Error) -> HypervisorError {
    if e.raw_os_error() == Some(libc::ENOTTY) {
        vm.snapshot.set(Some(false));
        return not_built_in();
    }
    HypervisorError::Ioctl {
        op: "VM_SNAPSHOT_REQ",
        source: io::Error::new(e.kind(), format!("{doing} {name}: {e}")),
    }
}

static FPU_WARNING: Once = Once::new();

/// Saves every kernel structure (all vCPUs stopped, each vCPU's own state already read).
pub(crate) fn save(vm: &VmShared) -> Result<IrqChipState> {
    check_support(vm)?;
    let release = vm.control.host_info().os_release;
    let vcpus = vm.vcpu_count() as usize;
    let first = MIN_BUFFER
        .max(vcpus.saturating_mul(PER_VCPU_BUFFER))
        .min(MAX_BLOB);
    let mut buf = vec![0u8; first];
    let mut blobs = vec![KernelBlob {
        name: RELEASE_BLOB.into(),
        data: release.into_bytes(),
    }];
    for (name, dev_req) in KERNEL_STRUCTS {
        let used = loop {
            match request(vm, dev_req, SNAPSHOT_SAVE, &mut buf) {
                Ok(used) => break used,
                Err(e) if e.raw_os_error() == Some(libc::E2BIG) => {
                    if buf.len() >= MAX_BLOB {
                        return invalid(format!(
                            "vmm.ko's {name} structure is larger than {} MiB",
                            MAX_BLOB >> 20
                        ));
                    }
                    let bigger = (buf.len() * 2).min(MAX_BLOB);
                    buf = vec![0u8; bigger];
                }
                Err(e) => return Err(request_error(vm, "saving", name, e)),
            }
        };
        if used == 0 {
            return invalid(format!("vmm.ko saved nothing for {name}"));
        }
        blobs.push(KernelBlob {
            name: name.into(),
            data: buf[..used].to_vec(),
        });
    }
    vm.snapshot.set(Some(true));
    FPU_WARNING.call_once(|| {
        log::warn!(
            "bhyve: vmm.ko's snapshot does not include the guests' x87/SSE/AVX registers; \
             a restored guest continues with the destination vCPU's FPU state"
        )
    });
    Ok(IrqChipState {
        backend: BACKEND.into(),
        blobs,
        ..Default::default()
    })
}

/// The major version of a `kern.osrelease` ("15.0-RELEASE-p2" -> 15).
fn major(release: &str) -> Option<u32> {
    let digits: String = release.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// Checks a state before any of it reaches the kernel; returns the structures in restore
/// order. `this_release` is the running kernel's `kern.osrelease` (empty if unknown, then
/// `this_major` decides).
pub(crate) fn validate<'a>(
    state: &'a IrqChipState,
    this_release: &str,
    this_major: u32,
) -> Result<Vec<(&'static str, i32, &'a [u8])>> {
    if state.backend != BACKEND {
        return invalid(format!(
            "made by the {:?} backend, this is {BACKEND}",
            state.backend
        ));
    }
    if !(state.pic_master.is_empty()
        && state.pic_slave.is_empty()
        && state.ioapic.is_empty()
        && state.pit.is_empty())
    {
        return invalid("it carries KVM-style PIC/IOAPIC/PIT blobs".into());
    }
    let names: Vec<&str> = state.blobs.iter().map(|b| b.name.as_str()).collect();
    let expected: Vec<&str> = std::iter::once(RELEASE_BLOB)
        .chain(KERNEL_STRUCTS.iter().map(|s| s.0))
        .collect();
    if names != expected {
        return invalid(format!("blobs {names:?}, expected {expected:?}"));
    }
    let saved = &state.blobs[0].data;
    let saved = match std::str::from_utf8(saved) {
        Ok(s) if s.len() <= MAX_RELEASE && s.bytes().all(|b| b.is_ascii_graphic()) => s,
        _ => {
            return invalid(format!(
                "the saving host's release is not a FreeBSD release name ({} bytes)",
                saved.len()
            ))
        }
    };
    let this = if this_release.is_empty() {
        Some(this_major)
    } else {
        major(this_release)
    };
    match (major(saved), this) {
        (Some(a), Some(b)) if a == b => {
            if !this_release.is_empty() && saved != this_release {
                log::warn!(
                    "bhyve: restoring kernel state saved on FreeBSD {saved} on FreeBSD \
                     {this_release}; vmm.ko checks only the sizes of its structures"
                );
            }
        }
        _ => {
            return invalid(format!(
                "saved on FreeBSD {saved:?}, this is FreeBSD {}: vmm.ko's structures differ \
                 between releases",
                if this_release.is_empty() {
                    this_major.to_string()
                } else {
                    this_release.to_string()
                }
            ))
        }
    }
    let mut out = Vec::with_capacity(KERNEL_STRUCTS.len());
    for ((name, dev_req), blob) in KERNEL_STRUCTS.iter().zip(&state.blobs[1..]) {
        if blob.data.is_empty() || blob.data.len() > MAX_BLOB {
            return invalid(format!(
                "{name} is {} bytes (1 to {} MiB expected)",
                blob.data.len(),
                MAX_BLOB >> 20
            ));
        }
        out.push((*name, *dev_req, blob.data.as_slice()));
    }
    Ok(out)
}

/// Restores every kernel structure into a VM whose vCPUs all exist and have not run, then
/// re-bases its time (VM_RESTORE_TIME).
pub(crate) fn restore(vm: &VmShared, state: &IrqChipState) -> Result<()> {
    check_support(vm)?;
    let release = vm.control.host_info().os_release;
    let parts = validate(state, &release, vm.abi.major() as u32)?;
    for (name, dev_req, data) in parts {
        // The kernel only reads the buffer; it gets a private copy all the same.
        let mut buf = data.to_vec();
        match request(vm, dev_req, SNAPSHOT_RESTORE, &mut buf) {
            Ok(used) if used == buf.len() => {}
            Ok(used) => {
                return invalid(format!(
                    "vmm.ko used {used} of the {} bytes saved for {name}: the state comes \
                     from a VM with other vCPUs or another kernel",
                    buf.len()
                ))
            }
            Err(e) if e.raw_os_error() == Some(libc::E2BIG) => {
                return invalid(format!(
                    "the {} bytes saved for {name} are fewer than this kernel restores: the \
                     state comes from a VM with other vCPUs or another kernel",
                    buf.len()
                ))
            }
            Err(e) => return Err(request_error(vm, "restoring", name, e)),
        }
    }
    vm.snapshot.set(Some(true));
    vm.ioctl(abi::VM_RESTORE_TIME, &mut abi::VmInt { value: 0 })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::bhyve::abi::{snapshot_req, Abi};
    use crate::bhyve::fake::{FakeControl, FakeKernel, FakeSnapshot};
    use crate::bhyve::{BhyveHypervisor, BhyveOptions, BhyveVm};
    use crate::{
        restore_vcpu_state, save_vcpu_state, Hypervisor, MpState, StandardRegisters, Vcpu, Vm,
    };

    /// A kernel built with BHYVE_SNAPSHOT whose structures have these sizes, filled with a
    /// pattern that names the structure.
    fn snapshot_kernel(sizes: &[(i32, usize)]) -> FakeSnapshot {
        let mut s = FakeSnapshot::default();
        for &(req, len) in sizes {
            let data = (0..len).map(|i| (req as u8) ^ (i as u8)).collect();
            s.structs.insert(req, data);
        }
        s
    }

    fn all_structs(vcpus: usize) -> Vec<(i32, usize)> {
        vec![
            (snapshot_req::STRUCT_VHPET, 300),
            (snapshot_req::STRUCT_VM, 64 * vcpus + 8),
            (snapshot_req::STRUCT_VIOAPIC, 420),
            (snapshot_req::STRUCT_VLAPIC, 4200 * vcpus),
            (snapshot_req::STRUCT_VMCX, 900 * vcpus),
            (snapshot_req::STRUCT_VATPIT, 200),
            (snapshot_req::STRUCT_VATPIC, 90),
            (snapshot_req::STRUCT_VPMTMR, 16),
            (snapshot_req::STRUCT_VRTC, 180),
        ]
    }

    struct Setup {
        control: Arc<FakeControl>,
        kernel: Arc<FakeKernel>,
        hv: BhyveHypervisor,
        vm: Arc<BhyveVm>,
    }

    /// One VM on a fake kernel with (`Some`) or without (`None`) BHYVE_SNAPSHOT.
    fn setup(abi: Abi, snapshot: Option<FakeSnapshot>) -> Setup {
        let control = FakeControl::new(abi);
        *control.kernel.snapshot.lock().unwrap() = snapshot;
        let hv = BhyveHypervisor::with_control(control.clone(), BhyveOptions::default());
        let vm = hv.create_bhyve_vm().unwrap();
        Setup {
            kernel: control.kernel.clone(),
            control,
            hv,
            vm,
        }
    }

    fn log(k: &FakeKernel) -> Vec<(i32, i32)> {
        k.snapshot.lock().unwrap().as_ref().unwrap().log.clone()
    }

    fn order() -> Vec<i32> {
        KERNEL_STRUCTS.iter().map(|s| s.1).collect()
    }

    #[test]
    fn probe_at_vm_creation_sets_the_capability() {
        let s = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(1))));
        assert_eq!(s.hv.capabilities().kernel_snapshot, Some(true));
        // The probe reads the PM timer and nothing else, and changes nothing.
        assert_eq!(
            log(&s.kernel),
            [(snapshot_req::STRUCT_VPMTMR, SNAPSHOT_SAVE)]
        );

        let s = setup(Abi::FreeBsd14, None);
        assert_eq!(s.hv.capabilities().kernel_snapshot, Some(false));
        // Before any VM exists, nobody knows.
        let hv = BhyveHypervisor::with_control(s.control.clone(), BhyveOptions::default());
        assert_eq!(hv.capabilities().kernel_snapshot, None);
    }

    #[test]
    fn without_bhyve_snapshot_save_and_restore_say_so() {
        let s = setup(Abi::FreeBsd15, None);
        for err in [
            s.vm.irqchip_state().unwrap_err(),
            s.vm.set_irqchip_state(&IrqChipState::default())
                .unwrap_err(),
        ] {
            let text = err.to_string();
            assert!(matches!(err, HypervisorError::Unsupported(_)), "{err:?}");
            assert!(text.contains("options BHYVE_SNAPSHOT"), "{text}");
            assert!(text.contains("lacks VM_SNAPSHOT_REQ"), "{text}");
        }
        // Only the probe reached the kernel.
        let reqs: Vec<u64> = s
            .kernel
            .requests()
            .into_iter()
            .filter(|&r| r == abi::VM_SNAPSHOT_REQ)
            .collect();
        assert_eq!(reqs.len(), 1);

        // A probe that failed otherwise decides nothing: the real request says ENOTTY, and
        // the error is the same.
        let s = setup(Abi::FreeBsd15, None);
        s.vm.shared.snapshot.set(None);
        let err = s.vm.irqchip_state().unwrap_err();
        assert!(err.to_string().contains("options BHYVE_SNAPSHOT"), "{err}");
        assert_eq!(s.vm.shared.snapshot.get(), Some(false));
    }

    #[test]
    fn save_walks_bhyves_order_and_grows_its_buffer() {
        // Two vCPUs; one structure larger than the first buffer (64 KiB).
        let mut sizes = all_structs(2);
        sizes[3].1 = 150_000;
        let s = setup(Abi::FreeBsd15, Some(snapshot_kernel(&sizes)));
        let _v0 = s.vm.create_bhyve_vcpu(0).unwrap();
        let _v1 = s.vm.create_bhyve_vcpu(1).unwrap();
        s.kernel
            .snapshot
            .lock()
            .unwrap()
            .as_mut()
            .unwrap()
            .log
            .clear();
        s.kernel.clear_calls();

        let state = s.vm.irqchip_state().unwrap();
        assert_eq!(state.backend, "bhyve");
        assert!(state.pic_master.is_empty() && state.pit.is_empty());
        assert_eq!(state.blobs[0].name, "osrelease");
        assert_eq!(state.blobs[0].data, b"15.0-RELEASE");
        let kernel = s.kernel.snapshot.lock().unwrap().clone().unwrap();
        for ((name, req), blob) in KERNEL_STRUCTS.iter().zip(&state.blobs[1..]) {
            assert_eq!(blob.name, *name);
            assert_eq!(blob.data, kernel.structs[req], "{name}");
        }
        // vlapic (150,000 bytes) took 64 KiB, 128 KiB, then 256 KiB: E2BIG twice.
        let mut expected: Vec<(i32, i32)> = Vec::new();
        for req in order() {
            let tries = if req == snapshot_req::STRUCT_VLAPIC {
                3
            } else {
                1
            };
            expected.extend(std::iter::repeat_n((req, SNAPSHOT_SAVE), tries));
        }
        assert_eq!(log(&s.kernel), expected);
        // Every request described a buffer the kernel could write, and named no device.
        for c in s.kernel.calls() {
            if c.request == abi::VM_SNAPSHOT_REQ {
                let m: VmSnapshotMeta = zerocopy::FromBytes::read_from_bytes(&c.arg[..]).unwrap();
                assert_eq!((m.dev_data, m.dev_name), (0, 0));
                assert_eq!((m.buf, m.buf_rem), (m.buf_start, m.buf_size));
                assert!(m.buf_size >= 64 << 10);
            }
        }
    }

    #[test]
    fn a_structure_beyond_the_limit_is_an_error_not_a_loop() {
        let mut sizes = all_structs(1);
        sizes[4].1 = MAX_BLOB + 1;
        let s = setup(Abi::FreeBsd15, Some(snapshot_kernel(&sizes)));
        let err = s.vm.irqchip_state().unwrap_err();
        assert!(err.to_string().contains("vmcx"), "{err}");
        assert!(err.to_string().contains("16 MiB"), "{err}");
        // Other kernel errors name the structure and the ioctl.
        let s = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(1))));
        s.kernel
            .fail
            .lock()
            .unwrap()
            .insert(abi::VM_SNAPSHOT_REQ, libc::EINVAL);
        let err = s.vm.irqchip_state().unwrap_err().to_string();
        assert!(
            err.contains("VM_SNAPSHOT_REQ") && err.contains("vhpet"),
            "{err}"
        );
    }

    #[test]
    fn restore_hands_back_every_structure_then_restores_time() {
        let src = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(2))));
        let _a = src.vm.create_bhyve_vcpu(0).unwrap();
        let _b = src.vm.create_bhyve_vcpu(1).unwrap();
        let state = src.vm.irqchip_state().unwrap();
        let json = serde_json::to_string(&state).unwrap();
        let carried: IrqChipState = serde_json::from_str(&json).unwrap();
        assert_eq!(carried, state);

        // The destination's kernel starts with other contents of the same sizes.
        let mut fresh = snapshot_kernel(&all_structs(2));
        for data in fresh.structs.values_mut() {
            data.fill(0);
        }
        let dst = setup(Abi::FreeBsd15, Some(fresh));
        let _c = dst.vm.create_bhyve_vcpu(0).unwrap();
        let _d = dst.vm.create_bhyve_vcpu(1).unwrap();
        dst.kernel
            .snapshot
            .lock()
            .unwrap()
            .as_mut()
            .unwrap()
            .log
            .clear();
        dst.kernel.clear_calls();
        dst.vm.set_irqchip_state(&carried).unwrap();

        let k = dst.kernel.snapshot.lock().unwrap().clone().unwrap();
        let expected: Vec<(i32, i32)> =
            order().into_iter().map(|r| (r, SNAPSHOT_RESTORE)).collect();
        assert_eq!(k.log, expected);
        let src_k = src.kernel.snapshot.lock().unwrap().clone().unwrap();
        assert_eq!(k.structs, src_k.structs, "every byte arrived");
        // VM_RESTORE_TIME once, after the last structure.
        let reqs = dst.kernel.requests();
        assert_eq!(reqs.last(), Some(&abi::VM_RESTORE_TIME));
        assert_eq!(
            reqs.iter().filter(|&&r| r == abi::VM_RESTORE_TIME).count(),
            1
        );
        assert_eq!(k.restore_time, 1);
    }

    #[test]
    fn a_state_from_other_vcpus_is_refused() {
        // Saved with two vCPUs, restored where the kernel has one: the kernel consumes less
        // (or, the other way round, runs out with E2BIG).
        let src = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(2))));
        let state = src.vm.irqchip_state().unwrap();
        let dst = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(1))));
        let err = dst.vm.set_irqchip_state(&state).unwrap_err().to_string();
        assert!(err.contains("used") && err.contains("vm"), "{err}");
        assert_eq!(
            dst.kernel
                .snapshot
                .lock()
                .unwrap()
                .as_ref()
                .unwrap()
                .restore_time,
            0
        );

        let src = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(1))));
        let state = src.vm.irqchip_state().unwrap();
        let dst = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(3))));
        let err = dst.vm.set_irqchip_state(&state).unwrap_err().to_string();
        assert!(err.contains("fewer than this kernel restores"), "{err}");
    }

    #[test]
    fn garbage_and_foreign_state_never_reach_the_kernel() {
        let src = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(1))));
        let good = src.vm.irqchip_state().unwrap();
        let dst = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(1))));
        type Corruption = Box<dyn Fn(&mut IrqChipState)>;
        let cases: Vec<(&str, Corruption)> = vec![
            ("KVM's", Box::new(|s| s.backend = "kvm".into())),
            ("no tag", Box::new(|s| s.backend.clear())),
            ("KVM chips", Box::new(|s| s.pic_master = vec![0; 16])),
            ("no blobs", Box::new(|s| s.blobs.clear())),
            (
                "one missing",
                Box::new(|s| {
                    s.blobs.remove(4);
                }),
            ),
            (
                "one extra",
                Box::new(|s| {
                    s.blobs.push(KernelBlob {
                        name: "vrtc".into(),
                        data: vec![1],
                    })
                }),
            ),
            ("reordered", Box::new(|s| s.blobs.swap(2, 3))),
            ("renamed", Box::new(|s| s.blobs[5].name = "VMCX".into())),
            ("empty", Box::new(|s| s.blobs[3].data.clear())),
            (
                "huge",
                Box::new(|s| s.blobs[3].data = vec![0; MAX_BLOB + 1]),
            ),
            (
                "release",
                Box::new(|s| s.blobs[0].data = b"14.3-RELEASE".to_vec()),
            ),
            ("not text", Box::new(|s| s.blobs[0].data = vec![0xff, 0x00])),
            ("too long", Box::new(|s| s.blobs[0].data = vec![b'1'; 65])),
        ];
        for (what, corrupt) in cases {
            let mut bad = good.clone();
            corrupt(&mut bad);
            dst.kernel.clear_calls();
            let err = dst.vm.set_irqchip_state(&bad).expect_err(what);
            assert!(
                matches!(err, HypervisorError::Invalid(_)),
                "{what}: {err:?}"
            );
            assert!(
                dst.kernel.requests().is_empty(),
                "{what}: reached the kernel"
            );
        }
        // KVM's own state is refused by name.
        let kvm = IrqChipState {
            backend: "kvm".into(),
            pic_master: vec![0; 16],
            ..Default::default()
        };
        let err = dst.vm.set_irqchip_state(&kvm).unwrap_err().to_string();
        assert!(err.contains("\"kvm\" backend"), "{err}");
        // And the good state still restores.
        dst.vm.set_irqchip_state(&good).unwrap();
    }

    #[test]
    fn release_check() {
        let state = |rel: &str| IrqChipState {
            backend: BACKEND.into(),
            blobs: std::iter::once(KernelBlob {
                name: RELEASE_BLOB.into(),
                data: rel.as_bytes().to_vec(),
            })
            .chain(KERNEL_STRUCTS.iter().map(|(n, _)| KernelBlob {
                name: (*n).into(),
                data: vec![1],
            }))
            .collect(),
            ..Default::default()
        };
        // Same major: accepted (with a warning if the strings differ).
        assert!(validate(&state("15.0-RELEASE"), "15.0-RELEASE-p3", 15).is_ok());
        assert!(validate(&state("14.3-RELEASE"), "14.2-STABLE", 14).is_ok());
        // Another major: refused.
        assert!(validate(&state("14.3-RELEASE"), "15.0-RELEASE", 15).is_err());
        // This host's release unknown: the ABI's major decides.
        assert!(validate(&state("15.1-RELEASE"), "", 15).is_ok());
        assert!(validate(&state("14.1-RELEASE"), "", 15).is_err());
        assert!(validate(&state("RELEASE"), "15.0-RELEASE", 15).is_err());
        assert_eq!(major("16.0-CURRENT"), Some(16));
        assert_eq!(major(""), None);
    }

    #[test]
    fn random_corruption_is_refused_without_a_panic() {
        let sizes = all_structs(1);
        let src = setup(Abi::FreeBsd15, Some(snapshot_kernel(&sizes)));
        let good = src.vm.irqchip_state().unwrap();
        let json = serde_json::to_vec(&good).unwrap();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let dst = setup(Abi::FreeBsd15, Some(snapshot_kernel(&sizes)));
        let (mut parsed, mut refused, mut accepted) = (0, 0, 0);
        for _ in 0..1000 {
            let mut bytes = json.clone();
            // Digits stay digits (so the JSON mostly still parses: other byte values,
            // other names' characters are untouched), or a byte of the text goes.
            for _ in 0..2 {
                let i = (next() as usize) % bytes.len();
                if bytes[i].is_ascii_digit() {
                    bytes[i] = b'0' + (next() % 10) as u8;
                } else if next() % 8 == 0 {
                    bytes.remove(i);
                }
            }
            let Ok(mut state) = serde_json::from_slice::<IrqChipState>(&bytes) else {
                continue;
            };
            // And now and then a blob grows, shrinks or is renamed.
            if let Some(blob) = state.blobs.get_mut((next() as usize) % 12) {
                match next() % 6 {
                    0 => blob.data.push(0),
                    1 => {
                        blob.data.pop();
                    }
                    2 => blob.name.push('x'),
                    _ => {}
                }
            }
            parsed += 1;
            match dst.vm.set_irqchip_state(&state) {
                // Accepted: the names, the release and every size were right.
                Ok(()) => {
                    assert!(validate(&state, "15.0-RELEASE", 15).is_ok());
                    let lens: Vec<usize> = state.blobs[1..].iter().map(|b| b.data.len()).collect();
                    let expected: Vec<usize> = KERNEL_STRUCTS
                        .iter()
                        .map(|(_, r)| sizes.iter().find(|s| s.0 == *r).unwrap().1)
                        .collect();
                    assert_eq!(lens, expected);
                    accepted += 1;
                }
                Err(_) => refused += 1,
            }
        }
        assert!(
            refused > 0 && accepted > 0,
            "{parsed} parsed, {refused} refused, {accepted} accepted"
        );
    }

    /// The whole vCPU state on bhyve: registers through the register ioctls, the FPU,
    /// XCRs and LAPIC left to the kernel blobs, the rest restored on a new VM.
    #[test]
    fn vcpu_state_skips_what_travels_in_the_kernel_blobs() {
        let src = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(2))));
        let v0 = src.vm.create_bhyve_vcpu(0).unwrap();
        let v1 = src.vm.create_bhyve_vcpu(1).unwrap();
        let regs = StandardRegisters {
            rax: 7,
            rsp: 0x8000,
            rip: 0x1234,
            rflags: 0x202,
            ..Default::default()
        };
        v0.set_regs(&regs).unwrap();
        src.kernel.set_reg(0, abi::reg::FS_BASE, 0x7000);
        let msrs = src.hv.msr_index_list().unwrap();
        let s0 = save_vcpu_state(&v0, &msrs).unwrap();
        let s1 = save_vcpu_state(&v1, &msrs).unwrap();
        assert_eq!(s0.regs, regs);
        assert!(s0.fpu.is_none() && s0.xsave.is_none() && s0.lapic.is_none());
        assert!(s0.xcrs.is_empty() && s0.cpuid.is_empty());
        assert_eq!(
            (s0.mp_state, s1.mp_state),
            (MpState::Runnable, MpState::Uninitialized)
        );
        assert!(s0
            .msrs
            .iter()
            .any(|m| m.index == 0xc000_0100 && m.data == 0x7000));
        assert!(
            s0.msrs.iter().any(|m| m.index == 0x1b),
            "IA32_APIC_BASE read"
        );
        let kernel = src.vm.irqchip_state().unwrap();
        // Through JSON, as a snapshot carries it.
        let s0: crate::VcpuState =
            serde_json::from_str(&serde_json::to_string(&s0).unwrap()).unwrap();

        let dst = setup(Abi::FreeBsd15, Some(snapshot_kernel(&all_structs(2))));
        let w0 = dst.vm.create_bhyve_vcpu(0).unwrap();
        let w1 = dst.vm.create_bhyve_vcpu(1).unwrap();
        dst.vm.set_irqchip_state(&kernel).unwrap();
        restore_vcpu_state(&w0, &s0).unwrap();
        restore_vcpu_state(&w1, &s1).unwrap();
        assert_eq!(w0.regs().unwrap(), regs);
        assert_eq!(dst.kernel.reg(0, abi::reg::FS_BASE), 0x7000);
        assert_eq!(w1.mp_state().unwrap(), MpState::Uninitialized);
        // A LAPIC from elsewhere (KVM's) cannot be written here: refused, not dropped.
        let mut foreign = s0.clone();
        foreign.lapic = Some(Default::default());
        assert!(restore_vcpu_state(&w0, &foreign).is_err());
    }
}
