//! Where the runtime keeps what the signal engine needs to know about its
//! code, taken from the runtime's own description where it has one.
//!
//! From .NET 9, `libcoreclr.so` (or a single-file program's executable)
//! exports `DotNetRuntimeContractDescriptor`: a header (magic `DNCCDAC\0`)
//! pointing at a JSON description of the runtime's data structures (the
//! cDAC's types, globals and contract versions) and a table of pointers the
//! JSON's globals index. .NET 10's names the `RealCodeHeader`'s fields and the
//! whole code map: the `RangeSectionMap` (a five-level table from address to
//! `RangeSection`), each code heap's `CodeHeapListNode`, and the scheme of its
//! nibble map (`ExecutionManager` contract version 2: the constant-time map,
//! where a code start is found in at most two reads).
//!
//! The choice is made once, when the engine starts ([`RuntimeLayout::detect`]):
//! - a descriptor with the code map: code starts by the map, header fields
//!   from the descriptor;
//! - a runtime corsnap has measured (3.x, 5 to 9, and 10 without its
//!   descriptor): the header fields known for them (the same on every one:
//!   `MethodDesc` 0x18, count 0x20, records 0x24) and a verified scan back
//!   over the code for the header;
//! - anything else (a future runtime whose descriptor lacks what is needed,
//!   or whose header disagrees with what the descriptor says): no layout,
//!   and the engine says so and lets the `suspend` engine sample instead.
//!   A guessed layout could only give wrong stacks.
//!
//! Parsing and the decision are pure functions of the JSON and the version,
//! unit-tested on the descriptor of a real .NET 10.0.12.

use std::collections::HashMap;

use corsnap_abi::process::{read_own_bytes, read_own_u64};

/// `RealCodeHeader` field offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeHeaderLayout {
    pub method_desc: u64,
    pub count: u64,
    pub functions: u64,
}

/// What .NET Core 3.x and .NET 5 to 10 all use (checked live on 3.1, 8, 9
/// and 10; the descriptor of 10 says the same).
pub const KNOWN_HEADER: CodeHeaderLayout = CodeHeaderLayout { method_desc: 0x18, count: 0x20, functions: 0x24 };

/// The runtime's map from code address to code heap, and each heap's
/// nibble map: everything read from the descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeMapScheme {
    /// Address of the `RangeSectionMap`'s top level (256 pointers).
    pub top_level: u64,
    /// `ExecutionManager` contract version: 1 linear nibble map, 2 constant-time.
    pub nibble_version: u32,
    pub fragment_begin: u64,
    pub fragment_end: u64,
    pub fragment_section: u64,
    pub fragment_next: u64,
    pub section_flags: u64,
    pub section_heap_list: u64,
    pub section_r2r_module: u64,
    pub section_next_for_delete: u64,
    pub heap_start: u64,
    pub heap_end: u64,
    pub heap_map_base: u64,
    pub heap_header_map: u64,
    /// Code headers at or below this value mark stub blocks, not methods.
    pub stub_code_block_last: u64,
}

/// How the engine finds a JIT'd body's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeLayout {
    pub header: CodeHeaderLayout,
    /// The runtime's own code map, when its descriptor describes one.
    pub code_map: Option<CodeMapScheme>,
    /// Where the layout came from, for the log.
    pub source: &'static str,
}

/// `RangeSection` flags.
const RANGE_SECTION_CODEHEAP: u64 = 2;
const RANGE_SECTION_RANGELIST: u64 = 4;
const RANGE_SECTION_INTERPRETER: u64 = 8;

/// What the runtime's code map says about an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapLookup {
    /// In a JIT code heap: the body's start and its `RealCodeHeader`.
    Body { start: u64, header: u64 },
    /// In a code heap, in a block of stubs starting at `start`
    /// (`StubCodeBlockKind`).
    StubBlock { start: u64, kind: u64 },
    /// In a range of stubs (precode, virtual stub dispatch...).
    StubRange,
    /// In a ReadyToRun image.
    ReadyToRun,
    /// Nothing the runtime's code map knows.
    Unknown,
}

