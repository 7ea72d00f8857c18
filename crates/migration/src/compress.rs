//! Compression of page data for slow links: `CompressedPages` frames (LZ4 or zstd), and the
//! automatic choice, which compresses only while it makes the migration faster.

use std::str::FromStr;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{Error, Result};

/// How page data is sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Compression {
    /// Compress while the link is slower than compressing (measured as the migration runs).
    #[default]
    Auto,
    None,
    Lz4,
    Zstd,
}

impl FromStr for Compression {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => Compression::Auto,
            "none" => Compression::None,
            "lz4" => Compression::Lz4,
            "zstd" => Compression::Zstd,
            other => {
                return Err(Error::Param(format!(
                    "compression {other:?}: auto, none, lz4 or zstd"
                )))
            }
        })
    }
}

/// A codec of `CompressedPages` frames (its number on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    Lz4 = 1,
    Zstd = 2,
}

/// zstd's fastest regular level: several hundred MB/s, well above a 1 Gbit/s link.
const ZSTD_LEVEL: i32 = 1;

impl Codec {
    pub fn from_u8(v: u8) -> Option<Codec> {
        match v {
            1 => Some(Codec::Lz4),
            2 => Some(Codec::Zstd),
            _ => None,
        }
    }

    /// Compresses `raw` into `out` (cleared first).
    pub fn compress(self, raw: &[u8], out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        match self {
            Codec::Lz4 => {
                out.resize(lz4_flex::block::get_maximum_output_size(raw.len()), 0);
                let n = lz4_flex::block::compress_into(raw, out)
                    .map_err(|e| Error::Vmm(format!("LZ4 compression: {e}")))?;
                out.truncate(n);
            }
            Codec::Zstd => {
                out.resize(zstd::zstd_safe::compress_bound(raw.len()), 0);
                let n = zstd::bulk::compress_to_buffer(raw, out, ZSTD_LEVEL)
                    .map_err(|e| Error::io("zstd compression", e))?;
                out.truncate(n);
            }
        }
        Ok(())
    }

    /// Decompresses `data` into exactly `dst`; anything else is an error message.
    pub fn decompress(self, data: &[u8], dst: &mut [u8]) -> std::result::Result<(), String> {
        let n = match self {
            Codec::Lz4 => lz4_flex::block::decompress_into(data, dst).map_err(|e| e.to_string())?,
            Codec::Zstd => {
                zstd::bulk::decompress_to_buffer(data, dst).map_err(|e| e.to_string())?
            }
        };
        if n != dst.len() {
            return Err(format!("{n} bytes decompressed, {} expected", dst.len()));
        }
        Ok(())
    }
}

/// Measured speed of one codec: raw bytes per second and compressed/raw ratio.
#[derive(Clone, Copy, Debug, Default)]
struct Measured {
    raw: u64,
    packed: u64,
    time: Duration,
}

impl Measured {
    /// Seconds per raw byte to compress and send at `link` bytes/s.
    fn cost(&self, link: f64) -> Option<f64> {
        if self.raw == 0 {
            return None;
        }
        let ratio = self.packed as f64 / self.raw as f64;
        Some(self.time.as_secs_f64() / self.raw as f64 + ratio / link)
    }
}

/// Decides, frame by frame, whether and how to compress.
pub(crate) struct Compressor {
    mode: Compression,
    measured: [Measured; 2],
    /// Frames since each codec was last tried (the data changes along guest memory).
    since_tried: [u32; 2],
    /// What the last `choose` said.
    last_choice: Option<Codec>,
    /// Bytes written and time spent writing them (the link as the sender sees it).
    link_bytes: u64,
    link_time: Duration,
    pub raw: Vec<u8>,
    pub packed: Vec<u8>,
    /// Raw page bytes that went out compressed, and their compressed size.
    pub compressed_raw: u64,
    pub compressed_bytes: u64,
    pub time: Duration,
    /// Repeated pages as `SamePage` markers (off with `--compress none`, the stream an
    /// earlier build reads).
    pub dedup: Option<crate::dedup::Dedup>,
}

/// Raw bytes sent uncompressed before the automatic choice trusts its link measurement.
const AUTO_PROBE_BYTES: u64 = 8 << 20;
/// Frames after which a codec not in use is tried again.
const RETRY_FRAMES: u32 = 64;
/// Raw bytes a codec's measurement holds before older samples count half.
const DECAY_BYTES: u64 = 64 << 20;

