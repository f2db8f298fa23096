//! The PDB a loaded assembly names: its CodeView debug directory entry,
//! read from the image the runtime mapped, so that the CLI can check a PDB
//! against it even when no assembly file is on disk (an assembly in a
//! single-file bundle) or the file there was rebuilt since.
//!
//! Written by hand rather than with `object`: the image is in memory, laid
//! out either as the file (IL-only assemblies are often mapped flat) or by
//! sections, and only a few fields are needed; each place is tried both
//! ways and an entry counts only if it starts with `RSDS`.

use corsnap_wire::PdbReference;

/// `IMAGE_DEBUG_TYPE_CODEVIEW`.
const DEBUG_TYPE_CODEVIEW: u32 = 2;
/// Bytes of the image's headers read (DOS, PE, optional header, sections).
const HEADERS_LEN: usize = 4096;
/// More debug directory entries than this are not an assembly's.
const MAX_ENTRIES: usize = 32;

/// The PDB reference of the image mapped at `base`.
pub fn pdb_reference(base: u64) -> Option<PdbReference> {
    if base == 0 {
        return None;
    }
    let headers = corsnap_abi::process::read_own_bytes(base, HEADERS_LEN)
        .or_else(|| corsnap_abi::process::read_own_bytes(base, 1024))?;
    parse_pdb_reference(&headers, |offset, len| corsnap_abi::process::read_own_bytes(base.checked_add(offset)?, len))
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// From an image's first bytes `headers`, and `read(offset from the image's
/// start, len)` for the rest: the CodeView entry's PDB reference.
pub fn parse_pdb_reference(headers: &[u8], read: impl Fn(u64, usize) -> Option<Vec<u8>>) -> Option<PdbReference> {
    if headers.get(..2)? != b"MZ" {
        return None;
    }
    let pe = u32_at(headers, 0x3c)? as usize;
    if headers.get(pe..pe + 4)? != b"PE\0\0" {
        return None;
    }
    let sections = u16_at(headers, pe + 6)? as usize;
    let optional = pe + 24;
    let optional_len = u16_at(headers, pe + 20)? as usize;
    let directories = match u16_at(headers, optional)? {
        0x10b => optional + 96,
        0x20b => optional + 112,
        _ => return None,
    };
    let debug_rva = u32_at(headers, directories + 6 * 8)?;
    let debug_len = (u32_at(headers, directories + 6 * 8 + 4)? as usize).min(28 * MAX_ENTRIES);
    if debug_rva == 0 || debug_len < 28 {
        return None;
    }
    // Where an RVA lies in the file (a flat image), by the section table.
    let table = optional + optional_len;
    let file_offset = |rva: u32| -> Option<u32> {
        (0..sections.min(96)).find_map(|i| {
            let s = table + i * 40;
            let (virtual_len, virtual_at) = (u32_at(headers, s + 8)?, u32_at(headers, s + 12)?);
            let (raw_len, raw_at) = (u32_at(headers, s + 16)?, u32_at(headers, s + 20)?);
            let within = rva.checked_sub(virtual_at)?;
            (within < virtual_len.max(raw_len)).then(|| raw_at.checked_add(within)).flatten()
        })
    };
    let places = [Some(debug_rva), file_offset(debug_rva)];
    for directory in places.iter().flatten() {
        let Some(entries) = read(u64::from(*directory), debug_len) else { continue };
        for entry in entries.chunks_exact(28) {
            if u32_at(entry, 12)? != DEBUG_TYPE_CODEVIEW {
                continue;
            }
            let stamp = u32_at(entry, 4)?;
            let len = (u32_at(entry, 16)? as usize).clamp(24, 24 + 1024);
            for at in [u32_at(entry, 20)?, u32_at(entry, 24)?] {
                let Some(data) = read(u64::from(at), len) else { continue };
                if data.get(..4) != Some(b"RSDS") {
                    continue;
                }
                let mut guid = [0u8; 16];
                guid.copy_from_slice(&data[4..20]);
                let path = &data[24..];
                let end = path.iter().position(|&b| b == 0).unwrap_or(path.len());
                let path = String::from_utf8_lossy(&path[..end]).into_owned();
                return Some(PdbReference { guid, stamp, path });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PE32 image whose one section is at RVA 0x2000 and file offset
    /// 0x400, with a debug directory of one CodeView entry in it; laid out
    /// as the file (`flat`) or by sections.
    fn image(flat: bool) -> Vec<u8> {
        let mut b = vec![0u8; 0x3000];
        b[..2].copy_from_slice(b"MZ");
        b[0x3c..0x40].copy_from_slice(&0x80u32.to_le_bytes());
        b[0x80..0x84].copy_from_slice(b"PE\0\0");
        b[0x86..0x88].copy_from_slice(&1u16.to_le_bytes()); // sections
        b[0x94..0x96].copy_from_slice(&224u16.to_le_bytes()); // optional header size
        let optional = 0x98;
        b[optional..optional + 2].copy_from_slice(&0x10bu16.to_le_bytes());
        let debug = optional + 96 + 6 * 8;
        b[debug..debug + 4].copy_from_slice(&0x2010u32.to_le_bytes());
        b[debug + 4..debug + 8].copy_from_slice(&28u32.to_le_bytes());
        let section = optional + 224;
        b[section + 8..section + 12].copy_from_slice(&0x1000u32.to_le_bytes());
        b[section + 12..section + 16].copy_from_slice(&0x2000u32.to_le_bytes());
        b[section + 16..section + 20].copy_from_slice(&0x1000u32.to_le_bytes());
        b[section + 20..section + 24].copy_from_slice(&0x400u32.to_le_bytes());
        let at = |rva: usize| if flat { rva - 0x2000 + 0x400 } else { rva };
        let entry = at(0x2010);
        b[entry + 4..entry + 8].copy_from_slice(&0xC6BE_C7CCu32.to_le_bytes());
        b[entry + 12..entry + 16].copy_from_slice(&DEBUG_TYPE_CODEVIEW.to_le_bytes());
        b[entry + 16..entry + 20].copy_from_slice(&(24u32 + 12).to_le_bytes());
        b[entry + 20..entry + 24].copy_from_slice(&0x2100u32.to_le_bytes());
        b[entry + 24..entry + 28].copy_from_slice(&((0x2100 - 0x2000 + 0x400) as u32).to_le_bytes());
        let data = at(0x2100);
        b[data..data + 4].copy_from_slice(b"RSDS");
        b[data + 4..data + 20].copy_from_slice(&[0xab; 16]);
        b[data + 20..data + 24].copy_from_slice(&1u32.to_le_bytes());
        b[data + 24..data + 35].copy_from_slice(b"/s/h.pdb\0\0\0");
        b
    }

    #[test]
    fn the_codeview_entry_is_found_in_either_layout() {
        for flat in [true, false] {
            let b = image(flat);
            let read = |offset: u64, len: usize| b.get(offset as usize..offset as usize + len).map(<[u8]>::to_vec);
            let found = parse_pdb_reference(&b[..0x400], read).unwrap_or_else(|| panic!("flat {flat}"));
            assert_eq!(found, PdbReference { guid: [0xab; 16], stamp: 0xC6BE_C7CC, path: "/s/h.pdb".into() });
        }
    }

    #[test]
    fn anything_else_is_none() {
        let read = |_: u64, _: usize| None;
        assert_eq!(parse_pdb_reference(b"MZ", read), None);
        assert_eq!(parse_pdb_reference(&[0u8; 512], read), None);
        let mut no_debug = image(true);
        no_debug[0x98 + 96 + 48..0x98 + 96 + 56].fill(0);
        let b = no_debug;
        let read = |offset: u64, len: usize| b.get(offset as usize..offset as usize + len).map(<[u8]>::to_vec);
        assert_eq!(parse_pdb_reference(&b[..0x400], read), None);
    }
}
