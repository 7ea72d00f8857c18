//! The C guest kit seen from Rust: console, command line, DMA pool, exit, and the
//! `virtio_drivers::Hal` over the kit's identity map.

use core::ffi::{c_char, CStr};
use core::fmt;
use core::ptr::NonNull;

use virtio_drivers::{BufferDirection, Hal, PhysAddr, PAGE_SIZE};

extern "C" {
    fn serial_write(s: *const u8, n: usize);
    fn dma_alloc(size: usize, align: usize) -> *mut u8;
    #[link_name = "cmdline_uint"]
    fn c_cmdline_uint(key: *const c_char, dflt: u64) -> u64;
    #[link_name = "cmdline_arg"]
    fn c_cmdline_arg(key: *const c_char, len: *mut usize) -> *const c_char;
    #[link_name = "exit_vm"]
    fn c_exit_vm(code: u8) -> !;
}

/// The kit's serial console (16550 at 0x3f8; ports are open at CPL 3).
pub struct Console;

impl fmt::Write for Console {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // SAFETY: the kit reads `n` bytes from `s`, which is valid for them.
        unsafe { serial_write(s.as_ptr(), s.len()) };
        Ok(())
    }
}

/// Prints one line on the kit's console.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        let _ = core::fmt::Write::write_fmt(&mut $crate::kit::Console, format_args!($($arg)*));
        let _ = core::fmt::Write::write_str(&mut $crate::kit::Console, "\n");
    }};
}

/// `key=N` from the kernel command line (decimal or 0x hex), or `dflt`.
pub fn cmdline_uint(key: &CStr, dflt: u64) -> u64 {
    // SAFETY: `key` is NUL-terminated; the kit only reads it.
    unsafe { c_cmdline_uint(key.as_ptr(), dflt) }
}

/// The value of `key=VALUE` on the command line, if present.
pub fn cmdline_arg(key: &CStr) -> Option<&'static [u8]> {
    let mut len = 0usize;
    // SAFETY: `key` is NUL-terminated and `len` a valid place for the length.
    let p = unsafe { c_cmdline_arg(key.as_ptr(), &mut len) };
    // SAFETY: the kit returns a pointer into the boot command line, which stays in place
    // for the whole run, with `len` bytes of value.
    (!p.is_null()).then(|| unsafe { core::slice::from_raw_parts(p.cast::<u8>(), len) })
}

/// Writes `code` to the debug-exit port; the VMM ends the run.
pub fn exit_vm(code: u8) -> ! {
    // SAFETY: a port write that never returns.
    unsafe { c_exit_vm(code) }
}

pub fn rdtsc() -> u64 {
    // SAFETY: RDTSC has no side effects (CR4.TSD is clear in the kit).
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// A zeroed buffer from the kit's DMA pool, for the whole run.
pub fn dma_buffer(bytes: usize) -> &'static mut [u8] {
    // SAFETY: the kit returns `bytes` zeroed bytes of RAM (or fails the guest) that no one
    // else uses and that are never freed.
    unsafe { core::slice::from_raw_parts_mut(dma_alloc(bytes, PAGE_SIZE), bytes) }
}

/// `Hal` over the kit: identity-mapped memory, pages from the bump pool.
pub struct KitHal;

// SAFETY: pages from `dma_alloc` are zeroed, page-aligned, unused by anyone else and
// never freed, and physical == virtual everywhere below 4 GiB, so the addresses handed
// out are valid for the device and the driver for as long as the crate needs them.
unsafe impl Hal for KitHal {
    fn dma_alloc(pages: usize, _direction: BufferDirection) -> (PhysAddr, NonNull<u8>) {
        // SAFETY: see the impl's comment.
        let p = unsafe { dma_alloc(pages * PAGE_SIZE, PAGE_SIZE) };
        (
            p as PhysAddr,
            NonNull::new(p).expect("the kit's dma_alloc returned NULL"),
        )
    }

    unsafe fn dma_dealloc(_paddr: PhysAddr, _vaddr: NonNull<u8>, _pages: usize) -> i32 {
        0 // a bump pool: nothing to give back
    }

    unsafe fn mmio_phys_to_virt(paddr: PhysAddr, _size: usize) -> NonNull<u8> {
        NonNull::new(paddr as *mut u8).expect("MMIO at physical address 0")
    }

    unsafe fn share(buffer: NonNull<[u8]>, _direction: BufferDirection) -> PhysAddr {
        buffer.as_ptr().cast::<u8>() as PhysAddr
    }

    unsafe fn unshare(_paddr: PhysAddr, _buffer: NonNull<[u8]>, _direction: BufferDirection) {}
}

/// Forwards the crate's warnings and errors to the console.
struct KitLogger;

impl log::Log for KitLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            crate::outln!("virtio-drivers: {}: {}", record.level(), record.args());
        }
    }

    fn flush(&self) {}
}

static LOGGER: KitLogger = KitLogger;

pub fn install_logger() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Warn);
    }
}

/// The heap of the `alloc` crate (the vsock driver's connection lists and buffers): chunks
/// of the kit's pool, handed out in order and never given back (a test guest's lifetime).
struct KitHeap;

// SAFETY: every block comes from `dma_alloc`, which returns fresh, unshared, suitably
// aligned memory (or fails the guest); nothing is ever handed out twice.
unsafe impl core::alloc::GlobalAlloc for KitHeap {
    unsafe fn alloc(&self, layout: core::alloc::Layout) -> *mut u8 {
        // SAFETY: the kit's allocator takes any size and a power-of-two alignment.
        unsafe { dma_alloc(layout.size().max(1), layout.align().max(16)) }
    }

    unsafe fn dealloc(&self, _ptr: *mut u8, _layout: core::alloc::Layout) {}
}

#[global_allocator]
static HEAP: KitHeap = KitHeap;
