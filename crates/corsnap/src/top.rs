//! `corsnap top`: a live view of where the time goes, refreshed every
//! second (py-spy's `top`): the functions with the most samples, by their
//! own share (the function itself was running) and their total share (it
//! was on the stack), over the last interval and since the start.
//!
//! Keys: `s` changes the sort column, `t`/`T` step through the threads, `a`
//! shows all threads again, `p` pauses the display, `q` (or Ctrl-C) quits;
//! with `--pid` quitting detaches and leaves the process as it was.

use std::collections::HashMap;
use std::io::{self, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use corsnap_profile::names::{is_roslyn_move_next, readable_name, state_machine_from_callers};
use corsnap_profile::roots::{classify_native, fold_point, NativeRoot, Start};
use corsnap_profile::{NativeFrames, RootFrames};
use corsnap_wire::{AttachRequest, EventKind, Message, SamplerKind, WalkerKind, NATIVE_FRAME_BIT};
use ratatui::crossterm::event::{self, Event as KeyEvent, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::crossterm::execute;
use ratatui::crossterm::terminal::{disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row, Table};
use ratatui::{DefaultTerminal, Frame};

use crate::record::{RecordOptions, StopSignals, Target};
use crate::session::{AgentConnection, Event, Listener};

#[derive(Debug, Clone)]
pub struct TopOptions {
    pub target: Target,
    pub event: EventKind,
    pub rate_hz: u32,
    pub sampler: SamplerKind,
    pub clock: corsnap_wire::CpuClock,
    pub walker: WalkerKind,
    /// Folders of native debug files (`--symbols`), absolute.
    pub symbol_dirs: Vec<PathBuf>,
    pub native: NativeFrames,
    pub roots: RootFrames,
    pub raw_names: bool,
    pub interval: Duration,
    /// One plain-text table after the first interval, then leave.
    pub once: bool,
    pub agent_path: Option<PathBuf>,
}

/// Weights of one function: as the leaf (own) and anywhere on the stack
/// (total).
#[derive(Debug, Clone, Copy, Default)]
struct Weights {
    own: u64,
    total: u64,
}

/// Weights per thread and function, for one stretch of time.
#[derive(Debug, Default)]
struct Tally {
    by_thread: HashMap<u64, HashMap<u64, Weights>>,
    /// All weight seen per thread (the denominator of shares).
    thread_totals: HashMap<u64, u64>,
    samples: u64,
}

impl Tally {
    fn add(&mut self, thread: u64, frames: &[u64], weight: u64) {
        let functions = self.by_thread.entry(thread).or_default();
        if let Some(&leaf) = frames.first() {
            functions.entry(leaf).or_default().own += weight;
        }
        let mut seen: Vec<u64> = Vec::with_capacity(frames.len());
        for &f in frames {
            if !seen.contains(&f) {
                seen.push(f);
                functions.entry(f).or_default().total += weight;
            }
        }
        *self.thread_totals.entry(thread).or_default() += weight;
        self.samples += 1;
    }

    /// Each function's weights, over one thread or all of them, and the
    /// weight they are shares of.
    fn view(&self, thread: Option<u64>) -> (HashMap<u64, Weights>, u64) {
        let mut out: HashMap<u64, Weights> = HashMap::new();
        let mut all = 0;
        for (&t, functions) in &self.by_thread {
            if thread.is_some_and(|only| only != t) {
                continue;
            }
            all += self.thread_totals.get(&t).copied().unwrap_or(0);
            for (&f, w) in functions {
                let e = out.entry(f).or_default();
                e.own += w.own;
                e.total += w.total;
            }
        }
        (out, all)
    }
}

/// What the table is sorted by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SortBy {
    OwnNow,
    TotalNow,
    OwnAll,
    TotalAll,
}

impl SortBy {
    fn next(self) -> SortBy {
        match self {
            SortBy::OwnNow => SortBy::TotalNow,
            SortBy::TotalNow => SortBy::OwnAll,
            SortBy::OwnAll => SortBy::TotalAll,
            SortBy::TotalAll => SortBy::OwnNow,
        }
    }

    fn label(self) -> &'static str {
        match self {
            SortBy::OwnNow => "own, last interval",
            SortBy::TotalNow => "total, last interval",
            SortBy::OwnAll => "own, since start",
            SortBy::TotalAll => "total, since start",
        }
    }
}

