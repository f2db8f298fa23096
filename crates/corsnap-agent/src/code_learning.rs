//! Learning where managed code is and how to unwind it, on the agent's
//! thread, for addresses the signal handler met in code it did not know.
//!
//! Two kinds of managed code, both with Windows x64 unwind information:
//!
//! - **JIT'd bodies** (every tier, OSR, IL stubs). Where the runtime describes
//!   its code map (.NET 10's contract descriptor, [`crate::runtime_layout`]),
//!   a body's start is found by the runtime's own nibble map. Else the 8 bytes before a
//!   body's first instruction point at its `RealCodeHeader`: `MethodDesc*`
//!   at 0x18, the number of `RUNTIME_FUNCTION`s at 0x20, the records from
//!   0x24 (the body, then its funclets), RVAs from a base that is the body's
//!   start minus the first record's begin. Checked live on .NET 8.0.4 and
//!   .NET Core 3.1.23 (the layout is the same; only the base differs). The
//!   header is found by scanning back from the address over 16-byte-aligned
//!   starts, and accepted only if its `MethodDesc` is the `FunctionID` the
//!   runtime gives for the address (they are the same pointer in CoreCLR)
//!   and its records cover the address. The unwind records are copied.
//! - **ReadyToRun images** (System.Private.CoreLib and most of the framework):
//!   their `RUNTIME_FUNCTION` table is a section of the image, found from the
//!   PE headers through the CLI header's `ManagedNativeHeader`. The table is
//!   copied; unwind records are read in the mapped image.
//!
//! Every read goes through `process_vm_readv`, so a wrong guess costs an
//! error, never a fault.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use corsnap_abi::process::{read_own_bytes, read_own_memory, read_own_u64};
use corsnap_abi::{CorProfilerInfo, FunctionID, ModuleID};
use corsnap_unwind::{unwind_info_len, CodeMap, ManagedCode, UnwindBytes};

use crate::runtime_layout::{CodeHeaderLayout, MapLookup, RuntimeLayout};

/// How far back from an address a body's start is looked for.
const MAX_BODY_BYTES: u64 = 512 * 1024;
const RUNTIME_FUNCTION_SIZE: usize = 12;
/// `READYTORUN_SECTION_RUNTIME_FUNCTIONS`.
const R2R_RUNTIME_FUNCTIONS: u32 = 102;
const R2R_SIGNATURE: u32 = 0x0052_5452; // "RTR"

/// What is known about a piece of managed code.
#[derive(Debug, Clone)]
pub enum Learned {
    /// A body or image to add to the code map.
    Code(ManagedCode),
    /// Managed (the runtime named its function) but its unwind information
    /// could not be found.
    FunctionOnly(FunctionID),
    /// Not managed code (a stub, or nothing the runtime knows).
    NotManaged,
}

#[derive(Debug)]
pub struct CodeLearner {
    info: CorProfilerInfo,
    layout: RuntimeLayout,
    /// ReadyToRun images by module (None: not one, or unreadable).
    images: HashMap<ModuleID, Option<ManagedCode>>,
    pub jit_bodies_learned: u64,
    pub images_learned: u64,
    pub stubs_learned: u64,
    /// Bodies found through the runtime's code map, and lookups in it whose
    /// answer failed the header check (then the scan decides).
    pub found_by_map: u64,
    pub map_misses: u64,
    /// Bodies compiled, found by the header before the start the runtime
    /// gave (see [`compiled_body`]).
    pub found_at_start: u64,
    /// `CORSNAP_TEST_LEARN_BY_CODE_MAP=1` (tests only): compiled bodies are
    /// looked up as any address a walk met, so that a test can check the
    /// runtime's code map on every one of them.
    learn_compiled_by_map: bool,
    /// Functions compiled whose code the runtime had not set yet when asked
    /// (a method compiled for the first time has it set only after
    /// `JITCompilationFinished` returns), and since when: asked again at
    /// each [`Self::learn_compiled`] for [`CODE_NOT_SET_FOR`]. They were
    /// dropped, and every sample or event in them needed a stack copy until
    /// a copy's walk learned them.
    code_not_set: Vec<(FunctionID, Instant)>,
}

