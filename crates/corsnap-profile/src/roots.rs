//! A clean root: the native frames below a thread's first managed frame (the
//! host's start-up under `Main`, the runtime's thread start under a worker's
//! first method) folded into one frame that says what they are.
//!
//! Works on frame ids as the agent sends them (leaf first; `0` for a run of
//! native frames the suspend engine cannot name, [`NATIVE_FRAME_BIT`] for a
//! named native frame), so the live view (`top`) and the profile builder fold
//! alike.

use corsnap_wire::NATIVE_FRAME_BIT;

/// The frame that stands for a main thread's start-up: the `dotnet` host (or
/// the program's own executable), libc's `__libc_start_main`, `hostfxr`,
/// `hostpolicy` and the runtime's code up to `Main`.
pub const HOST_START_FRAME: &str = "[host start-up]";
/// The frame that stands for any other thread's start: `clone3`,
/// `start_thread` and the runtime's code up to the thread's first method.
pub const THREAD_START_FRAME: &str = "[thread start]";

/// What one named native frame says about where its stack starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NativeRoot {
    /// A main thread's start: the host or libc's start of a program.
    Host,
    /// Nothing in particular.
    Other,
    /// The walk lost its way (`[incomplete stack]`): the frames at the end
    /// are not the thread's start.
    Lost,
}

/// What the folded frames were.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Start {
    Host,
    Thread,
}

impl Start {
    pub fn frame_name(self) -> &'static str {
        match self {
            Start::Host => HOST_START_FRAME,
            Start::Thread => THREAD_START_FRAME,
        }
    }
}

/// Classifies a native frame by its name (`libc.so.6!__libc_start_main`,
/// `libhostfxr.so+0x1234`) and module.
pub fn classify_native(name: &str, module: &str) -> NativeRoot {
    if name == "[incomplete stack]" {
        return NativeRoot::Lost;
    }
    let symbol = name.split_once('!').map_or("", |(_, symbol)| symbol);
    let host_symbol = symbol.contains("__libc_start_main")
        || symbol.contains("__libc_start_call_main")
        || symbol == "_start"
        || symbol == "main";
    let module = module.rsplit('/').next().unwrap_or(module);
    let host_module = module.starts_with("libhostfxr") || module.starts_with("libhostpolicy") || module == "dotnet";
    if host_symbol || host_module {
        NativeRoot::Host
    } else {
        NativeRoot::Other
    }
}

/// Where to fold a stack (`frames` leaf first): keep `frames[..n]` and put
/// one [`Start`] frame in place of the rest. `native` classifies a named
/// native frame id (`None`: never named, counts as [`NativeRoot::Other`]);
/// `main_thread` says the stack is the process's first thread (its OS thread
/// id is the process id), which tells the host's start when no frame does
/// (the runtime's own walks name no native frame: `[native code]`).
///
/// Nothing is folded when the stack has no managed frame (a GC or other
/// native thread keeps its frames), or when the walk did not reach the
/// thread's start.
pub fn fold_point(
    frames: &[u64],
    main_thread: bool,
    native: impl Fn(u64) -> Option<NativeRoot>,
) -> Option<(usize, Start)> {
    let is_native = |id: u64| id == 0 || id & NATIVE_FRAME_BIT != 0;
    let first_managed = frames.iter().rposition(|&id| !is_native(id))?;
    let tail = &frames[first_managed + 1..];
    if tail.is_empty() {
        return None;
    }
    let mut host = main_thread;
    for &id in tail.iter().filter(|&&id| id != 0) {
        match native(id).unwrap_or(NativeRoot::Other) {
            NativeRoot::Lost => return None,
            NativeRoot::Host => host = true,
            NativeRoot::Other => {}
        }
    }
    Some((first_managed + 1, if host { Start::Host } else { Start::Thread }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: u64 = NATIVE_FRAME_BIT;

    #[test]
    fn native_frames_are_classified_by_symbol_and_module() {
        let host = [
            ("libc.so.6!__libc_start_main_alias_2", "libc.so.6"),
            ("libc.so.6!__libc_start_call_main", "libc.so.6"),
            ("dotnet+0x6c48", "dotnet"),
            ("libhostfxr.so!hostfxr_main_startupinfo", "libhostfxr.so"),
            ("libhostpolicy.so+0x2f1a0", "libhostpolicy.so"),
            ("MyApp!main", "MyApp"),
            ("MyApp!_start", "MyApp"),
        ];
        for (name, module) in host {
            assert_eq!(classify_native(name, module), NativeRoot::Host, "{name}");
        }
        let other = [
            ("libc.so.6!start_thread", "libc.so.6"),
            ("libc.so.6!clone3", "libc.so.6"),
            ("libcoreclr.so+0x63cf50", "libcoreclr.so"),
            ("libcoreclr.so!ThreadNative::KickOffThread", "libcoreclr.so"),
            ("libdotnet_helper.so!maintain", "libdotnet_helper.so"),
            ("[unknown code]", ""),
            ("[runtime stub]", ""),
        ];
        for (name, module) in other {
            assert_eq!(classify_native(name, module), NativeRoot::Other, "{name}");
        }
        assert_eq!(classify_native("[incomplete stack]", ""), NativeRoot::Lost);
    }

    #[test]
    fn only_the_frames_below_the_first_managed_one_fold() {
        let start_main = N | 1;
        let hostfxr = N | 2;
        let coreclr = N | 3;
        let clone = N | 4;
        let qsort = N | 5;
        let lost = N | 6;
        let classify = |id: u64| match id {
            id if id == start_main || id == hostfxr => Some(NativeRoot::Host),
            id if id == lost => Some(NativeRoot::Lost),
            id if id == N | 99 => None,
            _ => Some(NativeRoot::Other),
        };
        let main = 0x100;
        let leaf = 0x200;
        type Case<'a> = (&'a [u64], Option<(usize, Start)>);
        let cases: &[Case] = &[
            // Main thread: the host's frames under Main, native frames above and between kept.
            (&[qsort, leaf, qsort, main, coreclr, hostfxr, start_main], Some((4, Start::Host))),
            (&[leaf, main, coreclr, coreclr, clone], Some((2, Start::Thread))),
            (&[leaf, main, N | 99], Some((2, Start::Thread))),
            (&[leaf, main, 0, coreclr], Some((2, Start::Thread))),
            // The runtime's own walk: `[native code]` below the first managed frame.
            (&[leaf, 0, main, 0], Some((3, Start::Thread))),
            // Nothing to fold, nothing managed, a lost walk.
            (&[leaf, main], None),
            (&[coreclr, clone], None),
            (&[], None),
            (&[leaf, main, coreclr, lost], None),
        ];
        for (frames, expected) in cases {
            assert_eq!(fold_point(frames, false, classify), *expected, "{frames:x?}");
        }
        // The process's first thread: the host's, whatever its frames say.
        assert_eq!(fold_point(&[leaf, main, 0], true, classify), Some((2, Start::Host)));
        assert_eq!(fold_point(&[leaf, main, coreclr], true, classify), Some((2, Start::Host)));
        assert_eq!(fold_point(&[leaf, main], true, classify), None);
        assert_eq!(fold_point(&[leaf, main, coreclr, lost], true, classify), None);
    }
}
