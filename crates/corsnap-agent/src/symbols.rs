//! Names for native frames, from ELF symbol tables, on the agent's thread
//! (never in the signal handler): `libc.so.6!qsort`, or `libcoreclr.so+0x1a2b3c`
//! where the module has no symbol there (Microsoft ships libcoreclr.so with
//! only its exports; its debug file, in a folder named by `--symbols`,
//! beside it or under /usr/lib/debug, is used instead).
//!
//! A module's table is read once, the first time one of its addresses needs
//! a name: `.symtab` if the file (or its debug file) has one, else `.dynsym`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

/// One function: stated start address, size, name as the table has it.
#[derive(Debug, Clone)]
struct Symbol {
    start: u64,
    end: u64,
    /// Mangled: demangled when a frame first needs it ([`Symbol::name`]).
    /// A runtime with its symbol table (libcoreclr.so of .NET Core 3.1)
    /// has tens of thousands of C++ names; demangling them all when the
    /// table was read took the agent's thread 2 s in a debug build, while
    /// the samples waiting to be drained overflowed their buffers.
    mangled: Box<str>,
    demangled: std::cell::OnceCell<String>,
    /// Lower is preferred among symbols at one address: exported names
    /// over weak ones over glibc's internal aliases (`__GI_qsort`).
    rank: u8,
}

#[derive(Debug, Default)]
struct SymbolTable {
    /// Sorted by start.
    symbols: Vec<Symbol>,
}

impl Symbol {
    fn name(&self) -> &str {
        self.demangled.get_or_init(|| demangle(&self.mangled))
    }
}

impl SymbolTable {
    fn from_elf<'d, R: object::ReadRef<'d>>(data: R) -> Option<SymbolTable> {
        let file = object::File::parse(data).ok()?;
        let mut symbols: Vec<Symbol> = Vec::new();
        let mut add = |sym: object::Symbol<'d, '_, R>| {
            if sym.kind() != SymbolKind::Text || sym.address() == 0 {
                return;
            }
            let Ok(name) = sym.name() else { return };
            if name.is_empty() {
                return;
            }
            let rank = match (sym.is_global(), sym.is_weak(), name.starts_with("__GI_") || name.starts_with("__")) {
                (_, _, true) => 3,
                (true, false, false) => 0,
                (_, true, false) => 1,
                _ => 2,
            };
            symbols.push(Symbol {
                start: sym.address(),
                end: sym.address() + sym.size(),
                mangled: name.into(),
                demangled: std::cell::OnceCell::new(),
                rank,
            });
        };
        let mut any = false;
        for sym in file.symbols() {
            any = true;
            add(sym);
        }
        if !any {
            for sym in file.dynamic_symbols() {
                add(sym);
            }
        }
        symbols.sort_by(|a, b| a.start.cmp(&b.start).then(a.rank.cmp(&b.rank)).then(b.end.cmp(&a.end)));
        symbols.dedup_by_key(|s| s.start);
        // Symbols without a size reach to the next symbol.
        for i in 0..symbols.len() {
            if symbols[i].end == symbols[i].start {
                symbols[i].end = symbols.get(i + 1).map_or(symbols[i].start + 1, |n| n.start);
            }
        }
        Some(SymbolTable { symbols })
    }

    /// The symbol covering stated address `addr`.
    fn lookup(&self, addr: u64) -> Option<&Symbol> {
        let i = self.symbols.partition_point(|s| s.start <= addr);
        let s = self.symbols.get(i.checked_sub(1)?)?;
        (addr < s.end).then_some(s)
    }
}

fn demangle(name: &str) -> String {
    // Rust's v0 names start with _R; its legacy ones look like C++ names but
    // end in a hash (`17h0123456789abcdefE`).
    let rust_legacy = name.starts_with("_ZN") && name.len() > 20 && name[name.len() - 20..].starts_with("17h");
    if name.starts_with("_R") || rust_legacy {
        if let Ok(d) = rustc_demangle::try_demangle(name) {
            return format!("{d:#}");
        }
    }
    if name.starts_with("_Z") {
        if let Ok(sym) = cpp_demangle::Symbol::new(name) {
            if let Ok(text) = sym.demangle(&cpp_demangle::DemangleOptions::new().no_params()) {
                return text;
            }
        }
    }
    name.to_string()
}

