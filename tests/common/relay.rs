//! TCP relays between a migration's source and destination that misbehave on purpose: cut a
//! connection at a byte offset or at a phase of the stream, flip a byte, or swallow the
//! destination's final acknowledgement.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};

/// The kind byte of the stream's `End` frame.
const KIND_END: u8 = migration::Kind::End as u8;

/// A TCP relay between source and destination that misbehaves on purpose.
pub enum Fault {
    /// Close both directions after this many bytes from the source.
    CutAfter(u64),
    /// Flip one bit of the byte at this offset of the source's stream.
    FlipByteAt(u64),
    /// Cut the connection just before the first frame of a phase passes (the frames before
    /// it pass whole): both ways, or only the source's stream (replies still flow back).
    CutAtPhase(Phase, Ways),
}

/// A phase of a migration, as the relay recognizes it from the frames it forwards.
#[derive(Clone, Copy, Debug)]
pub enum Phase {
    /// The `RoundEnd` of live round n (on any connection: each ends every round).
    RoundEnd(u32),
    /// The stop-and-copy: the final round's `RoundEnd` (the guest is paused by then).
    FinalRound,
    /// The `End` frame on the control connection: all the rest, the guest's final state
    /// included, has passed.
    End,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ways {
    Both,
    /// Source to destination only.
    StreamOnly,
}

/// Follows the frames of a stream as it passes (20-byte header, then frames of
/// 8 + length + 4 bytes): where the next frame starts, and whether it opens `phase`.
struct FrameWatch {
    next: u64,
    held: Vec<u8>,
}

impl FrameWatch {
    /// Feeds bytes that start at stream offset `at`; returns the stream offset of the
    /// frame that opens `phase`, once it is seen.
    fn feed(&mut self, at: u64, bytes: &[u8], phase: Phase) -> Option<u64> {
        let mut pos = at;
        let mut rest = bytes;
        while !rest.is_empty() {
            if pos < self.next {
                let skip = ((self.next - pos) as usize).min(rest.len());
                pos += skip as u64;
                rest = &rest[skip..];
                continue;
            }
            let take = (16 - self.held.len()).min(rest.len());
            self.held.extend_from_slice(&rest[..take]);
            pos += take as u64;
            rest = &rest[take..];
            // End is the last frame and may be shorter than the look-ahead: its kind decides.
            if matches!(phase, Phase::End) && self.held.first() == Some(&KIND_END) {
                return Some(self.next);
            }
            if self.held.len() < 16 {
                break;
            }
            let h = std::mem::take(&mut self.held);
            let (kind, len) = (h[0], u32::from_le_bytes(h[4..8].try_into().unwrap()));
            let round = u32::from_le_bytes(h[8..12].try_into().unwrap());
            let final_round = h[12] & 1 == 1;
            let hit = kind == 4
                && match phase {
                    Phase::RoundEnd(n) => !final_round && round == n,
                    Phase::FinalRound => final_round,
                    Phase::End => false,
                };
            if hit {
                return Some(self.next);
            }
            // Every stream frame is at least 16 bytes: the look-ahead stays inside it.
            self.next += 12 + u64::from(len);
        }
        None
    }
}

/// Pipes one connection to the destination both ways, untouched.
pub fn forward(src: TcpStream, to: u16) {
    let dst = TcpStream::connect(("127.0.0.1", to)).unwrap();
    for (mut a, mut b) in [
        (src.try_clone().unwrap(), dst.try_clone().unwrap()),
        (dst, src),
    ] {
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut a, &mut b);
            let _ = b.shutdown(Shutdown::Write);
        });
    }
}

/// A relay whose connection number `nth` (0: the control connection, 1...: a migration's
/// data connections, in the order they connect) misbehaves; the others pass untouched.
pub fn relay_nth(fault: Fault, nth: usize, to: u16) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut src = None;
        for (i, conn) in listener.incoming().enumerate() {
            let conn = conn.unwrap();
            if i == nth {
                src = Some(conn);
                break;
            }
            forward(conn, to);
        }
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                forward(conn.unwrap(), to);
            }
        });
        let mut src = src.unwrap();
        let mut dst = TcpStream::connect(("127.0.0.1", to)).unwrap();
        let (mut src_r, mut dst_w) = (src.try_clone().unwrap(), dst.try_clone().unwrap());
        // Replies flow back untouched.
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut dst, &mut src);
        });
        let mut offset = 0u64;
        let mut buf = vec![0u8; 64 * 1024];
        let mut watch = FrameWatch {
            next: 20,
            held: Vec::new(),
        };
        loop {
            let n = match src_r.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let chunk = &mut buf[..n];
            if let Fault::CutAtPhase(phase, ways) = fault {
                if let Some(at) = watch.feed(offset, chunk, phase) {
                    let keep = at.saturating_sub(offset) as usize;
                    let _ = dst_w.write_all(&chunk[..keep.min(n)]);
                    let _ = dst_w.shutdown(Shutdown::Write);
                    if ways == Ways::Both {
                        let _ = dst_w.shutdown(Shutdown::Both);
                        let _ = src_r.shutdown(Shutdown::Both);
                    }
                    // The source's further bytes go nowhere.
                    while matches!(src_r.read(&mut buf), Ok(n) if n > 0) {}
                    return;
                }
            }
            match fault {
                Fault::CutAfter(limit) if offset + n as u64 >= limit => {
                    let keep = (limit - offset) as usize;
                    let _ = dst_w.write_all(&chunk[..keep]);
                    let _ = dst_w.shutdown(Shutdown::Both);
                    let _ = src_r.shutdown(Shutdown::Both);
                    return;
                }
                Fault::FlipByteAt(at) if at >= offset && at < offset + n as u64 => {
                    chunk[(at - offset) as usize] ^= 0x10;
                }
                _ => {}
            }
            offset += n as u64;
            if dst_w.write_all(chunk).is_err() {
                break;
            }
        }
        let _ = dst_w.shutdown(Shutdown::Write);
    });
    port
}

/// Forwards a migration both ways, but swallows the destination's final `Ack` and then
/// closes the source's connection: the acknowledgement lost in the network.
pub fn ack_swallowing_relay(to: u16) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut src, _) = listener.accept().unwrap();
        let mut dst = TcpStream::connect(("127.0.0.1", to)).unwrap();
        // Data connections pass untouched.
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                forward(conn.unwrap(), to);
            }
        });
        let (mut src_r, mut dst_w) = (src.try_clone().unwrap(), dst.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut src_r, &mut dst_w);
        });
        // Reply frames: kind, flags, 2 reserved, u32 length, payload, CRC-32.
        loop {
            let mut header = [0u8; 8];
            if dst.read_exact(&mut header).is_err() {
                break;
            }
            let len = u32::from_le_bytes(header[4..8].try_into().unwrap()) as usize;
            let mut rest = vec![0u8; len + 4];
            if dst.read_exact(&mut rest).is_err() {
                break;
            }
            if header[0] == migration::Kind::Ack as u8 {
                break;
            }
            if src
                .write_all(&header)
                .and_then(|_| src.write_all(&rest))
                .is_err()
            {
                break;
            }
        }
        let _ = src.shutdown(Shutdown::Both);
    });
    port
}
