//! Native addresses of managed frames to IL offsets, for source lines.
//!
//! The runtime keeps, per native code body (each tier, OSR variant and
//! ReadyToRun image of a method is its own body), a map from native offsets
//! to the IL offsets they were compiled from. `GetNativeCodeStartAddresses`
//! lists a method's bodies and `GetILToNativeMapping3` gives the map of one
//! body by its start, so an address maps through the body it lies in, not
//! through whichever tier happens to be current. Both are asked once per body
//! and kept; an address is then a lookup. The CLI turns IL offsets into
//! `file:line` with the assembly's PDB; the agent never reads PDBs.
//!
//! Runs on the sampler thread only, after the runtime was resumed (the
//! suspend engine) or off the signal path (the signal engine), never in a
//! callback or a signal handler.

use std::collections::HashMap;

use corsnap_abi::{il_map, CorProfilerInfo, FunctionID, IlToNativeMap};
use corsnap_wire::NO_IL_OFFSET;

/// Entries kept before the caches are emptied (and counted), like the
/// sampler's other caches.
const CACHE_CAP: usize = 200_000;

/// One native code body of a method and its IL map, sorted by native start.
#[derive(Debug)]
struct Body {
    start: u64,
    map: Vec<IlToNativeMap>,
}

#[derive(Debug, Default)]
pub struct IlOffsets {
    bodies: HashMap<FunctionID, Vec<Body>>,
    /// Lookup address to IL offset ([`NO_IL_OFFSET`] when none).
    by_address: HashMap<(FunctionID, u64), u32>,
    pub cache_resets: u64,
    logged: u32,
}

impl IlOffsets {
    pub fn new() -> Self {
        Self::default()
    }

    /// The IL offset `address` (inside the instruction it stands for: a
    /// return address less one) of `function` was compiled from.
    /// `body_start`, when the caller knows it (the signal engine learned the
    /// body), is where that body starts: an OSR variant is not among the
    /// method's listed bodies, and is found by it.
    pub fn il_offset(
        &mut self,
        info: &CorProfilerInfo,
        function: FunctionID,
        body_start: Option<u64>,
        address: u64,
    ) -> u32 {
        if function == 0 || address == 0 {
            return NO_IL_OFFSET;
        }
        if let Some(&offset) = self.by_address.get(&(function, address)) {
            return offset;
        }
        if self.by_address.len() >= CACHE_CAP || self.bodies.len() >= CACHE_CAP {
            self.by_address.clear();
            self.bodies.clear();
            self.cache_resets += 1;
        }
        let mut offset = self.lookup(function, address);
        if offset.is_none() {
            // A body made since the method was last asked about (a new tier).
            match body_start {
                Some(start) => self.learn_body(info, function, start),
                None => self.learn(info, function),
            }
            offset = self.lookup(function, address);
        }
        if offset.is_none_or(|o| o == NO_IL_OFFSET) && self.logged < 10 {
            // For the agent's log: why frames go without a line.
            self.logged += 1;
            let bodies = self.bodies.get(&function).map_or(0, Vec::len);
            crate::log::write(format_args!(
                "no IL offset for {address:#x} in function {function:#x} ({bodies} bodies known)"
            ));
        }
        let offset = offset.unwrap_or(NO_IL_OFFSET);
        self.by_address.insert((function, address), offset);
        offset
    }

    fn lookup(&self, function: FunctionID, address: u64) -> Option<u32> {
        let bodies = self.bodies.get(&function)?;
        // Bodies never overlap, and `address` is in one of this method's:
        // the one starting last at or before it.
        let body = bodies.iter().filter(|b| b.start <= address).max_by_key(|b| b.start)?;
        let native = u32::try_from(address - body.start).ok()?;
        // Past its map's end: in a body not learned yet.
        let end = body.map.iter().map(|m| m.native_end.max(m.native_start)).max()?;
        (native < end).then(|| il_offset_at(&body.map, native))
    }

