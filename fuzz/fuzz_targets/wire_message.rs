//! The agent→CLI messages: one frame body through `Message::decode`, the
//! whole input as a stream through `read_message`, and every message that
//! decodes must encode back to something that decodes to the same message.
//! Replayed (same body) by `crates/corsnap-wire/tests/fuzz_corpus.rs`.

#![no_main]

#[path = "../bodies/wire_message.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    body::run(data);
});
