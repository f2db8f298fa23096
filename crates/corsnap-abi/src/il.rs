//! IL method bodies with a few instructions put before their code or
//! before one of their instructions, for ReJIT
//! (`ICorProfilerFunctionControl::SetILFunctionBody`).
//!
//! ECMA-335 II.25.4: a body is a tiny header (one byte, code up to 63
//! bytes, no locals, no exception clauses) or a fat one (12 bytes: flags,
//! the stack it needs, the code's size, the locals' signature), the code,
//! and, when the fat header says so, sections 4-byte aligned after the code
//! (the exception clauses, small or fat). Code put first moves every clause
//! by its length; branches are relative to the instruction after them and
//! stay right. Code put before an instruction further in moves what comes
//! after it, and so the branches that cross it, which needs every
//! instruction read (ECMA-335 III, the operands' sizes). The body written
//! back always has a fat header and fat clauses, so no offset can overflow
//! a small clause's 16 bits.
//!
//! Written here rather than taken from a crate: no crate in the vendor set
//! reads or writes method bodies, and this is all corsnap needs of one.

const TINY: u8 = 0x2;
const FAT: u16 = 0x3;
const FORMAT_MASK: u16 = 0x3;
const MORE_SECTS: u16 = 0x8;
const INIT_LOCALS: u16 = 0x10;
const FAT_HEADER_BYTES: usize = 12;
const SECTION_EH_TABLE: u8 = 0x1;
const SECTION_FAT_FORMAT: u8 = 0x40;
const SECTION_MORE_SECTS: u8 = 0x80;
const CLAUSE_FILTER: u32 = 0x1;
const SMALL_CLAUSE_BYTES: usize = 12;
const FAT_CLAUSE_BYTES: usize = 24;

/// One exception clause, offsets in the original code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Clause {
    flags: u32,
    try_offset: u32,
    try_length: u32,
    handler_offset: u32,
    handler_length: u32,
    /// A class token, or a filter's offset (`flags` has `CLAUSE_FILTER`).
    class_or_filter: u32,
}

/// A method body read apart.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Body<'a> {
    flags: u16,
    max_stack: u16,
    locals: u32,
    code: &'a [u8],
    clauses: Vec<Clause>,
}

fn u16_at(b: &[u8], at: usize) -> Result<u16, String> {
    b.get(at..at + 2).map(|s| u16::from_le_bytes([s[0], s[1]])).ok_or_else(|| format!("a body cut short at {at}"))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, String> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or_else(|| format!("a body cut short at {at}"))
}