/// How long a function compiled may go without code before it is no
/// longer asked about.
const CODE_NOT_SET_FOR: Duration = Duration::from_secs(1);

/// The tag of JIT'd code with no method the profiling API will name (IL
/// stubs): the walk uses its unwind information, the profile calls it a
/// stub.
pub const STUB_TAG: u64 = 1;
/// Tags of frameless runtime stubs (precode, virtual stub dispatch, jump
/// stubs, the copied write barrier...): `FRAMELESS_STUB_TAG + kind`, with
/// kind the runtime's `StubCodeBlockKind` (1-9), 0 for a stub whose kind the
/// runtime's code map does not give. Tags below [`TAG_LIMIT`] are stubs;
/// any other non-zero tag is a method's `MethodDesc`.
pub const FRAMELESS_STUB_TAG: u64 = 0x10;
pub const TAG_LIMIT: u64 = 0x100;
/// The frame key (before `NATIVE_FRAME_BIT`) and name of a stub tag.
pub fn stub_name(tag: u64) -> (u64, &'static str) {
    let name = match tag.wrapping_sub(FRAMELESS_STUB_TAG) {
        1 => "[stub: jump]",
        3 => "[stub: dynamic helper]",
        4 => "[stub: precode]",
        5 => "[stub: fixup precode]",
        6 => "[stub: virtual dispatch]",
        7 => "[stub: virtual resolve]",
        8 => "[stub: virtual lookup]",
        9 => "[stub: vtable]",
        _ => "[runtime stub]",
    };
    (0x100 + tag, name)
}

/// Whether a frame key (without `NATIVE_FRAME_BIT`) is a stub's.
pub fn is_stub_key(key: u64) -> bool {
    key == 3 || (0x100 + FRAMELESS_STUB_TAG..0x100 + TAG_LIMIT).contains(&key)
}

/// Whether a walker already knows the code at `addr`: its published map
/// does, or a region learned since (`pending`, for the next map) does.
pub fn knows_code(map: &CodeMap, pending: &[ManagedCode], addr: u64) -> bool {
    map.is_code(addr) || pending.iter().any(|m| m.code.contains(&addr))
}

/// A frameless stub region ([`ManagedCode::frameless`]); its function
/// table (one entry without unwind codes) is there for the resolver only.
fn frameless_stub(range: std::ops::Range<u64>, kind: u64) -> ManagedCode {
    let len = (range.end - range.start) as u32;
    let mut functions = Vec::with_capacity(12);
    for w in [0u32, len, len] {
        functions.extend_from_slice(&w.to_le_bytes());
    }
    ManagedCode {
        code: range.clone(),
        base: range.start,
        functions: functions.into(),
        // UNWIND_INFO version 1, no prologue, no codes, no frame register.
        unwind: UnwindBytes::Copied { rva: len, bytes: vec![1u8, 0, 0, 0].into() },
        tag: FRAMELESS_STUB_TAG + kind,
        frameless: true,
        body_rules: Default::default(),
        function_pages: Default::default(),
    }
}

/// The executable mapping of the runtime's own memory
/// (`/memfd:doublemapper`, where .NET 7+ puts JIT'd code and every stub it
/// generates) that holds `ip`, if any.
fn runtime_code_mapping(ip: u64) -> Option<std::ops::Range<u64>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    corsnap_unwind::process::parse_maps(&maps)
        .into_iter()
        .find(|m| m.range.contains(&ip) && m.executable && m.path.starts_with("/memfd:doublemapper"))
        .map(|m| m.range)
}

