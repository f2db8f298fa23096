//! Smoke run of the `metadata_names` fuzz target on stable, without
//! libFuzzer: every file of its corpus, then deterministic pseudo-random
//! inputs. The body is the target's own, from
//! `fuzz/bodies/metadata_names.rs`.

#[path = "../../../fuzz/replay.rs"]
mod replay;

#[path = "../../../fuzz/bodies/metadata_names.rs"]
mod metadata_names_body;

use metadata_names_body::run as metadata_names;

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
