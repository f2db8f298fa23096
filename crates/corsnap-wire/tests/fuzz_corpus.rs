//! Smoke run of the `wire_message` and `control_command` fuzz targets on
//! stable, without libFuzzer: every file of their corpora (including the
//! inputs that once failed), then deterministic pseudo-random inputs. The
//! bodies are the targets' own, from `fuzz/bodies/`.

#[path = "../../../fuzz/replay.rs"]
mod replay;

#[path = "../../../fuzz/bodies/control_command.rs"]
mod control_command_body;
#[path = "../../../fuzz/bodies/wire_message.rs"]
mod wire_message_body;

use corsnap_wire::{AttachRequest, Message};

use control_command_body::run as control_command;
use wire_message_body::run as wire_message;

#[test]
fn wire_message_corpus_replays() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "wire_message");
    let mut decoded = 0;
    replay::replay_corpus("wire_message", &corpus, |data| decoded += wire_message(data));
    assert!(decoded >= 10, "the corpus should hold every message kind, only {decoded} messages decoded");
}

#[test]
fn wire_message_pseudo_random() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "wire_message");
    replay::pseudo_random_run(0x5EED_0001, &corpus, |data| {
        wire_message(data);
    });
}

#[test]
fn control_command_corpus_replays() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "control_command");
    let mut decoded = 0;
    replay::replay_corpus("control_command", &corpus, |data| decoded += control_command(data));
    assert!(decoded >= 7, "the corpus should hold every command, only {decoded} decoded");
}

#[test]
fn control_command_pseudo_random() {
    let corpus = replay::corpus(env!("CARGO_MANIFEST_DIR"), "control_command");
    replay::pseudo_random_run(0x5EED_0002, &corpus, |data| {
        control_command(data);
    });
}

/// The two inputs that failed before the fixes, spelled out.
#[test]
fn regressions_found_by_fuzzing() {
    // Message::decode accepted a string longer than the encoder ever writes,
    // so the message changed in a round trip; it is now refused.
    let mut body = vec![7u8];
    body.extend_from_slice(&(corsnap_wire::MAX_STRING_LEN as u32 + 1).to_le_bytes());
    body.resize(body.len() + corsnap_wire::MAX_STRING_LEN + 1, b'x');
    assert!(Message::decode(&body).is_err());
    wire_message(&body);

    // A value ending in '\r' lost it in an attach request round trip.
    let data = b"corsnap-attach-v1\nsocket=/s\nrate=1\nevents=1\nlog=/tmp/a.log\r";
    let request = AttachRequest::decode(data).unwrap();
    assert_eq!(request.log.as_deref(), Some("/tmp/a.log\r"));
    control_command(data);
}
