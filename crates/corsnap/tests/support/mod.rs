//! Helpers for end-to-end tests: compile a C# program from `tests/programs`,
//! run it under `corsnap record`, and read the collapsed stacks back.
//!
//! The runtimes and the compiler come from `scripts/setup.sh`, which writes
//! their paths to `$CORSNAP_DEPS/env.sh`; `scripts/test.sh` loads it. These
//! tests never skip: a machine without a runtime fails them, loudly.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Runtime {
    /// The default: what users run (the SDK on PATH).
    Net10,
    Net9,
    Net8,
    Core31,
}

/// The supported runtimes the engine-truth, attach, dump and event tests run
/// on; .NET Core 3.1 gets a smoke set of its own.
pub const MATRIX: [Runtime; 3] = [Runtime::Net10, Runtime::Net9, Runtime::Net8];

/// One test per runtime of [`MATRIX`]: `on_each_runtime!(module, function)`
/// makes `module::net10`, `module::net9` and `module::net8`, each calling
/// `function(runtime)`, so a failure names its runtime and the others run.
#[macro_export]
macro_rules! on_each_runtime {
    ($module:ident, $function:ident) => {
        mod $module {
            #[test]
            fn net10() {
                super::$function(super::support::Runtime::Net10)
            }
            #[test]
            fn net9() {
                super::$function(super::support::Runtime::Net9)
            }
            #[test]
            fn net8() {
                super::$function(super::support::Runtime::Net8)
            }
        }
    };
}

impl Runtime {
    fn build_arg(self) -> &'static str {
        match self {
            Runtime::Net10 => "10",
            Runtime::Net9 => "9",
            Runtime::Net8 => "8",
            Runtime::Core31 => "3.1",
        }
    }

    fn env_var(self) -> &'static str {
        match self {
            Runtime::Net10 => "CORSNAP_DOTNET10",
            Runtime::Net9 => "CORSNAP_DOTNET9",
            Runtime::Net8 => "CORSNAP_DOTNET8",
            Runtime::Core31 => "CORSNAP_DOTNET31",
        }
    }

    pub fn dotnet(self) -> PathBuf {
        let var = self.env_var();
        let path = std::env::var_os(var).map(PathBuf::from).or_else(|| deps_env().get(var).map(PathBuf::from));
        match path {
            Some(p) if p.is_file() => p,
            _ => panic!("{var} is not set and no runtime was found: run scripts/setup.sh (or scripts/test.sh)"),
        }
    }
}

/// Values from `$CORSNAP_DEPS/env.sh` (lines `export NAME=value`), so
/// `cargo test` works after `scripts/setup.sh` without sourcing anything.
fn deps_env() -> &'static HashMap<String, String> {
    static ENV: OnceLock<HashMap<String, String>> = OnceLock::new();
    ENV.get_or_init(|| {
        let deps = std::env::var_os("CORSNAP_DEPS")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/corsnap"));
        let text = std::fs::read_to_string(deps.join("env.sh")).unwrap_or_default();
        text.lines()
            .filter_map(|l| l.trim().strip_prefix("export "))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.trim_matches(|c| c == '"' || c == '\'').to_string()))
            .collect()
    })
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

pub fn corsnap_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_corsnap"))
}

/// A scratch directory under `target/`, unique per test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = repo_root().join("target/e2e").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Compiles `tests/programs/<name>.cs` for `runtime` once per test run and
/// returns the path of its `.dll`.
pub fn compiled(name: &str, runtime: Runtime) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<(String, Runtime), PathBuf>>> = OnceLock::new();
    let built = BUILT.get_or_init(|| Mutex::new(HashMap::new()));
    let mut built = built.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = built.get(&(name.to_string(), runtime)) {
        return p.clone();
    }
    let root = repo_root();
    let out = root.join("target/e2e-programs").join(runtime.build_arg());
    std::fs::create_dir_all(&out).unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg(root.join("scripts/build-cs.sh"))
        .arg(root.join("tests/programs").join(format!("{name}.cs")))
        .arg(&out)
        .arg(runtime.build_arg());
    let status = cmd.status().expect("running scripts/build-cs.sh");
    assert!(status.success(), "compiling {name}.cs for {runtime:?} failed");
    let dll = out.join(format!("{name}.dll"));
    built.insert((name.to_string(), runtime), dll.clone());
    dll
}

