//! `run --restore FILE`: guest memory from a snapshot file.
//!
//! - Format version 2 (page images, written by `ctl snapshot`): by default the images are
//!   mapped over guest RAM (`MAP_PRIVATE`), so the guest runs again as soon as the frames are
//!   checked and pages come in from the file when the guest first touches them; a background
//!   thread meanwhile checks every page against the CRC table and stops the VM (exit status 2,
//!   one line naming the page) if one is corrupt. `--restore-verify` does that check before
//!   the guest runs instead; `--restore-eager` (and `--wired`, and hosts where guest RAM cannot
//!   be a file mapping: bhyve) copies every page into anonymous guest RAM first, checking each.
//! - Format version 1 (a stream, written by earlier builds): loaded eagerly, as before.
//!
//! While a lazily restored guest runs, the snapshot file must not be modified or truncated
//! (deleting or renaming it is fine, and `ctl snapshot` to the same path replaces it by a
//! rename, never in place). Guest writes never reach it (`MAP_PRIVATE`).

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use devices::exit::{ExitReason, ExitRequest};
use migration::{Bitmap, MigrationConfig, SnapshotImage};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::memory::{self, GuestMemory};

/// How `--restore` brings guest memory back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreOptions {
    /// `--restore-verify`: check all page data before the guest runs.
    pub verify_first: bool,
    /// `--restore-eager` (or `--wired`): copy every page into anonymous guest RAM before the
    /// guest runs; the guest then no longer depends on the file.
    pub eager: bool,
}

/// Guest memory restored from a snapshot file.
pub struct LoadedMemory {
    /// The device/vCPU state blob.
    pub state: Vec<u8>,
    /// Set when guest RAM is mapped from the file (a lazy restore).
    pub mapped: Option<Arc<MappedSnapshot>>,
    /// How it was done and how long it took, for the log.
    pub figures: Value,
}

enum Check {
    Running,
    Passed,
    Failed(String),
    Stopped,
}