/// The file with the symbols for `path`: the debug file that the user's
/// folders (`--symbols`, searched first), its `.gnu_debuglink` or its build
/// id name, if one is there, else itself. A candidate whose build id
/// differs from the module's is someone else's symbols and is passed over:
/// wrong names are worse than none.
fn debug_file_for<'d, R: object::ReadRef<'d>>(path: &Path, data: R, search_dirs: &[PathBuf]) -> Option<PathBuf> {
    let file = object::File::parse(data).ok()?;
    if file.section_by_name(".symtab").is_some() {
        return None;
    }
    let build_id = file.build_id().ok().flatten().filter(|id| id.len() > 1).map(<[u8]>::to_vec);
    let build_id_path = build_id.as_ref().map(|id| {
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        format!(".build-id/{}/{}.debug", &hex[..2], &hex[2..])
    });
    let link = file.gnu_debuglink().ok().flatten().map(|(link, _crc)| String::from_utf8_lossy(link).into_owned());
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned());

    let mut candidates = Vec::new();
    // The user's folders: the layouts `dotnet-symbol` and distributions use
    // (`libcoreclr.so.dbg` flat, a build-id tree), the debuglink's name, and
    // an unstripped copy under the module's own name.
    for dir in search_dirs {
        if let Some(rel) = &build_id_path {
            candidates.push(dir.join(rel));
        }
        if let Some(link) = &link {
            candidates.push(dir.join(link));
        }
        if let Some(name) = &file_name {
            candidates.push(dir.join(format!("{name}.dbg")));
            candidates.push(dir.join(format!("{name}.debug")));
            candidates.push(dir.join(name));
        }
    }
    if let Some(rel) = &build_id_path {
        candidates.push(Path::new("/usr/lib/debug").join(rel));
    }
    if let (Some(link), Some(dir)) = (&link, path.parent()) {
        candidates.push(dir.join(link));
        candidates.push(dir.join(".debug").join(link));
        candidates.push(Path::new("/usr/lib/debug").join(dir.strip_prefix("/").unwrap_or(dir)).join(link));
    }
    candidates.into_iter().find(|c| c.is_file() && c != path && same_build(c, build_id.as_deref()))
}

/// Whether the debug file at `candidate` was built with the module whose
/// build id is `module_id` (a module without one accepts any).
fn same_build(candidate: &Path, module_id: Option<&[u8]>) -> bool {
    let Some(module_id) = module_id else { return true };
    let Ok(handle) = std::fs::File::open(candidate) else { return false };
    let data = object::ReadCache::new(handle);
    let Ok(file) = object::File::parse(&data) else { return false };
    matches!(file.build_id(), Ok(Some(id)) if id == module_id)
}

/// What a native frame is called, and the id it goes by on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NativeName {
    /// [`corsnap_wire::NATIVE_FRAME_BIT`] with the symbol's (or, without
    /// one, the address's) actual address.
    pub key: u64,
    pub name: String,
    /// The module's file name.
    pub module: String,
}

/// Symbol tables by module path, read on first use.
#[derive(Debug, Default)]
pub struct Symbolizer {
    tables: HashMap<String, Option<SymbolTable>>,
    /// The folders the user named for debug files, searched first.
    search_dirs: Vec<PathBuf>,
}

impl Symbolizer {
    pub fn with_search_dirs(dirs: &[String]) -> Symbolizer {
        Symbolizer { tables: HashMap::new(), search_dirs: dirs.iter().map(PathBuf::from).collect() }
    }

