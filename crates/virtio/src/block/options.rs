//! What the user says about a disk:
//! `PATH[,readonly][,serial=S][,cache=writeback|none][,queues=N][,format=raw|qcow2][,backing=PATH]`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest serial GET_ID can return (VIRTIO_BLK_ID_BYTES).
pub const MAX_SERIAL_LEN: usize = 20;
/// Most request queues a block device offers.
pub const MAX_QUEUES: u16 = 16;

/// How the host caches the image.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// Through the host page cache; FLUSH makes writes durable.
    #[default]
    Writeback,
    /// O_DIRECT: around the host page cache (FLUSH still syncs the device's own cache).
    None,
}

impl fmt::Display for CacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CacheMode::Writeback => "writeback",
            CacheMode::None => "none",
        })
    }
}

impl FromStr for CacheMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "writeback" => Ok(CacheMode::Writeback),
            "none" => Ok(CacheMode::None),
            other => Err(format!("cache={other}: expected writeback or none")),
        }
    }
}

/// The image format the user asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    /// From the file's header: qcow2 if it has qcow2's magic, raw otherwise.
    #[default]
    Auto,
    Raw,
    Qcow2,
}

impl fmt::Display for ImageFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ImageFormat::Auto => "auto",
            ImageFormat::Raw => "raw",
            ImageFormat::Qcow2 => "qcow2",
        })
    }
}

impl FromStr for ImageFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ImageFormat::Auto),
            "raw" => Ok(ImageFormat::Raw),
            "qcow2" => Ok(ImageFormat::Qcow2),
            other => Err(format!("format={other}: expected raw or qcow2")),
        }
    }
}

/// How the image file is read: its format and, for qcow2, the backing file to use instead
/// of the one its header names.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FormatOptions {
    pub format: ImageFormat,
    pub backing: Option<PathBuf>,
}

impl FormatOptions {
    /// The `--disk` keys these options take.
    pub const KEYS: [&'static str; 2] = ["format", "backing"];

    /// Applies `key=value` if `key` is one of [`Self::KEYS`]; None for any other key.
    pub fn apply(&mut self, key: &str, value: &str) -> Option<Result<(), String>> {
        match key {
            "format" => Some(value.parse().map(|f| self.format = f)),
            "backing" if value.is_empty() => Some(Err("backing=: empty path".into())),
            "backing" => {
                self.backing = Some(PathBuf::from(value));
                Some(Ok(()))
            }
            _ => None,
        }
    }

    /// Checks that the options agree with each other.
    pub fn validate(&self) -> Result<(), String> {
        if self.backing.is_some() && self.format == ImageFormat::Raw {
            return Err("backing= needs a qcow2 image, not format=raw".into());
        }
        Ok(())
    }
}

/// A virtio-blk device's configuration: `--disk`, a Firecracker drive, a snapshot's record
/// of the disk (fields absent from a record take [`BlockOptions::default`]'s values).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BlockOptions {
    /// The image: a regular file or a block device, raw or qcow2.
    pub path: PathBuf,
    /// Its format and backing file.
    pub image: FormatOptions,
    pub readonly: bool,
    /// Returned by GET_ID; at most [`MAX_SERIAL_LEN`] bytes.
    pub serial: Option<String>,
    pub cache: CacheMode,
    /// Request queues, 1..=[`MAX_QUEUES`]; each is served by its own thread.
    pub queues: u16,
    /// Open the image without its lock, which [`crate::VirtioDevice::take_over`] takes later:
    /// a migration destination, whose source holds the lock until the hand-over.
    #[serde(skip)]
    pub defer_lock: bool,
    /// Restoring a snapshot: refuse an image file whose [`super::ImageStamp`] differs from
    /// the one the snapshot recorded (the guest's memory would not match its disk).
    #[serde(skip)]
    pub expect_unchanged: bool,
}

impl Default for BlockOptions {
    fn default() -> Self {
        BlockOptions::new("")
    }
}

impl BlockOptions {
    /// A writable, write-back cached, single-queue disk without serial.
    pub fn new(path: impl Into<PathBuf>) -> BlockOptions {
        BlockOptions {
            path: path.into(),
            image: FormatOptions::default(),
            readonly: false,
            serial: None,
            cache: CacheMode::Writeback,
            queues: 1,
            defer_lock: false,
            expect_unchanged: false,
        }
    }