impl CodeLearner {
    pub fn new(info: CorProfilerInfo, layout: RuntimeLayout) -> Self {
        CodeLearner {
            info,
            layout,
            images: HashMap::new(),
            jit_bodies_learned: 0,
            images_learned: 0,
            stubs_learned: 0,
            found_by_map: 0,
            found_at_start: 0,
            learn_compiled_by_map: std::env::var_os("CORSNAP_TEST_LEARN_BY_CODE_MAP").is_some_and(|v| v == "1"),
            map_misses: 0,
            code_not_set: Vec::new(),
        }
    }

    /// Whether functions compiled are waiting for their code (see
    /// [`Self::learn_compiled`]).
    pub fn waiting_for_code(&self) -> bool {
        !self.code_not_set.is_empty()
    }

    /// A body whose header names any method (an IL stub's), near `ip`.
    fn jit_body_any(&self, ip: u64) -> Option<ManagedCode> {
        jit_body(&self.layout.header, ip, None, 16 * 1024)
    }

    /// The body at `ip` by the runtime's own code map, whose header names
    /// `method_desc` (any method with `None`).
    fn body_by_map(&mut self, ip: u64, method_desc: Option<u64>) -> Option<ManagedCode> {
        match self.layout.lookup(ip)? {
            MapLookup::Body { start, header } => {
                let body = check_header(&self.layout.header, header, start, ip, method_desc);
                match body {
                    Some(_) => self.found_by_map += 1,
                    None => self.map_misses += 1,
                }
                body
            }
            _ => None,
        }
    }

    /// The bodies of `functions` (just compiled by the runtime) that
    /// `known` does not cover yet, learned, for a walker to know them before
    /// a walk meets them: the signal engine's and the event walker's.
    /// Those the runtime gives no code for yet are kept and asked about
    /// again at the next call, with those kept before.
    pub fn learn_compiled(&mut self, functions: &[FunctionID], known: impl Fn(u64) -> bool) -> Vec<ManagedCode> {
        let now = Instant::now();
        let mut waiting = std::mem::take(&mut self.code_not_set);
        waiting.retain(|&(_, since)| now.duration_since(since) < CODE_NOT_SET_FOR);
        let all: Vec<FunctionID> = functions.iter().copied().chain(waiting.iter().map(|&(f, _)| f)).collect();
        // What it makes is read by walks (see `corsnap_abi::hot_memory`).
        corsnap_abi::hot_memory::allocate_hot(|| {
            let mut learned: Vec<ManagedCode> = Vec::new();
            for &function in &all {
                let Ok(mut starts) = self.info.get_native_code_start_addresses(function) else { continue };
                for rejit_id in rejit_versions_of(function) {
                    starts.extend(self.info.get_native_code_start_addresses_of(function, rejit_id).unwrap_or_default());
                }
                if starts.iter().all(|&start| start == 0) {
                    if !self.code_not_set.iter().any(|&(f, _)| f == function) {
                        let since = waiting.iter().find(|&&(f, _)| f == function).map_or(now, |&(_, since)| since);
                        self.code_not_set.push((function, since));
                    }
                    continue;
                }
                for start in starts {
                    if start == 0 || known(start) || learned.iter().any(|m| m.code.contains(&start)) {
                        continue;
                    }
                    // Its header is the pointer before its first instruction;
                    // the runtime's code map (twenty-odd reads) only confirms it.
                    let at_start = if self.learn_compiled_by_map {
                        None
                    } else {
                        compiled_body(&self.layout.header, start, function as u64)
                    };
                    if let Some(body) = at_start {
                        self.jit_bodies_learned += 1;
                        self.found_at_start += 1;
                        learned.push(body);
                    } else if let Learned::Code(code) = self.learn(start) {
                        learned.push(code);
                    }
                }
            }
            learned
        })
    }

