#![allow(dead_code)]

use migration::{GuestRam, MigrationConfig, RamRange};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

pub const R0: u64 = 2 << 20;
pub const R1_BASE: u64 = 4 << 20;
pub const R1: u64 = 1 << 20;

/// 3 MiB of RAM in two regions with a hole: [0, 2 MiB) and [4 MiB, 5 MiB).
pub fn ram() -> GuestMemoryMmap<()> {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[
        (GuestAddress(0), R0 as usize),
        (GuestAddress(R1_BASE), R1 as usize),
    ])
    .unwrap();
    for r in mem.regions() {
        // SAFETY: the region is a mapping `mem` owns; this only disables transparent huge pages
        // so one touch populates exactly one 4 KiB page.
        unsafe { libc::madvise(r.host_ptr.cast(), r.size as usize, libc::MADV_NOHUGEPAGE) };
    }
    mem
}

pub fn config_of(mem: &GuestMemoryMmap<()>) -> MigrationConfig {
    let ram_regions: Vec<RamRange> = mem
        .regions()
        .iter()
        .map(|r| RamRange {
            guest_addr: r.guest_addr,
            size: r.size,
        })
        .collect();
    MigrationConfig {
        memory_size: ram_regions.iter().map(|r| r.size).sum(),
        vcpus: 2,
        irqchip: "kernel".into(),
        ram_regions,
        extra: Default::default(),
        devices: None,
    }
}

/// Deterministic pseudo-random bytes.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 11
    }

    pub fn page(&mut self) -> Vec<u8> {
        (0..4096 / 8)
            .flat_map(|_| self.next().to_le_bytes())
            .collect()
    }
}

/// Writes a pseudo-random page at `addr`.
pub fn fill_page(mem: &GuestMemoryMmap<()>, addr: u64, rng: &mut Lcg) {
    mem.write_slice(&rng.page(), GuestAddress(addr)).unwrap();
}

/// All guest RAM as bytes (for comparisons).
pub fn dump(mem: &GuestMemoryMmap<()>) -> Vec<u8> {
    let mut out = Vec::new();
    for r in mem.regions() {
        let mut v = vec![0u8; r.size as usize];
        mem.read_slice(&mut v, GuestAddress(r.guest_addr)).unwrap();
        out.extend_from_slice(&v);
    }
    out
}

/// Addresses of pages that differ.
pub fn diff(a: &GuestMemoryMmap<()>, b: &GuestMemoryMmap<()>) -> Vec<u64> {
    let (x, y) = (dump(a), dump(b));
    let regions = a.regions();
    let mut bad = Vec::new();
    let mut off = 0usize;
    for r in regions {
        for p in 0..(r.size / 4096) as usize {
            let s = off + p * 4096;
            if x[s..s + 4096] != y[s..s + 4096] {
                bad.push(r.guest_addr + p as u64 * 4096);
            }
        }
        off += r.size as usize;
    }
    bad
}
