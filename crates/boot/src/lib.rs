//! Guest boot support for ferrovm: the x86-64 guest memory layout and e820 map, the boot
//! GDT, kernel loaders for Linux bzImage (32-bit boot protocol), PVH ELF and Multiboot v1, and
//! the firmware tables a guest finds in the BIOS area (ACPI in [`acpi`], Intel MP in [`mptable`]).
//!
//! Parsing and boot structures come from the rust-vmm crates (linux-loader for the ELF64 and
//! bzImage loaders, `boot_params`, `hvm_start_info` and the command line; vm-memory for guest
//! memory); this crate adds what they lack (ELF32, Multiboot v1, validation of every offset
//! and length against the file and the RAM layout) and is independent of the hypervisor.

pub mod acpi;
pub mod cpuid;
mod elf;
pub mod gdt;
pub mod layout;
pub mod loader;
pub mod mptable;
pub mod multiboot;

#[cfg(test)]
mod loader_props;
#[cfg(test)]
mod testutil;

// The property tests measure the largest allocation a loader makes.
#[cfg(test)]
#[global_allocator]
static ALLOC: testkit::PeakAlloc = testkit::PeakAlloc;

pub use gdt::{segment_from_gdt_entry, SegmentDescriptor};
pub use layout::{e820_map, ram_regions, E820Entry, E820Kind};
pub use loader::{
    load_kernel, load_kernel_with_config, BootConfig, BootEntry, BootProtocol, LoadError, ReadSeek,
};
