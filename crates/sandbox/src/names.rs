//! The argument values a profile line may name: ioctl requests, fcntl commands, madvise
//! advice, prctl options and socket families, spelled as the kernel headers (and strace)
//! spell them.

use kvm_bindings::*;
use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

const KVMIO: u32 = 0xAE;
const UFFDIO: u32 = 0xAA;

// System ioctls.
ioctl_io_nr!(KVM_GET_API_VERSION, KVMIO, 0x00);
ioctl_io_nr!(KVM_CREATE_VM, KVMIO, 0x01);
ioctl_iowr_nr!(KVM_GET_MSR_INDEX_LIST, KVMIO, 0x02, kvm_msr_list);
ioctl_io_nr!(KVM_CHECK_EXTENSION, KVMIO, 0x03);
ioctl_io_nr!(KVM_GET_VCPU_MMAP_SIZE, KVMIO, 0x04);
ioctl_iowr_nr!(KVM_GET_SUPPORTED_CPUID, KVMIO, 0x05, kvm_cpuid2);
ioctl_iowr_nr!(KVM_GET_MSR_FEATURE_INDEX_LIST, KVMIO, 0x0a, kvm_msr_list);
// VM ioctls.
ioctl_io_nr!(KVM_CREATE_VCPU, KVMIO, 0x41);
ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
ioctl_iow_nr!(
    KVM_SET_USER_MEMORY_REGION,
    KVMIO,
    0x46,
    kvm_userspace_memory_region
);
ioctl_io_nr!(KVM_SET_TSS_ADDR, KVMIO, 0x47);
ioctl_iow_nr!(KVM_SET_IDENTITY_MAP_ADDR, KVMIO, 0x48, u64);
ioctl_io_nr!(KVM_CREATE_IRQCHIP, KVMIO, 0x60);
ioctl_iow_nr!(KVM_IRQ_LINE, KVMIO, 0x61, kvm_irq_level);
ioctl_iowr_nr!(KVM_GET_IRQCHIP, KVMIO, 0x62, kvm_irqchip);
ioctl_ior_nr!(KVM_SET_IRQCHIP, KVMIO, 0x63, kvm_irqchip);
ioctl_iowr_nr!(KVM_IRQ_LINE_STATUS, KVMIO, 0x67, kvm_irq_level);
ioctl_iow_nr!(KVM_SET_GSI_ROUTING, KVMIO, 0x6a, kvm_irq_routing);
ioctl_iow_nr!(KVM_IRQFD, KVMIO, 0x76, kvm_irqfd);
ioctl_iow_nr!(KVM_CREATE_PIT2, KVMIO, 0x77, kvm_pit_config);
ioctl_iow_nr!(KVM_IOEVENTFD, KVMIO, 0x79, kvm_ioeventfd);
ioctl_iow_nr!(KVM_SET_CLOCK, KVMIO, 0x7b, kvm_clock_data);
ioctl_ior_nr!(KVM_GET_CLOCK, KVMIO, 0x7c, kvm_clock_data);
ioctl_ior_nr!(KVM_GET_PIT2, KVMIO, 0x9f, kvm_pit_state2);
ioctl_iow_nr!(KVM_SET_PIT2, KVMIO, 0xa0, kvm_pit_state2);
ioctl_iow_nr!(KVM_ENABLE_CAP, KVMIO, 0xa3, kvm_enable_cap);
ioctl_iow_nr!(KVM_SIGNAL_MSI, KVMIO, 0xa5, kvm_msi);
ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);
// vCPU ioctls.
ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
ioctl_iow_nr!(KVM_SET_REGS, KVMIO, 0x82, kvm_regs);
ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
ioctl_iow_nr!(KVM_SET_SREGS, KVMIO, 0x84, kvm_sregs);
ioctl_iow_nr!(KVM_INTERRUPT, KVMIO, 0x86, kvm_interrupt);
ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
ioctl_iow_nr!(KVM_SET_MSRS, KVMIO, 0x89, kvm_msrs);
ioctl_ior_nr!(KVM_GET_FPU, KVMIO, 0x8c, kvm_fpu);
ioctl_iow_nr!(KVM_SET_FPU, KVMIO, 0x8d, kvm_fpu);
ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
ioctl_iow_nr!(KVM_SET_LAPIC, KVMIO, 0x8f, kvm_lapic_state);
ioctl_iow_nr!(KVM_SET_CPUID2, KVMIO, 0x90, kvm_cpuid2);
ioctl_iowr_nr!(KVM_GET_CPUID2, KVMIO, 0x91, kvm_cpuid2);
ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
ioctl_iow_nr!(KVM_SET_MP_STATE, KVMIO, 0x99, kvm_mp_state);
ioctl_io_nr!(KVM_NMI, KVMIO, 0x9a);
ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
ioctl_iow_nr!(KVM_SET_VCPU_EVENTS, KVMIO, 0xa0, kvm_vcpu_events);
ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
ioctl_iow_nr!(KVM_SET_DEBUGREGS, KVMIO, 0xa2, kvm_debugregs);
ioctl_io_nr!(KVM_SET_TSC_KHZ, KVMIO, 0xa2);
ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);
ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
ioctl_iow_nr!(KVM_SET_XSAVE, KVMIO, 0xa5, kvm_xsave);
ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
ioctl_iow_nr!(KVM_SET_XCRS, KVMIO, 0xa7, kvm_xcrs);
ioctl_io_nr!(KVM_KVMCLOCK_CTRL, KVMIO, 0xad);
ioctl_ior_nr!(KVM_GET_XSAVE2, KVMIO, 0xcf, kvm_xsave);
// userfaultfd ioctls; the sizes are those of struct uffdio_api (3 u64), uffdio_register
// (4 u64), uffdio_range (2 u64), uffdio_copy (5 u64), uffdio_zeropage and uffdio_continue
// (4 u64) in linux/userfaultfd.h.
ioctl_iowr_nr!(UFFDIO_API, UFFDIO, 0x3f, [u64; 3]);
ioctl_iowr_nr!(UFFDIO_REGISTER, UFFDIO, 0x00, [u64; 4]);
ioctl_ior_nr!(UFFDIO_UNREGISTER, UFFDIO, 0x01, [u64; 2]);
ioctl_ior_nr!(UFFDIO_WAKE, UFFDIO, 0x02, [u64; 2]);
ioctl_iowr_nr!(UFFDIO_COPY, UFFDIO, 0x03, [u64; 5]);
ioctl_iowr_nr!(UFFDIO_ZEROPAGE, UFFDIO, 0x04, [u64; 4]);
ioctl_iowr_nr!(UFFDIO_CONTINUE, UFFDIO, 0x07, [u64; 4]);

