//! Post-copy: the source stops pre-copying after some rounds, pauses, and sends its state
//! with the set of pages the destination does not hold correctly yet (the `Postcopy` frame,
//! in place of the final round). The destination runs the guest at once; a page it touches
//! before it arrived is asked for on the **post-copy connection**, a socket of its own that
//! the source opens at the switch:
//!
//! ```text
//! source ── header, Join(token, 0), Pages / ZeroPages ..., End ──▶ destination
//! source ◀── Request(addr, count) ..., Resident ─────────────────── destination
//! ```
//!
//! The source answers requests first and streams the remaining pages in the background,
//! each page once; `End` says every missing page was sent. The destination installs pages
//! as they arrive (verified like any `Pages` frame), and says `Resident` once every one is
//! in. From the switch on, the guest's only complete copy is split between the two hosts:
//! if either side or the link fails before `Resident`, **the guest is lost**.

use std::io::{BufWriter, Read};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::bitmap::{words_for, Bitmap};
use crate::error::{Error, Result};
use crate::lanes::SpawnLane;
use crate::pages::is_zero;
use crate::precopy::ms;
use crate::ram::{Layout, RamRange, PAGE_SIZE};
use crate::stream::{EndInfo, Frame, StreamReader, StreamWriter, MAX_PAGES_PER_FRAME};

const PAGE: usize = PAGE_SIZE as usize;
/// The most pages one request may ask for.
pub const MAX_REQUEST_PAGES: u32 = 256;
/// Length of a return-path record.
pub const RECORD_LEN: usize = 16;
const RECORD_REQUEST: u32 = 1;
const RECORD_RESIDENT: u32 = 2;
/// Pages the source streams between two looks at the requests (256 KiB): a request waits
/// for at most this much data queued before its answer.
const BACKGROUND_CHUNK: u64 = 64;

/// The switch to post-copy: the token the post-copy connection joins with, and the pages the
/// destination must still receive (one bitmap per RAM region).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Switch {
    pub token: u64,
    pub missing: Bitmap,
}

impl Switch {
    /// The `Postcopy` frame's payload: the token, then every region's bitmap words (LE).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.token.to_le_bytes().to_vec();
        for w in self.missing.regions().iter().flatten() {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// Decodes a payload for RAM regions of `region_pages` pages, refusing a wrong length or
    /// bits past a region's end.
    pub fn decode(payload: &[u8], region_pages: &[u64]) -> Result<Switch> {
        let words: usize = region_pages.iter().map(|&p| words_for(p)).sum();
        if payload.len() != 8 + 8 * words {
            return Err(Error::Protocol {
                offset: 0,
                reason: format!(
                    "the post-copy switch is {} bytes; {} expected for this guest's RAM",
                    payload.len(),
                    8 + 8 * words
                ),
            });
        }
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&payload[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let mut at = 8;
        let mut regions = Vec::with_capacity(region_pages.len());
        for &pages in region_pages {
            let n = words_for(pages);
            regions.push((0..n).map(|i| u64_at(at + 8 * i)).collect::<Vec<u64>>());
            at += 8 * n;
        }
        let mut missing = Bitmap::from_words(regions);
        let before = missing.count();
        missing
            .conform(region_pages)
            .map_err(|reason| Error::Protocol { offset: 0, reason })?;
        if missing.count() != before {
            return Err(Error::Protocol {
                offset: 0,
                reason: "the post-copy switch lists pages past the end of guest RAM".into(),
            });
        }
        Ok(Switch {
            token: u64_at(0),
            missing,
        })
    }
}

/// A record of the return path (destination to source).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// Send these pages first (the guest waits for one of them).
    Request { addr: u64, count: u32 },
    /// Every missing page is installed: the source may end.
    Resident,
}

impl Record {
    pub fn encode(self) -> [u8; RECORD_LEN] {
        let (kind, count, addr) = match self {
            Record::Request { addr, count } => (RECORD_REQUEST, count, addr),
            Record::Resident => (RECORD_RESIDENT, 0, 0),
        };
        let mut b = [0u8; RECORD_LEN];
        b[0..4].copy_from_slice(&kind.to_le_bytes());
        b[4..8].copy_from_slice(&count.to_le_bytes());
        b[8..16].copy_from_slice(&addr.to_le_bytes());
        b
    }

