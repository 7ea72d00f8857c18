//! Checks on the files the user names: what kind of file is there, in words, and the
//! refusal of anything that is not a regular file where only one makes sense (a FIFO would
//! hang a reader; a device node or a symlink would be replaced or written through).

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use crate::error::{Error, Result};

/// What kind of file `file_type` is, in words ("a FIFO").
pub fn kind_of(file_type: std::fs::FileType) -> &'static str {
    if file_type.is_symlink() {
        "a symbolic link"
    } else if file_type.is_dir() {
        "a directory"
    } else if file_type.is_file() {
        "a regular file"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_char_device() || file_type.is_block_device() {
        "a device node"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Fails unless `path` names a regular file (symlinks followed: reading through one is
/// fine). `what` names the file in the error ("snapshot", "initrd").
pub fn require_regular(path: &Path, what: &str) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::File {
        path: path.to_path_buf(),
        reason: format!("cannot open {what}: {e}"),
    })?;
    if !meta.is_file() {
        return Err(Error::File {
            path: path.to_path_buf(),
            reason: format!(
                "{what} must be a regular file; this is {}",
                kind_of(meta.file_type())
            ),
        });
    }
    Ok(())
}

/// Fails if something other than a regular file is at `path` (symlinks not followed): a
/// file written beside it and renamed over it would replace a device node, FIFO or symlink.
pub fn require_replaceable(path: &Path, what: &str) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_file() => Err(Error::File {
            path: path.to_path_buf(),
            reason: format!(
                "exists and is {}, not a regular file: refusing to replace it with a {what}",
                kind_of(meta.file_type())
            ),
        }),
        _ => Ok(()),
    }
}