    /// Finds the code containing `ip`.
    pub fn learn(&mut self, ip: u64) -> Learned {
        // What it makes is read by walks (see `corsnap_abi::hot_memory`).
        corsnap_abi::hot_memory::allocate_hot(|| {
            let Ok(function) = self.info.get_function_from_ip(ip as usize) else {
                // The runtime names no method here, but it may still be code its
                // JIT made: an IL stub (marshalling for P/Invoke and callbacks)
                // has a code header like any method. Without a method to check
                // the header against, the search is shorter and stricter.
                let body = self.body_by_map(ip, None).or_else(|| self.jit_body_any(ip));
                if let Some(mut body) = body {
                    self.stubs_learned += 1;
                    body.tag = STUB_TAG;
                    return Learned::Code(body);
                }
                // A stub the runtime generated, as a frameless region: a page of
                // a stub range whole (those hold nothing else); in a code heap,
                // where method bodies may follow, only up to the address.
                let stub = match self.layout.lookup(ip) {
                    Some(MapLookup::StubBlock { start, kind }) if kind < 0x10 => Some((start..ip + 1, kind)),
                    Some(MapLookup::StubRange) => Some((ip & !0xfff..(ip & !0xfff) + 0x1000, 0)),
                    _ => runtime_code_mapping(ip).map(|_| (ip..ip + 1, 0)),
                };
                if let Some((range, kind)) = stub {
                    self.stubs_learned += 1;
                    return Learned::Code(frameless_stub(range, kind));
                }
                return Learned::NotManaged;
            };
            let body = self
                .body_by_map(ip, Some(function as u64))
                .or_else(|| jit_body(&self.layout.header, ip, Some(function as u64), MAX_BODY_BYTES));
            if let Some(body) = body {
                self.jit_bodies_learned += 1;
                return Learned::Code(body);
            }
            if let Ok((_, module, _)) = self.info.get_function_info2(function) {
                let info = self.info;
                let image = self.images.entry(module).or_insert_with(|| {
                    let base = info.get_module_info(module).ok()?.0;
                    ready_to_run_image(base).map(with_image_body_rules)
                });
                if let Some(image) = image.as_ref().filter(|i| i.code.contains(&ip)) {
                    self.images_learned += 1;
                    return Learned::Code(image.clone());
                }
            }
            Learned::FunctionOnly(function)
        })
    }
}

/// The JIT'd body containing `ip`, whose header names `method_desc` (or,
/// with `None`, any method), starting at most `max_bytes` before `ip`.
fn jit_body(layout: &CodeHeaderLayout, ip: u64, method_desc: Option<u64>, max_bytes: u64) -> Option<ManagedCode> {
    let lowest = ip.saturating_sub(max_bytes);
    let mut candidate = ip & !15;
    // Read backwards a page at a time and look at each 16-byte-aligned
    // start's preceding 8 bytes.
    let mut block = vec![0u8; 4096];
    while candidate > lowest {
        let block_start = candidate.saturating_sub(block.len() as u64);
        if !read_own_memory(block_start, &mut block) {
            // Not readable further back: scan only the part that is.
            let page_start = (candidate - 1) & !4095;
            let len = (candidate - page_start) as usize;
            let mut part = vec![0u8; len];
            if !read_own_memory(page_start, &mut part) {
                return None;
            }
            return scan_block(layout, page_start, &part, candidate, page_start.max(lowest), ip, method_desc);
        }
        if let Some(body) = scan_block(layout, block_start, &block, candidate, block_start.max(lowest), ip, method_desc)
        {
            return Some(body);
        }
        candidate = block_start;
    }
    None
}

/// Tries starts from `from` down to `to` (16-aligned) whose header pointer
/// lies in `bytes` (read at `at`).
fn scan_block(
    layout: &CodeHeaderLayout,
    at: u64,
    bytes: &[u8],
    from: u64,
    to: u64,
    ip: u64,
    method_desc: Option<u64>,
) -> Option<ManagedCode> {
    let mut start = from;
    while start >= to + 8 && start >= at + 8 {
        let offset = (start - 8 - at) as usize;
        if let Some(word) = bytes.get(offset..offset + 8) {
            let header = u64::from_le_bytes(word.try_into().ok()?);
            if could_be_header(header) {
                if let Some(body) = check_header(layout, header, start, ip, method_desc) {
                    return Some(body);
                }
            }
        }
        start -= 16;
    }
    None
}

