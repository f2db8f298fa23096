//! A FIFO's reader for tests that write profiles into one.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Runs `cmd` while a reader that was waiting on `fifo` before it started
/// reads what arrives. A run that hangs (waiting for a reader that was given
/// up on) is killed after a minute, and the reader is let go.
pub fn through_fifo(fifo: &Path, mut cmd: Command) -> (Output, String) {
    let reader_path = fifo.to_path_buf();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::fs::File::open(&reader_path).unwrap().read_to_string(&mut text).unwrap();
        text
    });
    // The reader is waiting in open() before the writer starts.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            // Opening for reading and writing never waits: it lets the reader go.
            let _ = std::fs::OpenOptions::new().read(true).write(true).open(fifo);
            panic!("the writer of {} hung", fifo.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    if !out.status.success() {
        let _ = std::fs::OpenOptions::new().read(true).write(true).open(fifo);
    }
    (out, reader.join().unwrap())
}
