//! The parts of the `corsnap` command line that are worth reaching from
//! outside the binary: the client for the .NET runtime's diagnostics IPC,
//! whose response decoder reads bytes another process sends and is
//! therefore fuzzed (`fuzz/fuzz_targets/diagnostics_response.rs`) and
//! replayed by `tests/fuzz_corpus.rs`, and the check for native AOT
//! programs, which the diagnostics client and `record` share, and the
//! portable PDB reader behind `--lines` (its tests reach it from outside). The binary
//! (`src/main.rs`) uses this library for them; everything else of the
//! binary stays in the binary.

#![forbid(unsafe_code)]

pub mod diagnostics;
pub mod native_aot;
pub mod source_lines;