fn parse(method: &[u8]) -> Result<Body<'_>, String> {
    let first = *method.first().ok_or("an empty body")?;
    if first & 0x3 == TINY {
        let size = (first >> 2) as usize;
        let code = method.get(1..1 + size).ok_or("a tiny body cut short")?;
        return Ok(Body { flags: 0, max_stack: 8, locals: 0, code, clauses: Vec::new() });
    }
    let flags_and_size = u16_at(method, 0)?;
    let flags = flags_and_size & 0x0FFF;
    if flags & FORMAT_MASK != FAT {
        return Err(format!("a body of unknown format 0x{first:02X}"));
    }
    let header = ((flags_and_size >> 12) as usize) * 4;
    if header < FAT_HEADER_BYTES {
        return Err(format!("a fat header of {header} bytes"));
    }
    let max_stack = u16_at(method, 2)?;
    let code_size = u32_at(method, 4)? as usize;
    let locals = u32_at(method, 8)?;
    let code = method.get(header..header + code_size).ok_or("a fat body cut short")?;
    let mut clauses = Vec::new();
    let mut more = flags & MORE_SECTS != 0;
    let mut at = (header + code_size + 3) & !3;
    while more {
        let kind = *method.get(at).ok_or("a section cut short")?;
        if kind & 0x3F != SECTION_EH_TABLE {
            return Err(format!("a section of kind 0x{kind:02X}, not exception clauses"));
        }
        more = kind & SECTION_MORE_SECTS != 0;
        if kind & SECTION_FAT_FORMAT != 0 {
            let size = (u32_at(method, at)? >> 8) as usize;
            let count = size.saturating_sub(4) / FAT_CLAUSE_BYTES;
            for i in 0..count {
                let c = at + 4 + i * FAT_CLAUSE_BYTES;
                clauses.push(Clause {
                    flags: u32_at(method, c)?,
                    try_offset: u32_at(method, c + 4)?,
                    try_length: u32_at(method, c + 8)?,
                    handler_offset: u32_at(method, c + 12)?,
                    handler_length: u32_at(method, c + 16)?,
                    class_or_filter: u32_at(method, c + 20)?,
                });
            }
            at = (at + size + 3) & !3;
        } else {
            let size = *method.get(at + 1).ok_or("a section cut short")? as usize;
            let count = size.saturating_sub(4) / SMALL_CLAUSE_BYTES;
            for i in 0..count {
                let c = at + 4 + i * SMALL_CLAUSE_BYTES;
                let byte = |o: usize| method.get(c + o).copied().ok_or_else(|| "a clause cut short".to_string());
                clauses.push(Clause {
                    flags: u16_at(method, c)? as u32,
                    try_offset: u16_at(method, c + 2)? as u32,
                    try_length: byte(4)? as u32,
                    handler_offset: u16_at(method, c + 5)? as u32,
                    handler_length: byte(7)? as u32,
                    class_or_filter: u32_at(method, c + 8)?,
                });
            }
            at = (at + size + 3) & !3;
        }
    }
    Ok(Body { flags, max_stack, locals, code, clauses })
}

/// `method` (a whole body, header first) with `prologue` run before its
/// code; `prologue_stack`: the evaluation stack the prologue needs (it must
/// leave the stack empty). Branches are relative and all in the original
/// code, so none changes; a branch back to the first instruction skips the
/// prologue, which runs once.
pub fn prepend(method: &[u8], prologue: &[u8], prologue_stack: u16) -> Result<Vec<u8>, String> {
    let body = parse(method)?;
    let shift = prologue.len() as u32;
    let mut code = Vec::with_capacity(body.code.len() + prologue.len());
    code.extend_from_slice(prologue);
    code.extend_from_slice(body.code);
    let clauses: Vec<Clause> = body
        .clauses
        .iter()
        .map(|c| Clause {
            try_offset: c.try_offset + shift,
            handler_offset: c.handler_offset + shift,
            class_or_filter: if c.flags & CLAUSE_FILTER != 0 { c.class_or_filter + shift } else { c.class_or_filter },
            ..*c
        })
        .collect();
    Ok(write(body.flags, body.max_stack.max(prologue_stack), body.locals, &code, &clauses))
}

