//! The `assembly_pdb` fuzz target's body, shared by
//! `fuzz/fuzz_targets/assembly_pdb.rs` and the stable smoke run in
//! `cargo test` (crates/corsnap/tests/fuzz_corpus.rs): what `--lines` does
//! with an assembly and a PDB found on disk, both outside input.

use corsnap::source_lines::{inflate_embedded_pdb, portable_pdb_id, read_debug_directory, AssemblyLines};

/// The input as an assembly (its debug directory, an embedded PDB) and as
/// a PDB; returns how many lines were found.
pub fn run(data: &[u8]) -> usize {
    let mut found = 0;
    if let Ok(debug) = read_debug_directory(data) {
        if let Some(pdb) = debug.embedded.as_ref().and_then(|e| inflate_embedded_pdb(e).ok()) {
            found += lines(&pdb, debug.pdb_id);
        }
    }
    // As a PDB, checked against the id it gives itself: parsed, converted
    // and looked up.
    found += lines(data, portable_pdb_id(data));
    found
}

fn lines(pdb: &[u8], id: Option<([u8; 16], u32)>) -> usize {
    let Ok(lines) = AssemblyLines::from_pdb(pdb, id) else { return 0 };
    (0..4u32)
        .flat_map(|method| (0..64).map(move |il| (0x0600_0001 + method, il)))
        .filter(|&(token, il)| lines.line(token, il).is_some())
        .count()
}
