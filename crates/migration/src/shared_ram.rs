//! The destination of a migration over shared guest RAM (the source's side and the protocol
//! are in `precopy/shared.rs`): no page arrives; the stream carries the configuration, the
//! state and `End`.

use std::io::{BufReader, Read, Write};
use std::time::Instant;

use crate::config::{ConfigCheck, MigrationConfig};
use crate::error::{Error, Result};
use crate::receive::{read_config, AckSender, IncomingReport, IncomingResult};
use crate::stages::DestinationStages;
use crate::stream::{send_reply, Frame, StreamReader, MAX_STATE_TOTAL};

/// Receives a migration whose guest RAM the destination already maps: checks the source's
/// configuration against `expected`, replies `Ready`, and returns the state once `End`
/// arrives, with the sender of `Handover` and `Ack`. Nothing is written to guest memory. A
/// failure is told to the source (an `Error` frame) when the connection still works.
pub fn receive_shared_ram<R: Read, W: Write>(
    input: R,
    mut ack: W,
    expected: &ConfigCheck,
) -> Result<IncomingResult<W>> {
    match receive_state(input, &mut ack, expected) {
        Ok((state, config, report)) => Ok(IncomingResult {
            state,
            config,
            report,
            ack: AckSender::new(ack),
            postcopy: None,
        }),
        Err(e) => {
            if let Err(t) = send_reply(&mut ack, &Frame::Error(format!("destination: {e}"))) {
                log::debug!("could not tell the source about the failure: {t}");
            }
            Err(e)
        }
    }
}

fn receive_state<R: Read, W: Write>(
    input: R,
    ack: &mut W,
    expected: &ConfigCheck,
) -> Result<(Vec<u8>, MigrationConfig, IncomingReport)> {
    let t0 = Instant::now();
    let mut reader = StreamReader::new(BufReader::new(input));
    let config = read_config(&mut reader, expected)?;
    send_reply(ack, &Frame::Ready)?;
    let waiting = Instant::now();
    let mut state = Vec::new();
    loop {
        let at = reader.offset();
        let protocol = |reason: &str| Error::Protocol {
            offset: at,
            reason: format!("{reason} (guest RAM is shared: no pages may come)"),
        };
        match reader.next_frame()? {
            Frame::State(piece) => {
                if state.len() + piece.len() > MAX_STATE_TOTAL {
                    return Err(protocol("the device state is too large"));
                }
                state.extend_from_slice(&piece);
            }
            Frame::End(info) => {
                if state.is_empty() {
                    return Err(protocol("End before the device state"));
                }
                if (info.rounds, info.total_pages, info.total_zero_pages) != (0, 0, 0) {
                    return Err(protocol("End announces rounds of pages"));
                }
                let report = IncomingReport {
                    rounds: Vec::new(),
                    bytes_total: reader.offset(),
                    pages_total: 0,
                    zero_pages_total: 0,
                    state_bytes: state.len() as u64,
                    torn_pages_recovered: 0,
                    preexisting_pages_zeroed: 0,
                    total_time: t0.elapsed(),
                    final_phase: waiting.elapsed(),
                    stages: DestinationStages::default(),
                };
                return Ok((state, config, report));
            }
            Frame::Error(message) => {
                return Err(Error::Peer {
                    peer: "source",
                    message,
                })
            }
            other => return Err(protocol(&format!("unexpected {other:?}"))),
        }
    }
}
