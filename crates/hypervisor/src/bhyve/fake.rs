//! A fake vmm.ko for the tests: records every request, keeps registers and descriptors,
//! and answers VM_RUN with queued exits, following the pointers a real kernel follows.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::sync::{Arc, Mutex};

use zerocopy::{FromBytes, IntoBytes};

use super::abi::{self, Abi, SegDesc};
use super::transport::{HostInfo, VmmControl, VmmTransport};

/// One recorded ioctl.
#[derive(Clone, Debug)]
pub struct Call {
    pub request: u64,
    pub arg: Vec<u8>,
    /// For VM_SET_REGISTER(_SET): the (register, value) pairs written.
    pub regs: Vec<(i32, u64)>,
}

impl Call {
    pub fn sets(&self, regnum: i32) -> Option<u64> {
        self.regs.iter().find(|r| r.0 == regnum).map(|r| r.1)
    }
}

/// What VM_RUN does next.
pub enum RunReply {
    Exit([u8; abi::VM_EXIT_SIZE]),
    Errno(i32),
}

#[derive(Default)]
pub struct FakeKernel {
    pub calls: Mutex<Vec<Call>>,
    pub regs: Mutex<HashMap<(i32, i32), u64>>,
    pub descs: Mutex<HashMap<(i32, i32), SegDesc>>,
    pub x2apic: Mutex<HashMap<i32, i32>>,
    pub runs: Mutex<VecDeque<RunReply>>,
    /// Requests that fail with an errno.
    pub fail: Mutex<HashMap<u64, i32>>,
    /// Guest-linear pages whose translation faults (identity otherwise).
    pub faulting_pages: Mutex<HashSet<u64>>,
    /// (host address, length, GPA) of every guest-memory mapping.
    pub mapped: Mutex<Vec<(u64, u64, u64)>>,
    /// Called during VM_RUN, before the kernel reads `vm_run` (a kick landing just before
    /// entry).
    pub before_run: Mutex<Option<Box<dyn Fn() + Send>>>,
    /// Called during VM_RUN, after the kernel has read `vm_run` (a kick landing while the
    /// guest runs).
    pub during_run: Mutex<Option<Box<dyn Fn() + Send>>>,
    /// A kernel built with `options BHYVE_SNAPSHOT`; `None`: one without (VM_SNAPSHOT_REQ
    /// and VM_RESTORE_TIME say ENOTTY).
    pub snapshot: Mutex<Option<FakeSnapshot>>,
}

/// The kernel structures VM_SNAPSHOT_REQ saves and restores.
#[derive(Clone, Debug, Default)]
pub struct FakeSnapshot {
    /// `dev_req` -> the structure as the kernel would save it. A save copies it out; a
    /// restore reads exactly as many bytes back in and replaces it. Requests for anything
    /// else fail with EINVAL, like vmm.ko's `vm_snapshot_req`.
    pub structs: HashMap<i32, Vec<u8>>,
    /// `(dev_req, op)` of every request that reached a structure, in order.
    pub log: Vec<(i32, i32)>,
    /// How many times VM_RESTORE_TIME was called.
    pub restore_time: usize,
}

fn read<T: FromBytes>(arg: &[u8]) -> T {
    T::read_from_prefix(arg).expect("argument too short").0
}

fn write<T: IntoBytes + zerocopy::Immutable>(arg: &mut [u8], value: &T) {
    arg[..std::mem::size_of::<T>()].copy_from_slice(value.as_bytes());
}

impl FakeKernel {
    pub fn new() -> Arc<Self> {
        Arc::new(FakeKernel::default())
    }

    pub fn queue_exit(&self, exit: [u8; abi::VM_EXIT_SIZE]) {
        self.runs.lock().unwrap().push_back(RunReply::Exit(exit));
    }

    pub fn queue_errno(&self, errno: i32) {
        self.runs.lock().unwrap().push_back(RunReply::Errno(errno));
    }

    pub fn set_reg(&self, vcpu: i32, regnum: i32, value: u64) {
        self.regs.lock().unwrap().insert((vcpu, regnum), value);
    }

    pub fn reg(&self, vcpu: i32, regnum: i32) -> u64 {
        *self.regs.lock().unwrap().get(&(vcpu, regnum)).unwrap_or(&0)
    }

    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    pub fn requests(&self) -> Vec<u64> {
        self.calls().iter().map(|c| c.request).collect()
    }

