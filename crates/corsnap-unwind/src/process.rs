//! Building a [`CodeMap`](crate::CodeMap)'s parts from what a process shows
//! of itself: loaded ELF objects (their `.eh_frame` read from memory, so it
//! works for deleted files, single-file bundles and the vDSO alike) and the
//! anonymous mappings where thread stacks live. Pure parsing: the caller
//! supplies the bytes.

use std::ops::Range;

use crate::{Bytes, ElfSections, NativeModule};

/// `DW_EH_PE_*` pointer encodings used by `.eh_frame_hdr`'s `eh_frame_ptr`.
const DW_EH_PE_OMIT: u8 = 0xff;

/// Reads a pointer in `encoding` at `pos` (whose address is `addr`) of `data`.
fn read_encoded(data: &[u8], pos: usize, addr: u64, encoding: u8) -> Option<(u64, usize)> {
    if encoding == DW_EH_PE_OMIT {
        return None;
    }
    let (value, size): (i64, usize) = match encoding & 0x0f {
        0x00 | 0x04 => (i64::from_le_bytes(data.get(pos..pos + 8)?.try_into().ok()?), 8), // absptr, udata8
        0x03 => (i64::from(u32::from_le_bytes(data.get(pos..pos + 4)?.try_into().ok()?)), 4), // udata4
        0x0b => (i64::from(i32::from_le_bytes(data.get(pos..pos + 4)?.try_into().ok()?)), 4), // sdata4
        0x0c => (i64::from_le_bytes(data.get(pos..pos + 8)?.try_into().ok()?), 8),        // sdata8
        _ => return None,
    };
    let base = match encoding & 0x70 {
        0x00 => 0,
        0x10 => addr as i64, // pcrel
        _ => return None,
    };
    Some((base.wrapping_add(value) as u64, size))
}

/// The length of the `.eh_frame` section starting at `data[0]`: CIE and FDE
/// records up to the zero terminator (or the end of `data`).
fn eh_frame_len(data: &[u8]) -> usize {
    let mut pos = 0usize;
    while let Some(len) = data.get(pos..pos + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])) {
        if len == 0 {
            return pos + 4;
        }
        let (header, len) = if len == 0xffff_ffff {
            match data.get(pos + 4..pos + 12) {
                Some(b) => (12usize, u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize),
                None => return pos,
            }
        } else {
            (4, len as usize)
        };
        match pos.checked_add(header).and_then(|p| p.checked_add(len)) {
            Some(next) if next <= data.len() => pos = next,
            _ => return pos,
        }
    }
    pos
}

/// A loaded ELF object as `dl_iterate_phdr` describes it.
#[derive(Debug, Clone)]
pub struct LoadedElf<'a> {
    pub name: &'a str,
    pub bias: u64,
    /// `PT_LOAD` segments: stated address, size, executable.
    pub segments: &'a [(u64, u64, bool)],
    /// `PT_GNU_EH_FRAME`: stated address and size of `.eh_frame_hdr`.
    pub eh_frame_hdr: Option<(u64, u64)>,
}

/// Makes the [`NativeModule`] for `elf`, reading its unwind sections out of
/// memory with `read(address, buffer)` (`false`: not readable). `None` if
/// it has no executable segment.
pub fn native_module(elf: &LoadedElf<'_>, read: impl FnMut(u64, &mut [u8]) -> bool) -> Option<NativeModule> {
    native_module_without_table(elf, read, &mut Vec::new()).map(NativeModule::with_table)
}

