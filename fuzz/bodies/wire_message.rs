//! The `wire_message` fuzz target's body, shared by `fuzz/fuzz_targets/wire_message.rs` and
//! the stable smoke run in `cargo test` (crates/corsnap-wire/tests/fuzz_corpus.rs), so the two cannot drift.

use corsnap_wire::{read_message, Message};

fn message_round_trip(msg: &Message) {
    let mut buf = Vec::new();
    msg.encode_into(&mut buf);
    let again = Message::decode(&buf[4..]).expect("a message we encoded must decode");
    assert_eq!(&again, msg, "message changed in an encode/decode round trip");
    let mut framed = &buf[..];
    let read = read_message(&mut framed, &mut Vec::new()).expect("a framed message must read");
    assert_eq!(read.as_ref(), Some(msg));
    assert!(framed.is_empty());
}

/// Returns how many messages decoded.
pub fn run(data: &[u8]) -> usize {
    let mut decoded = 0;
    if let Ok(msg) = Message::decode(data) {
        message_round_trip(&msg);
        decoded += 1;
    }
    let mut input = data;
    let mut scratch = Vec::new();
    while let Ok(Some(msg)) = read_message(&mut input, &mut scratch) {
        message_round_trip(&msg);
        decoded += 1;
    }
    decoded
}
