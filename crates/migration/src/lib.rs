//! Snapshot/restore and live migration: a versioned, framed, checksummed stream of guest
//! memory and device/vCPU state, dirty-page tracking and the pre-copy engine.
//!
//! Not implemented yet: `ferrovm run --restore`, `--incoming` and `ctl snapshot|migrate`
//! are refused with "not supported yet" until this crate lands.
