//! Smoke run of the `wire_message` and `control_command` fuzz targets on
//! stable, without libFuzzer: every file of their corpora (including the
//! inputs that once failed), then deterministic pseudo-random inputs. The
//! bodies below are the targets' own (`fuzz/fuzz_targets/*.rs`); keep them
//! in step.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use corsnap_wire::{read_command, read_message, AttachRequest, Command, Message};

/// `AttachRequest::decode` declines client data longer than this.
const ATTACH_LIMIT: usize = 8192;

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

/// The `wire_message` target; returns how many messages decoded.
fn wire_message(data: &[u8]) -> usize {
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

fn command_round_trip(cmd: Command) {
    let mut buf = Vec::new();
    cmd.encode_into(&mut buf);
    assert!(buf.len() - 4 <= corsnap_wire::MAX_COMMAND_LEN as usize);
    assert_eq!(Command::decode(&buf[4..]), Ok(cmd));
}

/// The `control_command` target; returns how many commands and requests decoded.
fn control_command(data: &[u8]) -> usize {
    let mut decoded = 0;
    let mut input = data;
    while let Ok(Some(result)) = read_command(&mut input) {
        if let Ok(cmd) = result {
            command_round_trip(cmd);
            decoded += 1;
        }
    }
    if let Ok(cmd) = Command::decode(data) {
        command_round_trip(cmd);
        decoded += 1;
    }
    if let Some(request) = AttachRequest::decode(data) {
        let encoded = request.encode();
        // The canonical form can be one byte longer than the input (the last
        // newline), and anything over the 8 KiB limit is declined.
        let expected = (encoded.len() <= ATTACH_LIMIT).then_some(request);
        assert_eq!(AttachRequest::decode(&encoded), expected, "attach request changed in a round trip");
        decoded += 1;
    }
    decoded
}

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
