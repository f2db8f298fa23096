//! `corsnap top`, driven as a person would drive it: in a tmux pane, with
//! keys sent to it and the screen read back.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::{corsnap_bin, Service};

/// A detached tmux session running one command, killed when dropped.
struct Pane {
    session: String,
}

impl Pane {
    fn start(command: &str) -> Pane {
        let session = format!("corsnap-top-{}-{}", std::process::id(), rand_suffix());
        let status = Command::new("tmux")
            .args(["new-session", "-d", "-s", &session, "-x", "160", "-y", "40", command])
            .status()
            .expect("tmux (scripts/setup.sh installs it)");
        assert!(status.success(), "tmux new-session failed");
        Pane { session }
    }

    fn screen(&self) -> String {
        let out = Command::new("tmux").args(["capture-pane", "-p", "-t", &self.session]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn keys(&self, keys: &str) {
        Command::new("tmux").args(["send-keys", "-t", &self.session, keys]).status().unwrap();
    }

    fn alive(&self) -> bool {
        Command::new("tmux").args(["has-session", "-t", &self.session]).output().unwrap().status.success()
    }

    /// Waits until the screen satisfies `check`; the last screen either way.
    fn wait_for(&self, what: &str, limit: Duration, check: impl Fn(&str) -> bool) -> String {
        let started = Instant::now();
        loop {
            let screen = self.screen();
            if check(&screen) {
                return screen;
            }
            assert!(started.elapsed() < limit, "waited {limit:?} for {what}; the screen:\n{screen}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Pane {
    fn drop(&mut self) {
        let _ = Command::new("tmux").args(["kill-session", "-t", &self.session]).output();
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() % 1_000_000
}

#[test]
fn top_shows_the_busy_method_live_sorts_filters_and_quits_leaving_the_process_as_it_was() {
    let service = Service::start(&[]);
    let pane = Pane::start(&format!("{} top --pid {} --interval 0.5", corsnap_bin().display(), service.pid));
    // The busy method rises to the top of the table.
    let screen = pane.wait_for("Service.Crunch at the top", Duration::from_secs(30), |s| {
        s.lines().skip_while(|l| !l.contains("Function")).nth(1).is_some_and(|first| first.contains("Service.Crunch"))
    });
    assert!(screen.contains(&format!("pid {}", service.pid)), "{screen}");
    assert!(screen.contains("event cpu: CPU time ·") && screen.contains("sorted by own, last interval"), "{screen}");
    // `s` sorts by the next column.
    pane.keys("s");
    pane.wait_for("the total sort", Duration::from_secs(5), |s| s.contains("sorted by total, last interval"));
    // `t` shows one thread at a time; `a` all again.
    pane.keys("t");
    pane.wait_for("one thread", Duration::from_secs(5), |s| !s.contains("· all threads ·") && s.contains(" tid="));
    pane.keys("a");
    pane.wait_for("all threads", Duration::from_secs(5), |s| s.contains("· all threads ·"));
    // `q` quits, detaches, and the service runs on without the agent.
    pane.keys("q");
    let started = Instant::now();
    while pane.alive() {
        assert!(started.elapsed() < Duration::from_secs(15), "top did not quit:\n{}", pane.screen());
        std::thread::sleep(Duration::from_millis(100));
    }
    service.wait_agent_gone();
    service.wait_heartbeats(2);
}

#[test]
fn a_launched_program_that_ends_leaves_its_last_table_on_the_terminal() {
    let dir = support::scratch("top-last-table");
    let dll = support::compiled("split", support::Runtime::Net10);
    let command = format!(
        "cd {} && DOTNET_SYSTEM_GLOBALIZATION_INVARIANT=1 {} top --interval 0.5 -- {} {} 2; echo top-exit=$?; sleep 60",
        dir.display(),
        corsnap_bin().display(),
        support::Runtime::Net10.dotnet().display(),
        dll.display()
    );
    let pane = Pane::start(&command);
    let screen = pane.wait_for("top to end", Duration::from_secs(30), |s| s.contains("top-exit="));
    assert!(screen.contains("top-exit=0"), "the program's exit code:\n{screen}");
    assert!(screen.contains("corsnap top: the program exited"), "{screen}");
    assert!(screen.contains("event cpu: CPU time") && screen.contains("sorted by own, since start"), "{screen}");
    let table: Vec<&str> = screen.lines().skip_while(|l| !l.contains("Function")).skip(1).take(2).collect();
    assert!(table.iter().any(|l| l.contains("Split.Heavy")), "the busiest method leads:\n{screen}");
}
