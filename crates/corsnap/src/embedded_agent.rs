//! The agent library carried inside the `corsnap` binary (built by
//! `build.rs`), written out where a target process can load it when no
//! agent lies beside the binary and `$CORSNAP_AGENT` is not set.
//!
//! The runtime loads a profiler only from a file, so the bytes must land on
//! disk. Where: `$TMPDIR/corsnap-agent-<uid>/libcorsnap_agent-<hash>.so`.
//! - The directory is ours alone to write and list (mode 0711), and is
//!   checked before use: a directory of that name made by someone else, or
//!   one others may write to, is refused (they could swap the library that
//!   the next process loads).
//! - The file is readable by every user (0644) and the directory can be
//!   passed through by every user, because root attaching to another user's
//!   process hands that process this path, and the process, running as its
//!   own user, opens it. Its content is the agent inside the corsnap binary
//!   itself, no secret.
//! - The name carries a hash of the content: two corsnap versions never
//!   share a file, and one already there is reused when its bytes are the
//!   same (a machine profiling all day writes it once).
//! - Written to a temporary file in the same directory and renamed into
//!   place: a process never loads a half-written library, and two corsnaps
//!   writing at once both end with a whole file.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The agent, as built for this binary (empty when built with
/// `CORSNAP_EMBED_AGENT=0`).
static AGENT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libcorsnap_agent.so"));
const AGENT_HASH: &str = env!("CORSNAP_EMBEDDED_AGENT_HASH");

/// Whether this binary carries an agent.
pub fn available() -> bool {
    !AGENT.is_empty()
}

/// Writes the embedded agent out (or finds it already written) and returns
/// its absolute path.
pub fn install() -> Result<PathBuf> {
    install_in(&std::env::temp_dir())
}

fn install_in(base: &Path) -> Result<PathBuf> {
    let uid = corsnap_abi::current_uid();
    let dir = base.join(format!("corsnap-agent-{uid}"));
    private_dir(&dir, uid)?;
    let file = dir.join(format!("libcorsnap_agent-{AGENT_HASH}.so"));
    if let Ok(meta) = std::fs::symlink_metadata(&file) {
        if meta.is_file() && meta.uid() == uid && std::fs::read(&file).is_ok_and(|bytes| bytes == AGENT) {
            return Ok(file);
        }
    }
    let mut temp = tempfile::Builder::new()
        .prefix(".libcorsnap_agent-")
        .tempfile_in(&dir)
        .with_context(|| format!("writing corsnap's agent into {}", dir.display()))?;
    temp.write_all(AGENT)
        .and_then(|()| temp.as_file().sync_all())
        .with_context(|| format!("writing corsnap's agent into {} (is the file system full?)", dir.display()))?;
    std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o644))?;
    temp.persist(&file).with_context(|| format!("writing corsnap's agent to {}", file.display()))?;
    Ok(file)
}

/// Makes `dir` (or checks the one there): a directory of ours that only we
/// may write to or list, and everybody may pass through.
fn private_dir(dir: &Path, uid: u32) -> Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("creating {} for corsnap's agent", dir.display())),
    }
    let meta = std::fs::symlink_metadata(dir).with_context(|| format!("looking at {}", dir.display()))?;
    if !meta.is_dir() || meta.uid() != uid {
        bail!(
            "{} is not a directory of yours (uid {uid}): corsnap will not put its agent there, where someone else \
             could replace it; remove it, or set CORSNAP_AGENT to a libcorsnap_agent.so",
            dir.display()
        );
    }
    if meta.mode() & 0o777 != 0o711 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
            .with_context(|| format!("making {} private", dir.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_once_private_and_reused() {
        if !available() {
            return;
        }
        let base = tempfile::tempdir().unwrap();
        let first = install_in(base.path()).unwrap();
        assert_eq!(std::fs::read(&first).unwrap(), AGENT);
        let dir_mode = std::fs::metadata(first.parent().unwrap()).unwrap().mode() & 0o777;
        assert_eq!(dir_mode, 0o711);
        assert_eq!(std::fs::metadata(&first).unwrap().mode() & 0o777, 0o644);
        let written = std::fs::metadata(&first).unwrap().ino();
        let again = install_in(base.path()).unwrap();
        assert_eq!(first, again);
        assert_eq!(std::fs::metadata(&again).unwrap().ino(), written, "an identical file is reused, not rewritten");
        // A damaged file is replaced.
        std::fs::write(&first, b"not an agent").unwrap();
        let repaired = install_in(base.path()).unwrap();
        assert_eq!(std::fs::read(&repaired).unwrap(), AGENT);
        // Only the agent is left in the directory: no temporary files.
        assert_eq!(std::fs::read_dir(first.parent().unwrap()).unwrap().count(), 1);
    }

    #[test]
    fn a_directory_others_may_write_is_fixed_and_one_of_another_kind_refused() {
        if !available() {
            return;
        }
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join(format!("corsnap-agent-{}", corsnap_abi::current_uid()));
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        install_in(base.path()).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o711);
        let other = tempfile::tempdir().unwrap();
        std::fs::write(other.path().join(format!("corsnap-agent-{}", corsnap_abi::current_uid())), b"").unwrap();
        let e = install_in(other.path()).unwrap_err();
        assert!(e.to_string().contains("is not a directory of yours"), "{e}");
    }
}
