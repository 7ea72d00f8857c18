//! Test support for the robustness tests of the parsers that take untrusted input (kernel
//! images, migration streams and snapshot files, control API requests):
//!
//! - [`bounded`]: runs a parser on its own thread with a deadline and measures the largest
//!   single allocation it makes (with [`PeakAlloc`] as the test binary's global allocator),
//!   so that a property can assert "no hang, no allocation sized by a length field";
//! - [`mutate`]: structured mutations of valid inputs (bit flips, truncation, splices,
//!   length fields set to extremes) as proptest strategies;
//! - [`stream`]: recomputes the CRCs of a (mutated) migration stream, so that mutations
//!   reach the field checks behind the checksums.
//!
//! It is a development crate: the parsers' crates use it as a dev-dependency and the fuzz
//! targets in `fuzz/` use it for their allocation cap.

pub mod alloc;
pub mod bounded;
pub mod mutate;
pub mod stream;

pub use alloc::PeakAlloc;
pub use bounded::{bounded, Bounds};
pub use mutate::{apply_all, mutations, Mutation};