/// `method` with `inserted` run just before the instruction at offset `at`
/// of its code, as if it were that instruction's first part: a branch to
/// `at` runs it, a region (`try`, handler, filter) that starts at `at`
/// holds it, one that ends there does not. `inserted` must leave the
/// evaluation stack as it found it, and needs `inserted_stack` more of it.
///
/// Every instruction is read (ECMA-335 III: the operands' sizes) to find
/// `at` among them and the branches that cross it, whose offsets grow by
/// `inserted`'s length. A short branch (`br.s`, `leave.s`, ...) that no
/// longer reaches is refused rather than widened: widening moves the code
/// after it, and the methods corsnap rewrites have no such branch.
pub fn insert_before(method: &[u8], at: usize, inserted: &[u8], inserted_stack: u16) -> Result<Vec<u8>, String> {
    let body = parse(method)?;
    let instructions = instructions(body.code)?;
    if !instructions.iter().any(|i| i.offset == at) {
        return Err(format!("offset {at} is not where an instruction starts"));
    }
    let len = inserted.len() as i64;
    // Where an offset of the original code is in the new code.
    let moved = |offset: i64| if offset > at as i64 { offset + len } else { offset };
    let mut code = Vec::with_capacity(body.code.len() + inserted.len());
    code.extend_from_slice(&body.code[..at]);
    code.extend_from_slice(inserted);
    code.extend_from_slice(&body.code[at..]);
    for i in &instructions {
        // The instruction's own new offset: it moves when it is at `at` or after.
        let shift = if i.offset >= at { inserted.len() } else { 0 };
        let next = (i.offset + i.size) as i64;
        for (operand, width) in i.offset_fields() {
            let relative = moved(next + read_offset(body.code, operand, width)) - (next + shift as i64);
            let field = &mut code[operand + shift..operand + shift + width];
            if width == 1 {
                let short = i8::try_from(relative)
                    .map_err(|_| format!("the short branch at {} no longer reaches its target", i.offset))?;
                field[0] = short as u8;
            } else {
                let long = i32::try_from(relative).map_err(|_| format!("the branch at {} out of reach", i.offset))?;
                field.copy_from_slice(&long.to_le_bytes());
            }
        }
    }
    let region = |offset: u32, length: u32| {
        let start = moved(offset as i64);
        (start as u32, (moved(offset as i64 + length as i64) - start) as u32)
    };
    let clauses: Vec<Clause> = body
        .clauses
        .iter()
        .map(|c| {
            let (try_offset, try_length) = region(c.try_offset, c.try_length);
            let (handler_offset, handler_length) = region(c.handler_offset, c.handler_length);
            let filter = c.flags & CLAUSE_FILTER != 0;
            Clause {
                flags: c.flags,
                try_offset,
                try_length,
                handler_offset,
                handler_length,
                class_or_filter: if filter { moved(c.class_or_filter as i64) as u32 } else { c.class_or_filter },
            }
        })
        .collect();
    let max_stack = body.max_stack.checked_add(inserted_stack).ok_or("a stack too deep")?;
    Ok(write(body.flags, max_stack, body.locals, &code, &clauses))
}

/// A body with a fat header, `code` and `clauses` (fat), from the
/// original's `flags` (only `InitLocals` is kept).
fn write(flags: u16, max_stack: u16, locals: u32, code: &[u8], clauses: &[Clause]) -> Vec<u8> {
    let mut flags = FAT | (flags & INIT_LOCALS);
    if !clauses.is_empty() {
        flags |= MORE_SECTS;
    }
    let mut out = Vec::with_capacity(FAT_HEADER_BYTES + code.len() + 4 + clauses.len() * FAT_CLAUSE_BYTES);
    out.extend_from_slice(&(flags | (3 << 12)).to_le_bytes());
    out.extend_from_slice(&max_stack.to_le_bytes());
    out.extend_from_slice(&(code.len() as u32).to_le_bytes());
    out.extend_from_slice(&locals.to_le_bytes());
    out.extend_from_slice(code);
    if !clauses.is_empty() {
        while out.len() % 4 != 0 {
            out.push(0);
        }
        let size = 4 + clauses.len() * FAT_CLAUSE_BYTES;
        out.extend_from_slice(&(((size as u32) << 8) | (SECTION_EH_TABLE | SECTION_FAT_FORMAT) as u32).to_le_bytes());
        for c in clauses {
            for word in [c.flags, c.try_offset, c.try_length, c.handler_offset, c.handler_length, c.class_or_filter] {
                out.extend_from_slice(&word.to_le_bytes());
            }
        }
    }
    out
}

/// How an instruction moves control, with where its offset operand is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Branching {
    None,
    /// A one-byte offset at this position of the code.
    Short(usize),
    /// A four-byte offset at this position of the code.
    Long(usize),
    /// `switch` with this many targets.
    Switch(usize),
}

