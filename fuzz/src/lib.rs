//! The fuzz targets' harnesses: one function per target, taking the fuzzer's bytes. The
//! binaries in `src/bin/` wrap them in `afl::fuzz!`; the test below replays the corpus
//! through them with plain `cargo test --lib`.

use std::io::Cursor;
use std::sync::OnceLock;

use boot::{load_kernel, BootProtocol, ReadSeek};
use vm_memory::{GuestAddress, GuestMemoryMmap};

/// The migration crate's harness (seeds and checks), shared with its property tests.
#[path = "../../crates/migration/tests/support/harness.rs"]
pub mod migration_harness;

/// The devices crate's state harness, shared with its property tests.
#[path = "../../crates/devices/tests/support/state_harness.rs"]
pub mod device_state_harness;

/// The virtio crate's harnesses (hostile descriptor chains on a running device, accesses to
/// the PCI transport), shared with its property tests.
#[path = "../../crates/virtio/tests/support/mod.rs"]
pub mod virtio_harness;

/// Guest RAM of the boot target.
pub const BOOT_MEM: u64 = 32 << 20;
/// Largest single allocation any target may make (the fuzzer's inputs stay below 1 MiB;
/// a migration frame may be buffered whole, 8 MiB).
pub const ALLOC_CAP: usize = 12 << 20;

fn boot_mem() -> &'static GuestMemoryMmap {
    static MEM: OnceLock<GuestMemoryMmap> = OnceLock::new();
    MEM.get_or_init(|| {
        let ranges: Vec<(GuestAddress, usize)> = boot::ram_regions(BOOT_MEM)
            .into_iter()
            .map(|(a, s)| (a, s as usize))
            .collect();
        GuestMemoryMmap::from_ranges(&ranges).expect("mapping the boot target's RAM")
    })
}

/// Loads `data` as a kernel (with a small initrd when byte 0 is odd) into 32 MiB of RAM;
/// an accepted kernel must lie in RAM above 1 MiB with its entry inside it.
pub fn boot_loader(data: &[u8]) {
    let mem = boot_mem();
    let mut kernel = Cursor::new(data);
    let mut initrd = Cursor::new(vec![0x5au8; 0x1234]);
    let with_initrd = data.first().is_some_and(|b| b & 1 == 1);
    let initrd = with_initrd.then_some(&mut initrd as &mut dyn ReadSeek);
    let Ok(be) = load_kernel(mem, &mut kernel, "console=ttyS0", initrd, BOOT_MEM) else {
        return;
    };
    assert!(be.kernel_start >= 1 << 20 && be.kernel_start < be.kernel_end);
    assert!(be.kernel_end <= BOOT_MEM, "{be:x?}");
    assert!(be.entry_point >= be.kernel_start && be.entry_point < be.kernel_end);
    if let Some((addr, size)) = be.initrd {
        assert!(with_initrd && addr >= be.kernel_end && addr + size <= BOOT_MEM);
    }
    if be.protocol == BootProtocol::Linux {
        assert_eq!(be.esi, 0x7000);
    }
}

/// A migration stream, a frame sequence or a reply channel (byte 0 picks, see
/// [`migration_harness::fuzz_one`]).
pub fn migration_stream(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    // Mode 2 is the snapshot file, its own target.
    let mode = if mode & 3 == 2 { mode & !3 } else { mode };
    let mut input = vec![mode];
    input.extend_from_slice(rest);
    migration_harness::fuzz_one(&input);
}

/// A snapshot file (version 2): byte 0 bit 7 fixes the CRCs first, the rest is the file.
pub fn snapshot_file(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut input = vec![(mode & 0x80) | 2];
    input.extend_from_slice(rest);
    migration_harness::fuzz_one(&input);
}

/// A device state (JSON) restored into a fresh device, then guest port accesses: byte 0 picks
/// the device, byte 1 the number of 4-byte accesses that follow, the rest is the JSON (see
/// [`device_state_harness::fuzz_one`]).
pub fn device_state(data: &[u8]) {
    device_state_harness::fuzz_one(data);
}

/// One control API request (`METHOD PATH`, a line feed, the body): an accepted one was
/// decoded from an endpoint whose path it names.
pub fn api_request(data: &[u8]) {
    let Ok(request) = vmm::api::request::parse_wire(data) else {
        return;
    };
    let split = data.iter().position(|&b| b == b'\n').unwrap_or(data.len());
    let head = std::str::from_utf8(&data[..split]).expect("accepted, so UTF-8");
    let path = head.split_once(' ').expect("accepted, so METHOD PATH").1;
    let path = path.split('?').next().unwrap_or(path);
    let endpoint = vmm::api::request::endpoint_of(&request);
    assert!(
        vmm::api::request::matches_path(endpoint, path),
        "{path} gave {endpoint}"
    );
}

/// Descriptor tables, indirect tables, RAM contents and batches of available-ring entries
/// published to a running virtio-blk device on a temporary image (tmpfs when there is one),
/// one notification a batch (see [`virtio_harness::chain_input`] for the byte form; its
/// device field is ignored: always virtio-blk). The harness checks the used entries and
/// every byte of guest RAM the device wrote, then that a reset device serves requests.
pub fn virtio_blk_chains(data: &[u8]) {
    let mut scenario = virtio_harness::chain_input::decode(data);
    scenario.target = virtio_harness::chains::Target::Block;
    virtio_harness::chains::run(&scenario);
}

/// Configuration-space and BAR accesses and driver steps on the PCI transport of a virtio-blk
/// device (see [`virtio_harness::pci_input`] for the byte form); the harness checks the
/// transport's invariants after each, then a reset and a bring-up.
pub fn virtio_pci_access(data: &[u8]) {
    virtio_harness::pci_access::run(&virtio_harness::pci_input::decode(data));
}

/// A whole qcow2 file: the header checks, imago's metadata walk, reads, a write and a flush
/// (see [`virtio_harness::qcow2_image`]); errors are fine, panics and hangs are not.
pub fn qcow2_image(data: &[u8]) {
    virtio_harness::qcow2_image::run(data);
}

/// A target's harness.
pub type Harness = fn(&[u8]);

/// Every target by name: (corpus directory, harness).
pub const TARGETS: [(&str, Harness); 8] = [
    ("boot_loader", boot_loader),
    ("migration_stream", migration_stream),
    ("snapshot_file", snapshot_file),
    ("device_state", device_state),
    ("api_request", api_request),
    ("virtio_blk_chains", virtio_blk_chains),
    ("virtio_pci_access", virtio_pci_access),
    ("qcow2_image", qcow2_image),
];

/// `cargo test --lib` here replays every input of `corpus/<target>/` and of
/// `crashes/<target>/` (inputs that once failed, kept as regression cases) through its
/// target's harness, without AFL++ (the binaries link only under `cargo afl`).
#[cfg(test)]
mod tests {
    use std::path::Path;

    #[test]
    fn corpus_replays_cleanly() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut total = 0;
        for (name, harness) in super::TARGETS {
            for dir in ["corpus", "crashes"] {
                let Ok(entries) = std::fs::read_dir(root.join(dir).join(name)) else {
                    continue;
                };
                for entry in entries {
                    let path = entry.unwrap().path();
                    harness(&std::fs::read(&path).unwrap());
                    total += 1;
                }
            }
        }
        assert!(total > 0, "no corpus under {}", root.display());
        println!("replayed {total} inputs");
    }
}