/// The frame ids `top` gives the folded start of a stack (never a
/// `FunctionID`, nor a native frame's id: user-space addresses are below
/// 2^47).
const HOST_START_ID: u64 = u64::MAX;
const THREAD_START_ID: u64 = u64::MAX - 1;

fn start_id(start: Start) -> u64 {
    match start {
        Start::Host => HOST_START_ID,
        Start::Thread => THREAD_START_ID,
    }
}

fn is_start_id(id: u64) -> bool {
    id == HOST_START_ID || id == THREAD_START_ID
}

/// Everything the screen shows.
struct View {
    title: String,
    event: EventKind,
    native: NativeFrames,
    roots: RootFrames,
    raw_names: bool,
    /// Each function's name as shown.
    names: HashMap<u64, String>,
    /// What named native frames say about where a stack starts.
    native_roots: HashMap<u64, NativeRoot>,
    /// The process's id: its first thread's OS thread id.
    pid: u32,
    /// Roslyn state machines' `MoveNext`s by raw name, until a stack has
    /// shown what they are.
    untold_state_machines: HashMap<u64, String>,
    /// Managed functions' raw names (what tells a state machine's callers).
    raw: HashMap<u64, String>,
    threads: HashMap<u64, (u32, String)>,
    kernel_names: HashMap<u32, String>,
    /// The interval being collected, the last complete one, and all.
    current: Tally,
    last: Tally,
    all: Tally,
    sort: SortBy,
    thread: Option<u64>,
    paused: bool,
    started: Instant,
    note: Option<String>,
}

impl View {
    fn new(title: String, options: &TopOptions) -> View {
        View {
            title,
            event: options.event,
            native: options.native,
            roots: options.roots,
            raw_names: options.raw_names,
            names: HashMap::from([
                (HOST_START_ID, Start::Host.frame_name().to_string()),
                (THREAD_START_ID, Start::Thread.frame_name().to_string()),
            ]),
            native_roots: HashMap::new(),
            pid: 0,
            untold_state_machines: HashMap::new(),
            raw: HashMap::new(),
            threads: HashMap::new(),
            kernel_names: HashMap::new(),
            current: Tally::default(),
            last: Tally::default(),
            all: Tally::default(),
            sort: SortBy::OwnNow,
            thread: None,
            paused: false,
            started: Instant::now(),
            note: None,
        }
    }

    fn apply(&mut self, msg: &Message) {
        match msg {
            Message::Hello { pid, .. } => self.pid = *pid,
            Message::Function { function_id, name, module } => {
                let native = function_id & NATIVE_FRAME_BIT != 0;
                if native {
                    self.native_roots.insert(*function_id, classify_native(name, module));
                }
                let shown = if native && self.native == NativeFrames::Collapse {
                    "[native code]".to_string()
                } else if native || self.raw_names {
                    name.clone()
                } else {
                    self.raw.insert(*function_id, name.clone());
                    if is_roslyn_move_next(name) {
                        self.untold_state_machines.insert(*function_id, name.clone());
                    }
                    readable_name(name, None).into_owned()
                };
                self.names.insert(*function_id, shown);
            }
            Message::StateMachine { function_id, kind } => {
                if let Some(raw) = self.untold_state_machines.remove(function_id) {
                    self.names.insert(*function_id, readable_name(&raw, Some(*kind)).into_owned());
                }
            }
            Message::Thread { thread_id, os_tid, name } => {
                let keep = name.is_empty() && self.threads.get(thread_id).is_some_and(|t| !t.1.is_empty());
                if !keep {
                    self.threads.insert(*thread_id, (*os_tid, name.clone()));
                }
            }
            Message::OsThreadName { os_tid, name } => {
                self.kernel_names.insert(*os_tid, name.clone());
            }
            Message::Sample { thread_id, kind, weight, frames, truncated, .. } if *kind == self.event => {
                self.tell_state_machines(frames);
                let mut frames = frames.clone();
                if self.roots == RootFrames::Fold && !truncated {
                    let os_tid = self.threads.get(thread_id).map_or(0, |t| t.0);
                    let main_thread = os_tid != 0 && os_tid == self.pid;
                    let native_roots = &self.native_roots;
                    if let Some((keep, start)) = fold_point(&frames, main_thread, |id| native_roots.get(&id).copied()) {
                        frames.truncate(keep);
                        frames.push(start_id(start));
                    }
                }
                // Collapsed native runs: one frame for a run.
                let frames: Vec<u64> = if self.native == NativeFrames::Collapse {
                    let mut out: Vec<u64> = Vec::with_capacity(frames.len());
                    for &f in &frames {
                        let native = (f == 0 || f & NATIVE_FRAME_BIT != 0) && !is_start_id(f);
                        let key = if native { 0 } else { f };
                        if !(native && out.last() == Some(&0)) {
                            out.push(key);
                        }
                    }
                    out
                } else {
                    frames
                };
                self.current.add(*thread_id, &frames, *weight);
                self.all.add(*thread_id, &frames, *weight);
            }
            Message::Notice { text, .. } => self.note = Some(text.clone()),
            _ => {}
        }
    }

