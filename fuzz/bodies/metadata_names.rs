//! The `metadata_names` fuzz target's body, shared by `fuzz/fuzz_targets/metadata_names.rs` and
//! the stable smoke run in `cargo test` (crates/corsnap-agent/tests/fuzz_corpus.rs), so the two cannot drift.

use corsnap_agent::naming::{name_from_utf16, push_generic_params, strip_arity, MAX_NAME_CHARS};

fn checked_name(units: &[u16]) -> String {
    let name = name_from_utf16(units);
    assert!(name.chars().count() <= MAX_NAME_CHARS + 1, "name of {} chars", name.chars().count());
    assert!(!name.contains('\0'));
    name
}

/// Little-endian u16 units, 0xFFFF between a name and its generic
/// parameters. Returns the rendered name.
pub fn run(data: &[u8]) -> String {
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
    rendered
}