    pub fn clear_calls(&self) {
        self.calls.lock().unwrap().clear();
    }
}

impl VmmTransport for FakeKernel {
    fn ioctl(&self, request: u64, arg: &mut [u8]) -> io::Result<()> {
        assert_eq!(
            arg.len(),
            abi::ioc_len(request),
            "argument of {} has the wrong size",
            abi::ioctl_name(request)
        );
        if request == abi::VM_RUN || request == abi::VM_RUN_IOWR {
            if let Some(hook) = self.before_run.lock().unwrap().as_ref() {
                hook();
            }
        }
        let mut call = Call {
            request,
            arg: arg.to_vec(),
            regs: Vec::new(),
        };
        let result = self.handle(request, arg, &mut call);
        self.calls.lock().unwrap().push(call);
        result
    }

    unsafe fn map_guest_memory(&self, addr: u64, len: u64, gpa: u64) -> io::Result<()> {
        self.mapped.lock().unwrap().push((addr, len, gpa));
        Ok(())
    }
}

impl FakeKernel {
    fn handle(&self, request: u64, arg: &mut [u8], call: &mut Call) -> io::Result<()> {
        if let Some(&errno) = self.fail.lock().unwrap().get(&request) {
            return Err(io::Error::from_raw_os_error(errno));
        }
        match request {
            abi::VM_SET_REGISTER => {
                let r: abi::VmRegister = read(arg);
                call.regs.push((r.regnum, r.regval));
                self.set_reg(r.cpuid, r.regnum, r.regval);
            }
            abi::VM_GET_REGISTER => {
                let mut r: abi::VmRegister = read(arg);
                r.regval = self.reg(r.cpuid, r.regnum);
                write(arg, &r);
            }
            abi::VM_SET_REGISTER_SET | abi::VM_GET_REGISTER_SET => {
                let s: abi::VmRegisterSet = read(arg);
                let n = s.count as usize;
                // SAFETY: the backend passes pointers to `count` ints and u64s that live
                // across the call, as the kernel requires.
                let (nums, vals) = unsafe {
                    (
                        std::slice::from_raw_parts(s.regnums as *const i32, n),
                        std::slice::from_raw_parts_mut(s.regvals as *mut u64, n),
                    )
                };
                for (num, val) in nums.iter().zip(vals.iter_mut()) {
                    if request == abi::VM_SET_REGISTER_SET {
                        call.regs.push((*num, *val));
                        self.set_reg(s.cpuid, *num, *val);
                    } else {
                        *val = self.reg(s.cpuid, *num);
                    }
                }
            }
            abi::VM_SET_SEGMENT_DESCRIPTOR => {
                let d: abi::VmSegDesc = read(arg);
                self.descs
                    .lock()
                    .unwrap()
                    .insert((d.cpuid, d.regnum), d.desc);
            }
            abi::VM_GET_SEGMENT_DESCRIPTOR => {
                let mut d: abi::VmSegDesc = read(arg);
                d.desc = self
                    .descs
                    .lock()
                    .unwrap()
                    .get(&(d.cpuid, d.regnum))
                    .copied()
                    .unwrap_or_default();
                write(arg, &d);
            }
            abi::VM_SET_X2APIC_STATE => {
                let x: abi::VmX2apic = read(arg);
                self.x2apic.lock().unwrap().insert(x.cpuid, x.state);
            }
            abi::VM_GET_X2APIC_STATE => {
                let mut x: abi::VmX2apic = read(arg);
                x.state = *self.x2apic.lock().unwrap().get(&x.cpuid).unwrap_or(&0);
                write(arg, &x);
            }
            abi::VM_GLA2GPA | abi::VM_GLA2GPA_NOFAULT => {
                let mut g: abi::VmGla2gpa = read(arg);
                if self
                    .faulting_pages
                    .lock()
                    .unwrap()
                    .contains(&(g.gla & !0xfff))
                {
                    g.fault = 1;
                } else {
                    g.gpa = g.gla;
                }
                write(arg, &g);
            }
            abi::VM_SNAPSHOT_REQ => return self.snapshot_req(arg),
            abi::VM_RESTORE_TIME => match self.snapshot.lock().unwrap().as_mut() {
                Some(s) => s.restore_time += 1,
                None => return Err(io::Error::from_raw_os_error(libc::ENOTTY)),
            },
            abi::VM_RUN | abi::VM_RUN_IOWR => {
                let run: abi::VmRun = read(arg);
                if run.cpuid < 0 || run.cpuid >= 0x10000 {
                    return Err(io::Error::from_raw_os_error(libc::EINVAL));
                }
                if let Some(hook) = self.during_run.lock().unwrap().as_ref() {
                    hook();
                }
                match self.runs.lock().unwrap().pop_front() {
                    Some(RunReply::Exit(exit)) => {
                        // SAFETY: `vm_exit` points at the vCPU's 136-byte exit buffer,
                        // which the backend keeps alive, as the kernel's copyout assumes.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                exit.as_ptr(),
                                run.vm_exit as *mut u8,
                                exit.len(),
                            )
                        };
                    }
                    Some(RunReply::Errno(e)) => return Err(io::Error::from_raw_os_error(e)),
                    None => panic!("VM_RUN with no exit queued"),
                }
            }
            _ => {}
        }
        Ok(())
    }
}