/// `corsnap record` with `args` (before `--`) around `dotnet <program>.dll <program_args>`.
pub fn record(runtime: Runtime, program: &str, program_args: &[&str], args: &[&str], stdin: Option<&str>) -> Output {
    record_with_env(runtime, program, program_args, args, &[], stdin)
}

/// [`record`], with extra environment variables for corsnap and the program.
pub fn record_with_env(
    runtime: Runtime,
    program: &str,
    program_args: &[&str],
    args: &[&str],
    env: &[(&str, &str)],
    stdin: Option<&str>,
) -> Output {
    let dll = compiled(program, runtime);
    let mut cmd = Command::new(corsnap_bin());
    cmd.arg("record").args(args).arg("--").arg(runtime.dotnet()).arg(&dll).args(program_args);
    cmd.env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1");
    cmd.envs(env.iter().copied());
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("running corsnap");
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    }
    child.wait_with_output().unwrap()
}

/// One line of collapsed output: frames root first, and the count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stack {
    pub frames: Vec<String>,
    pub count: u64,
}

/// The CLI's line on walk verification (`CORSNAP_VERIFY_WALKS=1`), and its
/// numbers: walks compared with `DoStackSnapshot` at the same instant, those
/// identical, and those not compared (the sample came after the resume).
pub struct WalkVerification {
    pub line: String,
    pub compared: u64,
    pub identical: u64,
    pub late: u64,
}

/// Finds the walk verification line in corsnap's stderr; `what` names the
/// run in the panic when there is none.
pub fn walk_verification(stderr: &str, what: &str) -> WalkVerification {
    let line = stderr
        .lines()
        .find(|l| l.contains("walk verification:") && !l.contains("event walk verification:"))
        .unwrap_or_else(|| panic!("{what}: no walk verification line:\n{stderr}"));
    let numbers: Vec<u64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    let [compared, identical, late] = numbers[..] else { panic!("{what}: {line}") };
    WalkVerification { line: line.to_string(), compared, identical, late }
}

pub fn parse_collapsed(text: &str) -> Vec<Stack> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (stack, count) = l.rsplit_once(' ').expect("collapsed line ends with a count");
            Stack { frames: stack.split(';').map(str::to_string).collect(), count: count.parse().expect("count") }
        })
        .collect()
}

/// Records `program` into collapsed stacks and checks that the run succeeded.
pub fn record_collapsed(runtime: Runtime, program: &str, seconds: &str, extra: &[&str]) -> (Vec<Stack>, Output) {
    let dir = scratch(&format!("{program}-{runtime:?}-{}", extra.join("_").replace(['-', '/'], "")));
    let out = dir.join("out.txt");
    let out_str = out.to_str().unwrap();
    let mut args = vec!["-f", "collapsed", "-o", out_str];
    args.extend_from_slice(extra);
    let output = record(runtime, program, &[seconds], &args, None);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "corsnap record failed: {:?}\nstderr:\n{stderr}", output.status);
    let text = std::fs::read_to_string(&out).unwrap_or_else(|e| panic!("no output ({e}); stderr:\n{stderr}"));
    (parse_collapsed(&text), output)
}

/// Whether a frame is native code (`libc.so.6!qsort`, `libcoreclr.so+0x1a2b`,
/// `[native code]`, `[runtime stub]`) rather than a managed method.
pub fn is_native(frame: &str) -> bool {
    frame.contains('!') || frame.contains("+0x") || frame.starts_with('[')
}

/// The managed frames of a stack, in order.
pub fn managed_frames(frames: &[String]) -> Vec<&str> {
    frames.iter().map(String::as_str).filter(|f| !is_native(f)).collect()
}