// Block devices (linux/fs.h): discard and write-zeroes on a raw disk.
ioctl_io_nr!(BLKDISCARD, 0x12, 119);
ioctl_io_nr!(BLKZEROOUT, 0x12, 127);

// vhost-net (linux/vhost.h, type 0xAF). Sizes: struct vhost_memory's header (2 u32),
// vhost_vring_state (2 u32), vhost_vring_addr (2 u32 + 4 u64 = 40 bytes), vhost_vring_file
// (2 i32).
const VHOST_VIRTIO: u32 = 0xAF;
ioctl_ior_nr!(VHOST_GET_FEATURES, VHOST_VIRTIO, 0x00, u64);
ioctl_iow_nr!(VHOST_SET_FEATURES, VHOST_VIRTIO, 0x00, u64);
ioctl_io_nr!(VHOST_SET_OWNER, VHOST_VIRTIO, 0x01);
ioctl_iow_nr!(VHOST_SET_MEM_TABLE, VHOST_VIRTIO, 0x03, [u32; 2]);
ioctl_iow_nr!(VHOST_SET_VRING_NUM, VHOST_VIRTIO, 0x10, [u32; 2]);
ioctl_iow_nr!(VHOST_SET_VRING_ADDR, VHOST_VIRTIO, 0x11, [u64; 5]);
ioctl_iow_nr!(VHOST_SET_VRING_BASE, VHOST_VIRTIO, 0x12, [u32; 2]);
ioctl_iowr_nr!(VHOST_GET_VRING_BASE, VHOST_VIRTIO, 0x12, [u32; 2]);
ioctl_iow_nr!(VHOST_SET_VRING_KICK, VHOST_VIRTIO, 0x20, [i32; 2]);
ioctl_iow_nr!(VHOST_SET_VRING_CALL, VHOST_VIRTIO, 0x21, [i32; 2]);
ioctl_iow_nr!(VHOST_NET_SET_BACKEND, VHOST_VIRTIO, 0x30, [i32; 2]);

/// Pairs each listed constant with its name.
macro_rules! named {
    ($($name:ident),* $(,)?) => { &[$((stringify!($name), $name as u64)),*] };
}
/// Pairs each listed ioctl (a function giving its number) with its name.
macro_rules! named_ioctls {
    ($($name:ident),* $(,)?) => { [$((stringify!($name), $name() as u64)),*] };
}