/// Guest RAM mapped from a snapshot file: the pages that hold the file's data (a later
/// snapshot or migration must send them, touched or not), and the verification of that data.
pub struct MappedSnapshot {
    path: PathBuf,
    data_pages: Bitmap,
    check: Mutex<Check>,
    done: Condvar,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl MappedSnapshot {
    /// The pages of guest RAM that hold the snapshot file's data.
    pub fn data_pages(&self) -> &Bitmap {
        &self.data_pages
    }

    /// Waits until the page data has been verified. Fails if it proved corrupt, or if the
    /// verification was stopped: a snapshot or migration of the guest would otherwise carry
    /// unchecked data on with fresh checksums.
    pub fn wait_verified(&self) -> Result<()> {
        let mut check = lock(&self.check);
        if matches!(*check, Check::Running) {
            log::info!(
                "waiting for the verification of {} to finish",
                self.path.display()
            );
        }
        while matches!(*check, Check::Running) {
            check = self.done.wait(check).unwrap_or_else(|e| e.into_inner());
        }
        match &*check {
            Check::Passed => Ok(()),
            Check::Failed(reason) => Err(self.error(reason.clone())),
            Check::Running | Check::Stopped => {
                Err(self.error("the verification of its page data did not finish".into()))
            }
        }
    }

    /// The error that stopped the guest, if the page data proved corrupt.
    pub fn failure(&self) -> Option<Error> {
        match &*lock(&self.check) {
            Check::Failed(reason) => Some(self.error(reason.clone())),
            _ => None,
        }
    }

    /// Stops the background verification (the VM is ending) and waits for its thread.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }

    fn error(&self, reason: String) -> Error {
        Error::File {
            path: self.path.clone(),
            reason,
        }
    }

    fn finish(&self, check: Check) {
        *lock(&self.check) = check;
        self.done.notify_all();
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// Restores guest memory from the snapshot at `path` (see the module documentation).
/// `memory` must be the machine's fresh guest RAM, already registered with the VM, with no
/// vCPU running. `exit` ends the VM if the background verification finds corrupt data.
pub fn load(
    path: &Path,
    memory: &GuestMemory,
    expected: &MigrationConfig,
    options: RestoreOptions,
    exit: &Arc<ExitRequest>,
) -> Result<LoadedMemory> {
    let t0 = Instant::now();
    let bad = |e: migration::Error| Error::File {
        path: path.to_path_buf(),
        reason: format!("bad snapshot: {e}"),
    };
    let file = File::open(path).map_err(|e| Error::File {
        path: path.to_path_buf(),
        reason: format!("cannot open snapshot: {e}"),
    })?;
    if migration::snapshot_version(&file).map_err(bad)? == 1 {
        // An earlier build's snapshot: a stream, read and checked page by page.
        let restored =
            migration::restore_from(memory, BufReader::with_capacity(1 << 20, file), expected)
                .map_err(bad)?;
        return Ok(LoadedMemory {
            state: restored.state,
            mapped: None,
            figures: json!({"format": 1, "memory": "eager", "load_ms": ms(t0)}),
        });
    }
    let image = SnapshotImage::open(file, expected).map_err(bad)?;
    let open_ms = ms(t0);
    if options.verify_first {
        let t = Instant::now();
        image.verify(&AtomicBool::new(false)).map_err(bad)?;
        log::info!("snapshot page data verified in {:.1} ms", ms(t));
    }
    if options.eager || !memory::can_map_files() {
        let report = image.load(memory).map_err(bad)?;
        return Ok(LoadedMemory {
            state: image.state().to_vec(),
            mapped: None,
            figures: json!({
                "format": 2, "memory": "eager", "pages": report.pages,
                "open_ms": open_ms, "load_ms": ms(t0),
            }),
        });
    }
    image.map_into(memory).map_err(bad)?;
    let mapped = Arc::new(MappedSnapshot {
        path: path.to_path_buf(),
        data_pages: image.data_pages(),
        check: Mutex::new(if options.verify_first {
            Check::Passed
        } else {
            Check::Running
        }),
        done: Condvar::new(),
        stop: AtomicBool::new(false),
        thread: Mutex::new(None),
    });
    let state = image.state().to_vec();
    let figures = json!({
        "format": 2, "memory": "lazy", "pages_in_file": image.data_page_count(),
        "verified_first": options.verify_first, "open_ms": open_ms, "load_ms": ms(t0),
    });
    if !options.verify_first {
        let (m, exit) = (mapped.clone(), exit.clone());
        let thread = sandbox::spawn(sandbox::Role::RestoreVerify, "snapshot-verify", move || {
            verify_in_background(&image, &m, &exit)
        })
        .map_err(|e| Error::Control(format!("cannot start the snapshot verifier: {e}")))?;
        *lock(&mapped.thread) = Some(thread);
    }
    Ok(LoadedMemory {
        state,
        mapped: Some(mapped),
        figures,
    })
}

/// Checks every page of the image while the guest runs; stops the VM if one is corrupt.
fn verify_in_background(image: &SnapshotImage, m: &MappedSnapshot, exit: &ExitRequest) {
    match image.verify(&m.stop) {
        Ok(r) if r.complete => {
            log::info!(
                "snapshot {}: page data verified ({} pages, {:.1} ms)",
                m.path.display(),
                r.pages_checked,
                r.duration.as_secs_f64() * 1000.0
            );
            m.finish(Check::Passed);
        }
        Ok(_) => m.finish(Check::Stopped),
        Err(e) => {
            log::debug!("snapshot verification failed: {e}");
            // Recorded before the exit request, so the main loop finds the cause.
            *lock(&m.check) =
                Check::Failed(format!("bad snapshot: {e}; the restored guest was stopped"));
            exit.request(ExitReason::Failed);
            m.done.notify_all();
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

    const MIB: u64 = 1 << 20;

    fn guest() -> (GuestMemory, MigrationConfig) {
        let mem = memory::create_guest_memory(16 * MIB, false).unwrap();
        let ram_regions = mem
            .iter()
            .map(|r| migration::RamRange {
                guest_addr: r.start_addr().0,
                size: r.len(),
            })
            .collect();
        let cfg = MigrationConfig {
            memory_size: 16 * MIB,
            vcpus: 1,
            irqchip: "kernel".into(),
            ram_regions,
            extra: Default::default(),
        };
        (mem, cfg)
    }

    fn fill(mem: &GuestMemory) {
        for (i, a) in [0u64, 0x5000, 0x20_0000, 15 * MIB].into_iter().enumerate() {
            mem.write_slice(&[i as u8 + 1; 4096], GuestAddress(a))
                .unwrap();
        }
    }

    fn same(a: &GuestMemory, b: &GuestMemory) -> bool {
        let mut x = vec![0u8; 16 * MIB as usize];
        let mut y = x.clone();
        a.read_slice(&mut x, GuestAddress(0)).unwrap();
        b.read_slice(&mut y, GuestAddress(0)).unwrap();
        x == y
    }

    fn scratch(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("ferrovm-restore-{}-{name}", std::process::id()))
    }

    fn write_v2(name: &str) -> (PathBuf, GuestMemory, MigrationConfig) {
        let (src, cfg) = guest();
        fill(&src);
        let path = scratch(name);
        let file = File::create(&path).unwrap();
        migration::snapshot_file(&src, &cfg, b"state", &file).unwrap();
        (path, src, cfg)
    }

    fn exit() -> Arc<ExitRequest> {
        Arc::new(ExitRequest::new().unwrap())
    }

    #[test]
    fn version_1_snapshots_load_eagerly() {
        let (src, cfg) = guest();
        fill(&src);
        let path = scratch("v1");
        migration::snapshot(&src, &cfg, b"state", File::create(&path).unwrap()).unwrap();
        let (dst, _) = guest();
        let loaded = load(&path, &dst, &cfg, RestoreOptions::default(), &exit()).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(loaded.mapped.is_none());
        assert_eq!(loaded.state, b"state");
        assert_eq!(loaded.figures["format"], 1);
        assert!(same(&src, &dst));
    }

    #[test]
    fn version_2_maps_lazily_then_verifies() {
        let (path, src, cfg) = write_v2("lazy");
        let (dst, _) = guest();
        let exit = exit();
        let loaded = load(&path, &dst, &cfg, RestoreOptions::default(), &exit).unwrap();
        let mapped = loaded.mapped.expect("mapped lazily");
        assert_eq!(loaded.figures["memory"], "lazy");
        assert_eq!(mapped.data_pages().count(), 4);
        mapped.wait_verified().unwrap();
        assert!(mapped.failure().is_none());
        assert!(same(&src, &dst));
        // The file can go: the mapping holds it.
        std::fs::remove_file(&path).unwrap();
        assert!(same(&src, &dst));
        mapped.stop();
        assert_eq!(exit.reason(), None);
    }

    #[test]
    fn eager_and_verified_restores() {
        let (path, src, cfg) = write_v2("eager");
        let (dst, _) = guest();
        let eager = RestoreOptions {
            eager: true,
            ..Default::default()
        };
        let loaded = load(&path, &dst, &cfg, eager, &exit()).unwrap();
        assert!(loaded.mapped.is_none());
        assert!(same(&src, &dst));
        let (dst, _) = guest();
        let verify = RestoreOptions {
            verify_first: true,
            ..Default::default()
        };
        let loaded = load(&path, &dst, &cfg, verify, &exit()).unwrap();
        std::fs::remove_file(&path).unwrap();
        // Checked already: no thread, nothing to wait for.
        loaded.mapped.unwrap().wait_verified().unwrap();
        assert!(same(&src, &dst));
    }

    #[test]
    fn a_corrupt_page_stops_the_guest() {
        let (path, _, cfg) = write_v2("corrupt");
        let image = SnapshotImage::open(File::open(&path).unwrap(), &cfg).unwrap();
        let at = image.images()[0].offset + 0x20_0000 + 9;
        let f = File::options().write(true).open(&path).unwrap();
        f.write_all_at(&[0xee], at).unwrap();

        let (dst, _) = guest();
        let exit = exit();
        let loaded = load(&path, &dst, &cfg, RestoreOptions::default(), &exit).unwrap();
        let mapped = loaded.mapped.unwrap();
        let e = mapped.wait_verified().unwrap_err().to_string();
        assert!(
            e.contains("guest page 0x200000") && e.contains("the restored guest was stopped"),
            "{e}"
        );
        assert_eq!(
            exit.wait_timeout(std::time::Duration::from_secs(10)),
            Some(ExitReason::Failed)
        );
        assert!(mapped.failure().is_some());

        for options in [
            RestoreOptions {
                verify_first: true,
                eager: false,
            },
            RestoreOptions {
                verify_first: false,
                eager: true,
            },
        ] {
            let (dst, _) = guest();
            let e = load(&path, &dst, &cfg, options, &exit).err().unwrap();
            assert!(e.to_string().contains("fails its checksum"), "{e}");
        }
        std::fs::remove_file(&path).unwrap();
    }
}