/// The body the runtime compiled for `method_desc` at `start`: its code
/// header is the pointer in the 8 bytes before `start` (as the runtime's
/// code map finds it, `MapLookup::Body`), checked as any other.
fn compiled_body(layout: &CodeHeaderLayout, start: u64, method_desc: u64) -> Option<ManagedCode> {
    let header = read_own_u64(start.checked_sub(8)?)?;
    if !could_be_header(header) {
        return None;
    }
    check_header(layout, header, start, start, Some(method_desc))
}

/// Whether the 8 bytes before a body's start could point at its code
/// header (an aligned user-space address), before it is read.
fn could_be_header(word: u64) -> bool {
    word > 0xffff && word.is_multiple_of(8) && word < 1 << 47
}

/// Records read with the header's fields, in the same read: most bodies
/// have one to three (the body, then its funclets).
const RECORDS_WITH_FIELDS: u64 = 4;

/// The body whose code header is at `header`, if the header is one: it
/// names `method_desc` (with `None`, a readable pointer), and its records
/// cover `ip`. Its records and unwind information are copied.
///
/// Four reads where it can (the header's fields with its first records,
/// the records' unwind heads, then the span that holds their unwind
/// information): each is a system call (`process_vm_readv`), about a
/// microsecond in this VM, and a body the runtime compiles again is learned
/// by the compiling thread (see `Shared::learn_compiled_now`). Field by
/// field, with a read per record, a body took 50 to 130 µs.
fn check_header(
    layout: &CodeHeaderLayout,
    header: u64,
    start: u64,
    ip: u64,
    method_desc: Option<u64>,
) -> Option<ManagedCode> {
    let (md_at, count_at, functions_at) = (layout.method_desc, layout.count, layout.functions);
    let fields_start = md_at.min(count_at).min(functions_at);
    let fields_end = (md_at + 8).max(count_at + 4).max(functions_at);
    // With the first records if the memory after the fields is readable
    // (a header at the end of a mapping may have no more).
    let with_records = fields_end.max(functions_at + RECORDS_WITH_FIELDS * RUNTIME_FUNCTION_SIZE as u64);
    let fields = read_own_bytes(header + fields_start, (with_records - fields_start) as usize)
        .or_else(|| read_own_bytes(header + fields_start, (fields_end - fields_start) as usize))?;
    let field = |at: u64| (at - fields_start) as usize;
    let found = u64::from_le_bytes(fields.get(field(md_at)..field(md_at) + 8)?.try_into().ok()?);
    match method_desc {
        Some(md) if found != md => return None,
        // Any method: it must at least be a readable pointer.
        None if found < 0x10000 || found % 8 != 0 || read_own_u64(found).is_none() => return None,
        _ => {}
    }
    let count = u32_at(&fields, field(count_at))?;
    let max_count = if method_desc.is_some() { 1024 } else { 16 };
    if count == 0 || count > max_count {
        return None;
    }
    let records_len = count as usize * RUNTIME_FUNCTION_SIZE;
    let raw = match fields.get(field(functions_at)..field(functions_at) + records_len) {
        Some(raw) => raw.to_vec(),
        None => read_own_bytes(header + functions_at, records_len)?,
    };
    let mut records: Vec<[u32; 3]> = raw
        .chunks_exact(RUNTIME_FUNCTION_SIZE)
        .map(|c| {
            let w = |i: usize| u32::from_le_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]);
            [w(0), w(4), w(8)]
        })
        .collect();
    let first = records[0];
    if first[0] >= first[1] {
        return None;
    }
    let base = start.checked_sub(u64::from(first[0]))?;
    records.sort_by_key(|r| r[0]);
    let code_start = base + u64::from(records[0][0]);
    let code_end = base + u64::from(records.iter().map(|r| r[1]).max()?);
    if records.iter().any(|r| r[0] >= r[1]) || !(code_start..code_end).contains(&ip) {
        return None;
    }
    // The unwind records lie after the code, in the same allocation: the
    // heads (each gives its record's length) in one read, then the span
    // that holds them all.
    let heads_start = records.iter().map(|r| base + u64::from(r[2])).min()?;
    let heads_end = records.iter().map(|r| base + u64::from(r[2]) + 4).max()?;
    if heads_end - heads_start > 64 * 1024 {
        return None;
    }
    let heads = read_own_bytes(heads_start, (heads_end - heads_start) as usize)?;
    let mut span_end = heads_end;
    for r in &records {
        let at = (base + u64::from(r[2]) - heads_start) as usize;
        let head = heads.get(at..at + 4)?;
        let len = unwind_info_len([head[0], head[1], head[2], head[3]]) as u64;
        span_end = span_end.max(base + u64::from(r[2]) + len);
    }
    let span_start = heads_start;
    if span_end - span_start > 64 * 1024 {
        return None;
    }
    let unwind = read_own_bytes(span_start, (span_end - span_start) as usize)?;
    if method_desc.is_none()
        && !records.iter().all(|r| plausible_unwind_info(&unwind, (base + u64::from(r[2]) - span_start) as usize))
    {
        return None;
    }
    let functions: Vec<u8> = records.iter().flat_map(|r| r.iter().flat_map(|w| w.to_le_bytes())).collect();
    Some(
        ManagedCode {
            code: code_start..code_end,
            base,
            functions: functions.into(),
            unwind: UnwindBytes::Copied { rva: (span_start - base) as u32, bytes: unwind.into() },
            tag: found,
            frameless: false,
            body_rules: Default::default(),
            function_pages: Default::default(),
        }
        .with_body_rules(None),
    )
}