impl Compressor {
    pub fn new(mode: Compression) -> Self {
        Compressor {
            mode,
            measured: [Measured::default(); 2],
            since_tried: [0; 2],
            last_choice: None,
            link_bytes: 0,
            link_time: Duration::ZERO,
            raw: Vec::new(),
            packed: Vec::new(),
            compressed_raw: 0,
            compressed_bytes: 0,
            time: Duration::ZERO,
            dedup: (mode != Compression::None).then(crate::dedup::Dedup::new),
        }
    }

    /// Records a write of `bytes` that took `time` (the link's speed).
    pub fn link(&mut self, bytes: u64, time: Duration) {
        self.link_bytes += bytes;
        self.link_time += time;
    }

    /// The codec for the next frame, if any.
    pub fn choose(&mut self) -> Option<Codec> {
        self.last_choice = match self.mode {
            Compression::None => None,
            Compression::Lz4 => Some(Codec::Lz4),
            Compression::Zstd => Some(Codec::Zstd),
            Compression::Auto => self.choose_auto(),
        };
        self.last_choice
    }

    /// While compressing, zero pages go inside the compressed runs (where they cost almost
    /// nothing) rather than cutting them into many small frames.
    pub fn merges_zero_pages(&self) -> bool {
        self.last_choice.is_some() || matches!(self.mode, Compression::Lz4 | Compression::Zstd)
    }

    fn choose_auto(&mut self) -> Option<Codec> {
        if self.link_bytes < AUTO_PROBE_BYTES || self.link_time.is_zero() {
            return None;
        }
        let link = self.link_bytes as f64 / self.link_time.as_secs_f64();
        // Each codec is tried on real data before it is judged, and again every
        // RETRY_FRAMES frames, since what memory holds changes along the guest's RAM.
        for codec in [Codec::Lz4, Codec::Zstd] {
            let i = codec as usize - 1;
            self.since_tried[i] += 1;
            let m = &self.measured[i];
            // A codec slower than the link can never pay off: not worth trying again.
            let could_pay = m.raw as f64 > link * m.time.as_secs_f64();
            if m.raw == 0 || (self.since_tried[i] > RETRY_FRAMES && could_pay) {
                return Some(codec);
            }
        }
        let plain = 1.0 / link;
        [Codec::Lz4, Codec::Zstd]
            .into_iter()
            .filter_map(|c| Some((c, self.measured[c as usize - 1].cost(link)?)))
            .filter(|&(_, cost)| cost < plain)
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(c, _)| c)
    }

    /// Compresses `self.raw` into `self.packed` with `codec`; false if it did not shrink
    /// enough to be worth sending compressed.
    pub fn compress(&mut self, codec: Codec) -> Result<bool> {
        let t = Instant::now();
        codec.compress(&self.raw, &mut self.packed)?;
        let spent = t.elapsed();
        self.time += spent;
        self.since_tried[codec as usize - 1] = 0;
        let m = &mut self.measured[codec as usize - 1];
        if m.raw > DECAY_BYTES {
            // Recent data counts most.
            *m = Measured {
                raw: m.raw / 2,
                packed: m.packed / 2,
                time: m.time / 2,
            };
        }
        m.raw += self.raw.len() as u64;
        m.packed += self.packed.len() as u64;
        m.time += spent;
        Ok(self.packed.len() < self.raw.len() / 10 * 9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codecs_round_trip_and_refuse_a_wrong_size() {
        let raw: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8 & 0xf0).collect();
        for codec in [Codec::Lz4, Codec::Zstd] {
            let mut packed = Vec::new();
            codec.compress(&raw, &mut packed).unwrap();
            assert!(packed.len() < raw.len() / 2, "{codec:?}");
            let mut back = vec![0u8; raw.len()];
            codec.decompress(&packed, &mut back).unwrap();
            assert_eq!(back, raw);
            let mut short = vec![0u8; raw.len() + 4096];
            assert!(codec.decompress(&packed, &mut short).is_err());
            assert!(codec
                .decompress(&packed[..packed.len() / 2], &mut back)
                .is_err());
        }
    }

    #[test]
    fn auto_compresses_only_on_a_slow_link() {
        let mut c = Compressor::new(Compression::Auto);
        assert_eq!(c.choose(), None, "nothing measured yet");
        c.raw = (0..1 << 20).map(|i: u32| (i % 7) as u8).collect();
        // A fast link: 10 GB/s.
        c.link(100 << 20, Duration::from_millis(10));
        c.compress(Codec::Lz4).unwrap();
        c.compress(Codec::Zstd).unwrap();
        c.measured[0].time = Duration::from_millis(2); // 500 MB/s
        c.measured[1].time = Duration::from_millis(4);
        assert_eq!(c.choose(), None);
        // A slow link: 100 MB/s.
        c.link(0, Duration::from_secs(10));
        assert!(c.choose().is_some());
    }
}
