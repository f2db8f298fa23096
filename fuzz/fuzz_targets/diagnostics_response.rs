//! The .NET runtime's answer on its diagnostics socket, as `corsnap record
//! --pid` reads it: `decode_response` must describe anything malformed, never
//! panic. Replayed (same body) by `crates/corsnap/tests/fuzz_corpus.rs`.

#![no_main]

#[path = "../bodies/diagnostics_response.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    body::run(data);
});
