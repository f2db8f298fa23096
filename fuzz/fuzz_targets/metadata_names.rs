//! Names read from the profiled program's metadata (odd, huge, or invalid
//! UTF-16): the input as little-endian u16 units, split at 0xFFFF into a
//! name and its generic parameters, through `name_from_utf16`,
//! `strip_arity` and `push_generic_params`. Replayed (same body) by
//! `crates/corsnap-agent/tests/fuzz_corpus.rs`.

#![no_main]

#[path = "../bodies/metadata_names.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    body::run(data);
});