    /// Names a state machine's `MoveNext` by what the first stack it is
    /// seen in shows it to be (async method or iterator).
    fn tell_state_machines(&mut self, frames: &[u64]) {
        if self.untold_state_machines.is_empty() {
            return;
        }
        for (i, f) in frames.iter().enumerate() {
            let Some(raw) = self.untold_state_machines.get(f) else { continue };
            let callers = frames[i + 1..].iter().map(|caller| {
                let managed = *caller != 0 && caller & NATIVE_FRAME_BIT == 0;
                managed.then(|| self.raw.get(caller).map(String::as_str)).flatten()
            });
            if let Some(kind) = state_machine_from_callers(raw, callers) {
                let name = readable_name(raw, Some(kind)).into_owned();
                self.names.insert(*f, name);
                self.untold_state_machines.remove(f);
            }
        }
    }

    fn end_interval(&mut self) {
        self.last = std::mem::take(&mut self.current);
    }

    fn thread_label(&self, thread: u64) -> String {
        match self.threads.get(&thread) {
            Some((tid, name)) if !name.is_empty() => format!("{name} tid={tid}"),
            Some((tid, _)) => match self.kernel_names.get(tid) {
                Some(kernel) => format!("{kernel} tid={tid}"),
                None => format!("tid={tid}"),
            },
            None => format!("thread {thread:#x}"),
        }
    }

    fn function_name(&self, f: u64) -> String {
        match f {
            0 => "[native code]".to_string(),
            f => self.names.get(&f).cloned().unwrap_or_else(|| format!("[function {f:#x}]")),
        }
    }

    /// Threads that have samples, in a stable order.
    fn thread_list(&self) -> Vec<u64> {
        let mut threads: Vec<u64> = self.all.by_thread.keys().copied().collect();
        threads.sort_by_key(|t| self.threads.get(t).map_or(u32::MAX, |e| e.0));
        threads
    }

    fn step_thread(&mut self, forward: bool) {
        let threads = self.thread_list();
        if threads.is_empty() {
            return;
        }
        let at = self.thread.and_then(|t| threads.iter().position(|&x| x == t));
        self.thread = match (at, forward) {
            (None, true) => Some(threads[0]),
            (None, false) => threads.last().copied(),
            (Some(i), true) if i + 1 < threads.len() => Some(threads[i + 1]),
            (Some(i), false) if i > 0 => Some(threads[i - 1]),
            _ => None,
        };
    }

    /// The status line: which event is shown, in what unit, for how long.
    fn status(&self) -> String {
        let unit = match self.event {
            EventKind::Cpu => "CPU time",
            EventKind::Wall => "samples of every thread",
            EventKind::Alloc => "bytes allocated",
            EventKind::Exceptions => "exceptions thrown",
            EventKind::Gc => "GC pause time",
            EventKind::ClassLoad => "classes loaded",
        };
        let thread = self.thread.map_or("all threads".to_string(), |t| self.thread_label(t));
        format!(
            "event {}: {unit} · {:.0} s · {} samples · {thread} · sorted by {}{}",
            self.event,
            self.started.elapsed().as_secs_f64(),
            self.all.samples,
            self.sort.label(),
            if self.paused { " · PAUSED" } else { "" }
        )
    }

