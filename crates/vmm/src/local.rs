//! Local live update: a migration to a new ferrovm on the same host over a Unix socket
//! (`--incoming unix:PATH`, `migrate unix:PATH`). Guest RAM is a shared file (memfd or
//! `file:PATH`); its descriptor goes across with `SCM_RIGHTS` in the first message, so the
//! new process maps the very pages the guest runs on and no page is copied. The migration
//! stream that follows carries the device and vCPU state only (migration's shared-RAM mode).
//!
//! The first message: a 4-byte little-endian length, then that many bytes of JSON
//! ([`Handoff`]), with the guest RAM file's descriptor attached.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::error::{Error, Result};
use crate::memory::{SharedRam, SharedRegion};
use crate::socket::SocketGuard;

/// Format of the hand-off message.
const HANDOFF_FORMAT: u32 = 1;
/// The largest hand-off message read (a few regions of JSON).
const MAX_HANDOFF: usize = 16 * 1024;
/// How long a new connection may take to send its hand-off.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the source hands over besides the stream.
#[derive(Serialize, Deserialize)]
struct Handoff {
    format: u32,
    /// Guest RAM's regions in the attached file.
    ram: Vec<SharedRegion>,
}

/// `unix:PATH` → `PATH`; `None` for any other address.
pub fn unix_path(text: &str) -> Option<PathBuf> {
    text.strip_prefix("unix:").map(PathBuf::from)
}

/// The `--incoming unix:PATH` listener; its socket file is removed when it is dropped.
pub struct LocalListener {
    listener: UnixListener,
    path: PathBuf,
    _guard: SocketGuard,
}

/// Binds the listener and says where it listens (tests and scripts wait for the line).
pub fn listen(path: &Path) -> Result<LocalListener> {
    let (listener, guard) = crate::socket::bind_for(path, "--incoming")?;
    eprintln!("listening on unix:{}", path.display());
    Ok(LocalListener {
        listener,
        path: path.to_path_buf(),
        _guard: guard,
    })
}

/// An accepted local update: the connection the stream follows on, and guest RAM.
pub struct Accepted {
    pub stream: UnixStream,
    pub ram: SharedRam,
}

impl LocalListener {
    /// Waits for a source and takes its guest RAM file. A connection that is not one (a
    /// peer of another user, garbage, a RAM layout that is not `memory` bytes of this
    /// machine's) is refused with an `Error` frame the source reports, logged, and the wait
    /// goes on.
    pub fn accept(&self, memory: u64) -> Result<Accepted> {
        loop {
            let (stream, _) = self.listener.accept()?;
            match take_handoff(&stream, memory) {
                Ok(ram) => {
                    log::info!("local update arriving on {}", self.path.display());
                    return Ok(Accepted { stream, ram });
                }
                Err(e) => {
                    log::warn!(
                        "connection on {} refused: {e}; still waiting for a migration",
                        self.path.display()
                    );
                    refuse(&stream, &e);
                }
            }
        }
    }
}

