//! `corsnap ps`: the .NET processes one may attach to, and `--name`, which
//! finds one of them by its name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// One .NET process.
#[derive(Debug, Clone)]
pub struct DotnetProcess {
    pub pid: u32,
    /// What corsnap calls the program: `app` for `dotnet app.dll`.
    pub name: String,
    /// The kernel's name for it (`comm`).
    pub comm: String,
    /// From the runtime's directory (`.../Microsoft.NETCore.App/10.0.12/`),
    /// or `?` when its memory map is unreadable or the runtime is built in.
    pub runtime: String,
    pub user: String,
    pub command: String,
    /// Whether corsnap may attach to it, or why not.
    pub attach: Result<(), String>,
}

/// The processes that run .NET: those with a diagnostics socket in `/tmp`
/// (or our `TMPDIR`), and those with the runtime in their memory map (which
/// finds ones with another `TMPDIR`, when we may read their map).
pub fn list() -> Vec<DotnetProcess> {
    let me = std::process::id();
    let mut pids: BTreeSet<u32> = BTreeSet::new();
    let mut dirs = vec![PathBuf::from("/tmp")];
    if let Some(own) = std::env::var_os("TMPDIR").filter(|v| !v.is_empty()) {
        dirs.push(PathBuf::from(own));
    }
    for dir in &dirs {
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name
                .strip_prefix("dotnet-diagnostic-")
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse().ok())
            {
                pids.insert(pid);
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            if let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() {
                if runtime_of(pid).is_some() {
                    pids.insert(pid);
                }
            }
        }
    }
    pids.into_iter().filter(|&pid| pid != me && is_process(pid)).map(describe).collect()
}

/// Whether `pid` is a live process, not a thread: `/proc/{tid}` answers for
/// threads too, and a socket left by a killed process names a pid that may
/// since have gone to a thread of another one.
fn is_process(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|status| {
        status.lines().find_map(|l| l.strip_prefix("Tgid:")).and_then(|t| t.trim().parse::<u32>().ok()) == Some(pid)
    })
}

/// The runtime version in `pid`'s memory map, if it has loaded one.
fn runtime_of(pid: u32) -> Option<String> {
    runtime_in_maps(&std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?)
}

/// The runtime version from a memory map: the name of the directory that
/// holds `libcoreclr.so` (`.../Microsoft.NETCore.App/10.0.12/libcoreclr.so`).
fn runtime_in_maps(maps: &str) -> Option<String> {
    let line = maps.lines().find(|l| l.ends_with("/libcoreclr.so"))?;
    let path = Path::new(&line[line.find('/')?..]);
    Some(path.parent()?.file_name()?.to_string_lossy().into_owned())
}

fn describe(pid: u32) -> DotnetProcess {
    let command = crate::record::process_command_line(pid);
    let name = crate::record::program_name(command.split(' ').map(str::to_string));
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string();
    let uid = std::fs::read_to_string(format!("/proc/{pid}/status")).ok().and_then(|s| {
        s.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|l| l.split_whitespace().next()?.parse().ok())
    });
    let user = match uid {
        Some(uid) => crate::diagnostics::user_name(uid).unwrap_or_else(|| uid.to_string()),
        None => "?".to_string(),
    };
    let attach = crate::diagnostics::find_socket(pid).map(|_| ()).map_err(|e| format!("{e:#}"));
    DotnetProcess {
        pid,
        name,
        comm,
        runtime: runtime_of(pid).unwrap_or_else(|| "?".to_string()),
        user,
        command,
        attach,
    }
}

/// The table `corsnap ps` prints.
pub fn table(processes: &[DotnetProcess]) -> String {
    use std::fmt::Write as _;
    let name_width = processes.iter().map(|p| p.name.len()).max().unwrap_or(0).max(4);
    let user_width = processes.iter().map(|p| p.user.len()).max().unwrap_or(0).max(4);
    let mut out = format!(
        "{:>7}  {:<name_width$}  {:<8}  {:<user_width$}  {:<6}  COMMAND\n",
        "PID", "NAME", "RUNTIME", "USER", "ATTACH"
    );
    for p in processes {
        let attach = if p.attach.is_ok() { "yes" } else { "no" };
        let _ = writeln!(
            out,
            "{:>7}  {:<name_width$}  {:<8}  {:<user_width$}  {attach:<6}  {}",
            p.pid, p.name, p.runtime, p.user, p.command
        );
    }
    out
}

pub fn run() -> Result<()> {
    let processes = list();
    if processes.is_empty() {
        eprintln!("corsnap: no .NET processes found (none with a diagnostics socket in /tmp, none whose runtime this user can see)");
        return Ok(());
    }
    print!("{}", table(&processes));
    for p in processes.iter().filter(|p| p.attach.is_err()) {
        if let Err(why) = &p.attach {
            eprintln!("corsnap: {}: {why}", p.pid);
        }
    }
    Ok(())
}

/// The pid of the one .NET process called `name` (corsnap's name for it,
/// as `ps` shows, or the kernel's).
pub fn pid_by_name(name: &str) -> Result<u32> {
    let all = list();
    let matching: Vec<&DotnetProcess> = all.iter().filter(|p| p.name == name || p.comm == name).collect();
    match matching.as_slice() {
        [one] => Ok(one.pid),
        [] => {
            let names: BTreeSet<&str> = all.iter().map(|p| p.name.as_str()).collect();
            if names.is_empty() {
                bail!("no .NET process is named {name}: none is running that corsnap can see")
            }
            bail!(
                "no .NET process is named {name}; there are: {} (corsnap ps lists them)",
                names.into_iter().collect::<Vec<_>>().join(", ")
            )
        }
        several => bail!(
            "{} .NET processes are named {name} (pids {}): choose one with --pid (corsnap ps lists them)",
            several.len(),
            several.iter().map(|p| p.pid.to_string()).collect::<Vec<_>>().join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_not_processes() {
        assert!(is_process(std::process::id()));
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(std::fs::read_link("/proc/thread-self").unwrap()).unwrap();
            let _ = done_rx.recv();
        });
        let tid: u32 = rx.recv().unwrap().file_name().unwrap().to_string_lossy().parse().unwrap();
        assert!(Path::new(&format!("/proc/{tid}")).exists(), "/proc answers for a thread");
        assert!(!is_process(tid));
        done_tx.send(()).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn the_runtime_version_is_the_directory_of_libcoreclr() {
        let maps = "7f3a1c000000-7f3a1c200000 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libc.so.6\n\
                    7f3a1d000000-7f3a1d400000 r-xp 00000000 08:01 5678 \
                    /usr/share/dotnet/shared/Microsoft.NETCore.App/10.0.12/libcoreclr.so\n";
        assert_eq!(runtime_in_maps(maps).as_deref(), Some("10.0.12"));
        assert_eq!(runtime_in_maps("7f00-7f01 r-xp 0 0:0 0 /usr/bin/python3\n"), None);
    }
}