impl FakeKernel {
    /// VM_SNAPSHOT_REQ as `vm_snapshot_req` and `vm_snapshot_buf` do it: the structure's
    /// bytes go to (or come from) `buf`, which then advances; a structure larger than
    /// `buf_rem` fails with E2BIG; the meta is copied back on success.
    fn snapshot_req(&self, arg: &mut [u8]) -> io::Result<()> {
        let mut guard = self.snapshot.lock().unwrap();
        let Some(snap) = guard.as_mut() else {
            return Err(io::Error::from_raw_os_error(libc::ENOTTY));
        };
        let mut meta: abi::VmSnapshotMeta = read(arg);
        let Some(data) = snap.structs.get_mut(&meta.dev_req) else {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        };
        snap.log.push((meta.dev_req, meta.op));
        let len = data.len();
        assert!(meta.buf_rem <= meta.buf_size, "buf_rem beyond the buffer");
        assert_eq!(meta.buf, meta.buf_start + (meta.buf_size - meta.buf_rem));
        if (meta.buf_rem as usize) < len {
            return Err(io::Error::from_raw_os_error(libc::E2BIG));
        }
        match meta.op {
            abi::SNAPSHOT_SAVE => {
                // SAFETY: `buf .. buf + buf_rem` is the backend's buffer, alive and
                // exclusively lent for the call, as the kernel's copyout assumes; `len` is at
                // most `buf_rem`.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), meta.buf as *mut u8, len) }
            }
            abi::SNAPSHOT_RESTORE => {
                // SAFETY: as above, read instead of written (the kernel's copyin).
                let saved = unsafe { std::slice::from_raw_parts(meta.buf as *const u8, len) };
                data.copy_from_slice(saved);
            }
            _ => return Err(io::Error::from_raw_os_error(libc::EINVAL)),
        }
        meta.buf += len as u64;
        meta.buf_rem -= len as u64;
        write(arg, &meta);
        Ok(())
    }
}

/// A control interface whose every VM is the same fake kernel.
pub struct FakeControl {
    pub kernel: Arc<FakeKernel>,
    pub abi: Abi,
    pub created: Mutex<Vec<String>>,
    pub destroyed: Mutex<Vec<String>>,
}

impl FakeControl {
    pub fn new(abi: Abi) -> Arc<Self> {
        Arc::new(FakeControl {
            kernel: FakeKernel::new(),
            abi,
            created: Mutex::new(Vec::new()),
            destroyed: Mutex::new(Vec::new()),
        })
    }
}

impl VmmControl for FakeControl {
    fn abi(&self) -> Abi {
        self.abi
    }

    fn host_info(&self) -> HostInfo {
        HostInfo {
            os_release: "15.0-RELEASE".into(),
            max_vcpus: 16,
            vendor: "VT-x".into(),
            tpr_shadow: Some(true),
            apic_virtualization: Some(false),
            posted_interrupts: Some(false),
            unrestricted_guest: Some(true),
        }
    }

    fn create_vm(&self, name: &str) -> io::Result<Arc<dyn VmmTransport>> {
        self.created.lock().unwrap().push(name.into());
        Ok(self.kernel.clone())
    }

    fn destroy_vm(&self, name: &str) -> io::Result<()> {
        self.destroyed.lock().unwrap().push(name.into());
        Ok(())
    }
}
