//! Recognising a native AOT program: a .NET program compiled ahead of time
//! to machine code with its own small runtime (NativeAOT) instead of
//! CoreCLR. It loads no CLR profiler and has no diagnostics socket, so
//! corsnap has nothing to attach its agent to.
//!
//! Every native AOT executable (.NET 7 and later) exports
//! `DotNetRuntimeDebugHeader`, the data debuggers and dump readers find its
//! runtime by (a CoreCLR host exports `DotNetRuntimeInfo` instead), and
//! keeps its compiled code in a section named `__managedcode` (.NET 8 and
//! later). Either marks it. Only the ELF headers, the section headers and the
//! dynamic symbol table are read, not the whole file.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use object::{BinaryFormat, Object, ObjectSymbol, ReadCache};

/// The symbol a native AOT executable exports for debuggers.
const DEBUG_HEADER_SYMBOL: &str = "DotNetRuntimeDebugHeader";
/// The section the native AOT compiler puts managed code in.
const MANAGED_CODE_SECTION: &str = "__managedcode";

/// Whether the file at `path` is a native AOT executable (or library).
/// Anything unreadable or not ELF is not.
pub fn is_native_aot(path: &Path) -> bool {
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let data = ReadCache::new(file);
    let Ok(elf) = object::File::parse(&data) else {
        return false;
    };
    if elf.format() != BinaryFormat::Elf {
        return false;
    }
    elf.dynamic_symbols().any(|s| s.is_definition() && s.name() == Ok(DEBUG_HEADER_SYMBOL))
        || elf.section_by_name(MANAGED_CODE_SECTION).is_some()
}

/// The file `program` runs, found as `execvp` finds it: a name with a `/` as
/// it is, any other in the directories of `PATH`.
pub fn program_file(program: &OsStr) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;
    if program.as_bytes().contains(&b'/') {
        return Some(PathBuf::from(program));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Whether process `pid` runs a native AOT executable.
pub fn process_is_native_aot(pid: u32) -> bool {
    is_native_aot(Path::new(&format!("/proc/{pid}/exe")))
}

/// The one line corsnap prints for a native AOT program.
pub fn message(program: &str) -> String {
    format!("{program} is a native AOT program: it has no .NET runtime to profile")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_programs_and_non_elf_files_are_not_native_aot() {
        // corsnap's own test binary is an ELF executable without the marks.
        assert!(!is_native_aot(&std::env::current_exe().unwrap()));
        assert!(!is_native_aot(Path::new("/etc/passwd")));
        assert!(!is_native_aot(Path::new("/nonexistent/program")));
        assert!(!process_is_native_aot(std::process::id()));
    }

    #[test]
    fn programs_are_found_like_execvp_finds_them() {
        assert_eq!(program_file(OsStr::new("./app")), Some(PathBuf::from("./app")));
        let sh = program_file(OsStr::new("sh")).expect("sh on PATH");
        assert!(sh.is_absolute() && sh.ends_with("sh"), "{}", sh.display());
        assert_eq!(program_file(OsStr::new("no-such-program-corsnap")), None);
    }
}
