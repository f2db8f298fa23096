//! Shared by the `tests/fuzz_corpus.rs` smoke runs of the workspace crates
//! (each includes this file with `#[path]`): load a target's corpus, and
//! generate deterministic pseudo-random inputs, half of them mutated from the
//! corpus, so `cargo test` exercises the parsers without cargo-fuzz or a
//! nightly compiler. Not part of the fuzz crate itself.

#![allow(dead_code)]

use std::fs;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// Inputs per parser in the pseudo-random run.
pub const RANDOM_INPUTS: usize = 20_000;
/// Pseudo-random inputs are shorter than this.
pub const MAX_RANDOM_LEN: usize = 512;

/// `fuzz/corpus/<target>`, from a crate directory two levels below the root.
pub fn corpus_dir(manifest_dir: &str, target: &str) -> PathBuf {
    Path::new(manifest_dir).join("../../fuzz/corpus").join(target)
}

/// Every file of a target's corpus, sorted by name; panics if the directory
/// is missing or empty, so a lost corpus fails the suite instead of passing
/// vacuously.
pub fn corpus(manifest_dir: &str, target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(manifest_dir, target);
    let entries = fs::read_dir(&dir).unwrap_or_else(|e| panic!("fuzz corpus {} is missing: {e}", dir.display()));
    let mut files: Vec<(String, Vec<u8>)> = entries
        .map(|entry| {
            let path = entry.expect("reading the corpus directory").path();
            let bytes = fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            (path.file_name().unwrap().to_string_lossy().into_owned(), bytes)
        })
        .collect();
    assert!(!files.is_empty(), "fuzz corpus {} is empty", dir.display());
    files.sort();
    files
}

/// xorshift64*: small, fast, and the same sequence on every machine.
#[derive(Debug)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        XorShift(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform enough in `0..n`; `n` must not be 0.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Values that make length and count fields interesting.
const INTERESTING_U32: [u32; 9] = [0, 1, 2, 4, 8, 0x7F, 0xFFFF, 0x7FFF_FFFF, 0xFFFF_FFFF];

/// A few byte-level mutations, as libFuzzer's simplest ones.
pub fn mutate(rng: &mut XorShift, buf: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        match rng.below(7) {
            0 if !buf.is_empty() => {
                let i = rng.below(buf.len());
                buf[i] ^= 1 << rng.below(8);
            }
            1 if !buf.is_empty() => {
                let i = rng.below(buf.len());
                buf[i] = rng.next_u64() as u8;
            }
            2 if !buf.is_empty() => {
                let i = rng.below(buf.len());
                buf.remove(i);
            }
            3 => {
                let i = rng.below(buf.len() + 1);
                buf.insert(i, rng.next_u64() as u8);
            }
            4 if !buf.is_empty() => {
                let len = rng.below(buf.len());
                buf.truncate(len);
            }
            5 if buf.len() >= 4 => {
                let i = rng.below(buf.len() - 3);
                let v = INTERESTING_U32[rng.below(INTERESTING_U32.len())];
                buf[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            6 if !buf.is_empty() => {
                // Repeat a slice of the input: duplicated frames and fields.
                let start = rng.below(buf.len());
                let end = start + rng.below(buf.len() - start + 1);
                let copy = buf[start..end].to_vec();
                let at = rng.below(buf.len() + 1);
                buf.splice(at..at, copy);
            }
            _ => {}
        }
    }
}

/// Calls `run` on [`RANDOM_INPUTS`] inputs shorter than [`MAX_RANDOM_LEN`]:
/// one in four is random bytes, the rest are corpus files mutated.
pub fn pseudo_random_run(seed: u64, corpus: &[(String, Vec<u8>)], mut run: impl FnMut(&[u8])) {
    let mut rng = XorShift::new(seed);
    let mut buf = Vec::with_capacity(2 * MAX_RANDOM_LEN);
    for i in 0..RANDOM_INPUTS {
        buf.clear();
        if i % 4 == 0 {
            let len = rng.below(MAX_RANDOM_LEN);
            buf.extend((0..len).map(|_| rng.next_u64() as u8));
        } else {
            let (_, base) = &corpus[rng.below(corpus.len())];
            buf.extend_from_slice(&base[..base.len().min(MAX_RANDOM_LEN)]);
            mutate(&mut rng, &mut buf);
            buf.truncate(MAX_RANDOM_LEN - 1);
        }
        if panic::catch_unwind(AssertUnwindSafe(|| run(&buf))).is_err() {
            panic!("pseudo-random input {i} (seed {seed}) failed: {buf:?}");
        }
    }
}

/// Calls `run` on every corpus file, naming the file that fails.
pub fn replay_corpus(target: &str, corpus: &[(String, Vec<u8>)], mut run: impl FnMut(&[u8])) {
    for (name, bytes) in corpus {
        if panic::catch_unwind(AssertUnwindSafe(|| run(bytes))).is_err() {
            panic!("fuzz/corpus/{target}/{name} failed");
        }
    }
}