impl RuntimeLayout {
    /// The layout for the runtime in this process, or why there is none.
    /// `version` is the runtime's ("10.0.12"; "unknown" if not known).
    /// `CORSNAP_TEST_RUNTIME_VERSION` stands in for the version (the tests'
    /// way to meet a runtime corsnap does not know).
    pub fn detect(version: &str) -> Result<RuntimeLayout, String> {
        let overridden = std::env::var("CORSNAP_TEST_RUNTIME_VERSION").ok();
        let version = overridden.as_deref().unwrap_or(version);
        let descriptor = match read_contract_descriptor() {
            Ok(d) => d,
            Err(e) => {
                crate::log::write(format_args!("contract descriptor: {e}"));
                None
            }
        };
        choose(version, descriptor.as_ref())
    }

    /// Looks `ip` up in the runtime's code map (`None` without one, or when
    /// a read fails: the caller falls back to its scan).
    pub fn lookup(&self, ip: u64) -> Option<MapLookup> {
        let s = self.code_map.as_ref()?;
        // Five levels of 256 entries, indexed by address bits 56..49 down to
        // 24..17; bit 0 of a pointer marks a collectible entry.
        let mut level = s.top_level;
        for shift in [49u32, 41, 33, 25] {
            let entry = read_own_u64(level + 8 * ((ip >> shift) & 0xff))? & !1;
            if entry == 0 {
                return Some(MapLookup::Unknown);
            }
            level = entry;
        }
        let mut fragment = read_own_u64(level + 8 * ((ip >> 17) & 0xff))? & !1;
        let mut section = 0;
        for _ in 0..64 {
            if fragment == 0 {
                break;
            }
            let begin = read_own_u64(fragment + s.fragment_begin)?;
            let end = read_own_u64(fragment + s.fragment_end)?;
            if (begin..end).contains(&ip) {
                section = read_own_u64(fragment + s.fragment_section)?;
                break;
            }
            fragment = read_own_u64(fragment + s.fragment_next)? & !1;
        }
        if section == 0 {
            return Some(MapLookup::Unknown);
        }
        if read_own_u64(section + s.section_next_for_delete)? != 0 {
            return None; // being removed
        }
        let flags = read_own_u64(section + s.section_flags)? & 0xffff_ffff;
        if flags & RANGE_SECTION_INTERPRETER != 0 {
            return None;
        }
        if flags & RANGE_SECTION_RANGELIST != 0 {
            return Some(MapLookup::StubRange);
        }
        if read_own_u64(section + s.section_r2r_module)? != 0 {
            return Some(MapLookup::ReadyToRun);
        }
        if flags & RANGE_SECTION_CODEHEAP == 0 {
            return Some(MapLookup::Unknown);
        }
        let heap = read_own_u64(section + s.section_heap_list)?;
        if heap == 0 {
            return None;
        }
        let start = read_own_u64(heap + s.heap_start)?;
        let end = read_own_u64(heap + s.heap_end)?;
        if ip < start || ip > end {
            return Some(MapLookup::Unknown);
        }
        let map_base = read_own_u64(heap + s.heap_map_base)?;
        let header_map = read_own_u64(heap + s.heap_header_map)?;
        let read_unit = |index: u64| -> Option<u32> {
            let b = read_own_bytes(header_map + 4 * index, 4)?;
            Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        let Some(code_start) = find_method_code(ip.checked_sub(map_base)?, s.nibble_version, read_unit)? else {
            return Some(MapLookup::Unknown);
        };
        let code_start = map_base + code_start;
        let header = read_own_u64(code_start - 8)?;
        if header <= s.stub_code_block_last {
            return Some(MapLookup::StubBlock { start: code_start, kind: header });
        }
        Some(MapLookup::Body { start: code_start, header })
    }
}

/// Bytes of code per nibble, and nibbles per 32-bit map unit.
const BYTES_PER_BUCKET: u64 = 32;
const NIBBLES_PER_UNIT: u64 = 8;
/// How many map units a version-1 lookup reads back at most (about 32 KiB
/// of code, per unit 256 bytes): beyond, the caller scans instead.
const LINEAR_UNITS_MAX: u64 = 128;

/// The nibble-map lookup (the runtime's `FindMethodCode`, as the cDAC's
/// `NibbleMapConstantLookup` and `NibbleMapLinearLookup` do it): the start
/// of the code containing `relative` (an offset from the heap's map base),
/// as an offset from it. `Ok(None)`: no code there. `None`: a read failed or
/// a linear scan went too far.
fn find_method_code(relative: u64, version: u32, read_unit: impl Fn(u64) -> Option<u32>) -> Option<Option<u64>> {
    let is_pointer = |u: u32| version >= 2 && (u & 0xf) > 8;
    let decode_pointer = |u: u32| u64::from((u & !0xf) + (((u & 0xf) - 9) << 2));
    let absolute = |index: u64, nibble: u32| index * BYTES_PER_BUCKET + u64::from(nibble - 1) * 4;
    let mut index = relative / BYTES_PER_BUCKET;
    let byte_nibble = ((relative & (BYTES_PER_BUCKET - 1)) / 4 + 1) as u32;
    let mut unit = read_unit(index / NIBBLES_PER_UNIT)?;
    if is_pointer(unit) {
        return Some(Some(decode_pointer(unit)));
    }
    let shift = 28 - (index % NIBBLES_PER_UNIT) * 4;
    let mut t = unit >> shift;
    if t & 0xf != 0 && t & 0xf <= byte_nibble {
        return Some(Some(absolute(index, t & 0xf)));
    }
    t >>= 4;
    if t != 0 {
        index -= 1;
        while t & 0xf == 0 {
            t >>= 4;
            index -= 1;
        }
        return Some(Some(absolute(index, t & 0xf)));
    }
    let mut units_read = 0;
    loop {
        if index < NIBBLES_PER_UNIT {
            return Some(None);
        }
        index = (index & !(NIBBLES_PER_UNIT - 1)) - 1;
        unit = read_unit(index / NIBBLES_PER_UNIT)?;
        if unit == 0 {
            if version >= 2 {
                // The map writes a pointer into every unit a body covers
                // whole: an empty unit before means no body here.
                return Some(None);
            }
            units_read += 1;
            if units_read > LINEAR_UNITS_MAX {
                return None;
            }
            continue;
        }
        if is_pointer(unit) {
            return Some(Some(decode_pointer(unit)));
        }
        let mut t = unit;
        while index > 0 && t & 0xf == 0 {
            t >>= 4;
            index -= 1;
        }
        return Some(Some(absolute(index, t & 0xf)));
    }
}

/// The parts of a contract descriptor the engine uses.
#[derive(Debug, Clone, Default)]
pub struct Descriptor {
    /// `types[type][field]`.
    types: HashMap<String, HashMap<String, u64>>,
    /// Globals: literal values, and indirect ones resolved through the
    /// descriptor's pointer table.
    globals: HashMap<String, u64>,
    contracts: HashMap<String, u32>,
}

impl Descriptor {
    /// Parses the descriptor's JSON; `pointers` is its pointer table.
    /// Tolerant of what the format allows: offsets as numbers or
    /// `[offset, "type"]`, globals as `"0x…"` strings, `[index]`,
    /// `["0x…", "type"]` or `[[index], "type"]`, contract versions as numbers
    /// or `"cN"`, and keys it does not know.
    pub fn parse(json: &str, pointers: &[u64]) -> Result<Descriptor, String> {
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("its JSON does not parse: {e}"))?;
        let mut d = Descriptor::default();
        if let Some(types) = v.get("types").and_then(|t| t.as_object()) {
            for (name, fields) in types {
                let Some(fields) = fields.as_object() else { continue };
                let map = fields
                    .iter()
                    .filter(|(k, _)| k.as_str() != "!")
                    .filter_map(|(k, f)| {
                        let offset = match f {
                            serde_json::Value::Array(a) => a.first()?.as_u64()?,
                            other => other.as_u64()?,
                        };
                        Some((k.clone(), offset))
                    })
                    .collect();
                d.types.insert(name.clone(), map);
            }
        }
        if let Some(globals) = v.get("globals").and_then(|g| g.as_object()) {
            for (name, value) in globals {
                let pointer = |i: &serde_json::Value| i.as_u64().and_then(|i| pointers.get(i as usize).copied());
                let literal = |v: &serde_json::Value| match v {
                    serde_json::Value::String(s) => parse_number(s),
                    serde_json::Value::Number(n) => n.as_u64(),
                    _ => None,
                };
                let resolved = match value {
                    // `[index]` (indirect), `[[index], "type"]`, `["0x…", "type"]`.
                    serde_json::Value::Array(a) => match a.first() {
                        Some(serde_json::Value::Array(inner)) => inner.first().and_then(pointer),
                        Some(first @ serde_json::Value::Number(_)) if a.len() == 1 => pointer(first),
                        Some(first) => literal(first),
                        None => None,
                    },
                    other => literal(other),
                };
                if let Some(r) = resolved {
                    d.globals.insert(name.clone(), r);
                }
            }
        }
        if let Some(contracts) = v.get("contracts").and_then(|c| c.as_object()) {
            for (name, version) in contracts {
                let version = match version {
                    serde_json::Value::Number(n) => n.as_u64().map(|n| n as u32),
                    serde_json::Value::String(s) => s.trim_start_matches('c').parse().ok(),
                    _ => None,
                };
                if let Some(version) = version {
                    d.contracts.insert(name.clone(), version);
                }
            }
        }
        Ok(d)
    }

