//! Smoke run of the `raw_recording` and `diagnostics_response` fuzz targets
//! on stable, without libFuzzer: every file of their corpora (including the
//! inputs that once failed), then deterministic pseudo-random inputs. The
//! bodies below are the targets' own (`fuzz/fuzz_targets/*.rs`); keep them
//! in step.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use corsnap_profile::writers::{writer_for, Format, WriteOptions};
use corsnap_profile::{Profile, ProfileBuilder};
use corsnap_wire::{read_message, read_raw_header, write_raw_header};

/// What `corsnap report` does with a file; returns the number of samples.
fn report(file: &[u8], threads: bool) -> usize {
    let mut input = file;
    if read_raw_header(&mut input).is_err() {
        return 0;
    }
    let mut builder = ProfileBuilder::new();
    let mut scratch = Vec::new();
    while let Ok(Some(msg)) = read_message(&mut input, &mut scratch) {
        builder.apply(&msg);
    }
    let samples = builder.sample_count();
    let profile = builder.finish();
    let kinds = profile.kinds();
    let options = WriteOptions { threads, ..WriteOptions::default() };
    for &format in Format::all() {
        // As `Outputs::write`: pprof holds every kind, the others get one
        // profile per kind (or the whole profile when there is at most one).
        let profiles: Vec<Profile> = if format.holds_many_kinds() || kinds.is_empty() {
            vec![profile.clone()]
        } else {
            kinds.iter().map(|&kind| profile.only(kind)).collect()
        };
        for p in &profiles {
            let _ = writer_for(format).write(p, &options, &mut Vec::new());
        }
    }
    samples
}

/// The `raw_recording` target: an even first byte puts a valid header first.
fn raw_recording(data: &[u8]) -> usize {
    let Some((&mode, rest)) = data.split_first() else {
        return 0;
    };
    let mut file = Vec::with_capacity(12 + rest.len());
    if mode & 1 == 0 {
        write_raw_header(&mut file).unwrap();
    }
    file.extend_from_slice(rest);
    report(&file, mode & 2 != 0)
}

/// The `diagnostics_response` target; returns whether the response was accepted.
fn diagnostics_response(data: &[u8]) -> bool {
    let result = corsnap::diagnostics::decode_response(data);
    if result.is_ok() {
        assert!(data.len() >= 24 && data.starts_with(b"DOTNET_IPC_V1\0"));
    }
    result.is_ok()
}

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
        }
        .encode_into(&mut data);
    }
    assert_eq!(raw_recording(&data), 3);
    data[0] = 2;
    assert_eq!(raw_recording(&data), 3);
}