fn ioctl_requests() -> Vec<(&'static str, u64)> {
    let kvm = named_ioctls![
        KVM_GET_API_VERSION,
        KVM_CREATE_VM,
        KVM_GET_MSR_INDEX_LIST,
        KVM_CHECK_EXTENSION,
        KVM_GET_VCPU_MMAP_SIZE,
        KVM_GET_SUPPORTED_CPUID,
        KVM_GET_MSR_FEATURE_INDEX_LIST,
        KVM_CREATE_VCPU,
        KVM_GET_DIRTY_LOG,
        KVM_SET_USER_MEMORY_REGION,
        KVM_SET_TSS_ADDR,
        KVM_SET_IDENTITY_MAP_ADDR,
        KVM_CREATE_IRQCHIP,
        KVM_IRQ_LINE,
        KVM_GET_IRQCHIP,
        KVM_SET_IRQCHIP,
        KVM_IRQ_LINE_STATUS,
        KVM_SET_GSI_ROUTING,
        KVM_IRQFD,
        KVM_CREATE_PIT2,
        KVM_IOEVENTFD,
        KVM_SET_CLOCK,
        KVM_GET_CLOCK,
        KVM_GET_PIT2,
        KVM_SET_PIT2,
        KVM_ENABLE_CAP,
        KVM_SIGNAL_MSI,
        KVM_CLEAR_DIRTY_LOG,
        KVM_RUN,
        KVM_GET_REGS,
        KVM_SET_REGS,
        KVM_GET_SREGS,
        KVM_SET_SREGS,
        KVM_INTERRUPT,
        KVM_GET_MSRS,
        KVM_SET_MSRS,
        KVM_GET_FPU,
        KVM_SET_FPU,
        KVM_GET_LAPIC,
        KVM_SET_LAPIC,
        KVM_SET_CPUID2,
        KVM_GET_CPUID2,
        KVM_GET_MP_STATE,
        KVM_SET_MP_STATE,
        KVM_NMI,
        KVM_GET_VCPU_EVENTS,
        KVM_SET_VCPU_EVENTS,
        KVM_GET_DEBUGREGS,
        KVM_SET_DEBUGREGS,
        KVM_SET_TSC_KHZ,
        KVM_GET_TSC_KHZ,
        KVM_GET_XSAVE,
        KVM_SET_XSAVE,
        KVM_GET_XCRS,
        KVM_SET_XCRS,
        KVM_KVMCLOCK_CTRL,
        KVM_GET_XSAVE2,
    ];
    let uffd = named_ioctls![
        UFFDIO_API,
        UFFDIO_REGISTER,
        UFFDIO_UNREGISTER,
        UFFDIO_WAKE,
        UFFDIO_COPY,
        UFFDIO_ZEROPAGE,
        UFFDIO_CONTINUE,
    ];
    let block = named_ioctls![BLKDISCARD, BLKZEROOUT];
    let vhost = named_ioctls![
        VHOST_GET_FEATURES,
        VHOST_SET_FEATURES,
        VHOST_SET_OWNER,
        VHOST_SET_MEM_TABLE,
        VHOST_SET_VRING_NUM,
        VHOST_SET_VRING_ADDR,
        VHOST_SET_VRING_BASE,
        VHOST_GET_VRING_BASE,
        VHOST_SET_VRING_KICK,
        VHOST_SET_VRING_CALL,
        VHOST_NET_SET_BACKEND,
    ];
    use libc::{FIOCLEX, FIONBIO, FIONCLEX, FIONREAD, TCGETS, TCSETS, TIOCGWINSZ};
    let tty: &[(&str, u64)] =
        named![TCGETS, TCSETS, TIOCGWINSZ, FIONBIO, FIONREAD, FIOCLEX, FIONCLEX];
    // The tap device's, for virtio-net's I/O threads.
    use libc::{TUNSETOFFLOAD, TUNSETQUEUE};
    let tap: &[(&str, u64)] = named![TUNSETOFFLOAD, TUNSETQUEUE];
    kvm.iter()
        .chain(uffd.iter())
        .chain(block.iter())
        .chain(vhost.iter())
        .chain(tty)
        .chain(tap)
        .copied()
        .collect()
}

use libc::{
    F_DUPFD, F_DUPFD_CLOEXEC, F_GETFD, F_GETFL, F_GETLK, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW,
    F_SETFD, F_SETFL, F_SETLK, F_SETLKW,
};
const FCNTL_COMMANDS: &[(&str, u64)] = named![
    F_DUPFD,
    F_DUPFD_CLOEXEC,
    F_GETFD,
    F_SETFD,
    F_GETFL,
    F_SETFL,
    F_GETLK,
    F_SETLK,
    F_SETLKW,
    F_OFD_GETLK,
    F_OFD_SETLK,
    F_OFD_SETLKW,
];

