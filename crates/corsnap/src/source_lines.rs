//! Source lines from portable PDBs, read by the command line (never in the
//! profiled process).
//!
//! The agent sends each managed frame's IL offset, each function's module
//! and `MethodDef` token, and each module's path. Here an assembly's PDB is
//! found, once per assembly, embedded in it (a debug directory entry of type
//! 17, `EmbeddedPortablePdb`: `MPDB`, the uncompressed size, then deflated
//! data) or beside it (`app.dll` → `app.pdb`), and checked against the
//! assembly's CodeView entry: the PDB's id (its `#Pdb` stream) must be the
//! CodeView GUID and the entry's time stamp. A PDB that does not match gives
//! no lines, never wrong ones, and is named once on stderr. The PDB's
//! sequence points are read with `symbolic-ppdb` (Sentry's portable PDB
//! reader, vendored), which also skips hidden sequence points (line
//! `0xFEEFEE`): an IL offset takes the line of the last visible sequence
//! point at or before it.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use corsnap_profile::{Assembly, SourceLine, SourceLocator};
use object::pe;
use object::read::pe::{ImageNtHeaders, PeFile32, PeFile64};
use object::LittleEndian as LE;
use symbolic_ppdb::{PortablePdb, PortablePdbCache, PortablePdbCacheConverter};

/// `IMAGE_DEBUG_TYPE_EMBEDDED_PORTABLE_PDB`.
const DEBUG_TYPE_EMBEDDED_PORTABLE_PDB: u32 = 17;
/// An embedded PDB larger than this is refused (the assembly is outside
/// input; the size field is not trusted).
const MAX_PDB_BYTES: usize = 512 << 20;
/// `MethodDef` tokens' table.
const METHOD_DEF_TABLE: u32 = 0x06;

/// The PDB facts of an assembly's debug directory.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DebugDirectory {
    /// The CodeView entry's GUID (as stored) and time stamp: the id the
    /// assembly's PDB must have.
    pub pdb_id: Option<([u8; 16], u32)>,
    /// The PDB's path as the compiler wrote it into the CodeView entry.
    pub pdb_path: String,
    /// The embedded portable PDB's compressed entry (`MPDB` and on).
    pub embedded: Option<Vec<u8>>,
}

/// Reads an assembly's debug directory.
pub fn read_debug_directory(image: &[u8]) -> Result<DebugDirectory, String> {
    match object::FileKind::parse(image).map_err(|e| e.to_string())? {
        object::FileKind::Pe32 => {
            debug_directory::<pe::ImageNtHeaders32>(&PeFile32::parse(image).map_err(|e| e.to_string())?, image)
        }
        object::FileKind::Pe64 => {
            debug_directory::<pe::ImageNtHeaders64>(&PeFile64::parse(image).map_err(|e| e.to_string())?, image)
        }
        other => Err(format!("not a PE image ({other:?})")),
    }
}

fn debug_directory<Pe: ImageNtHeaders>(
    file: &object::read::pe::PeFile<'_, Pe>,
    image: &[u8],
) -> Result<DebugDirectory, String> {
    let mut out = DebugDirectory::default();
    let Some(dir) = file.data_directory(pe::IMAGE_DIRECTORY_ENTRY_DEBUG) else { return Ok(out) };
    let bytes = dir.data(image, &file.section_table()).map_err(|e| e.to_string())?;
    let entries: &[pe::ImageDebugDirectory] =
        object::pod::slice_from_all_bytes(bytes).map_err(|()| "debug directory of an odd size".to_string())?;
    for entry in entries {
        let start = entry.pointer_to_raw_data.get(LE) as usize;
        let len = entry.size_of_data.get(LE) as usize;
        let Some(data) = image.get(start..start.saturating_add(len)) else { continue };
        match entry.typ.get(LE) {
            pe::IMAGE_DEBUG_TYPE_CODEVIEW if data.len() >= 24 && &data[..4] == b"RSDS" && out.pdb_id.is_none() => {
                let mut guid = [0u8; 16];
                guid.copy_from_slice(&data[4..20]);
                out.pdb_id = Some((guid, entry.time_date_stamp.get(LE)));
                let path = &data[24..];
                let end = path.iter().position(|&b| b == 0).unwrap_or(path.len());
                out.pdb_path = String::from_utf8_lossy(&path[..end]).into_owned();
            }
            DEBUG_TYPE_EMBEDDED_PORTABLE_PDB => out.embedded = Some(data.to_vec()),
            _ => {}
        }
    }
    Ok(out)
}

