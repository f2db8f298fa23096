//! The parts of the `corsnap` command line that are worth reaching from
//! outside the binary: today the client for the .NET runtime's diagnostics
//! IPC, whose response decoder reads bytes another process sends and is
//! therefore fuzzed (`fuzz/fuzz_targets/diagnostics_response.rs`) and
//! replayed by `tests/fuzz_corpus.rs`. The binary (`src/main.rs`) uses this
//! library for it; everything else of the binary stays in the binary.

#![forbid(unsafe_code)]

pub mod diagnostics;