    /// The table: shares (own and total, last interval and since the
    /// start) and the function, sorted, at most `limit` rows.
    fn rows(&self, limit: usize) -> Vec<([f64; 4], String)> {
        let (now, now_total) = self.last.view(self.thread);
        let (all, all_total) = self.all.view(self.thread);
        let share = |w: u64, total: u64| if total == 0 { 0.0 } else { w as f64 * 100.0 / total as f64 };
        let mut functions: Vec<u64> = all.keys().copied().collect();
        let key = |f: &u64| -> u64 {
            let n = now.get(f).copied().unwrap_or_default();
            let a = all.get(f).copied().unwrap_or_default();
            match self.sort {
                SortBy::OwnNow => n.own,
                SortBy::TotalNow => n.total,
                SortBy::OwnAll => a.own,
                SortBy::TotalAll => a.total,
            }
        };
        let total_all = |f: &u64| all.get(f).map_or(0, |w| w.total);
        functions.sort_by(|a, b| key(b).cmp(&key(a)).then(total_all(b).cmp(&total_all(a))).then(a.cmp(b)));
        functions
            .iter()
            .take(limit)
            .map(|f| {
                let n = now.get(f).copied().unwrap_or_default();
                let a = all.get(f).copied().unwrap_or_default();
                (
                    [
                        share(n.own, now_total),
                        share(n.total, now_total),
                        share(a.own, all_total),
                        share(a.total, all_total),
                    ],
                    self.function_name(*f),
                )
            })
            .collect()
    }

    /// The screen as plain text: for scripts, and left behind when a
    /// launched program ends.
    fn text(&self, limit: usize) -> String {
        use std::fmt::Write as _;
        let mut out = format!("{}\n{}\n", self.title, self.status());
        if let Some(note) = &self.note {
            let _ = writeln!(out, "{note}");
        }
        let _ = writeln!(out, "{:>7} {:>7} {:>8} {:>9}  Function", "Own", "Total", "Own all", "Total all");
        for (shares, name) in self.rows(limit) {
            let _ =
                writeln!(out, "{:6.1}% {:6.1}% {:7.1}% {:8.1}%  {name}", shares[0], shares[1], shares[2], shares[3]);
        }
        out
    }

    /// The table once the program has ended: the last (partial) interval
    /// closed, sorted by the whole run.
    fn final_text(&mut self, limit: usize) -> String {
        self.end_interval();
        self.sort = match self.sort {
            SortBy::OwnNow => SortBy::OwnAll,
            SortBy::TotalNow => SortBy::TotalAll,
            other => other,
        };
        self.text(limit)
    }

    fn draw(&self, frame: &mut Frame) {
        let [header, table] = Layout::vertical([Constraint::Length(4), Constraint::Min(1)]).areas(frame.area());
        let lines = vec![
            Line::from(self.title.clone()).style(Style::default().add_modifier(Modifier::BOLD)),
            Line::from(self.status()),
            Line::from("keys: s sort · t/T next/previous thread · a all threads · p pause · q quit"),
            Line::from(self.note.clone().unwrap_or_default()),
        ];
        frame.render_widget(Paragraph::new(lines), header);
        let rows: Vec<Row> = self
            .rows(table.height.saturating_sub(1) as usize)
            .into_iter()
            .map(|(shares, name)| {
                Row::new(vec![
                    Cell::from(format!("{:6.1}%", shares[0])),
                    Cell::from(format!("{:6.1}%", shares[1])),
                    Cell::from(format!("{:6.1}%", shares[2])),
                    Cell::from(format!("{:6.1}%", shares[3])),
                    Cell::from(name),
                ])
            })
            .collect();
        let widths = [
            Constraint::Length(8),
            Constraint::Length(8),
            Constraint::Length(9),
            Constraint::Length(9),
            Constraint::Min(20),
        ];
        let head = Row::new(vec!["Own", "Total", "Own all", "Total all", "Function"])
            .style(Style::default().add_modifier(Modifier::REVERSED));
        frame.render_widget(Table::new(rows, widths).header(head), table);
    }
}