/// An embedded portable PDB's bytes: `MPDB`, u32 size, deflate stream.
pub fn inflate_embedded_pdb(entry: &[u8]) -> Result<Vec<u8>, String> {
    if entry.len() < 8 || &entry[..4] != b"MPDB" {
        return Err("the embedded PDB entry does not start with MPDB".into());
    }
    let size = u32::from_le_bytes([entry[4], entry[5], entry[6], entry[7]]) as usize;
    if size > MAX_PDB_BYTES {
        return Err(format!("the embedded PDB claims {size} bytes"));
    }
    let mut pdb = Vec::with_capacity(size);
    flate2::read::DeflateDecoder::new(&entry[8..])
        .take(size as u64)
        .read_to_end(&mut pdb)
        .map_err(|e| format!("the embedded PDB does not inflate: {e}"))?;
    if pdb.len() != size {
        return Err(format!("the embedded PDB inflates to {} bytes, not {size}", pdb.len()));
    }
    Ok(pdb)
}

/// A portable PDB's id (`#Pdb` stream: GUID and stamp), as a `DebugId`.
fn expected_id((guid, stamp): ([u8; 16], u32)) -> Option<debugid::DebugId> {
    debugid::DebugId::from_guid_age(&guid, stamp).ok()
}

/// The id a portable PDB gives itself (its `#Pdb` stream), in the form a
/// CodeView entry holds it (GUID bytes as stored, stamp).
pub fn portable_pdb_id(pdb: &[u8]) -> Option<([u8; 16], u32)> {
    let id = PortablePdb::parse(pdb).ok()?.pdb_id()?;
    let uuid = id.uuid();
    let (d1, d2, d3, d4) = uuid.as_fields();
    let mut guid = [0u8; 16];
    guid[..4].copy_from_slice(&d1.to_le_bytes());
    guid[4..6].copy_from_slice(&d2.to_le_bytes());
    guid[6..8].copy_from_slice(&d3.to_le_bytes());
    guid[8..].copy_from_slice(d4);
    Some((guid, id.appendix()))
}

/// An assembly's sequence points, ready for lookups.
#[derive(Debug)]
pub struct AssemblyLines {
    /// A `PortablePdbCache` (symbolic's compact form of the sequence
    /// points: sorted ranges, parsed in place for each lookup).
    cache: Vec<u8>,
}

impl AssemblyLines {
    /// From a portable PDB's bytes, checked against the id the assembly
    /// wants (`None`: the assembly names none, nothing can be checked).
    pub fn from_pdb(pdb: &[u8], wanted: Option<([u8; 16], u32)>) -> Result<AssemblyLines, Mismatch> {
        if !PortablePdb::peek(pdb) {
            return Err(Mismatch::NotPortable);
        }
        let parsed = PortablePdb::parse(pdb).map_err(|e| Mismatch::Unreadable(e.to_string()))?;
        let (Some(wanted), Some(found)) = (wanted.and_then(expected_id), parsed.pdb_id()) else {
            return Err(Mismatch::NoId);
        };
        if wanted != found {
            return Err(Mismatch::Id { wanted: wanted.to_string(), found: found.to_string() });
        }
        let mut converter = PortablePdbCacheConverter::new();
        converter.process_portable_pdb(&parsed).map_err(|e| Mismatch::Unreadable(e.to_string()))?;
        let mut cache = Vec::new();
        converter.serialize(&mut cache).map_err(|e| Mismatch::Unreadable(e.to_string()))?;
        Ok(AssemblyLines { cache })
    }