/// One instruction of a method's code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Instruction {
    offset: usize,
    size: usize,
    branch: Branching,
}

impl Instruction {
    /// Its branch offsets, each relative to the next instruction: where
    /// each is in the code, and its width in bytes (1 or 4).
    fn offset_fields(&self) -> impl Iterator<Item = (usize, usize)> {
        let (first, count, width) = match self.branch {
            Branching::None => (0, 0, 4),
            Branching::Short(operand) => (operand, 1, 1),
            Branching::Long(operand) => (operand, 1, 4),
            Branching::Switch(targets) => (self.offset + 5, targets, 4),
        };
        (0..count).map(move |k| (first + k * width, width))
    }
}

/// A branch offset of `width` bytes (1 or 4) at `at` in `code`, signed.
fn read_offset(code: &[u8], at: usize, width: usize) -> i64 {
    if width == 1 {
        code[at] as i8 as i64
    } else {
        i32::from_le_bytes([code[at], code[at + 1], code[at + 2], code[at + 3]]) as i64
    }
}

/// The size of a one-byte opcode's operand (`None`: no such opcode;
/// `switch` is read apart).
fn operand_size(opcode: u8) -> Option<usize> {
    Some(match opcode {
        0x00..=0x0D | 0x14..=0x1E | 0x25 | 0x26 | 0x2A => 0,
        0x0E..=0x13 | 0x1F | 0x2B..=0x37 | 0xDE => 1,
        0x20 | 0x22 | 0x27..=0x29 | 0x38..=0x44 | 0x6F..=0x75 | 0x79 | 0x7B..=0x81 | 0x8C | 0x8D | 0x8F => 4,
        0xA3..=0xA5 | 0xC2 | 0xC6 | 0xD0 | 0xDD => 4,
        0x21 | 0x23 => 8,
        0x46..=0x6E | 0x76 | 0x7A | 0x82..=0x8B | 0x8E | 0x90..=0xA2 | 0xB3..=0xBA | 0xC3 | 0xD1..=0xDC => 0,
        0xDF | 0xE0 => 0,
        _ => return None,
    })
}

/// The size of a two-byte opcode's (`0xFE xx`) operand.
fn operand_size_fe(second: u8) -> Option<usize> {
    Some(match second {
        0x00..=0x05 | 0x0F | 0x11 | 0x13 | 0x14 | 0x17 | 0x18 | 0x1A | 0x1D | 0x1E => 0,
        0x12 | 0x19 => 1,
        0x09..=0x0E => 2,
        0x06 | 0x07 | 0x15 | 0x16 | 0x1C => 4,
        _ => return None,
    })
}

/// Every instruction of `code`, in order.
fn instructions(code: &[u8]) -> Result<Vec<Instruction>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < code.len() {
        let opcode = code[at];
        let (size, branch) = match opcode {
            0x45 => {
                let count = u32_at(code, at + 1)? as usize;
                let size = count.checked_mul(4).and_then(|n| n.checked_add(5)).ok_or("a switch too large")?;
                (size, Branching::Switch(count))
            }
            0xFE => {
                let second = *code.get(at + 1).ok_or("an instruction cut short")?;
                let operand =
                    operand_size_fe(second).ok_or_else(|| format!("unknown opcode 0xFE 0x{second:02X} at {at}"))?;
                (2 + operand, Branching::None)
            }
            _ => {
                let operand = operand_size(opcode).ok_or_else(|| format!("unknown opcode 0x{opcode:02X} at {at}"))?;
                let branch = match opcode {
                    0x2B..=0x37 | 0xDE => Branching::Short(at + 1),
                    0x38..=0x44 | 0xDD => Branching::Long(at + 1),
                    _ => Branching::None,
                };
                (1 + operand, branch)
            }
        };
        if at + size > code.len() {
            return Err(format!("the instruction at {at} runs past the code"));
        }
        out.push(Instruction { offset: at, size, branch });
        at += size;
    }
    Ok(out)
}