/// Puts the terminal back however `top` ends.
struct TerminalGuard;

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        let _ = disable_raw_mode();
        let _ = execute!(io::stdout(), LeaveAlternateScreen);
    }
}

pub fn run(options: &TopOptions) -> Result<ExitCode> {
    if let Target::Launch(program) = &options.target {
        if let Some(first) = program.first() {
            if corsnap::native_aot::program_file(first).is_some_and(|f| corsnap::native_aot::is_native_aot(&f)) {
                anyhow::bail!(
                    "{}: corsnap top has nothing to show (run it without corsnap)",
                    corsnap::native_aot::message(&first.to_string_lossy())
                );
            }
        }
    }
    // Drawn on a terminal (keys on stdin, screen on stdout), else plain
    // text; decided before anything is attached or started.
    let interactive = !options.once && io::stdin().is_terminal() && io::stdout().is_terminal();
    let agent = crate::record::find_agent(options.agent_path.as_deref())?;
    if let Target::Attach(pid) = options.target {
        crate::diagnostics::find_socket(pid)?;
    }
    let listener = match options.target {
        Target::Attach(pid) => Listener::for_process(pid)?,
        Target::Launch(_) => Listener::new()?,
    };
    let signals = StopSignals::install()?;
    let mut program_output = None;
    let (connection, title, child) = match &options.target {
        Target::Attach(pid) => {
            let request = AttachRequest {
                socket: listener.socket_path().to_string_lossy().into_owned(),
                rate_hz: options.rate_hz,
                events: options.event.bit(),
                max_pause_ppm: corsnap_wire::DEFAULT_MAX_PAUSE_PPM,
                log: None,
                sampler: options.sampler,
                clock: options.clock,
                walker: options.walker,
                symbols: options.symbol_dirs.iter().map(|d| d.to_string_lossy().into_owned()).collect(),
            };
            let connection = crate::record::attach(*pid, &agent, &listener, &request)?;
            let title = format!("corsnap top · pid {pid} · {}", crate::record::process_command_line(*pid));
            (connection, title, None)
        }
        Target::Launch(program) => {
            // The program's output would write over the screen: it goes to
            // a file, named when top ends.
            let words = program.iter().map(|a| a.to_string_lossy().into_owned());
            let log = PathBuf::from(format!(
                "corsnap-top-{}-{}.out",
                crate::record::program_name(words),
                corsnap_abi::os::local_timestamp()
            ));
            let record = RecordOptions {
                target: options.target.clone(),
                output: None,
                format: crate::output::OutputFormat::Raw,
                rate_hz: options.rate_hz,
                duration: None,
                threads: false,
                agent_log: None,
                agent_path: None,
                stats: false,
                events: vec![options.event],
                max_pause_ppm: corsnap_wire::DEFAULT_MAX_PAUSE_PPM,
                sampler: options.sampler,
                clock: options.clock,
                walker: options.walker,
                symbol_dirs: options.symbol_dirs.clone(),
                native: options.native,
                roots: options.roots,
                raw_names: options.raw_names,
                lines: false,
                title: String::new(),
                inverted: false,
                subprocesses: false,
                continuous: None,
            };
            let (process, connection, command) =
                crate::record::launch_with_output(program, &agent, &listener, &record, &signals, Some(&log))?;
            program_output = Some(log);
            (connection, format!("corsnap top · {command}"), Some(process))
        }
    };
    let mut view = View::new(title, options);
    let (ended, program_ended, mut connection) = if interactive {
        enable_raw_mode().context("switching the terminal to raw mode (corsnap top needs a terminal)")?;
        let guard = TerminalGuard;
        execute!(io::stdout(), EnterAlternateScreen)?;
        let mut terminal = ratatui::Terminal::new(ratatui::backend::CrosstermBackend::new(io::stdout()))?;
        let ended = ui_loop(&mut terminal, &mut view, connection, options.interval, &signals)?;
        drop(terminal);
        drop(guard);
        if ended.1 {
            // The program is gone and so is the screen: leave its last table.
            let rows = ratatui::crossterm::terminal::size().map_or(24, |(_, rows)| rows);
            print!("{}", view.final_text(usize::from(rows.saturating_sub(6)).clamp(5, 40)));
        }
        ended
    } else {
        plain_loop(&mut view, connection, options.interval, options.once, &signals)?
    };
    let _ = io::stdout().flush();
    // Leave: a detach for an attached process; a launched one is ended.
    if !program_ended {
        let _ = connection.send_command(corsnap_wire::Command::Detach);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            match connection.next_event(Duration::from_millis(100)) {
                Some(Event::Message(Message::Goodbye { .. })) | Some(Event::Closed(_)) => break,
                _ => {}
            }
        }
    }
    connection.close();
    eprintln!("corsnap top: {ended}");
    if let Some(log) = program_output {
        eprintln!("corsnap top: the program's output is in {}", log.display());
    }
    Ok(match child {
        Some(mut process) if program_ended => process.wait(),
        Some(mut process) => process.end_and_wait(),
        None => ExitCode::SUCCESS,
    })
}