    /// Decodes a record, refusing unknown kinds and empty or oversized requests (the pages'
    /// place in RAM is checked by whoever serves them).
    pub fn decode(b: &[u8; RECORD_LEN]) -> Result<Record> {
        let kind = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let count = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[8..16]);
        let addr = u64::from_le_bytes(a);
        let bad = |reason: String| Error::Protocol { offset: 0, reason };
        match kind {
            RECORD_REQUEST if count == 0 || count > MAX_REQUEST_PAGES => Err(bad(format!(
                "a post-copy request for {count} pages (1 to {MAX_REQUEST_PAGES} allowed)"
            ))),
            RECORD_REQUEST => Ok(Record::Request { addr, count }),
            RECORD_RESIDENT if count == 0 && addr == 0 => Ok(Record::Resident),
            _ => Err(bad(format!(
                "an unknown post-copy record (kind {kind}, count {count}, address {addr:#x})"
            ))),
        }
    }
}

/// Reads one record; `Ok(None)` at a clean end of the connection.
pub fn read_record<R: Read>(r: &mut R) -> Result<Option<Record>> {
    let mut b = [0u8; RECORD_LEN];
    let mut got = 0;
    while got < RECORD_LEN {
        match r.read(&mut b[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(Error::Truncated {
                    what: "a post-copy request".into(),
                    offset: got as u64,
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("reading the post-copy return path", e)),
        }
    }
    Record::decode(&b).map(Some)
}

/// What post-copy did, as the source saw it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PostcopyReport {
    /// Pre-copy rounds before the switch.
    pub after_rounds: u32,
    /// Pages the destination did not have at the switch.
    pub missing_pages: u64,
    /// Sent because the destination asked (a fault waited for them).
    pub pages_on_demand: u64,
    /// Sent in the background.
    pub pages_streamed: u64,
    /// Of those, sent as zero markers.
    pub zero_pages: u64,
    pub requests: u64,
    pub bytes: u64,
    /// From the source's pause to the destination's `Resident`.
    #[serde(rename = "time_to_residency_ms", serialize_with = "ms")]
    pub time_to_residency: Duration,
}

/// How the source reaches the destination for post-copy.
pub struct PostcopySource<'a> {
    /// Live pre-copy rounds before the switch (0: switch before any page is sent).
    pub after_rounds: u32,
    /// Opens the post-copy connection (to the address the control connection went to).
    pub connect: &'a dyn Fn() -> std::io::Result<TcpStream>,
    /// Starts the thread that reads the return path, and the one that waits for the
    /// destination's replies while the source answers page requests.
    pub spawn: SpawnLane<'a>,
    /// Another reader of the control connection (where the destination replies), for that
    /// thread.
    pub replies: &'a dyn Fn() -> std::io::Result<Box<dyn Read + Send>>,
    /// How long the destination may stay silent once every page is sent.
    pub timeout: Duration,
}

/// The source's end of the post-copy connection.
pub(crate) struct SourceLink {
    w: StreamWriter<BufWriter<TcpStream>>,
    /// Shut down when the link is dropped: the return path's thread holds a copy of the
    /// socket, which would otherwise keep the connection open after a failure.
    stream: TcpStream,
    records: Receiver<Result<Record>>,
    timeout: Duration,
}

impl SourceLink {
    /// Opens the connection and joins it to the migration `token`; a thread forwards the
    /// destination's records.
    pub fn open(pc: &PostcopySource<'_>, token: u64) -> Result<SourceLink> {
        let stream =
            (pc.connect)().map_err(|e| Error::io("opening the post-copy connection", e))?;
        let _ = stream.set_nodelay(true);
        let mut input = stream
            .try_clone()
            .map_err(|e| Error::io("the post-copy connection", e))?;
        let (tx, records) = channel();
        let body = Box::new(move || forward_records(&mut input, &tx));
        (pc.spawn)("migration-postcopy".into(), body)
            .map_err(|e| Error::io("starting the post-copy return path's thread", e))?;
        let out = stream
            .try_clone()
            .map_err(|e| Error::io("the post-copy connection", e))?;
        let mut w = StreamWriter::new(BufWriter::with_capacity(1 << 20, out));
        w.write_header()?;
        w.write_frame(&Frame::Join { token, index: 0 })?;
        w.flush()?;
        Ok(SourceLink {
            w,
            stream,
            records,
            timeout: pc.timeout,
        })
    }