    /// Reads now the symbol tables of the modules under the root of every
    /// stack: the executable's (the bottom of the main thread; in a
    /// single-file app, the runtime too), the runtime's (its thread start
    /// and call frames) and the thread library's (`start_thread`,
    /// `clone3`); the runtime known as elsewhere in the agent, by an empty
    /// path or one ending `/libcoreclr.so`. Read when the first event's frames were
    /// named, they came while the program's first work ran: on `validate`
    /// (.NET 10, two pool threads filling both CPUs), 13 ms of the sampler
    /// thread in the 100 ms after the workers started.
    pub fn preload_roots<'p>(&mut self, paths: impl Iterator<Item = &'p str>) {
        const THREAD_LIBRARIES: [&str; 2] = ["/libc.so.6", "/libpthread.so.0"];
        for path in paths {
            let root = path.is_empty()
                || path.ends_with("/libcoreclr.so")
                || THREAD_LIBRARIES.iter().any(|library| path.ends_with(library));
            if root {
                let search_dirs = &self.search_dirs;
                self.tables.entry(path.to_string()).or_insert_with(|| load_table(path, search_dirs));
            }
        }
    }

    /// Takes `other`'s tables for the modules this one has not read.
    pub fn adopt(&mut self, other: Symbolizer) {
        for (path, table) in other.tables {
            self.tables.entry(path).or_insert(table);
        }
    }

    /// Names `addr` in the module loaded from `path` (empty: the main
    /// executable) with load bias `bias`.
    pub fn name(&mut self, path: &str, bias: u64, addr: u64) -> NativeName {
        let module = module_file_name(path);
        let search_dirs = &self.search_dirs;
        let table = self.tables.entry(path.to_string()).or_insert_with(|| load_table(path, search_dirs));
        let stated = addr.wrapping_sub(bias);
        match table.as_ref().and_then(|t| t.lookup(stated)) {
            Some(sym) => NativeName {
                key: corsnap_wire::NATIVE_FRAME_BIT | bias.wrapping_add(sym.start),
                name: format!("{module}!{}", sym.name()),
                module,
            },
            None => NativeName {
                key: corsnap_wire::NATIVE_FRAME_BIT | addr,
                name: format!("{module}+0x{stated:x}"),
                module,
            },
        }
    }
}

/// `libc.so.6` from `/lib/x86_64-linux-gnu/libc.so.6`; the executable's own
/// name for the main program.
pub fn module_file_name(path: &str) -> String {
    let path = if path.is_empty() { std::fs::read_link("/proc/self/exe").ok() } else { Some(PathBuf::from(path)) };
    path.as_deref()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "[unknown module]".to_string())
}

fn load_table(path: &str, search_dirs: &[PathBuf]) -> Option<SymbolTable> {
    if path == "linux-vdso.so.1" {
        return vdso_image().and_then(|data| SymbolTable::from_elf(data.as_slice()));
    }
    let file = if path.is_empty() { PathBuf::from("/proc/self/exe") } else { PathBuf::from(path) };
    // Read as needed (the symbol and string tables), not whole: a runtime
    // library is megabytes, and the host's memory would keep the pages.
    let data = object::ReadCache::new(std::fs::File::open(&file).ok()?);
    if let Some(debug) = debug_file_for(&file, &data, search_dirs) {
        let debug_data = std::fs::File::open(&debug).ok().map(object::ReadCache::new);
        if let Some(table) = debug_data.as_ref().and_then(|d| SymbolTable::from_elf(WithStrings::new(d))) {
            return Some(table);
        }
    }
    SymbolTable::from_elf(WithStrings::new(&data))
}

/// A file read as needed, but for its symbol names, read whole at once
/// first. Through [`object::ReadCache`] alone each name was a read of its
/// own (a seek and a `read`, for each of libcoreclr.so's 16,000 symbols in
/// .NET Core 3.1: 143 ms in a debug build, while the samples waiting to be
/// drained piled up in their buffers).
struct WithStrings<'a, R: object::ReadCacheOps> {
    file: &'a object::ReadCache<R>,
    /// The string tables' file offsets and bytes.
    strings: [(u64, &'a [u8]); 2],
}

// By hand: a derive would ask `R: Copy`, and only references are copied.
impl<R: object::ReadCacheOps> Clone for WithStrings<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<R: object::ReadCacheOps> Copy for WithStrings<'_, R> {}

impl<'a, R: object::ReadCacheOps> WithStrings<'a, R> {
    fn new(file: &'a object::ReadCache<R>) -> WithStrings<'a, R> {
        let mut strings = [(0, &[][..]); 2];
        if let Ok(elf) = object::File::parse(file) {
            let tables = [".strtab", ".dynstr"].map(|name| elf.section_by_name(name).and_then(|s| s.file_range()));
            for (out, (offset, size)) in strings.iter_mut().zip(tables.into_iter().flatten()) {
                if let Ok(bytes) = object::ReadRef::read_bytes_at(file, offset, size) {
                    *out = (offset, bytes);
                }
            }
        }
        WithStrings { file, strings }
    }
}

impl<'a, R: object::ReadCacheOps> object::ReadRef<'a> for WithStrings<'a, R> {
    fn len(self) -> Result<u64, ()> {
        object::ReadRef::len(self.file)
    }

    fn read_bytes_at(self, offset: u64, size: u64) -> Result<&'a [u8], ()> {
        for (start, bytes) in self.strings {
            if let Some(at) = offset.checked_sub(start).filter(|at| at + size <= bytes.len() as u64) {
                return Ok(&bytes[at as usize..(at + size) as usize]);
            }
        }
        object::ReadRef::read_bytes_at(self.file, offset, size)
    }

    fn read_bytes_at_until(self, range: std::ops::Range<u64>, delimiter: u8) -> Result<&'a [u8], ()> {
        for (start, bytes) in self.strings {
            let end = range.end.min(start + bytes.len() as u64);
            if let Some(at) = range.start.checked_sub(start).filter(|_| range.start < end) {
                let within = &bytes[at as usize..(end - start) as usize];
                if let Some(n) = within.iter().position(|&b| b == delimiter) {
                    return Ok(&within[..n]);
                }
            }
        }
        object::ReadRef::read_bytes_at_until(self.file, range, delimiter)
    }
}

