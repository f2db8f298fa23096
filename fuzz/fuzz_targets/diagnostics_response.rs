//! The .NET runtime's answer on its diagnostics socket, as `corsnap record
//! --pid` reads it: `decode_response` must describe anything malformed, never
//! panic. Replayed (same body) by `crates/corsnap/tests/fuzz_corpus.rs`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let result = corsnap::diagnostics::decode_response(data);
    if result.is_ok() {
        assert!(data.len() >= 24 && data.starts_with(b"DOTNET_IPC_V1\0"));
    }
});
