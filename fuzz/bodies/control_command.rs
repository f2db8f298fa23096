//! The `control_command` fuzz target's body, shared by `fuzz/fuzz_targets/control_command.rs` and
//! the stable smoke run in `cargo test` (crates/corsnap-wire/tests/fuzz_corpus.rs), so the two cannot drift.

use corsnap_wire::{read_command, AttachRequest, Command};

/// `AttachRequest::decode` declines client data longer than this.
const ATTACH_LIMIT: usize = 8192;

fn command_round_trip(cmd: Command) {
    let mut buf = Vec::new();
    cmd.encode_into(&mut buf);
    assert!(buf.len() - 4 <= corsnap_wire::MAX_COMMAND_LEN as usize);
    assert_eq!(Command::decode(&buf[4..]), Ok(cmd));
}

/// Returns how many commands and attach requests decoded.
pub fn run(data: &[u8]) -> usize {
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
