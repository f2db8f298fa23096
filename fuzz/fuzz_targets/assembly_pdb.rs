//! An assembly and a portable PDB as `--lines` reads them from disk: the
//! PE debug directory, the embedded PDB's deflate stream, the PDB's
//! metadata and sequence points. Replayed (same body) by
//! `crates/corsnap/tests/fuzz_corpus.rs`.

#![no_main]

#[path = "../bodies/assembly_pdb.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    body::run(data);
});