    /// Checks the values a parser or a caller may have got wrong.
    pub fn validate(&self) -> Result<(), String> {
        if self.path.as_os_str().is_empty() {
            return Err("disk: empty path".into());
        }
        if let Some(serial) = &self.serial {
            if serial.len() > MAX_SERIAL_LEN || !serial.is_ascii() {
                return Err(format!(
                    "serial must be ASCII and at most {MAX_SERIAL_LEN} bytes"
                ));
            }
        }
        self.image.validate()?;
        if !(1..=MAX_QUEUES).contains(&self.queues) {
            return Err(format!(
                "queues={}: expected 1 to {MAX_QUEUES}",
                self.queues
            ));
        }
        Ok(())
    }

    fn apply(&mut self, item: &str) -> Result<(), String> {
        match item.split_once('=') {
            None if item == "readonly" || item == "ro" => self.readonly = true,
            Some(("serial", value)) => self.serial = Some(value.to_string()),
            Some(("cache", value)) => self.cache = value.parse()?,
            Some(("queues", value)) => {
                self.queues = value
                    .parse()
                    .map_err(|_| format!("queues={value}: not a number"))?
            }
            Some((key, value)) if FormatOptions::KEYS.contains(&key) => {
                if let Some(result) = self.image.apply(key, value) {
                    result?
                }
            }
            _ => return Err(format!("unknown disk option {item:?}")),
        }
        Ok(())
    }
}

/// The first key given twice in the items of a `KEY=VALUE,FLAG,...` option, if any (the
/// last one would win silently). `aliases` name spellings of one key: `("ro", "readonly")`.
pub fn repeated_key<'a>(
    items: impl IntoIterator<Item = &'a str>,
    aliases: &[(&str, &'a str)],
) -> Option<&'a str> {
    let mut seen: Vec<&str> = Vec::new();
    for item in items {
        let key = item.split_once('=').map_or(item, |(key, _)| key);
        let key = aliases
            .iter()
            .find(|(alias, _)| *alias == key)
            .map_or(key, |(_, canonical)| *canonical);
        if seen.contains(&key) {
            return Some(key);
        }
        seen.push(key);
    }
    None
}

impl FromStr for BlockOptions {
    type Err = String;

    /// Parses `PATH[,readonly][,serial=S][,cache=writeback|none][,queues=N][,format=F][,backing=PATH]`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut items = s.split(',');
        let path = items.next().unwrap_or_default();
        if path.is_empty() {
            return Err(
                "expected PATH[,readonly][,serial=S][,cache=writeback|none][,queues=N]".into(),
            );
        }
        if let Some(key) = repeated_key(items.clone(), &[("ro", "readonly")]) {
            return Err(format!("{key} is given twice"));
        }
        let mut options = BlockOptions::new(path);
        for item in items {
            options.apply(item)?;
        }
        options.validate()?;
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_option() {
        let o: BlockOptions = "/img,readonly,serial=abc,cache=none,queues=4,format=qcow2,backing=b"
            .parse()
            .unwrap();
        assert_eq!(o.image.format, ImageFormat::Qcow2);
        assert_eq!(o.image.backing, Some(PathBuf::from("b")));
        assert_eq!(o.path, PathBuf::from("/img"));
        assert!(o.readonly);
        assert_eq!(o.serial.as_deref(), Some("abc"));
        assert_eq!(o.cache, CacheMode::None);
        assert_eq!(o.queues, 4);
        assert_eq!(
            "/img".parse::<BlockOptions>().unwrap(),
            BlockOptions::new("/img")
        );
    }

    #[test]
    fn refuses_bad_values() {
        for bad in [
            "",
            "/img,cache=always",
            "/img,queues=0",
            "/img,queues=17",
            "/img,queues=x",
            "/img,serial=123456789012345678901",
            "/img,bogus",
            "/img,cache=none,cache=writeback",
            "/img,serial=a,serial=b",
            "/img,readonly,readonly",
            "/img,format=vmdk",
            "/img,format=raw,backing=/base",
            "/img,backing=",
            "/img,format=raw,format=qcow2",
        ] {
            assert!(bad.parse::<BlockOptions>().is_err(), "{bad} accepted");
        }
        assert!("/img,serial=12345678901234567890"
            .parse::<BlockOptions>()
            .is_ok());
    }
}