use libc::{
    MADV_DODUMP, MADV_DONTDUMP, MADV_DONTNEED, MADV_FREE, MADV_HUGEPAGE, MADV_NOHUGEPAGE,
    MADV_NORMAL, MADV_POPULATE_READ, MADV_POPULATE_WRITE, MADV_RANDOM, MADV_REMOVE,
    MADV_SEQUENTIAL, MADV_WILLNEED,
};
const MADVICE: &[(&str, u64)] = named![
    MADV_NORMAL,
    MADV_RANDOM,
    MADV_SEQUENTIAL,
    MADV_WILLNEED,
    MADV_DONTNEED,
    MADV_FREE,
    MADV_REMOVE,
    MADV_HUGEPAGE,
    MADV_NOHUGEPAGE,
    MADV_DONTDUMP,
    MADV_DODUMP,
    MADV_POPULATE_READ,
    MADV_POPULATE_WRITE,
];

use libc::{
    PR_CAPBSET_READ, PR_GET_NAME, PR_GET_NO_NEW_PRIVS, PR_GET_SECCOMP, PR_SET_NAME,
    PR_SET_NO_NEW_PRIVS,
};
const PRCTL_OPTIONS: &[(&str, u64)] = named![
    PR_SET_NAME,
    PR_GET_NAME,
    PR_SET_NO_NEW_PRIVS,
    PR_GET_NO_NEW_PRIVS,
    PR_GET_SECCOMP,
    PR_CAPBSET_READ,
];

use libc::{AF_INET, AF_INET6, AF_UNIX};
const SOCKET_FAMILIES: &[(&str, u64)] = named![AF_UNIX, AF_INET, AF_INET6];

/// A system call whose profile lines may name one value of one argument.
pub(crate) struct KeyedArgument {
    /// The argument's index (0 is the first).
    pub index: u8,
    /// The argument is a 32-bit int in the kernel's prototype (compared on its low half).
    pub dword: bool,
    pub values: Vec<(&'static str, u64)>,
}

impl KeyedArgument {
    pub fn value(&self, name: &str) -> Option<u64> {
        self.values
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, v)| v)
    }
}

/// The argument of `syscall` that a profile line may restrict, if any.
pub(crate) fn keyed_argument(syscall: &str) -> Option<KeyedArgument> {
    let (index, values) = match syscall {
        "ioctl" => (1, ioctl_requests()),
        "fcntl" => (1, FCNTL_COMMANDS.to_vec()),
        "madvise" => (2, MADVICE.to_vec()),
        "prctl" => (0, PRCTL_OPTIONS.to_vec()),
        "socket" => (0, SOCKET_FAMILIES.to_vec()),
        _ => return None,
    };
    Some(KeyedArgument {
        index,
        dword: true,
        values,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        let ioctl = keyed_argument("ioctl").unwrap();
        // Values from linux/kvm.h and linux/userfaultfd.h as strace and the kernel print them.
        assert_eq!(ioctl.value("KVM_RUN"), Some(0xae80));
        assert_eq!(ioctl.value("KVM_GET_REGS"), Some(0x8090_ae81));
        assert_eq!(ioctl.value("KVM_SET_USER_MEMORY_REGION"), Some(0x4020_ae46));
        assert_eq!(ioctl.value("KVM_INTERRUPT"), Some(0x4004_ae86));
        assert_eq!(ioctl.value("KVM_CLEAR_DIRTY_LOG"), Some(0xc018_aec0));
        assert_eq!(ioctl.value("UFFDIO_COPY"), Some(0xc028_aa03));
        assert_eq!(ioctl.value("UFFDIO_API"), Some(0xc018_aa3f));
        assert_eq!(ioctl.value("TCGETS"), Some(0x5401));
        assert_eq!(ioctl.value("BLKZEROOUT"), Some(0x127f));
        assert_eq!(ioctl.value("KVM_NOT_AN_IOCTL"), None);
        // linux/vhost.h, as the rust-vmm vhost crate's bindings compute them.
        assert_eq!(ioctl.value("VHOST_GET_FEATURES"), Some(0x8008_af00));
        assert_eq!(ioctl.value("VHOST_SET_OWNER"), Some(0xaf01));
        assert_eq!(ioctl.value("VHOST_SET_MEM_TABLE"), Some(0x4008_af03));
        assert_eq!(ioctl.value("VHOST_SET_VRING_ADDR"), Some(0x4028_af11));
        assert_eq!(ioctl.value("VHOST_GET_VRING_BASE"), Some(0xc008_af12));
        assert_eq!(ioctl.value("VHOST_SET_VRING_CALL"), Some(0x4008_af21));
        assert_eq!(ioctl.value("VHOST_NET_SET_BACKEND"), Some(0x4008_af30));
    }

    #[test]
    fn names_are_unique_within_each_table() {
        for syscall in ["ioctl", "fcntl", "madvise", "prctl", "socket"] {
            let mut names: Vec<_> = keyed_argument(syscall).unwrap().values;
            names.sort();
            let before = names.len();
            names.dedup_by(|a, b| a.0 == b.0);
            assert_eq!(names.len(), before, "{syscall}");
        }
    }
}
