//! Smoke run of the `metadata_names` fuzz target on stable, without
//! libFuzzer: every file of its corpus, then deterministic pseudo-random
//! inputs. The body below is the target's own
//! (`fuzz/fuzz_targets/metadata_names.rs`); keep them in step.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use corsnap_agent::naming::{name_from_utf16, push_generic_params, strip_arity, MAX_NAME_CHARS};

fn checked_name(units: &[u16]) -> String {
    let name = name_from_utf16(units);
    assert!(name.chars().count() <= MAX_NAME_CHARS + 1, "name of {} chars", name.chars().count());
    assert!(!name.contains('\0'));
    name
}

/// The `metadata_names` target: little-endian u16 units, 0xFFFF between a
/// name and its generic parameters. Returns the rendered name.
fn metadata_names(data: &[u8]) -> String {
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

#[test]
fn metadata_names_corpus_replays() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "metadata_names");
    let mut capped = 0;
    replay::replay_corpus("metadata_names", &corpus, |data| {
        capped += usize::from(metadata_names(data).contains('…'));
    });
    assert!(capped > 0, "the corpus should hold a name over the length cap");
    let generic = corpus.iter().find(|(name, _)| name == "generic_type").expect("the generic_type seed");
    assert_eq!(metadata_names(&generic.1), "Shop.Billing.Ledger<TKey, TValue>");
}

#[test]
fn metadata_names_pseudo_random() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "metadata_names");
    replay::pseudo_random_run(0x5EED_0005, &corpus, |data| {
        metadata_names(data);
    });
}