    fn learn_body(&mut self, info: &CorProfilerInfo, function: FunctionID, start: u64) {
        let bodies = self.bodies.entry(function).or_default();
        if start == 0 || bodies.iter().any(|b| b.start == start) {
            return;
        }
        let mut map = info.get_il_to_native_mapping3(start as usize).unwrap_or_default();
        map.sort_by_key(|m| m.native_start);
        bodies.push(Body { start, map });
    }

    fn learn(&mut self, info: &CorProfilerInfo, function: FunctionID) {
        let starts = info.get_native_code_start_addresses(function).unwrap_or_default();
        for start in starts {
            self.learn_body(info, function, start);
        }
    }
}

/// The IL offset of native offset `native` in a body whose map (sorted by
/// native start) is `map`: the entry that starts last at or before it. An
/// entry for a prolog, an epilog or code with no IL gives [`NO_IL_OFFSET`];
/// so does an offset past the last entry's end.
pub fn il_offset_at(map: &[IlToNativeMap], native: u32) -> u32 {
    let at = map.partition_point(|m| m.native_start <= native);
    // Entries may share a start (an empty one before the real one): of
    // those, one with a real IL offset.
    let Some(last) = at.checked_sub(1) else { return NO_IL_OFFSET };
    let end = &map[last];
    if last + 1 == map.len() && end.native_end > end.native_start && native >= end.native_end {
        // Past the end of the last entry: code the map does not cover.
        return NO_IL_OFFSET;
    }
    let start = end.native_start;
    map[..at]
        .iter()
        .rev()
        .take_while(|m| m.native_start == start)
        .find(|m| !matches!(m.il_offset, il_map::NO_MAPPING | il_map::PROLOG | il_map::EPILOG))
        .map_or(NO_IL_OFFSET, |m| m.il_offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(il_offset: u32, native_start: u32, native_end: u32) -> IlToNativeMap {
        IlToNativeMap { il_offset, native_start, native_end }
    }

    #[test]
    fn an_offset_maps_through_the_entry_it_lies_in() {
        let map = [
            entry(il_map::PROLOG, 0, 0x10),
            entry(0, 0x10, 0x20),
            entry(0x0c, 0x20, 0x48),
            entry(0x1a, 0x48, 0x50),
            entry(il_map::EPILOG, 0x50, 0x58),
        ];
        assert_eq!(il_offset_at(&map, 0x05), NO_IL_OFFSET, "prolog");
        assert_eq!(il_offset_at(&map, 0x10), 0);
        assert_eq!(il_offset_at(&map, 0x1f), 0);
        assert_eq!(il_offset_at(&map, 0x20), 0x0c);
        assert_eq!(il_offset_at(&map, 0x47), 0x0c);
        assert_eq!(il_offset_at(&map, 0x48), 0x1a);
        assert_eq!(il_offset_at(&map, 0x52), NO_IL_OFFSET, "epilog");
        assert_eq!(il_offset_at(&map, 0x60), NO_IL_OFFSET, "past the map");
        assert_eq!(il_offset_at(&[], 0x10), NO_IL_OFFSET);
    }

    #[test]
    fn of_entries_sharing_a_start_the_one_with_il_wins() {
        let map = [entry(0, 0, 0x10), entry(il_map::NO_MAPPING, 0x10, 0x10), entry(0x22, 0x10, 0x30)];
        assert_eq!(il_offset_at(&map, 0x14), 0x22);
    }

    #[test]
    fn a_no_mapping_region_has_no_offset() {
        let map = [entry(0, 0, 0x10), entry(il_map::NO_MAPPING, 0x10, 0x18), entry(0x08, 0x18, 0x30)];
        assert_eq!(il_offset_at(&map, 0x12), NO_IL_OFFSET);
        assert_eq!(il_offset_at(&map, 0x18), 0x08);
    }
}
