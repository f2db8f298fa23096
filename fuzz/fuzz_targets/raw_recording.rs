//! What `corsnap report` does with a raw recording file: check the header,
//! read frames into `ProfileBuilder` until the end or the first damage, and
//! render the profile with every writer, split by event kind as the CLI
//! splits it. An even first byte puts a valid header in front of the rest of
//! the input, so the fuzzer spends its time past the magic. Replayed (same
//! body) by `crates/corsnap/tests/fuzz_corpus.rs`.

#![no_main]

use corsnap_profile::writers::{writer_for, Format, WriteOptions};
use corsnap_profile::{Profile, ProfileBuilder};
use corsnap_wire::{read_message, read_raw_header, write_raw_header};
use libfuzzer_sys::fuzz_target;

fn report(file: &[u8], threads: bool) {
    let mut input = file;
    if read_raw_header(&mut input).is_err() {
        return;
    }
    let mut builder = ProfileBuilder::new();
    let mut scratch = Vec::new();
    while let Ok(Some(msg)) = read_message(&mut input, &mut scratch) {
        builder.apply(&msg);
    }
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
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut file = Vec::with_capacity(12 + rest.len());
    if mode & 1 == 0 {
        write_raw_header(&mut file).unwrap();
    }
    file.extend_from_slice(rest);
    report(&file, mode & 2 != 0);
});