    fn field(&self, ty: &str, field: &str) -> Result<u64, String> {
        self.types.get(ty).and_then(|t| t.get(field)).copied().ok_or_else(|| format!("no {ty}.{field}"))
    }

    fn header(&self) -> Option<Result<CodeHeaderLayout, String>> {
        self.types.get("RealCodeHeader")?;
        Some((|| {
            Ok(CodeHeaderLayout {
                method_desc: self.field("RealCodeHeader", "MethodDesc")?,
                count: self.field("RealCodeHeader", "NumUnwindInfos")?,
                functions: self.field("RealCodeHeader", "UnwindInfos")?,
            })
        })())
    }

    fn code_map(&self) -> Result<CodeMapScheme, String> {
        let version = *self.contracts.get("ExecutionManager").ok_or("no ExecutionManager contract")?;
        if !(1..=2).contains(&version) {
            return Err(format!("ExecutionManager contract version {version}, which corsnap does not know"));
        }
        let map = *self.globals.get("ExecutionManagerCodeRangeMapAddress").ok_or("no code range map address")?;
        Ok(CodeMapScheme {
            top_level: map + self.field("RangeSectionMap", "TopLevelData")?,
            nibble_version: version,
            fragment_begin: self.field("RangeSectionFragment", "RangeBegin")?,
            fragment_end: self.field("RangeSectionFragment", "RangeEndOpen")?,
            fragment_section: self.field("RangeSectionFragment", "RangeSection")?,
            fragment_next: self.field("RangeSectionFragment", "Next")?,
            section_flags: self.field("RangeSection", "Flags")?,
            section_heap_list: self.field("RangeSection", "HeapList")?,
            section_r2r_module: self.field("RangeSection", "R2RModule")?,
            section_next_for_delete: self.field("RangeSection", "NextForDelete")?,
            heap_start: self.field("CodeHeapListNode", "StartAddress")?,
            heap_end: self.field("CodeHeapListNode", "EndAddress")?,
            heap_map_base: self.field("CodeHeapListNode", "MapBase")?,
            heap_header_map: self.field("CodeHeapListNode", "HeaderMap")?,
            stub_code_block_last: *self.globals.get("StubCodeBlockLast").ok_or("no StubCodeBlockLast")?,
        })
    }
}