/// Total count of stacks whose frames contain `frame`.
pub fn count_with(stacks: &[Stack], frame: &str) -> u64 {
    stacks.iter().filter(|s| s.frames.iter().any(|f| f == frame)).map(|s| s.count).sum()
}

/// The weight of the stacks whose last frames (leaf last) are `tail`.
#[allow(dead_code)] // not every test binary uses it
pub fn count_ending(stacks: &[Stack], tail: &[&str]) -> u64 {
    stacks
        .iter()
        .filter(|s| s.frames.ends_with(&tail.iter().map(|f| f.to_string()).collect::<Vec<_>>()))
        .map(|s| s.count)
        .sum()
}

pub fn describe(stacks: &[Stack]) -> String {
    let mut sorted: Vec<_> = stacks.iter().collect();
    sorted.sort_by_key(|s| std::cmp::Reverse(s.count));
    sorted.iter().take(8).map(|s| format!("{:6} {}", s.count, s.frames.join(";"))).collect::<Vec<_>>().join("\n")
}

/// A running test program that prints `ready <pid>` first and then
/// `heartbeat` lines; killed when dropped.
#[derive(Debug)]
pub struct Service {
    child: Child,
    pub pid: u32,
    heartbeats: Arc<AtomicU64>,
    /// Every other line the service wrote to stdout after its ready line.
    lines: Arc<Mutex<Vec<String>>>,
    /// The end of what the service wrote to stderr: the runtime's last words
    /// if it crashes.
    stderr_tail: Arc<Mutex<String>>,
}

impl Service {
    /// `service.cs` for two minutes on .NET 10.
    pub fn start(env: &[(&str, &str)]) -> Service {
        Service::start_on(Runtime::Net10, env)
    }

    /// `service.cs` for two minutes on `runtime`.
    pub fn start_on(runtime: Runtime, env: &[(&str, &str)]) -> Service {
        Service::start_program(runtime, "service", &["120"], env)
    }

    pub fn start_program(runtime: Runtime, program: &str, args: &[&str], env: &[(&str, &str)]) -> Service {
        let (service, rest) = Service::start_program_ready(runtime, program, args, env);
        assert!(rest.is_empty(), "unexpected words after the pid in the ready line: {rest:?}");
        service
    }

    /// A program whose ready line says more: `ready <pid> <port>` from
    /// `webapp.cs`. Returns the service and the port it listens on.
    pub fn start_listening(runtime: Runtime, program: &str, args: &[&str], env: &[(&str, &str)]) -> (Service, u16) {
        let (service, rest) = Service::start_program_ready(runtime, program, args, env);
        let port = match rest.as_slice() {
            [port] => port.parse().unwrap_or_else(|_| panic!("ready line's port {port:?}")),
            _ => panic!("expected `ready <pid> <port>`, the words after the pid are {rest:?}"),
        };
        (service, port)
    }

