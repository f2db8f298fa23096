//! The agent→CLI messages: one frame body through `Message::decode`, the
//! whole input as a stream through `read_message`, and every message that
//! decodes must encode back to something that decodes to the same message.
//! Replayed (same body) by `crates/corsnap-wire/tests/fuzz_corpus.rs`.

#![no_main]

use corsnap_wire::{read_message, Message};
use libfuzzer_sys::fuzz_target;

fn round_trip(msg: &Message) {
    let mut buf = Vec::new();
    msg.encode_into(&mut buf);
    let again = Message::decode(&buf[4..]).expect("a message we encoded must decode");
    assert_eq!(&again, msg, "message changed in an encode/decode round trip");
    let mut framed = &buf[..];
    let read = read_message(&mut framed, &mut Vec::new()).expect("a framed message must read");
    assert_eq!(read.as_ref(), Some(msg));
    assert!(framed.is_empty());
}

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = Message::decode(data) {
        round_trip(&msg);
    }
    let mut input = data;
    let mut scratch = Vec::new();
    while let Ok(Some(msg)) = read_message(&mut input, &mut scratch) {
        round_trip(&msg);
    }
});