    /// Answers the destination's page requests that arrive within `wait`, nothing else:
    /// while it applies the final state, before it replies, the destination may already
    /// need pages (KVM reads guest memory when some MSRs are set, as Linux's kvmclock wall
    /// clock), and the reply would never come if they waited for the background stream.
    pub fn answer_requests(
        &mut self,
        layout: &Layout,
        missing: &mut Bitmap,
        report: &mut PostcopyReport,
        wait: Duration,
    ) -> Result<()> {
        match self.records.recv_timeout(wait) {
            Ok(Ok(Record::Request { addr, count })) => {
                report.pages_on_demand += self.answer(layout, missing, addr, count, report)?;
                self.w.flush()?;
                report.bytes = self.w.bytes_written();
                Ok(())
            }
            Ok(Ok(Record::Resident)) => Err(Error::Protocol {
                offset: 0,
                reason: "the destination says it holds every page before they were sent".into(),
            }),
            Ok(Err(e)) => Err(e),
            Err(RecvTimeoutError::Timeout) => Ok(()),
            Err(RecvTimeoutError::Disconnected) => Err(Error::Vmm(
                "the post-copy connection closed before the destination took over".into(),
            )),
        }
    }

    /// Sends what a request asks for of `missing` (pages sent already are skipped).
    fn answer(
        &mut self,
        layout: &Layout,
        missing: &mut Bitmap,
        addr: u64,
        count: u32,
        report: &mut PostcopyReport,
    ) -> Result<u64> {
        report.requests += 1;
        let (region, first) =
            layout
                .locate(addr, u64::from(count))
                .map_err(|r| Error::Protocol {
                    offset: 0,
                    reason: format!("a post-copy request for {addr:#x} (+{count} pages): {r}"),
                })?;
        self.send_missing(layout, missing, region, first, u64::from(count), report)
    }