/// The vDSO's ELF image, copied out of memory (it has no file).
fn vdso_image() -> Option<Vec<u8>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let line = maps.lines().find(|l| l.ends_with("[vdso]"))?;
    let (start, end) = line.split_whitespace().next()?.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    corsnap_abi::process::read_own_bytes(start, (end - start) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libc_functions_are_named_and_keyed_by_their_start() {
        let (objects, _) = corsnap_abi::process::loaded_objects();
        let libc = objects.iter().find(|o| o.name.contains("libc.so")).unwrap();
        let qsort = libc::qsort as *const () as u64;
        let mut s = Symbolizer::default();
        let a = s.name(&libc.name, libc.bias, qsort + 4);
        assert_eq!(a.name, "libc.so.6!qsort");
        assert_eq!(a.key, corsnap_wire::NATIVE_FRAME_BIT | qsort);
        assert_eq!(a.module, "libc.so.6");
    }

    #[test]
    fn the_root_modules_tables_are_read_before_any_name_is_asked_for() {
        let (objects, _) = corsnap_abi::process::loaded_objects();
        let libc = objects.iter().find(|o| o.name.contains("libc.so")).unwrap();
        let others: Vec<&str> = objects
            .iter()
            .map(|o| o.name.as_str())
            .filter(|n| !n.contains("libc.so") && !n.ends_with("/libpthread.so.0"))
            .collect();
        let mut s = Symbolizer::default();
        s.preload_roots(objects.iter().map(|o| o.name.as_str()));
        assert!(s.tables.get(&libc.name).is_some_and(Option::is_some), "libc's table not read");
        // The executable (the runtime too, in a single-file app); no other
        // library is read (no libcoreclr.so in this test's process).
        assert!(s.tables.contains_key(""), "the executable's table not read");
        let read_too: Vec<&&str> = others.iter().filter(|n| !n.is_empty() && s.tables.contains_key(**n)).collect();
        assert!(read_too.is_empty(), "read too: {read_too:?}");
        let qsort = libc::qsort as *const () as u64;
        assert_eq!(s.name(&libc.name, libc.bias, qsort).name, "libc.so.6!qsort");
    }

    #[test]
    fn names_read_from_the_string_tables_whole_are_the_names_read_one_by_one() {
        let (objects, _) = corsnap_abi::process::loaded_objects();
        let libc = objects.iter().find(|o| o.name.contains("libc.so")).unwrap();
        let file = object::ReadCache::new(std::fs::File::open(&libc.name).unwrap());
        let one_by_one = SymbolTable::from_elf(&file).unwrap();
        let whole = SymbolTable::from_elf(WithStrings::new(&file)).unwrap();
        assert!(WithStrings::new(&file).strings.iter().any(|s| !s.1.is_empty()), "no string table read whole");
        let names = |t: &SymbolTable| t.symbols.iter().map(|s| (s.start, s.mangled.clone())).collect::<Vec<_>>();
        assert!(one_by_one.symbols.len() > 1000);
        assert_eq!(names(&one_by_one), names(&whole));
    }

    #[test]
    fn cpp_and_rust_names_are_demangled() {
        assert_eq!(demangle("_ZN3WKS7gc_heap15garbage_collectEi"), "WKS::gc_heap::garbage_collect");
        assert_eq!(demangle("qsort"), "qsort");
    }
}
