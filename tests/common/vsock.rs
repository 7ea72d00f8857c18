//! The host side of ferrovm's vsock convention (Firecracker's): a host process connects to
//! the device's socket and asks for a guest port with `CONNECT port`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// Connects to the device's socket with `CONNECT port`, retrying while the guest refuses
/// (it is not listening yet); returns the stream and the host port the VMM named.
pub fn connect_into_guest(socket: &Path, port: u32, limit: Duration) -> (UnixStream, u32) {
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < limit,
            "the guest did not accept CONNECT {port}"
        );
        let Ok(mut stream) = UnixStream::connect(socket) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        stream
            .write_all(format!("CONNECT {port}\n").as_bytes())
            .unwrap();
        let mut line = String::new();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        // The VMM closes the socket if the guest answers RST.
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        let local: u32 = line
            .strip_prefix("OK ")
            .and_then(|rest| rest.trim_end().parse().ok())
            .unwrap_or_else(|| panic!("bad answer to CONNECT: {line:?}"));
        assert!(reader.buffer().is_empty(), "data before the guest sent any");
        return (stream, local);
    }
}
