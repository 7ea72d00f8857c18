//! The interrupt controllers as one object, through real guests in both modes: a guest
//! whose timer interrupts keep it going is snapshotted, the snapshot holds the controllers
//! as the one `irqchip` device in the one versioned format (its mode inside), and the
//! restored guest goes on taking interrupts. (tests/interrupts.rs runs the interrupt
//! guests themselves in both modes.)

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

const MODES: [&str; 2] = ["kernel", "split"];

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrovm-irqchip-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A running VMM with an API socket, its output collected.
struct Vm {
    child: Child,
    socket: PathBuf,
    stdout: Arc<Mutex<String>>,
}

impl Vm {
    fn start(args: &[&str], socket: &Path) -> Vm {
        require_kvm();
        let mut child = Command::new(FERROVM)
            .arg("run")
            .args(args)
            .args(["--api-socket", socket.to_str().unwrap()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn ferrovm");
        let stdout = Arc::new(Mutex::new(String::new()));
        let (mut pipe, sink) = (child.stdout.take().unwrap(), stdout.clone());
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&chunk[..n]));
            }
        });
        Vm {
            child,
            socket: socket.to_path_buf(),
            stdout,
        }
    }

    fn wait_for(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.stdout.lock().unwrap().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "the guest never printed {needle:?}:\n{}",
                self.stdout.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn ctl(&self, args: &[&str]) {
        let mut all = vec!["ctl", "--api-socket", self.socket.to_str().unwrap()];
        all.extend_from_slice(args);
        ferrovm(&all, Duration::from_secs(60)).expect_status(0);
    }

    fn shut_down(mut self) {
        self.ctl(&["shutdown"]);
        let status = self.child.wait().unwrap();
        assert_eq!(status.code(), Some(0));
    }
}

/// A test that fails leaves no VMM behind.
impl Drop for Vm {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The machine state in a snapshot file (a JSON object near its start, before the RAM
/// images).
fn saved_state(snapshot: &Path) -> serde_json::Value {
    let mut head = Vec::new();
    let file = std::fs::File::open(snapshot).unwrap();
    file.take(1 << 20).read_to_end(&mut head).unwrap();
    let key = br#"{"format":"#;
    let at = head
        .windows(key.len())
        .position(|w| w == key)
        .expect("the snapshot holds the machine state");
    let mut values =
        serde_json::Deserializer::from_slice(&head[at..]).into_iter::<serde_json::Value>();
    values.next().unwrap().expect("the machine state is JSON")
}

#[test]
fn both_modes_save_one_irqchip_state_and_restore_it() {
    let kernel = guest("migrate-idle");
    for mode in MODES {
        let dir = scratch(mode);
        let socket = dir.join("api.sock");
        let shape = ["--irqchip", mode, "--memory", "64M"];
        let mut args = vec![kernel.to_str().unwrap(), "--cmdline", "mib=8 ticks=100"];
        args.insert(0, "--kernel");
        args.extend_from_slice(&shape);
        let source = Vm::start(&args, &socket);
        source.wait_for("tick 2 ok");
        let snap = dir.join("vm.snap");
        source.ctl(&["snapshot", snap.to_str().unwrap()]);
        source.shut_down();

        let machine = saved_state(&snap);
        assert_eq!(machine["format"], 4);
        assert!(machine.get("kernel_irqchip").is_none(), "written no more");
        let devices = machine["devices"].as_object().unwrap();
        assert!(!devices.contains_key("split_irqchip"), "written no more");
        let state = &devices["irqchip"];
        assert_eq!(state["version"], 1, "{state}");
        assert_eq!(state["data"]["mode"], mode, "{state}");
        let chips = &state["data"]["chips"];
        match mode {
            "kernel" => assert_eq!(chips["backend"], "kvm", "{state}"),
            _ => assert!(chips["ioapic"]["redirection"].is_array(), "{state}"),
        }

        let other = if mode == "kernel" { "split" } else { "kernel" };
        let refused = ferrovm(
            &[
                "run",
                "--restore",
                snap.to_str().unwrap(),
                "--irqchip",
                other,
            ],
            Duration::from_secs(60),
        );
        refused.expect_error("--irqchip");

        let restored = Vm::start(&["--restore", snap.to_str().unwrap()], &socket);
        restored.wait_for("tick 4 ok");
        restored.shut_down();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