    /// Serves the destination until every page of `missing` is sent and it says it has them
    /// all: requests first, the rest in address order. `progress` hears the bytes sent and
    /// the pages left after each step.
    pub fn serve(
        mut self,
        layout: &Layout,
        mut missing: Bitmap,
        report: &mut PostcopyReport,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<()> {
        let mut cursor = (0usize, 0u64);
        let mut left = missing.count();
        let mut ended = false;
        loop {
            let next = if ended {
                match self.records.recv_timeout(self.timeout) {
                    Ok(r) => Some(r),
                    Err(RecvTimeoutError::Timeout) => {
                        return Err(Error::Vmm(format!(
                            "the destination did not confirm it holds every page within {:?}",
                            self.timeout
                        )))
                    }
                    Err(RecvTimeoutError::Disconnected) => None,
                }
            } else {
                self.records.try_recv().ok()
            };
            match next {
                Some(Ok(Record::Request { addr, count })) => {
                    let n = self.answer(layout, &mut missing, addr, count, report)?;
                    report.pages_on_demand += n;
                    left -= n;
                    self.w.flush()?;
                }
                // The connection closes as the link is dropped.
                Some(Ok(Record::Resident)) if ended => return Ok(()),
                Some(Ok(Record::Resident)) => {
                    return Err(Error::Protocol {
                        offset: 0,
                        reason: "the destination says it holds every page before they were sent"
                            .into(),
                    })
                }
                Some(Err(e)) => return Err(e),
                None if ended => {
                    return Err(Error::Vmm(
                        "the post-copy connection closed before the destination held every page"
                            .into(),
                    ))
                }
                None if left == 0 => {
                    self.w.write_frame(&Frame::End(EndInfo {
                        rounds: 0,
                        total_pages: report.pages_on_demand + report.pages_streamed,
                        total_zero_pages: report.zero_pages,
                    }))?;
                    self.w.flush()?;
                    ended = true;
                }
                None => {
                    let n = self.stream_next(layout, &mut missing, &mut cursor, report)?;
                    report.pages_streamed += n;
                    left -= n;
                }
            }
            report.bytes = self.w.bytes_written();
            progress(report.bytes, left);
        }
    }

    /// Sends the next pages of `missing` from `cursor` on, at most a background chunk.
    fn stream_next(
        &mut self,
        layout: &Layout,
        missing: &mut Bitmap,
        cursor: &mut (usize, u64),
        report: &mut PostcopyReport,
    ) -> Result<u64> {
        while cursor.0 < layout.regions.len() {
            let (region, from) = *cursor;
            match missing.runs_from(region, from, 1).next() {
                Some((first, _)) => {
                    let pages = layout.regions[region].size / PAGE_SIZE;
                    let count = BACKGROUND_CHUNK.min(pages - first);
                    *cursor = (region, first + count);
                    let sent = self.send_missing(layout, missing, region, first, count, report)?;
                    if sent > 0 {
                        return Ok(sent);
                    }
                }
                None => *cursor = (region + 1, 0),
            }
        }
        Ok(0)
    }

    /// Sends the pages of `first..first + count` of `region` still in `missing` (clearing
    /// them); returns how many.
    fn send_missing(
        &mut self,
        layout: &Layout,
        missing: &mut Bitmap,
        region: usize,
        first: u64,
        count: u64,
        report: &mut PostcopyReport,
    ) -> Result<u64> {
        let base = layout.regions[region].guest_addr;
        let end = first + count;
        let runs: Vec<(u64, u64)> = missing
            .runs_from(region, first, u64::from(MAX_PAGES_PER_FRAME))
            .take_while(|&(p, _)| p < end)
            .map(|(p, n)| (p, n.min(end - p)))
            .collect();
        let mut sent = 0;
        for (p, n) in runs {
            // SAFETY: pages `p..p + n` lie inside region `region` (bounded by `missing`,
            // which conforms to the layout, and by a checked request range); the source guest
            // is paused for the whole post-copy, so nothing writes them while they are read.
            let data = unsafe {
                std::slice::from_raw_parts(layout.host_page(region, p), n as usize * PAGE)
            };
            self.send_run(base + p * PAGE_SIZE, data, report)?;
            for q in p..p + n {
                missing.clear(region, q);
            }
            sent += n;
        }
        Ok(sent)
    }

    /// Sends a run of pages: zero pages as markers, the others with their data.
    fn send_run(&mut self, addr: u64, data: &[u8], report: &mut PostcopyReport) -> Result<()> {
        let mut i = 0;
        let pages = data.len() / PAGE;
        while i < pages {
            let zero = is_zero(&data[i * PAGE..(i + 1) * PAGE]);
            let mut j = i + 1;
            while j < pages && is_zero(&data[j * PAGE..(j + 1) * PAGE]) == zero {
                j += 1;
            }
            let at = addr + (i * PAGE) as u64;
            if zero {
                self.w.write_frame(&Frame::ZeroPages {
                    addr: at,
                    count: (j - i) as u32,
                })?;
                report.zero_pages += (j - i) as u64;
            } else {
                self.w.write_pages(at, &data[i * PAGE..j * PAGE], false)?;
            }
            i = j;
        }
        Ok(())
    }
}

impl Drop for SourceLink {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

fn forward_records(input: &mut TcpStream, to: &Sender<Result<Record>>) {
    loop {
        match read_record(input) {
            Ok(Some(r)) => {
                if to.send(Ok(r)).is_err() {
                    return;
                }
            }
            Ok(None) => return,
            Err(e) => {
                let _ = to.send(Err(e));
                return;
            }
        }
    }
}

/// The destination's side of a switch to post-copy, returned by `receive`: the pages still
/// missing and the post-copy connection (already joined).
pub struct PostcopyIncoming {
    pub missing: Bitmap,
    pub link: TcpStream,
    /// Guest RAM as the stream lays it out.
    pub ranges: Vec<RamRange>,
}

/// Accepts the post-copy connection of the migration `token` on `listener`.
pub(crate) fn accept_link(
    listener: &TcpListener,
    token: u64,
    timeout: Duration,
) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    let stream = crate::lanes::accept_by(listener, deadline)?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| Error::io("setting up the post-copy connection", e))?;
    let mut reader = StreamReader::new(
        stream
            .try_clone()
            .map_err(|e| Error::io("setting up the post-copy connection", e))?,
    );
    reader.read_header()?;
    match reader.next_frame()? {
        Frame::Join { token: t, index: 0 } if t == token => Ok(stream),
        other => Err(Error::Vmm(format!(
            "the post-copy connection opened with {other:?}, not this migration's Join"
        ))),
    }
}

