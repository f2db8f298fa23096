//! Smoke run of the `raw_recording`, `diagnostics_response` and `assembly_pdb` fuzz targets
//! on stable, without libFuzzer: every file of their corpora (including the
//! inputs that once failed), then deterministic pseudo-random inputs. The
//! bodies are the targets' own, from `fuzz/bodies/`.

#[path = "../../../fuzz/replay.rs"]
mod replay;

#[path = "../../../fuzz/bodies/assembly_pdb.rs"]
mod assembly_pdb_body;
#[path = "../../../fuzz/bodies/diagnostics_response.rs"]
mod diagnostics_response_body;
#[path = "../../../fuzz/bodies/raw_recording.rs"]
mod raw_recording_body;

use diagnostics_response_body::run as diagnostics_response;
use raw_recording_body::run as raw_recording;

#[test]
fn raw_recording_corpus_replays() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "raw_recording");
    let mut samples = 0;
    replay::replay_corpus("raw_recording", &corpus, |data| samples += raw_recording(data));
    assert!(samples > 0, "no corpus file held a sample");
}

#[test]
fn raw_recording_pseudo_random() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "raw_recording");
    replay::pseudo_random_run(0x5EED_0003, &corpus, |data| {
        raw_recording(data);
    });
}

#[test]
fn assembly_pdb_corpus_replays() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "assembly_pdb");
    let mut lines = 0;
    replay::replay_corpus("assembly_pdb", &corpus, |data| lines += assembly_pdb_body::run(data));
    assert!(lines > 0, "the embedded PDB of the corpus gives lines");
}

#[test]
fn assembly_pdb_pseudo_random() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "assembly_pdb");
    replay::pseudo_random_run(0x5EED_0009, &corpus, |data| {
        assembly_pdb_body::run(data);
    });
}

#[test]
fn diagnostics_response_corpus_replays() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "diagnostics_response");
    let mut accepted = 0;
    replay::replay_corpus("diagnostics_response", &corpus, |data| accepted += usize::from(diagnostics_response(data)));
    assert!(accepted >= 2, "the corpus should hold an OK and an error response");
}

#[test]
fn diagnostics_response_pseudo_random() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "diagnostics_response");
    replay::pseudo_random_run(0x5EED_0004, &corpus, |data| {
        diagnostics_response(data);
    });
}

/// The input that failed before the fix, spelled out: weights whose total
/// overflows a u64 (inferno adds them up in a usize).
#[test]
fn huge_weights_render() {
    let mut data = vec![0u8];
    for (thread_id, frames) in [(1u64, vec![1u64]), (2, vec![2, 1]), (3, vec![])] {
        corsnap_wire::Message::Sample {
            time_ns: 0,
            thread_id,
            kind: corsnap_wire::EventKind::Cpu,
            weight: u64::MAX,
            truncated: false,
            leaf: String::new(),
            frames,
            il_offsets: Vec::new(),
        }
        .encode_into(&mut data);
    }
    assert_eq!(raw_recording(&data), 3);
    data[0] = 2;
    assert_eq!(raw_recording(&data), 3);
}