/// How a session ended: why, whether the program (or process) ended by
/// itself, and the connection to leave by.
type Ended = (String, bool, AgentConnection);

/// Without a terminal: a plain-text table every interval (or one, with
/// `--once`), and a last one when the program ends.
fn plain_loop(
    view: &mut View,
    mut connection: AgentConnection,
    interval: Duration,
    once: bool,
    signals: &StopSignals,
) -> Result<Ended> {
    let mut next_interval = Instant::now() + interval;
    loop {
        if let Some(ev) = connection.next_event(Duration::from_millis(50)) {
            match ev {
                Event::Message(Message::Goodbye { reason }) => {
                    println!("{}", view.final_text(30));
                    return Ok((reason, true, connection));
                }
                Event::Message(msg) => view.apply(&msg),
                Event::Closed(_) => {
                    println!("{}", view.final_text(30));
                    return Ok(("the program exited".to_string(), true, connection));
                }
            }
        }
        if signals.stopped() {
            // `timeout 10 corsnap top ... > log`: the whole run, once more.
            println!("{}", view.final_text(30));
            return Ok((signals.reason().0.to_string(), false, connection));
        }
        if Instant::now() >= next_interval {
            next_interval += interval;
            view.end_interval();
            println!("{}", view.text(30));
            let _ = io::stdout().flush();
            if once {
                return Ok(("--once: one interval shown".to_string(), false, connection));
            }
        }
    }
}