/// [`native_module`] with its row table left to compile later
/// ([`NativeModule::with_table`]), reading through `scratch`, which keeps
/// its size for the next module.
pub fn native_module_without_table(
    elf: &LoadedElf<'_>,
    mut read: impl FnMut(u64, &mut [u8]) -> bool,
    scratch: &mut Vec<u8>,
) -> Option<NativeModule> {
    let exec: Vec<&(u64, u64, bool)> = elf.segments.iter().filter(|s| s.2 && s.1 > 0).collect();
    let text_start = exec.iter().map(|s| s.0).min()?;
    let text_end = exec.iter().map(|s| s.0 + s.1).max()?;
    let mut sections = ElfSections { text: Some(text_start..text_end), ..Default::default() };
    if let Some((hdr_svma, hdr_len)) = elf.eh_frame_hdr {
        let mut hdr = vec![0u8; hdr_len as usize];
        if read(elf.bias.wrapping_add(hdr_svma), &mut hdr) && hdr.len() >= 8 && hdr[0] == 1 {
            // eh_frame_ptr follows the 4-byte header, pc-relative to itself.
            let ptr_avma = elf.bias.wrapping_add(hdr_svma) + 4;
            if let Some((eh_avma, _)) = read_encoded(&hdr, 4, ptr_avma, hdr[1]) {
                // The section ends at its terminator, within its segment:
                // read up to the segment's end into `scratch` (reused from
                // module to module: in this VM each fresh page costs a fault
                // of about 11 µs), and only the section kept, copied once.
                let eh_svma = eh_avma.wrapping_sub(elf.bias);
                let segment_end = elf
                    .segments
                    .iter()
                    .find(|s| s.0 <= eh_svma && eh_svma < s.0 + s.1)
                    .map(|s| s.0 + s.1)
                    .unwrap_or(eh_svma);
                let max = (segment_end - eh_svma) as usize;
                if scratch.len() < max {
                    scratch.resize(max, 0);
                }
                let bytes = &mut scratch[..max];
                if read(eh_avma, bytes) {
                    let len = eh_frame_len(bytes);
                    sections.eh_frame = Some((eh_svma..eh_svma + len as u64, Bytes::from(&bytes[..len])));
                }
            }
            sections.eh_frame_hdr = Some((hdr_svma..hdr_svma + hdr_len, hdr.into()));
        }
    }
    let code = elf.bias.wrapping_add(text_start)..elf.bias.wrapping_add(text_end);
    Some(NativeModule::without_table(elf.name.to_string(), code, elf.bias, sections))
}

/// One line of `/proc/self/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub range: Range<u64>,
    pub readable: bool,
    pub writable: bool,
    pub executable: bool,
    /// The file, `[stack]`, `[heap]`, `[anon:…]`, or empty.
    pub path: String,
}

/// Parses `/proc/<pid>/maps`.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let perms = fields.next()?.as_bytes();
            let path = fields.nth(3).map(|_| line.splitn(6, char::is_whitespace).nth(5).unwrap_or("").trim());
            Some(Mapping {
                range: u64::from_str_radix(start, 16).ok()?..u64::from_str_radix(end, 16).ok()?,
                readable: perms.first() == Some(&b'r'),
                writable: perms.get(1) == Some(&b'w'),
                executable: perms.get(2) == Some(&b'x'),
                path: path.unwrap_or("").to_string(),
            })
        })
        .collect()
}

/// Where thread stacks can be: private anonymous read-write mappings and
/// the main thread's `[stack]`.
pub fn stack_ranges(maps: &[Mapping]) -> Vec<Range<u64>> {
    maps.iter()
        .filter(|m| m.readable && m.writable && !m.executable)
        .filter(|m| m.path.is_empty() || m.path == "[stack]" || m.path.starts_with("[anon:"))
        .map(|m| m.range.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse_with_and_without_paths() {
        let text = "7f00-7f10 rw-p 00000000 00:00 0 \n\
                    7f10-7f20 r-xp 00001000 08:01 123 /usr/lib/libc.so.6\n\
                    7ffd-7ffe rw-p 00000000 00:00 0                          [stack]\n\
                    8000-9000 rw-p 00000000 00:00 0 [anon:glibc: malloc]\n\
                    9000-a000 rw-s 00000000 00:01 9 /memfd:doublemapper (deleted)\n";
        let maps = parse_maps(text);
        assert_eq!(maps.len(), 5);
        assert_eq!(maps[1].path, "/usr/lib/libc.so.6");
        assert!(maps[1].executable && !maps[1].writable);
        assert_eq!(maps[4].path, "/memfd:doublemapper (deleted)");
        assert_eq!(stack_ranges(&maps), [0x7f00..0x7f10, 0x7ffd..0x7ffe, 0x8000..0x9000]);
    }

    #[test]
    fn eh_frame_ends_at_its_terminator() {
        let mut data = Vec::new();
        data.extend_from_slice(&8u32.to_le_bytes());
        data.extend_from_slice(&[1; 8]);
        data.extend_from_slice(&4u32.to_le_bytes());
        data.extend_from_slice(&[2; 4]);
        data.extend_from_slice(&0u32.to_le_bytes());
        data.extend_from_slice(&[9; 32]);
        assert_eq!(eh_frame_len(&data), 24);
        assert_eq!(eh_frame_len(&data[..10]), 0);
    }
}