/// Version 1 or 2 `UNWIND_INFO` whose prolog fits its codes.
fn plausible_unwind_info(bytes: &[u8], at: usize) -> bool {
    let Some(h) = bytes.get(at..at + 4) else { return false };
    let version = h[0] & 7;
    (version == 1 || version == 2) && h[0] >> 3 <= 7
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The ReadyToRun image mapped at `base`: its whole range, and its function
/// table copied out.
pub fn ready_to_run_image(base: u64) -> Option<ManagedCode> {
    let dos = read_own_bytes(base, 0x40)?;
    if dos.get(..2)? != b"MZ" {
        return None;
    }
    let pe = base + u64::from(u32_at(&dos, 0x3c)?);
    let headers = read_own_bytes(pe, 24 + 240)?;
    if headers.get(..4)? != b"PE\0\0" {
        return None;
    }
    let optional = 24usize;
    if u16_at(&headers, optional)? != 0x20b {
        return None; // not PE32+
    }
    let size_of_image = u64::from(u32_at(&headers, optional + 56)?);
    // Data directory 14: the CLI header.
    let cli_rva = u32_at(&headers, optional + 112 + 14 * 8)?;
    if cli_rva == 0 {
        return None;
    }
    let cli = read_own_bytes(base + u64::from(cli_rva), 72)?;
    let native_header_rva = u32_at(&cli, 64)?;
    if native_header_rva == 0 {
        return None;
    }
    let r2r_at = base + u64::from(native_header_rva);
    let r2r = read_own_bytes(r2r_at, 16)?;
    if u32_at(&r2r, 0)? != R2R_SIGNATURE {
        return None;
    }
    let sections = u32_at(&r2r, 12)?.min(256) as usize;
    let table = read_own_bytes(r2r_at + 16, sections * 12)?;
    let (rva, size) = table.chunks_exact(12).find_map(|s| {
        (u32_at(s, 0)? == R2R_RUNTIME_FUNCTIONS).then(|| Some((u32_at(s, 4)?, u32_at(s, 8)?))).flatten()
    })?;
    if !(size as usize).is_multiple_of(RUNTIME_FUNCTION_SIZE) || size > 64 * 1024 * 1024 {
        return None;
    }
    let functions = read_own_bytes(base + u64::from(rva), size as usize)?;
    Some(ManagedCode {
        code: base..base + size_of_image,
        base,
        functions: functions.into(),
        unwind: UnwindBytes::InCode,
        tag: 0,
        frameless: false,
        body_rules: Default::default(),
        function_pages: Default::default(),
    })
}

/// A ReadyToRun image with its functions' body rules compiled (see
/// `corsnap_unwind::ManagedCode::with_body_rules`): its unwind records read
/// in one span, from the first record's RVA to the last one's end (no more
/// than 16 MiB, inside the image). If they cannot be read, the image as it
/// was: its frames are unwound in full. CoreLib's take 10 to 20 ms here
/// (50,000 functions).
pub fn with_image_body_rules(image: ManagedCode) -> ManagedCode {
    let rvas = image.functions.chunks_exact(RUNTIME_FUNCTION_SIZE).filter_map(|f| u32_at(f, 8));
    let (first, last) = rvas.fold((u32::MAX, 0), |(lo, hi), r| (lo.min(r), hi.max(r)));
    // A record is at most 4 bytes of header, 255 codes (rounded to 256),
    // and a 12-byte chained entry.
    let end = (u64::from(last) + 4 + 512 + 12).min(image.code.end - image.base);
    let Some(len) = end.checked_sub(u64::from(first)).filter(|&l| l > 0 && l <= 16 << 20) else { return image };
    match read_own_bytes(image.base + u64::from(first), len as usize) {
        // The rules are read by walks (see `corsnap_abi::hot_memory`); the
        // records they are compiled from are not kept.
        Some(records) => corsnap_abi::hot_memory::allocate_hot(|| image.with_body_rules(Some((first, &records)))),
        None => image,
    }
}

/// `System.Private.CoreLib`'s ReadyToRun image, when the runtime mapped it
/// from its file (not from a single-file bundle, where it is learned from
/// the first address met in it, as any image).
pub fn corelib_image() -> Option<ManagedCode> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let mappings: Vec<_> = corsnap_unwind::process::parse_maps(&maps)
        .into_iter()
        .filter(|m| m.path.ends_with("/System.Private.CoreLib.dll"))
        .collect();
    // The image is the one that holds the file's code. Its base is not the
    // file's lowest mapping: .NET 10 first maps the whole file flat (shared,
    // read-only, below the image), where RVAs are not addresses.
    let code = mappings.iter().find(|m| m.executable)?.range.start;
    // Its function table is read by walks (see `corsnap_abi::hot_memory`).
    corsnap_abi::hot_memory::allocate_hot(|| {
        mappings
            .iter()
            .rev()
            .filter(|m| m.range.start <= code)
            .find_map(|m| ready_to_run_image(m.range.start).filter(|image| image.code.contains(&code)))
    })
}

/// ReJIT versions of methods (`(FunctionID, ReJITID)`), from
/// `ReJITCompilationFinished`: their code starts are asked for beside the
/// original's when the function is learned (the exception hook's rewritten
/// entry points; without it every throw walked through code not known and
/// copied its stack until the sampler thread learned it from a copy, a
/// thousand times a run of `validate` with CPU sampling).
static REJIT_VERSIONS: std::sync::Mutex<Vec<(FunctionID, usize)>> = std::sync::Mutex::new(Vec::new());

pub fn note_rejit_version(function: FunctionID, rejit_id: usize) {
    let mut versions = REJIT_VERSIONS.lock().unwrap_or_else(|p| p.into_inner());
    if !versions.contains(&(function, rejit_id)) && versions.len() < 64 {
        versions.push((function, rejit_id));
    }
}

fn rejit_versions_of(function: FunctionID) -> Vec<usize> {
    let versions = REJIT_VERSIONS.lock().unwrap_or_else(|p| p.into_inner());
    versions.iter().filter(|&&(f, _)| f == function).map(|&(_, r)| r).collect()
}
