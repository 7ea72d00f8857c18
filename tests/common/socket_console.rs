//! The guest's console as a `--serial socket:PATH` client sees it: what it prints, read
//! until a needle appears, and lines typed into it.

use std::io::{ErrorKind, Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use super::linux::BOOT_LIMIT;

/// The guest's console, read and typed on through the `--serial socket:` client.
pub struct SocketConsole {
    stream: std::os::unix::net::UnixStream,
    seen: String,
}

impl SocketConsole {
    pub fn connect(path: &Path) -> Self {
        let start = Instant::now();
        let stream = loop {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) => assert!(start.elapsed() < Duration::from_secs(30), "{e}"),
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        stream
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        SocketConsole {
            stream,
            seen: String::new(),
        }
    }

    /// Reads until `needle` appears after what earlier waits consumed.
    pub fn wait_for(&mut self, needle: &str) {
        let start = Instant::now();
        let mut buf = [0u8; 4096];
        while !self.seen.contains(needle) {
            assert!(
                start.elapsed() < BOOT_LIMIT,
                "never saw {needle:?}:\n{}",
                self.seen
            );
            match self.stream.read(&mut buf) {
                Ok(0) => panic!("the console closed before {needle:?}:\n{}", self.seen),
                Ok(n) => self.seen.push_str(&String::from_utf8_lossy(&buf[..n])),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) => panic!("console: {e}"),
            }
        }
        let end = self.seen.find(needle).unwrap() + needle.len();
        self.seen.drain(..end);
    }

    pub fn type_line(&mut self, text: &str) {
        self.stream
            .write_all(format!("{text}\r").as_bytes())
            .unwrap();
    }
}
