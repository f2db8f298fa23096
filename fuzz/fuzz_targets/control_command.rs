//! The CLI→agent control channel and the attach request's client data, both
//! parsed inside the profiled process: `read_command` over the input as a
//! stream, `Command::decode` of one body, and `AttachRequest::decode`, each
//! round-tripped when it succeeds. Replayed (same body) by
//! `crates/corsnap-wire/tests/fuzz_corpus.rs`.

#![no_main]

#[path = "../bodies/control_command.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    body::run(data);
});
