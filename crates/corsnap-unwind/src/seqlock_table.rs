//! A table of three-word entries that every thread reads and any thread but
//! a signal handler writes, with nothing that blocks or allocates: the
//! process-wide memories of the walks ([`crate::leaf_rules`],
//! [`crate::known_addresses::SharedKnownAddresses`]).
//!
//! Each entry is a sequence lock of plain atomics, four words (32 bytes,
//! two to a cache line): its sequence, then its three words. A writer claims
//! an entry by moving its sequence from even to odd, and gives up if another
//! writer holds it; a reader takes what it read only if the sequence was
//! even and the same before and after. A lost race only loses an entry,
//! which the walk's full lookup then serves. A signal handler never writes:
//! a claim is a locked instruction on a line other cores read, and the
//! handler hands what it learned to the agent instead.

use std::sync::atomic::{fence, AtomicU64, Ordering};

/// Words an entry takes: its sequence and three words of data.
const WORDS: usize = 4;

pub(crate) struct SeqlockTable {
    words: Box<[AtomicU64]>,
}

impl SeqlockTable {
    /// Where its entries lie, as (address, bytes).
    pub(crate) fn block(&self) -> (usize, usize) {
        (self.words.as_ptr() as usize, std::mem::size_of_val(&*self.words))
    }
}

impl Default for SeqlockTable {
    /// A table of no entries: nothing kept, nothing found.
    fn default() -> Self {
        SeqlockTable { words: Box::new([]) }
    }
}

impl SeqlockTable {
    /// A table of `entries` empty entries (all words 0).
    pub(crate) fn new(entries: usize) -> Self {
        SeqlockTable { words: (0..entries * WORDS).map(|_| AtomicU64::new(0)).collect() }
    }

    pub(crate) fn len(&self) -> usize {
        self.words.len() / WORDS
    }

    fn entry(&self, index: usize) -> Option<&[AtomicU64]> {
        self.words.get(index.checked_mul(WORDS)?..index * WORDS + WORDS)
    }

    /// Where entry `index` lies, for a prefetch (0 if there is none).
    pub(crate) fn line_of(&self, index: usize) -> u64 {
        self.entry(index).map_or(0, |e| e.as_ptr() as u64)
    }

    /// Entry `index`'s words, unless a writer is changing them (or there is
    /// no such entry). An entry never written reads as zeros.
    pub(crate) fn read(&self, index: usize) -> Option<[u64; 3]> {
        let e = self.entry(index)?;
        let seq = e[0].load(Ordering::Acquire);
        if seq & 1 != 0 {
            return None;
        }
        let words = [e[1].load(Ordering::Relaxed), e[2].load(Ordering::Relaxed), e[3].load(Ordering::Relaxed)];
        fence(Ordering::Acquire);
        (e[0].load(Ordering::Relaxed) == seq).then_some(words)
    }

    /// Writes entry `index`, unless another writer holds it. Never from a
    /// signal handler (see the module documentation).
    pub(crate) fn write(&self, index: usize, words: [u64; 3]) {
        let Some(e) = self.entry(index) else { return };
        let seq = e[0].load(Ordering::Relaxed);
        if seq & 1 == 0 && e[0].compare_exchange(seq, seq + 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
            // The odd sequence is seen before any word changes.
            fence(Ordering::Release);
            for (cell, word) in e[1..].iter().zip(words) {
                cell.store(word, Ordering::Relaxed);
            }
            e[0].store(seq + 2, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reads_back_what_was_written_and_others_stay_empty() {
        let table = SeqlockTable::new(5);
        assert_eq!(table.len(), 5);
        table.write(2, [1, 2, 3]);
        assert_eq!(table.read(2), Some([1, 2, 3]));
        assert_eq!(table.read(1), Some([0, 0, 0]));
        assert_eq!(table.read(5), None);
        table.write(5, [1, 2, 3]);
        assert_eq!(SeqlockTable::default().read(0), None);
    }

    #[test]
    fn a_reader_never_sees_half_of_a_write() {
        let table = std::sync::Arc::new(SeqlockTable::new(1));
        let writer = {
            let table = table.clone();
            std::thread::spawn(move || {
                for i in 0..200_000u64 {
                    table.write(0, [i, i, i]);
                }
            })
        };
        let mut seen = 0;
        while !writer.is_finished() {
            if let Some([a, b, c]) = table.read(0) {
                assert!(a == b && b == c, "{a} {b} {c}");
                seen += 1;
            }
        }
        writer.join().unwrap();
        // On a loaded machine the writer may finish before this thread ran
        // at all (CI: `seen` was 0). With no write in progress, a read must
        // succeed and see the last write whole.
        assert_eq!(table.read(0), Some([199_999; 3]), "after {seen} reads during the writes");
    }
}
