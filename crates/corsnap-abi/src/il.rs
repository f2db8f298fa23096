//! IL method bodies with a few instructions put before their code, for
//! ReJIT (`ICorProfilerFunctionControl::SetILFunctionBody`).
//!
//! ECMA-335 II.25.4: a body is a tiny header (one byte, code up to 63
//! bytes, no locals, no exception clauses) or a fat one (12 bytes: flags,
//! the stack it needs, the code's size, the locals' signature), the code,
//! and, when the fat header says so, sections 4-byte aligned after the code
//! (the exception clauses, small or fat). Code put first moves every clause
//! by its length; branches are relative to the instruction after them and
//! stay right. The body written back always has a fat header and fat
//! clauses, so no offset can overflow a small clause's 16 bits.
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
/// leave the stack empty).
pub fn prepend(method: &[u8], prologue: &[u8], prologue_stack: u16) -> Result<Vec<u8>, String> {
    let body = parse(method)?;
    let shift = prologue.len() as u32;
    let code_size = body.code.len() + prologue.len();
    let mut flags = FAT | (body.flags & INIT_LOCALS);
    if !body.clauses.is_empty() {
        flags |= MORE_SECTS;
    }
    let mut out = Vec::with_capacity(FAT_HEADER_BYTES + code_size + 4 + body.clauses.len() * FAT_CLAUSE_BYTES);
    out.extend_from_slice(&(flags | (3 << 12)).to_le_bytes());
    out.extend_from_slice(&body.max_stack.max(prologue_stack).to_le_bytes());
    out.extend_from_slice(&(code_size as u32).to_le_bytes());
    out.extend_from_slice(&body.locals.to_le_bytes());
    out.extend_from_slice(prologue);
    out.extend_from_slice(body.code);
    if !body.clauses.is_empty() {
        while out.len() % 4 != 0 {
            out.push(0);
        }
        let size = 4 + body.clauses.len() * FAT_CLAUSE_BYTES;
        out.extend_from_slice(&(((size as u32) << 8) | (SECTION_EH_TABLE | SECTION_FAT_FORMAT) as u32).to_le_bytes());
        for c in &body.clauses {
            let filter = c.flags & CLAUSE_FILTER != 0;
            for word in [
                c.flags,
                c.try_offset + shift,
                c.try_length,
                c.handler_offset + shift,
                c.handler_length,
                if filter { c.class_or_filter + shift } else { c.class_or_filter },
            ] {
                out.extend_from_slice(&word.to_le_bytes());
            }
        }
    }
    Ok(out)
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
}