    /// [`Service::start_program`] for a ready line `ready <pid> [words...]`:
    /// the service and the words after the pid.
    pub fn start_program_ready(
        runtime: Runtime,
        program: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> (Service, Vec<String>) {
        let dll = compiled(program, runtime);
        let mut cmd = Command::new(runtime.dotnet());
        cmd.env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1");
        cmd.arg(&dll).args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Service::start_command_ready(cmd)
    }

    /// Any command that keeps the handshake (`ready <pid>`, then
    /// `heartbeat` lines): a published app's own executable, for one.
    pub fn start_command(cmd: Command) -> Service {
        let (service, rest) = Service::start_command_ready(cmd);
        assert!(rest.is_empty(), "unexpected words after the pid in the ready line: {rest:?}");
        service
    }

    /// [`Service::start_command`], with the words after the pid.
    pub fn start_command_ready(mut cmd: Command) -> (Service, Vec<String>) {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
        let mut child = cmd.spawn().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // Readiness handshake: the service prints its pid once it runs.
        let ready = lines.next().expect("service printed nothing").unwrap();
        let mut words =
            ready.strip_prefix("ready ").unwrap_or_else(|| panic!("unexpected first line {ready:?}")).split(' ');
        let pid: u32 = words.next().unwrap().parse().unwrap();
        let rest: Vec<String> = words.map(str::to_string).collect();
        let heartbeats = Arc::new(AtomicU64::new(0));
        let count = heartbeats.clone();
        let other_lines = Arc::new(Mutex::new(Vec::new()));
        let others = other_lines.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if line.starts_with("heartbeat ") {
                    count.fetch_add(1, Ordering::SeqCst);
                } else {
                    others.lock().unwrap().push(line);
                }
            }
        });
        let stderr_tail = Arc::new(Mutex::new(String::new()));
        let tail = stderr_tail.clone();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut tail = tail.lock().unwrap();
                tail.push_str(&line);
                tail.push('\n');
                if tail.len() > 8192 {
                    let cut = tail.len() - 4096;
                    let cut = (cut..tail.len()).find(|&i| tail.is_char_boundary(i)).unwrap_or(0);
                    tail.drain(..cut);
                }
            }
        });
        (Service { child, pid, heartbeats, lines: other_lines, stderr_tail }, rest)
    }

    pub fn is_alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Whether the service still runs (or how it ended), and the end of its
    /// stderr: for failure messages.
    pub fn describe(&mut self) -> String {
        // A process that is crashing may need a moment to end and finish
        // its last words; one still running is described as such.
        let _ = wait_for(Duration::from_secs(1), || self.child.try_wait().ok().flatten().is_some());
        let state = match self.child.try_wait().unwrap() {
            None => "still running".to_string(),
            Some(status) => format!("ended: {status}"),
        };
        format!("service {state}; its stderr ends:\n{}", self.stderr_tail.lock().unwrap())
    }

    /// Waits until `n` more heartbeats have arrived: the service still runs
    /// and its stdout is intact.
    pub fn wait_heartbeats(&self, n: u64) {
        let start = self.heartbeats.load(Ordering::SeqCst);
        wait_for(Duration::from_secs(10), || self.heartbeats.load(Ordering::SeqCst) >= start + n)
            .unwrap_or_else(|| panic!("the service stopped beating"));
    }

    /// Waits for a line of stdout (other than a heartbeat) that starts with
    /// `prefix`, written since the start, and returns it.
    pub fn wait_line(&self, prefix: &str, limit: Duration) -> String {
        let mut found = None;
        wait_for(limit, || {
            found = self.lines.lock().unwrap().iter().find(|l| l.starts_with(prefix)).cloned();
            found.is_some()
        })
        .unwrap_or_else(|| panic!("no line {prefix:?} from the service within {limit:?}"));
        found.unwrap()
    }

    pub fn agent_mapped(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/maps", self.pid)).unwrap_or_default().contains("libcorsnap_agent")
    }

    /// What a signal sampler could leave behind in the process: POSIX
    /// timers, perf event fds, a SIGPROF handler, more than one trampoline.
    /// Empty when there is none.
    pub fn signal_leftovers(&self) -> Vec<String> {
        let mut found = Vec::new();
        if let Ok(timers) = std::fs::read_to_string(format!("/proc/{}/timers", self.pid)) {
            if !timers.trim().is_empty() {
                found.push(format!("POSIX timers:\n{timers}"));
            }
        }
        let perf = std::fs::read_dir(format!("/proc/{}/fd", self.pid))
            .map(|d| {
                d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                    .filter(|l| l.to_string_lossy().contains("perf_event"))
                    .count()
            })
            .unwrap_or(0);
        if perf > 0 {
            found.push(format!("{perf} perf event fds"));
        }
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        let caught = status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .unwrap_or(0);
        // SIGPROF is signal 27: bit 26.
        if caught & (1 << 26) != 0 {
            found.push("a SIGPROF handler".to_string());
        }
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", self.pid)).unwrap_or_default();
        let trampolines = maps.lines().filter(|l| l.contains("corsnap-signal-trampoline")).count();
        if trampolines > 2 {
            found.push(format!("{trampolines} trampoline mappings (one code page and one data page are kept)"));
        }
        found
    }

    /// Thread names, without the runtime's tiered-compilation worker, which
    /// comes and goes by itself.
    pub fn threads(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", self.pid))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|n| n.trim().to_string())
            .filter(|n| n != ".NET Tiered Com")
            .collect();
        names.sort();
        names
    }

    /// The thread list once it has stopped changing (a runtime starting up,
    /// or finishing a detach, still creates and names threads).
    pub fn settled_threads(&self) -> Vec<String> {
        let mut last = self.threads();
        let mut stable_since = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && stable_since.elapsed() < Duration::from_millis(500) {
            std::thread::sleep(Duration::from_millis(50));
            let now = self.threads();
            if now != last {
                last = now;
                stable_since = Instant::now();
            }
        }
        last
    }

    /// Waits until the agent has left: not mapped, no thread of ours.
    pub fn wait_agent_gone(&self) {
        self.wait_agent_gone_logged(None);
    }

    /// [`Self::wait_agent_gone`], showing the end of the agent's log (its
    /// `--agent-log`) if it has not left: why it stayed.
    pub fn wait_agent_gone_logged(&self, agent_log: Option<&Path>) {
        wait_for(Duration::from_secs(10), || {
            !self.agent_mapped() && !self.threads().iter().any(|t| t.starts_with("corsnap"))
        })
        .unwrap_or_else(|| {
            let log = agent_log.map(|p| std::fs::read_to_string(p).unwrap_or_default()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
            panic!("agent still present: threads {:?}\nagent log, last lines:\n{}", self.threads(), tail.join("\n"))
        });
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn wait_for(limit: Duration, mut condition: impl FnMut() -> bool) -> Option<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if condition() {
            return Some(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// How `dotnet publish` makes an app of a test program (`published`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shape {
    /// `app.dll` on the installed runtime (`dotnet app.dll`, or the apphost `app`).
    FrameworkDependent,
    /// `app` with its own copy of the runtime beside it.
    SelfContained,
    /// One executable with the runtime linked in and the assemblies bundled.
    SingleFile,
    /// Framework-dependent, with the program's own code compiled ahead of
    /// time into its assembly (crossgen2), as the framework's is.
    ReadyToRun,
    /// Compiled to machine code with its own small runtime: no CLR at all.
    NativeAot,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::FrameworkDependent => "framework-dependent",
            Shape::SelfContained => "self-contained",
            Shape::SingleFile => "single-file",
            Shape::ReadyToRun => "ready-to-run",
            Shape::NativeAot => "native-aot",
        }
    }

    fn properties(self) -> &'static str {
        match self {
            Shape::FrameworkDependent => "<SelfContained>false</SelfContained>",
            Shape::SelfContained => "<SelfContained>true</SelfContained>",
            Shape::SingleFile => "<SelfContained>true</SelfContained><PublishSingleFile>true</PublishSingleFile>",
            Shape::ReadyToRun => "<SelfContained>false</SelfContained><PublishReadyToRun>true</PublishReadyToRun>",
            Shape::NativeAot => "<PublishAot>true</PublishAot>",
        }
    }
}

