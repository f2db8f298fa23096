//! The `raw_recording` fuzz target's body, shared by `fuzz/fuzz_targets/raw_recording.rs` and
//! the stable smoke run in `cargo test` (crates/corsnap/tests/fuzz_corpus.rs), so the two cannot drift.

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

/// An even first byte puts a valid header first; returns the samples read.
pub fn run(data: &[u8]) -> usize {
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
