//! Names read from the profiled program's metadata (odd, huge, or invalid
//! UTF-16): the input as little-endian u16 units, split at 0xFFFF into a
//! name and its generic parameters, through `name_from_utf16`,
//! `strip_arity` and `push_generic_params`. Replayed (same body) by
//! `crates/corsnap-agent/tests/fuzz_corpus.rs`.

#![no_main]

use corsnap_agent::naming::{name_from_utf16, push_generic_params, strip_arity, MAX_NAME_CHARS};
use libfuzzer_sys::fuzz_target;

fn checked_name(units: &[u16]) -> String {
    let name = name_from_utf16(units);
    assert!(name.chars().count() <= MAX_NAME_CHARS + 1, "name of {} chars", name.chars().count());
    assert!(!name.contains('\0'));
    name
}

fuzz_target!(|data: &[u8]| {
    let units: Vec<u16> = data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    checked_name(&units);
    let mut parts = units.split(|&u| u == 0xFFFF);
    let first = checked_name(parts.next().unwrap_or(&[]));
    let params: Vec<String> = parts.map(|p| strip_arity(&checked_name(p)).to_string()).collect();
    let stripped = strip_arity(&first);
    assert!(first.starts_with(stripped));
    let mut rendered = stripped.to_string();
    push_generic_params(&mut rendered, &params);
    assert!(rendered.starts_with(stripped));
    if !params.is_empty() {
        assert!(rendered.ends_with('>'));
    }
});
