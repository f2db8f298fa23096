//! The CLI→agent control channel and the attach request's client data, both
//! parsed inside the profiled process: `read_command` over the input as a
//! stream, `Command::decode` of one body, and `AttachRequest::decode`, each
//! round-tripped when it succeeds. Replayed (same body) by
//! `crates/corsnap-wire/tests/fuzz_corpus.rs`.

#![no_main]

use corsnap_wire::{read_command, AttachRequest, Command};
use libfuzzer_sys::fuzz_target;

/// `AttachRequest::decode` declines client data longer than this.
const ATTACH_LIMIT: usize = 8192;

fn round_trip(cmd: Command) {
    let mut buf = Vec::new();
    cmd.encode_into(&mut buf);
    assert!(buf.len() - 4 <= corsnap_wire::MAX_COMMAND_LEN as usize);
    assert_eq!(Command::decode(&buf[4..]), Ok(cmd));
}

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    while let Ok(Some(result)) = read_command(&mut input) {
        if let Ok(cmd) = result {
            round_trip(cmd);
        }
    }
    if let Ok(cmd) = Command::decode(data) {
        round_trip(cmd);
    }
    if let Some(request) = AttachRequest::decode(data) {
        let encoded = request.encode();
        // The canonical form can be one byte longer than the input (the last
        // newline), and anything over the 8 KiB limit is declined.
        let expected = (encoded.len() <= ATTACH_LIMIT).then_some(request);
        assert_eq!(AttachRequest::decode(&encoded), expected, "attach request changed in a round trip");
    }
});