/// What arrives on the post-copy connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Arrival {
    /// Pages with data, verified against their CRCs.
    Pages {
        addr: u64,
        data: Vec<u8>,
    },
    Zero {
        addr: u64,
        count: u32,
    },
    /// Every missing page was sent: `pages` in all, `zero_pages` of them as markers.
    End {
        pages: u64,
        zero_pages: u64,
    },
}

/// The destination's reader of the post-copy connection (after the `Join`).
pub struct ArrivalReader<R: Read> {
    reader: StreamReader<R>,
}

impl<R: Read> ArrivalReader<R> {
    pub fn new(input: R, ranges: Vec<RamRange>) -> Self {
        let mut reader = StreamReader::new(input);
        reader.assume_header_read();
        reader.set_ram_ranges(ranges);
        ArrivalReader { reader }
    }

    /// The next pages; fails on a bad CRC, a page outside RAM, any other frame, or a
    /// connection that ends before `End`.
    pub fn next_arrival(&mut self) -> Result<Arrival> {
        let at = self.reader.offset();
        match self.reader.next_frame()? {
            Frame::Pages(h) => {
                let (data, bad) = self.reader.read_page_data_vec()?;
                if let Some(i) = bad.first() {
                    return Err(Error::Protocol {
                        offset: at,
                        reason: format!(
                            "post-copy page {:#x} fails its checksum",
                            h.addr + u64::from(*i) * PAGE_SIZE
                        ),
                    });
                }
                Ok(Arrival::Pages { addr: h.addr, data })
            }
            Frame::ZeroPages { addr, count } => Ok(Arrival::Zero { addr, count }),
            Frame::End(e) => Ok(Arrival::End {
                pages: e.total_pages,
                zero_pages: e.total_zero_pages,
            }),
            Frame::Error(message) => Err(Error::Peer {
                peer: "source",
                message,
            }),
            other => Err(Error::Protocol {
                offset: at,
                reason: format!("{other:?} on the post-copy connection"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switch_round_trips_and_refuses_bad_payloads() {
        let counts = [100u64, 64];
        let mut missing = Bitmap::new(&counts);
        missing.set(0, 3);
        missing.set(0, 99);
        missing.set(1, 63);
        let s = Switch { token: 7, missing };
        let bytes = s.encode();
        assert_eq!(Switch::decode(&bytes, &counts).unwrap(), s);
        let short = Switch::decode(&bytes[..bytes.len() - 1], &counts).unwrap_err();
        assert!(short.to_string().contains("expected"), "{short}");
        let mut past = bytes.clone();
        past[8 + 8 + 7] |= 0x80; // page 127 of region 0, which has 100
        let err = Switch::decode(&past, &counts).unwrap_err();
        assert!(err.to_string().contains("past the end"), "{err}");
    }

    #[test]
    fn records_round_trip_and_bad_ones_are_refused() {
        for r in [
            Record::Request {
                addr: 0x1000,
                count: 16,
            },
            Record::Resident,
        ] {
            assert_eq!(Record::decode(&r.encode()).unwrap(), r);
        }
        let zero = Record::Request { addr: 0, count: 0 }.encode();
        assert!(Record::decode(&zero).is_err());
        let big = Record::Request {
            addr: 0,
            count: MAX_REQUEST_PAGES + 1,
        }
        .encode();
        assert!(Record::decode(&big)
            .unwrap_err()
            .to_string()
            .contains("allowed"));
        let mut unknown = Record::Resident.encode();
        unknown[0] = 9;
        assert!(Record::decode(&unknown)
            .unwrap_err()
            .to_string()
            .contains("unknown"));
        // A record cut short is an error, not a clean end; an empty input is a clean end.
        let rec = Record::Resident.encode();
        assert!(matches!(
            read_record(&mut &rec[..7]),
            Err(Error::Truncated { .. })
        ));
        assert!(read_record(&mut &[][..]).unwrap().is_none());
    }
}