    /// The line of `il_offset` in the method `method_token`.
    pub fn line(&self, method_token: u32, il_offset: u32) -> Option<SourceLine> {
        if method_token >> 24 != METHOD_DEF_TABLE {
            return None;
        }
        let cache = PortablePdbCache::parse(&self.cache).ok()?;
        let info = cache.lookup(method_token & 0x00FF_FFFF, il_offset)?;
        Some(SourceLine { file: info.file_name.to_string(), line: info.line })
    }
}

/// Why a PDB gave no lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// A Windows (MSF) PDB, or not a PDB at all.
    NotPortable,
    Unreadable(String),
    /// The assembly has no CodeView entry, or the PDB no id: nothing says
    /// they belong together.
    NoId,
    Id {
        wanted: String,
        found: String,
    },
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mismatch::NotPortable => write!(f, "it is not a portable PDB (build with <DebugType>portable</DebugType>)"),
            Mismatch::Unreadable(e) => write!(f, "it could not be read: {e}"),
            Mismatch::NoId => write!(f, "nothing ties it to the assembly (no CodeView entry or no PDB id)"),
            Mismatch::Id { wanted, found } => {
                write!(f, "it is from another build (the assembly wants PDB id {wanted}, the PDB is {found})")
            }
        }
    }
}

/// Finds and reads each assembly's PDB once, and answers lookups.
#[derive(Debug, Default)]
pub struct PdbLocator {
    assemblies: HashMap<String, Option<AssemblyLines>>,
}

impl PdbLocator {
    pub fn new() -> Self {
        Self::default()
    }

    /// A new locator, boxed, for each process's profile.
    pub fn boxed() -> Box<dyn SourceLocator> {
        Box::new(PdbLocator::new())
    }

    /// The lines of `assembly`, or why there are none (`Ok(None)`: no PDB
    /// at all, which is no news). The PDB id it must have is the one the
    /// loaded image named (the agent read it), else the file's.
    pub fn load(assembly: &Assembly) -> Result<Option<AssemblyLines>, String> {
        let path = Path::new(&assembly.path);
        let debug = std::fs::read(path).ok().and_then(|image| read_debug_directory(&image).ok());
        let loaded = assembly.pdb.as_ref().map(|p| (p.guid, p.stamp));
        let wanted = loaded.or(debug.as_ref().and_then(|d| d.pdb_id));
        if let Some(entry) = debug.as_ref().and_then(|d| d.embedded.as_ref()) {
            let pdb =
                inflate_embedded_pdb(entry).map_err(|e| format!("the PDB embedded in {}: {e}", path.display()))?;
            return AssemblyLines::from_pdb(&pdb, wanted)
                .map(Some)
                .map_err(|e| format!("the PDB embedded in {} gives no lines: {e}", path.display()));
        }
        // Beside the assembly (or where a single-file bundle's assembly
        // would be), else where the compiler wrote it.
        let compiler_path = assembly.pdb.as_ref().map(|p| p.path.clone()).or(debug.map(|d| d.pdb_path));
        let mut candidates = vec![pdb_beside(path)];
        candidates.extend(compiler_path.filter(|p| p.starts_with('/')).map(PathBuf::from));
        let mut refused = None;
        for candidate in candidates {
            let Ok(pdb) = std::fs::read(&candidate) else { continue };
            match AssemblyLines::from_pdb(&pdb, wanted) {
                Ok(lines) => return Ok(Some(lines)),
                Err(e) => {
                    refused.get_or_insert(format!("{} gives {} no lines: {e}", candidate.display(), path.display()));
                }
            }
        }
        refused.map_or(Ok(None), Err)
    }
}

/// `dir/app.dll` → `dir/app.pdb`.
fn pdb_beside(assembly: &Path) -> PathBuf {
    assembly.with_extension("pdb")
}

impl SourceLocator for PdbLocator {
    fn locate(&mut self, assembly: &Assembly, method_token: u32, il_offset: u32) -> Option<SourceLine> {
        let lines = self.assemblies.entry(assembly.path.clone()).or_insert_with(|| match PdbLocator::load(assembly) {
            Ok(lines) => lines,
            Err(why) => {
                eprintln!("corsnap: {why}");
                None
            }
        });
        lines.as_ref()?.line(method_token, il_offset)
    }
}