/// The offset in `method`'s code of its first `call` of `callee` whose
/// last argument is `method`'s own argument `argument` (`ldarg.N` just
/// before the call), if there is one.
pub fn call_after_ldarg(method: &[u8], callee: u32, argument: u8) -> Result<Option<usize>, String> {
    let ldarg = match argument {
        0..=3 => 0x02 + argument,
        _ => return Err(format!("argument {argument}: only 0 to 3")),
    };
    let body = parse(method)?;
    let instructions = instructions(body.code)?;
    Ok(instructions.windows(2).find_map(|pair| {
        let (before, call) = (pair[0], pair[1]);
        let is_call = body.code[call.offset] == 0x28 && u32_at(body.code, call.offset + 1).ok() == Some(callee);
        (is_call && before.size == 1 && body.code[before.offset] == ldarg).then_some(call.offset)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_body_becomes_fat_with_the_prologue_first() {
        let tiny = [(3 << 2) | 0x2, 0x00, 0x00, 0x2A]; // nop nop ret
        let out = prepend(&tiny, &[0x14, 0x26], 1).unwrap(); // ldnull pop
        let body = parse(&out).unwrap();
        assert_eq!(body.code, &[0x14, 0x26, 0x00, 0x00, 0x2A]);
        assert_eq!(body.max_stack, 8);
        assert!(body.clauses.is_empty());
        assert_eq!(out.len(), 12 + 5);
    }

    #[test]
    fn small_clauses_move_by_the_prologue_and_come_back_fat() {
        // Fat header: MoreSects | InitLocals, maxstack 1, 8 bytes of code, locals 0x11000001.
        let mut m = Vec::new();
        m.extend_from_slice(&((0x3 | 0x8 | 0x10) | (3u16 << 12)).to_le_bytes());
        m.extend_from_slice(&1u16.to_le_bytes());
        m.extend_from_slice(&8u32.to_le_bytes());
        m.extend_from_slice(&0x1100_0001u32.to_le_bytes());
        m.extend_from_slice(&[0; 8]);
        // Small EH section, two clauses: a catch (class 0x01000005) and a filter at 6.
        m.extend_from_slice(&[0x01, 4 + 24, 0, 0]);
        m.extend_from_slice(&0u16.to_le_bytes());
        m.extend_from_slice(&1u16.to_le_bytes());
        m.push(2);
        m.extend_from_slice(&3u16.to_le_bytes());
        m.push(1);
        m.extend_from_slice(&0x0100_0005u32.to_le_bytes());
        m.extend_from_slice(&1u16.to_le_bytes());
        m.extend_from_slice(&1u16.to_le_bytes());
        m.push(2);
        m.extend_from_slice(&7u16.to_le_bytes());
        m.push(1);
        m.extend_from_slice(&6u32.to_le_bytes());
        let out = prepend(&m, &[0; 26], 2).unwrap();
        let body = parse(&out).unwrap();
        assert_eq!(body.code.len(), 34);
        assert_eq!(body.max_stack, 2);
        assert_eq!(body.locals, 0x1100_0001);
        assert_eq!(body.flags & INIT_LOCALS, INIT_LOCALS);
        assert_eq!(
            body.clauses,
            vec![
                Clause {
                    flags: 0,
                    try_offset: 27,
                    try_length: 2,
                    handler_offset: 29,
                    handler_length: 1,
                    class_or_filter: 0x0100_0005
                },
                Clause {
                    flags: 1,
                    try_offset: 27,
                    try_length: 2,
                    handler_offset: 33,
                    handler_length: 1,
                    class_or_filter: 32
                },
            ]
        );
    }

    #[test]
    fn other_sections_and_broken_bodies_are_refused() {
        assert!(prepend(&[], &[0], 0).is_err());
        assert!(prepend(&[(9 << 2) | 0x2, 0], &[0], 0).is_err());
        let mut m = Vec::new();
        m.extend_from_slice(&((0x3 | 0x8) | (3u16 << 12)).to_le_bytes());
        m.extend_from_slice(&1u16.to_le_bytes());
        m.extend_from_slice(&4u32.to_le_bytes());
        m.extend_from_slice(&0u32.to_le_bytes());
        m.extend_from_slice(&[0; 4]);
        m.extend_from_slice(&[0x02, 4, 0, 0]);
        assert!(prepend(&m, &[0], 0).unwrap_err().contains("kind 0x02"));
    }
    /// A fat body (maxstack 3, locals 0x11000001) of `code`, with `clauses`
    /// (fat) when there are any.
    fn fat(code: &[u8], clauses: &[Clause]) -> Vec<u8> {
        write(0, 3, 0x1100_0001, code, clauses)
    }

    fn hex(s: &str) -> Vec<u8> {
        s.split('-').map(|b| u8::from_str_radix(b, 16).unwrap()).collect()
    }

    /// `RhThrowEx` of CoreLib 10.0 (45 bytes), read by reflection.
    const RH_THROW_EX_10: &str = "02-2D-15-03-7B-D5-10-00-04-7B-CA-10-00-04-0A-1E-06-28-14-4B-00-06-10-00-03-02-16-28-1E-4B-00-06-03-7C-DA-10-00-04-03-28-18-4B-00-06-2A";
    /// `RhThrowHwEx` of CoreLib 10.0 (187 bytes, a `switch` and 24 branches).
    const RH_THROW_HW_EX_10: &str = "03-7B-D5-10-00-04-7B-CA-10-00-04-0A-17-0B-16-0C-14-0D-02-20-02-00-00-80-35-12-02-2C-4B-02-1F-42-2E-4A-02-20-02-00-00-80-2E-48-2B-67-02-20-06-00-00-C0-35-12-02-20-05-00-00-C0-2E-3B-02-20-06-00-00-C0-2E-45-2B-4D-02-20-1D-00-00-C0-2E-36-02-20-94-00-00-C0-59-45-03-00-00-00-16-00-00-00-1A-00-00-00-28-00-00-00-2B-2B-1E-0C-2B-2F-16-0B-1E-0C-2B-29-1F-0A-0C-2B-24-1F-09-0C-2B-1F-1A-0C-2B-1B-1D-0C-2B-17-1F-0D-0C-2B-12-1F-0F-0C-2B-0D-1F-0E-0C-2B-08-17-14-06-28-10-4B-00-06-08-2C-08-08-06-28-14-4B-00-06-0D-03-09-07-28-1E-4B-00-06-03-7C-DA-10-00-04-03-28-18-4B-00-06-2A";
    /// `DispatchEx`'s token in CoreLib 10.0.
    const DISPATCH_EX_10: u32 = 0x0600_4B18;

    /// Where each branch of `code` goes (offset of the branch, target).
    fn targets(code: &[u8]) -> Vec<(usize, i64)> {
        instructions(code)
            .unwrap()
            .iter()
            .flat_map(|i| {
                let next = (i.offset + i.size) as i64;
                i.offset_fields().map(move |(at, width)| (i.offset, next + read_offset(code, at, width)))
            })
            .collect()
    }

    #[test]
    fn the_call_goes_just_before_each_entry_points_call_of_dispatch_ex() {
        for (source, call_at) in [(RH_THROW_EX_10, 39), (RH_THROW_HW_EX_10, 181)] {
            let original = fat(&hex(source), &[]);
            assert_eq!(call_after_ldarg(&original, DISPATCH_EX_10, 1).unwrap(), Some(call_at));
            assert_eq!(call_after_ldarg(&original, DISPATCH_EX_10, 0).unwrap(), None);
            assert_eq!(call_after_ldarg(&original, 0x0600_0001, 1).unwrap(), None);
            let inserted = [0x00; 27];
            let out = insert_before(&original, call_at, &inserted, 2).unwrap();
            let body = parse(&out).unwrap();
            let old = hex(source);
            assert_eq!(body.code[..call_at], old[..call_at]);
            assert_eq!(body.code[call_at..call_at + 27], inserted);
            assert_eq!(body.code[call_at + 27..], old[call_at..]);
            assert_eq!((body.max_stack, body.locals), (5, 0x1100_0001));
            // Every branch of these methods stays before the call.
            assert_eq!(targets(body.code), targets(&old));
        }
    }

    #[test]
    fn branches_across_the_inserted_code_are_moved_and_one_to_it_runs_it() {
        // 0: br.s 10 (across)   2: brtrue 10 (across, long)   7: br.s 9
        // 9: nop                10: nop (`at`)               11: switch(2) -> 9, 10
        // 24: br.s 0 (back across)  26: ret
        let mut code = vec![0x2B, 8, 0x3A];
        code.extend_from_slice(&3i32.to_le_bytes());
        code.extend_from_slice(&[0x2B, 0, 0x00, 0x00, 0x45]);
        code.extend_from_slice(&2u32.to_le_bytes());
        code.extend_from_slice(&(-15i32).to_le_bytes());
        code.extend_from_slice(&(-14i32).to_le_bytes());
        code.extend_from_slice(&[0x2B, (-26i8) as u8, 0x2A]);
        assert_eq!(targets(&code), vec![(0, 10), (2, 10), (7, 9), (11, 9), (11, 10), (24, 0)]);
        let out = insert_before(&fat(&code, &[]), 10, &[0x14, 0x26], 1).unwrap();
        let body = parse(&out).unwrap();
        // A branch to `at` now runs the inserted code (still at 10); what
        // came after it moved by two.
        assert_eq!(targets(body.code), vec![(0, 10), (2, 10), (7, 9), (13, 9), (13, 10), (26, 0)]);
        assert_eq!(body.code[10..12], [0x14, 0x26]);
    }

    #[test]
    fn regions_that_start_at_the_inserted_code_hold_it_and_those_that_end_there_do_not() {
        let code = [0x00; 8];
        let clause = |flags, try_offset, try_length, handler_offset, handler_length, class_or_filter| Clause {
            flags,
            try_offset,
            try_length,
            handler_offset,
            handler_length,
            class_or_filter,
        };
        let clauses = [clause(0, 0, 4, 4, 2, 0x0100_0005), clause(1, 4, 2, 7, 1, 6)];
        let out = insert_before(&fat(&code, &clauses), 4, &[0x00; 3], 0).unwrap();
        let body = parse(&out).unwrap();
        assert_eq!(body.clauses, vec![clause(0, 0, 4, 4, 5, 0x0100_0005), clause(1, 4, 5, 10, 1, 9)]);
    }

    #[test]
    fn what_cannot_be_rewritten_safely_is_refused() {
        // A short branch that the inserted code puts out of its reach.
        let mut code = vec![0x2B, 125];
        code.extend_from_slice(&[0x00; 126]);
        let err = insert_before(&fat(&code, &[]), 2, &[0x00; 8], 0).unwrap_err();
        assert!(err.contains("no longer reaches"), "{err}");
        // Not where an instruction starts (inside `ldc.i4`'s operand).
        let code = [0x20, 1, 0, 0, 0, 0x2A];
        assert!(insert_before(&fat(&code, &[]), 2, &[0x00], 0).unwrap_err().contains("offset 2"));
        // An opcode ECMA-335 does not define.
        assert!(insert_before(&fat(&[0x24, 0x2A], &[]), 0, &[0x00], 0).unwrap_err().contains("0x24"));
        assert!(call_after_ldarg(&fat(&[0xFE, 0x08], &[]), 1, 1).unwrap_err().contains("0xFE 0x08"));
    }
}