fn ui_loop(
    terminal: &mut DefaultTerminal,
    view: &mut View,
    mut connection: AgentConnection,
    interval: Duration,
    signals: &StopSignals,
) -> Result<Ended> {
    let mut next_interval = Instant::now() + interval;
    let mut dirty = true;
    loop {
        // Messages for up to 50 ms, then keys, then the screen.
        let until = Instant::now() + Duration::from_millis(50);
        while let Some(ev) = connection.next_event(until.saturating_duration_since(Instant::now())) {
            match ev {
                Event::Message(Message::Goodbye { reason }) => return Ok((reason, true, connection)),
                Event::Message(msg) => view.apply(&msg),
                Event::Closed(_) => return Ok(("the process exited".to_string(), true, connection)),
            }
            if Instant::now() >= until {
                break;
            }
        }
        if signals.stopped() {
            return Ok((signals.reason().0.to_string(), false, connection));
        }
        while event::poll(Duration::ZERO)? {
            if let KeyEvent::Key(key) = event::read()? {
                if key.kind != KeyEventKind::Press {
                    continue;
                }
                match key.code {
                    KeyCode::Char('q') | KeyCode::Esc => return Ok(("quit".to_string(), false, connection)),
                    KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => {
                        return Ok(("quit".to_string(), false, connection))
                    }
                    KeyCode::Char('s') => view.sort = view.sort.next(),
                    KeyCode::Char('t') => view.step_thread(true),
                    KeyCode::Char('T') => view.step_thread(false),
                    KeyCode::Char('a') => view.thread = None,
                    KeyCode::Char('p') => view.paused = !view.paused,
                    _ => {}
                }
                dirty = true;
            }
        }
        if Instant::now() >= next_interval {
            next_interval += interval;
            if !view.paused {
                view.end_interval();
                dirty = true;
            }
        }
        if dirty {
            terminal.draw(|f| view.draw(f))?;
            dirty = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: u64 = NATIVE_FRAME_BIT;

    fn options(native: NativeFrames, roots: RootFrames, raw_names: bool) -> TopOptions {
        TopOptions {
            target: Target::Attach(1),
            event: EventKind::Cpu,
            rate_hz: 100,
            sampler: SamplerKind::Signal,
            clock: corsnap_wire::CpuClock::Auto,
            walker: WalkerKind::Native,
            symbol_dirs: Vec::new(),
            native,
            roots,
            raw_names,
            interval: Duration::from_secs(1),
            once: false,
            agent_path: None,
        }
    }

    /// The functions' totals as shown, sorted by name.
    fn totals(options: &TopOptions) -> Vec<(String, u64)> {
        let mut view = View::new(String::new(), options);
        let functions: &[(u64, &str, &str)] = &[
            (N | 1, "libc.so.6!__libc_start_main_alias_2", "libc.so.6"),
            (N | 2, "libcoreclr.so+0x1ec8db", "libcoreclr.so"),
            (N | 3, "libc.so.6!qsort", "libc.so.6"),
            (0x10, "Shop.Program.Main", "Shop.dll"),
            (0x11, "System.Runtime.CompilerServices.AsyncMethodBuilderCore.Start<TStateMachine>", "c.dll"),
            (0x12, "Shop.Program+<Main>d__0.MoveNext", "Shop.dll"),
            (0x13, "Shop.Program+<>c.<Main>b__0_1", "Shop.dll"),
        ];
        for &(function_id, name, module) in functions {
            view.apply(&Message::Function { function_id, name: name.into(), module: module.into() });
        }
        let frames = vec![0x13, N | 3, 0x12, 0x11, 0x10, N | 2, N | 1];
        let sample = Message::Sample {
            time_ns: 1,
            thread_id: 7,
            kind: EventKind::Cpu,
            weight: 5,
            truncated: false,
            leaf: String::new(),
            frames,
            il_offsets: Vec::new(),
        };
        view.apply(&sample);
        let (all, _) = view.all.view(None);
        let mut totals: Vec<(String, u64)> = all.iter().map(|(&f, w)| (view.function_name(f), w.total)).collect();
        totals.sort();
        totals
    }

    #[test]
    fn names_are_readable_and_roots_fold_as_in_profiles() {
        let shown = totals(&options(NativeFrames::Show, RootFrames::Fold, false));
        let names: Vec<&str> = shown.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(
            names,
            [
                "Shop.Program.Main",
                "Shop.Program.Main [async]",
                "Shop.Program.Main.lambda#1",
                "System.Runtime.CompilerServices.AsyncMethodBuilderCore.Start<TStateMachine>",
                "[host start-up]",
                "libc.so.6!qsort",
            ]
        );
        let collapsed = totals(&options(NativeFrames::Collapse, RootFrames::Fold, false));
        assert!(collapsed.iter().any(|(name, _)| name == "[host start-up]"), "{collapsed:?}");
        assert!(collapsed.iter().any(|(name, _)| name == "[native code]"), "{collapsed:?}");

        let raw = totals(&options(NativeFrames::Show, RootFrames::Show, true));
        let names: Vec<&str> = raw.iter().map(|(name, _)| name.as_str()).collect();
        assert!(names.contains(&"Shop.Program+<Main>d__0.MoveNext") && names.contains(&"libcoreclr.so+0x1ec8db"));
        assert!(!names.contains(&"[host start-up]"), "{names:?}");
    }

    #[test]
    fn the_agents_word_on_a_state_machine_names_it_before_any_stack() {
        let mut view = View::new(String::new(), &options(NativeFrames::Show, RootFrames::Fold, false));
        let name = "Shop.Feed+<ReadAllAsync>d__2.MoveNext";
        view.apply(&Message::Function { function_id: 0x20, name: name.into(), module: "Shop.dll".into() });
        assert_eq!(view.function_name(0x20), "Shop.Feed.ReadAllAsync [state machine]");
        view.apply(&Message::StateMachine { function_id: 0x20, kind: corsnap_wire::StateMachine::AsyncIterator });
        assert_eq!(view.function_name(0x20), "Shop.Feed.ReadAllAsync [async iterator]");
    }
}
