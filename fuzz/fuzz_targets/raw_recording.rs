//! What `corsnap report` does with a raw recording file: check the header,
//! read frames into `ProfileBuilder` until the end or the first damage, and
//! render the profile with every writer, split by event kind as the CLI
//! splits it. An even first byte puts a valid header in front of the rest of
//! the input, so the fuzzer spends its time past the magic. Replayed (same
//! body) by `crates/corsnap/tests/fuzz_corpus.rs`.

#![no_main]

#[path = "../bodies/raw_recording.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    body::run(data);
});