/// Tells a source why its hand-off was refused, then reads what it sent meanwhile until it
/// closes (for at most a second): closing at once could fail its writes of the stream's
/// start, and it would report a broken pipe instead of the reason.
fn refuse(stream: &UnixStream, why: &Error) {
    let mut reply = stream;
    let frame = migration::Frame::Error(format!("destination: {why}"));
    if migration::send_reply(&mut reply, &frame).is_err() {
        return;
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let mut sink = [0u8; 4096];
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    while std::time::Instant::now() < deadline {
        match reply.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

fn take_handoff(stream: &UnixStream, memory: u64) -> Result<SharedRam> {
    if !crate::socket::peer_allowed(stream)? {
        return Err(Error::Migration(
            "the peer runs as another user than this VMM or root".into(),
        ));
    }
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut buf = vec![0u8; MAX_HANDOFF + 4];
    let (mut got, file) = stream
        .recv_with_fd(&mut buf)
        .map_err(|e| Error::Migration(format!("reading the hand-off: {e}")))?;
    let file = file.ok_or_else(|| {
        Error::Migration("the hand-off came without guest RAM's descriptor".into())
    })?;
    while got < 4 {
        got += read_some(stream, &mut buf[got..4])?;
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > MAX_HANDOFF {
        return Err(Error::Migration(format!(
            "a hand-off of {len} bytes, more than the {MAX_HANDOFF} allowed"
        )));
    }
    while got < len + 4 {
        got += read_some(stream, &mut buf[got..len + 4])?;
    }
    let handoff: Handoff = serde_json::from_slice(&buf[4..len + 4])
        .map_err(|e| Error::Migration(format!("a malformed hand-off: {e}")))?;
    if handoff.format != HANDOFF_FORMAT {
        return Err(Error::Migration(format!(
            "hand-off format {} (this ferrovm reads {HANDOFF_FORMAT})",
            handoff.format
        )));
    }
    let ram = SharedRam {
        file: Arc::new(file),
        regions: handoff.ram,
    };
    crate::memory::check_handed_over(&ram, memory)?;
    stream.set_read_timeout(None)?;
    Ok(ram)
}

fn read_some(mut stream: &UnixStream, buf: &mut [u8]) -> Result<usize> {
    match stream.read(buf)? {
        0 => Err(Error::Migration(
            "the peer closed inside the hand-off".into(),
        )),
        n => Ok(n),
    }
}

/// Connects to a local destination and hands guest RAM's file over.
pub fn connect_and_hand_off(path: &Path, ram: &SharedRam) -> Result<UnixStream> {
    let stream = UnixStream::connect(path)
        .map_err(|e| Error::Migration(format!("destination unix:{}: {e}", path.display())))?;
    let body = serde_json::to_vec(&Handoff {
        format: HANDOFF_FORMAT,
        ram: ram.regions.clone(),
    })
    .map_err(|e| Error::Migration(format!("hand-off: {e}")))?;
    let mut message = (body.len() as u32).to_le_bytes().to_vec();
    message.extend_from_slice(&body);
    let sent = stream
        .send_with_fds(&[&message[..]], &[ram.file.as_raw_fd()])
        .map_err(|e| Error::Migration(format!("handing guest RAM over: {e}")))?;
    if sent < message.len() {
        (&stream).write_all(&message[sent..])?;
    }
    Ok(stream)
}

impl crate::snapshot::Core {
    /// `migrate unix:PATH`: hands guest RAM's file to the destination, then migrates the
    /// device and vCPU state only. Refused, with the guest untouched, where RAM cannot be
    /// shared: anonymous RAM (use `tcp:`), RAM still partly mapped from a snapshot file, a
    /// post-copy destination's RAM.
    pub(crate) fn migrate_local(
        &self,
        path: &Path,
        request: &crate::api::MigrateRequest,
        paused: bool,
        cancel: &crate::runstate::MigrationCancel,
        progress: &mut dyn FnMut(crate::api::types::MigrationProgress),
    ) -> Result<crate::api::types::MigrationReport> {
        let here = crate::snapshot::where_guest_stays(paused);
        let refuse = |why: &str| Err(Error::Migration(format!("{why} ({here})")));
        let Some(ram) = crate::memory::shared_ram_of(&self.memory) else {
            return refuse(
                "a local update hands guest RAM over as a file, and this guest's RAM is \
                 anonymous: start it with --memory-backend memfd (or file:PATH), or migrate \
                 over tcp:",
            );
        };
        if self.restored.get().is_some() {
            return refuse(
                "guest RAM is still partly mapped from the snapshot it was restored from, \
                 which a local update cannot hand over: migrate over tcp: (or restore with \
                 --restore-eager)",
            );
        }
        if self.postcopy.get().is_some() {
            return refuse("guest RAM arrived by post-copy: migrate over tcp:");
        }
        if request.post_copy_rounds().is_some() {
            return refuse("a local update copies no pages: leave post-copy out");
        }
        self.check_can_save()
            .map_err(|e| Error::Migration(format!("{e} ({here})")))?;
        let stream = connect_and_hand_off(path, &ram)
            .map_err(|e| Error::Migration(format!("{e} ({here})")))?;
        stream.set_write_timeout(Some(crate::snapshot::PEER_TIMEOUT))?;
        stream.set_read_timeout(Some(crate::snapshot::PEER_TIMEOUT))?;
        cancel.attach(stream.try_clone()?)?;
        let result = self.migrate_shared(stream, paused, cancel, progress);
        let addr = format!("unix:{}", path.display());
        self.outcome_of(result, &addr, here, cancel)
    }

    fn migrate_shared(
        &self,
        stream: UnixStream,
        paused: bool,
        cancel: &crate::runstate::MigrationCancel,
        progress: &mut dyn FnMut(crate::api::types::MigrationProgress),
    ) -> migration::Result<migration::MigrationReport> {
        let ack_in = stream
            .try_clone()
            .map_err(|e| migration::Error::vmm(format!("the migration connection: {e}")))?;
        let params = migration::MigrationParams {
            shared_ram: true,
            compression: migration::Compression::None,
            ..migration::MigrationParams::default()
        };
        let mut control = crate::snapshot::VmPause::new(self, paused);
        migration::migrate(
            &*self.memory,
            &self.config,
            &mut crate::snapshot::NothingDirty::of(&self.regions),
            &mut control,
            std::io::BufWriter::new(stream),
            std::io::BufReader::new(ack_in),
            &params,
            |p: &migration::Progress| {
                if p.phase == migration::Phase::WaitingAck {
                    cancel.final_state_sent();
                }
                progress(crate::snapshot::api_progress(p))
            },
        )
    }
}

/// The destination's side once the hand-off was accepted: receives the state.
pub fn receive(
    stream: UnixStream,
    expected: &migration::MigrationConfig,
) -> Result<crate::snapshot::Incoming> {
    let started = std::time::Instant::now();
    stream.set_read_timeout(Some(crate::snapshot::PEER_TIMEOUT))?;
    stream.set_write_timeout(Some(crate::snapshot::PEER_TIMEOUT))?;
    let reply = crate::snapshot::ReplyChannel::local(stream.try_clone()?);
    let result = migration::receive_shared_ram(stream, reply, expected)
        .map_err(|e| Error::Migration(format!("local update: {e}")))?;
    Ok(crate::snapshot::Incoming {
        state: crate::state::MachineState::from_bytes(&result.state)?,
        ack: result.ack,
        postcopy: None,
        figures: serde_json::json!({
            "receive_ms": crate::snapshot::ms(started.elapsed()),
            "bytes": result.report.bytes_total,
            "shared_ram": true,
        }),
    })
}

/// `--incoming` (or a `receiver_url`): `unix:PATH` for a local update, else `tcp:HOST:PORT`.
pub fn incoming_start(text: &str, option: &'static str) -> Result<crate::config::StartFrom> {
    use crate::config::StartFrom;
    match unix_path(text) {
        Some(path) if path.as_os_str().is_empty() => Err(Error::Option {
            option,
            value: text.to_string(),
            reason: "expected unix:PATH with a path".into(),
        }),
        Some(path) => Ok(StartFrom::IncomingLocal(path)),
        None => crate::snapshot::parse_tcp(text, option)
            .map(StartFrom::Incoming)
            .map_err(|e| match e {
                Error::Option { option, value, .. } => Error::Option {
                    option,
                    value,
                    reason: "expected tcp:HOST:PORT or unix:PATH".into(),
                },
                other => other,
            }),
    }
}
