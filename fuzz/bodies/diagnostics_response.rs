//! The `diagnostics_response` fuzz target's body, shared by `fuzz/fuzz_targets/diagnostics_response.rs` and
//! the stable smoke run in `cargo test` (crates/corsnap/tests/fuzz_corpus.rs), so the two cannot drift.

/// Returns whether the response was accepted.
pub fn run(data: &[u8]) -> bool {
    let result = corsnap::diagnostics::decode_response(data);
    if result.is_ok() {
        assert!(data.len() >= 24 && data.starts_with(b"DOTNET_IPC_V1\0"));
    }
    result.is_ok()
}