/// A test program published by `dotnet publish`.
#[derive(Debug, Clone)]
pub struct Published {
    /// The publish folder.
    pub dir: PathBuf,
    /// The app's own executable (the apphost, or the whole app).
    pub exe: PathBuf,
    /// `<program>.dll`, for `dotnet <program>.dll` (framework-dependent shapes).
    pub dll: PathBuf,
}

/// Publishes `tests/programs/<program>.cs` as `shape` for .NET 10, linux-x64,
/// into `target/e2e-apps/<program>-<shape>/out`, from a project generated
/// beside it. Once per test run at most, and not at all while the project,
/// the source and the SDK are what the last publish used. Publishes never
/// run two at a time.
pub fn published(program: &str, shape: Shape) -> Published {
    static PUBLISHED: OnceLock<Mutex<HashMap<(String, Shape), Published>>> = OnceLock::new();
    let published = PUBLISHED.get_or_init(|| Mutex::new(HashMap::new()));
    let mut published = published.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = published.get(&(program.to_string(), shape)) {
        return p.clone();
    }
    let root = repo_root();
    let source = root.join("tests/programs").join(format!("{program}.cs"));
    let base = root.join("target/e2e-apps").join(format!("{program}-{}", shape.name()));
    let project_dir = base.join("project");
    let out = base.join("out");
    let project = format!(
        r#"<Project Sdk="Microsoft.NET.Sdk">
  <PropertyGroup>
    <OutputType>Exe</OutputType>
    <TargetFramework>net10.0</TargetFramework>
    <RuntimeIdentifier>linux-x64</RuntimeIdentifier>
    <AssemblyName>{program}</AssemblyName>
    <UseAppHost>true</UseAppHost>
    <InvariantGlobalization>true</InvariantGlobalization>
    <SatelliteResourceLanguages>en</SatelliteResourceLanguages>
    <Nullable>disable</Nullable>
    <ImplicitUsings>disable</ImplicitUsings>
    <EnableDefaultCompileItems>false</EnableDefaultCompileItems>
    {}
  </PropertyGroup>
  <ItemGroup>
    <Compile Include="{}" />
  </ItemGroup>
</Project>
"#,
        shape.properties(),
        source.display()
    );
    let dotnet = Runtime::Net10.dotnet();
    // The SDKs and runtimes installed beside it: an update publishes anew.
    let mut installed: Vec<String> = ["sdk", "shared/Microsoft.NETCore.App"]
        .iter()
        .flat_map(|d| std::fs::read_dir(dotnet.parent().unwrap().join(d)).into_iter().flatten())
        .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
        .collect();
    installed.sort();
    let stamp_text = format!(
        "{project}\n{}\n{} {installed:?}\n",
        std::fs::read_to_string(&source).unwrap_or_else(|e| panic!("{}: {e}", source.display())),
        dotnet.display()
    );
    let stamp = base.join("stamp");
    let app = Published { exe: out.join(program), dll: out.join(format!("{program}.dll")), dir: out.clone() };
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(stamp_text.as_str()) && app.exe.is_file() {
        published.insert((program.to_string(), shape), app.clone());
        return app;
    }
    let _ = std::fs::remove_file(&stamp);
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&project_dir).unwrap();
    let csproj = project_dir.join(format!("{program}.csproj"));
    std::fs::write(&csproj, &project).unwrap();
    let started = Instant::now();
    let output = Command::new(&dotnet)
        .arg("publish")
        .arg(&csproj)
        .args(["-c", "Release", "-nologo", "-nodeReuse:false", "-p:UseSharedCompilation=false", "-o"])
        .arg(&out)
        .env("DOTNET_CLI_TELEMETRY_OPTOUT", "1")
        .env("DOTNET_NOLOGO", "1")
        .env("DOTNET_SKIP_FIRST_TIME_EXPERIENCE", "1")
        .env("DOTNET_CLI_USE_MSBUILD_SERVER", "0")
        .env("MSBUILDDISABLENODEREUSE", "1")
        .stdin(Stdio::null())
        .output()
        .expect("running dotnet publish");
    assert!(
        output.status.success(),
        "dotnet publish of {program} as {} failed ({}):\n{}{}",
        shape.name(),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(app.exe.is_file(), "dotnet publish made no {}", app.exe.display());
    eprintln!("published {program} as {} in {:.1} s", shape.name(), started.elapsed().as_secs_f64());
    std::fs::write(&stamp, stamp_text).unwrap();
    published.insert((program.to_string(), shape), app.clone());
    app
}

/// `corsnap record` with `args` (before `--`) around any `command` (a
/// published app's own executable, say), with extra environment variables
/// for corsnap and the program.
pub fn record_command(command: &[&std::ffi::OsStr], args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(corsnap_bin());
    cmd.arg("record").args(args).arg("--").args(command);
    cmd.env("DOTNET_SYSTEM_GLOBALIZATION_INVARIANT", "1");
    cmd.envs(env.iter().copied());
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.output().expect("running corsnap")
}