fn parse_number(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// The runtime's major version, if `version` names one.
fn major(version: &str) -> Option<u32> {
    version.split('.').next()?.parse().ok()
}

/// Runtimes whose code headers corsnap has measured.
fn header_known_for(major: u32) -> bool {
    (3..=10).contains(&major)
}

/// The decision, as a pure function (see the module doc).
pub fn choose(version: &str, descriptor: Option<&Descriptor>) -> Result<RuntimeLayout, String> {
    let known = major(version).is_some_and(header_known_for);
    let Some(d) = descriptor else {
        return if known {
            Ok(RuntimeLayout { header: KNOWN_HEADER, code_map: None, source: "the layout known for this version" })
        } else {
            Err(format!(
                "corsnap does not know where .NET {version} keeps its code's unwind information (the runtime has no \
                 contract descriptor that says)"
            ))
        };
    };
    let header = match d.header() {
        Some(Ok(h)) => h,
        Some(Err(e)) => return Err(format!("the runtime's contract descriptor is incomplete ({e})")),
        None if known => KNOWN_HEADER,
        None => {
            return Err(format!("the contract descriptor of .NET {version} does not describe its code headers"));
        }
    };
    if known && header != KNOWN_HEADER {
        return Err(format!(
            "the contract descriptor of .NET {version} places the code header's fields at {header:?}, not where this \
             version keeps them"
        ));
    }
    match d.code_map() {
        Ok(map) => Ok(RuntimeLayout { header, code_map: Some(map), source: "the runtime's contract descriptor" }),
        Err(_) if d.types.contains_key("RealCodeHeader") || known => Ok(RuntimeLayout {
            header,
            code_map: None,
            source: if known {
                "the layout known for this version (its contract descriptor has no code map)"
            } else {
                "the runtime's contract descriptor (code headers only)"
            },
        }),
        Err(e) => Err(format!("the runtime's contract descriptor has no usable code map ({e})")),
    }
}

/// `DotNetRuntimeContractDescriptor`'s magic, `DNCCDAC\0`.
const DESCRIPTOR_MAGIC: u64 = 0x0043_4144_4343_4e44;

/// Finds and reads the runtime's contract descriptor, if it exports one.
fn read_contract_descriptor() -> Result<Option<Descriptor>, String> {
    let (objects, _) = corsnap_abi::process::loaded_objects();
    for o in &objects {
        let is_runtime = o.name.ends_with("/libcoreclr.so");
        // A single-file program has the runtime in its executable.
        let path = if o.name.is_empty() { "/proc/self/exe".to_string() } else { o.name.clone() };
        if !is_runtime && !o.name.is_empty() {
            continue;
        }
        let Some(symbol) = exported_symbol(&path, "DotNetRuntimeContractDescriptor") else { continue };
        let at = o.bias.wrapping_add(symbol);
        let header = read_own_bytes(at, 40).ok_or("its header cannot be read")?;
        let word = |i: usize| u64::from_le_bytes(header[i..i + 8].try_into().unwrap());
        let half = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().unwrap());
        if word(0) != DESCRIPTOR_MAGIC {
            return Err("its magic is wrong".into());
        }
        let flags = half(8);
        if flags & 1 == 0 || flags & 2 != 0 {
            return Err(format!("flags {flags:#x} (not a 64-bit descriptor)"));
        }
        let size = half(12) as usize;
        if size > 16 << 20 {
            return Err(format!("its JSON claims {size} bytes"));
        }
        let json = read_own_bytes(word(16), size).ok_or("its JSON cannot be read")?;
        let json = String::from_utf8_lossy(&json);
        let count = (half(24) as usize).min(4096);
        let pointers = read_own_bytes(word(32), count * 8).ok_or("its pointer table cannot be read")?;
        let pointers: Vec<u64> = pointers.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        return Descriptor::parse(json.trim_end_matches('\0'), &pointers).map(Some);
    }
    Ok(None)
}

/// The stated address of an exported data symbol of the ELF file at `path`.
fn exported_symbol(path: &str, name: &str) -> Option<u64> {
    use object::{Object, ObjectSymbol};
    // Read as needed, not whole (see `symbols`).
    let data = object::ReadCache::new(std::fs::File::open(path).ok()?);
    let file = object::File::parse(&data).ok()?;
    let found = file.dynamic_symbols().find(|s| s.name() == Ok(name)).map(|s| s.address());
    found
}

#[cfg(test)]
mod tests;
