//! Where in a large function table to look for an address.
//!
//! A ReadyToRun image's `RUNTIME_FUNCTION` table is long (CoreLib's: about
//! 50,000 entries, 600 KB), and a binary search of it for a frame met
//! without a kept rule (a leaf outside the kept stretches, a return address
//! met for the first time) made 16 reads one after the other, ten or more
//! of them on lines of their own, each a cache miss at 100 samples a
//! second. On .NET 10, where exceptions are dispatched by CoreLib's managed
//! code, those frames are common while a program is still being learned.
//!
//! So an image's table gets a page index, as a native module's rows have
//! (`native_table`): for each KiB of code, the first entry beginning at or
//! after it. A search then reads one word of the index and the few entries
//! that begin in that KiB (a line or two), and the entry before them when
//! the function began earlier. Built with the image's body rules, on the
//! agent's thread; 4 bytes a KiB of code (CoreLib's: about 40 KB).

/// The index's granularity: 1 KiB of code a page, a handful of functions.
const PAGE_SHIFT: u32 = 10;
/// Tables shorter than this are searched whole: a JIT'd body's table holds
/// the body and its funclets, a line or two.
const INDEXED_FROM: usize = 64;
const ENTRY: usize = 12;

/// The begin RVA of entry `i` (the walk's own reader of table fields).
fn begin_at(table: &[u8], i: usize) -> Option<u32> {
    crate::table_rva(table, i * ENTRY)
}

/// The end RVA of entry `i`.
fn end_at(table: &[u8], i: usize) -> Option<u32> {
    crate::table_rva(table, i * ENTRY + 4)
}

/// The page index of `table` (`RUNTIME_FUNCTION` records sorted by their
/// begin RVA); empty for a short table, or one not sorted.
pub(crate) fn index(table: &[u8]) -> Vec<u32> {
    let count = table.len() / ENTRY;
    if count < INDEXED_FROM || u32::try_from(count).is_err() {
        return Vec::new();
    }
    if (1..count).any(|i| begin_at(table, i - 1) > begin_at(table, i)) {
        return Vec::new();
    }
    let Some(last) = begin_at(table, count - 1) else { return Vec::new() };
    let mut pages = Vec::with_capacity((last >> PAGE_SHIFT) as usize + 2);
    let mut entry = 0usize;
    for page in 0..=(u64::from(last) >> PAGE_SHIFT) + 1 {
        let page_start = page << PAGE_SHIFT;
        while entry < count && begin_at(table, entry).is_some_and(|b| u64::from(b) < page_start) {
            entry += 1;
        }
        pages.push(entry as u32);
    }
    pages
}

/// The byte offset in `table` of the entry whose function holds `rva`, by
/// the page index `pages` (see [`index`]), or by a search of the whole
/// table when it has none.
pub(crate) fn entry_of(table: &[u8], pages: &[u32], rva: u32) -> Option<usize> {
    let count = table.len() / ENTRY;
    let (mut lo, mut hi) = if pages.is_empty() {
        (0, count)
    } else {
        let page = (rva >> PAGE_SHIFT) as usize;
        // Entries beginning in the page lie in pages[page]..pages[page + 1];
        // past the index's end, only the last entry can hold the address.
        match (pages.get(page), pages.get(page + 1)) {
            (Some(&from), Some(&to)) => (from as usize, (to as usize).min(count)),
            _ => (count, count),
        }
    };
    // The last entry beginning at or before `rva`: in the range, or the one
    // before it.
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if begin_at(table, mid)? <= rva {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let i = lo.checked_sub(1)?;
    (begin_at(table, i)? <= rva && rva < end_at(table, i)?).then_some(i * ENTRY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(functions: &[(u32, u32)]) -> Vec<u8> {
        functions.iter().flat_map(|&(b, e)| [b.to_le_bytes(), e.to_le_bytes(), 0u32.to_le_bytes()]).flatten().collect()
    }

    /// Functions of every size (a few bytes, across several pages), with
    /// gaps between some: the index finds for every address the entry the
    /// search of the whole table finds.
    #[test]
    fn the_index_finds_what_the_whole_search_finds() {
        let mut functions = Vec::new();
        let mut at = 0x1000u32;
        let mut seed = 7u32;
        for i in 0..400 {
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let len = match i % 7 {
                0 => 5000 + seed % 3000,
                1 => 1 + seed % 8,
                _ => 16 + seed % 700,
            };
            functions.push((at, at + len));
            at += len + if i % 5 == 0 { seed % 300 } else { 0 };
        }
        let table = table(&functions);
        let pages = index(&table);
        assert!(!pages.is_empty());
        for rva in 0..at + 0x900 {
            assert_eq!(entry_of(&table, &pages, rva), entry_of(&table, &[], rva), "at {rva:#x}");
        }
        assert_eq!(entry_of(&table, &pages, 0x1000), Some(0));
        assert_eq!(entry_of(&table, &pages, functions[399].0), Some(399 * ENTRY));
    }

    #[test]
    fn short_or_unsorted_tables_are_not_indexed() {
        let short: Vec<(u32, u32)> = (0..10).map(|i| (i * 100, i * 100 + 50)).collect();
        assert!(index(&table(&short)).is_empty());
        let mut unsorted: Vec<(u32, u32)> = (0..100).map(|i| (i * 100, i * 100 + 50)).collect();
        unsorted.swap(3, 60);
        assert!(index(&table(&unsorted)).is_empty());
    }
}
