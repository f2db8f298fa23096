//! Sending windows to a backend without the program ever noticing: each
//! backend has a thread of its own fed through a queue bounded in bytes
//! (the oldest window is dropped, and counted, to make room), and the
//! recording loop only ever queues.
//!
//! Connection errors, timeouts (10 s), 429 and 5xx are retried with
//! jittered exponential backoff (`Retry-After` honoured) for as long as a
//! window period: a window still unsent then is given up, so a dead backend
//! costs at most one period of retries per window and the queue's bytes.
//! Any other 4xx means the request itself is wrong: said once, never
//! retried. Failures are reported on stderr as they start and when they
//! end, with at most one summary a minute in between.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The most a backend's queue holds, in bytes of encoded windows. A window
/// of a busy service is tens of kilobytes compressed, so this is minutes
/// of windows; with the backend down an hour, memory stays here.
pub const DEFAULT_QUEUE_BYTES: usize = 8 << 20;
/// Each request's time limit.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How often, at most, a failing backend is reported while it keeps failing.
const REPORT_EVERY: Duration = Duration::from_secs(60);
/// A window queued longer than this is dropped unsent: Pyroscope refuses
/// profiles more than an hour old, and a backlog that old helps nobody.
const MAX_AGE: Duration = Duration::from_secs(55 * 60);

/// One request body waiting to be sent.
#[derive(Debug)]
pub struct Job {
    pub body: Vec<u8>,
    pub window: u64,
    /// When it was queued.
    pub queued: Instant,
}

impl Job {
    pub fn new(body: Vec<u8>, window: u64) -> Job {
        Job { body, window, queued: Instant::now() }
    }
}

/// A FIFO bounded in bytes: pushing past the bound drops the oldest jobs.
#[derive(Debug)]
pub struct ByteQueue {
    jobs: VecDeque<Job>,
    bytes: usize,
    limit: usize,
    pub dropped: u64,
}

impl ByteQueue {
    pub fn new(limit: usize) -> ByteQueue {
        ByteQueue { jobs: VecDeque::new(), bytes: 0, limit, dropped: 0 }
    }

    /// Queues `job`, dropping the oldest to make room (a job larger than
    /// the whole bound is dropped itself). The number dropped.
    pub fn push(&mut self, job: Job) -> u64 {
        let before = self.dropped;
        if job.body.len() > self.limit {
            self.dropped += 1;
            return 1;
        }
        while self.bytes + job.body.len() > self.limit {
            let Some(old) = self.jobs.pop_front() else { break };
            self.bytes -= old.body.len();
            self.dropped += 1;
        }
        self.bytes += job.body.len();
        self.jobs.push_back(job);
        self.dropped - before
    }

    pub fn pop(&mut self) -> Option<Job> {
        let job = self.jobs.pop_front()?;
        self.bytes -= job.body.len();
        Some(job)
    }

    /// The bytes queued: never more than the bound.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.jobs.len()
    }
}

/// Where and how to send: the URL (without credentials), and the headers
/// every request carries. Header values are never printed.
#[derive(Clone)]
pub struct Endpoint {
    pub url: String,
    pub headers: Vec<(String, String)>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The headers carry secrets.
        f.debug_struct("Endpoint").field("url", &self.url).field("headers", &self.headers.len()).finish()
    }
}

/// What the user said about credentials and headers.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    /// `--token-file`: a bearer token, read from this file.
    pub token_file: Option<std::path::PathBuf>,
    /// `--tenant`: sent as `X-Scope-OrgID`.
    pub tenant: Option<String>,
    /// `--header K=V` (repeatable).
    pub headers: Vec<(String, String)>,
}

/// The environment variable a bearer token may come from.
pub const ENV_TOKEN: &str = "CORSNAP_PUSH_TOKEN";

impl Endpoint {
    /// `url` + `path` (unless the URL already ends in it), with user info
    /// taken out of the URL and sent as Basic credentials.
    pub fn new(url: &str, path: &str, auth: &Auth, flag: &str) -> Result<Endpoint> {
        let Some((scheme, rest)) = url.split_once("://") else {
            bail!("{flag} {}: not a URL; write it as http://host:port or https://host", redact(url));
        };
        if scheme != "http" && scheme != "https" {
            bail!("{flag} {}: corsnap sends over http or https, not {scheme}", redact(url));
        }
        let (authority, tail) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let (userinfo, host) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        if host.is_empty() {
            bail!("{flag} {}: the URL has no host", redact(url));
        }
        let base = tail.trim_end_matches('/');
        let full_path = if base.ends_with(path) { base.to_string() } else { format!("{base}{path}") };
        let mut headers = Vec::new();
        if let Some(info) = userinfo {
            let (user, password) = info.split_once(':').unwrap_or((info, ""));
            let credentials = format!("{}:{}", percent_decode(user), percent_decode(password));
            headers.push(("Authorization".to_string(), format!("Basic {}", base64(credentials.as_bytes()))));
        }
        let token = match &auth.token_file {
            Some(file) => Some(
                std::fs::read_to_string(file)
                    .with_context(|| format!("--token-file {}: cannot read the token", file.display()))?
                    .trim()
                    .to_string(),
            ),
            None => std::env::var(ENV_TOKEN).ok().map(|t| t.trim().to_string()),
        };
        if let Some(token) = token.filter(|t| !t.is_empty()) {
            if userinfo.is_some() {
                bail!(
                    "{flag}: both credentials in the URL and a bearer token (--token-file or {ENV_TOKEN}) were \
                     given; keep one"
                );
            }
            headers.push(("Authorization".to_string(), format!("Bearer {token}")));
        }
        if let Some(tenant) = &auth.tenant {
            headers.push(("X-Scope-OrgID".to_string(), tenant.clone()));
        }
        headers.extend(auth.headers.iter().cloned());
        Ok(Endpoint { url: format!("{scheme}://{host}{full_path}"), headers })
    }
}

/// `K=V` (or `K: V`) for `--header`.
pub fn parse_header(text: &str) -> Result<(String, String), String> {
    let split = text.split_once('=').or_else(|| text.split_once(':'));
    match split {
        Some((k, v)) if !k.trim().is_empty() && k.trim().bytes().all(|b| b.is_ascii_graphic() && b != b':') => {
            Ok((k.trim().to_string(), v.trim().to_string()))
        }
        _ => Err("a header is written Name=value (for example --header 'Authorization=Bearer xyz')".to_string()),
    }
}

/// A URL as it may be printed: user info replaced.
pub fn redact(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let end = rest.find('/').unwrap_or(rest.len());
            match rest[..end].rsplit_once('@') {
                Some((_, host)) => format!("{scheme}://***@{host}{}", &rest[end..]),
                None => url.to_string(),
            }
        }
        None => match url.rsplit_once('@') {
            Some((_, host)) => format!("***@{host}"),
            None => url.to_string(),
        },
    }
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&text[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Standard base64, for Basic credentials (a dozen lines are not worth a
/// crate).
fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// What one attempt came to.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Sent,
    /// Worth another try (connection error, timeout, 429, 5xx); the server's
    /// `Retry-After`, if it gave one.
    Retry {
        why: String,
        after: Option<Duration>,
    },
    /// The server refused the request itself (another 4xx): no retry.
    Refused {
        status: u16,
        why: String,
    },
}

fn classify(status: u16, retry_after: Option<&str>, body: &str) -> Outcome {
    match status {
        200..=299 => Outcome::Sent,
        429 | 500..=599 => Outcome::Retry {
            why: format!("HTTP {status}{}", snippet(body)),
            after: retry_after.and_then(|v| v.trim().parse::<u64>().ok()).map(Duration::from_secs),
        },
        _ => Outcome::Refused { status, why: format!("HTTP {status}{}", snippet(body)) },
    }
}

fn snippet(body: &str) -> String {
    let text: String = body.trim().chars().take(200).collect();
    if text.is_empty() {
        String::new()
    } else {
        format!(": {text}")
    }
}

/// What an uploader did, for the summary at the end.
#[derive(Debug, Default, Clone)]
pub struct Counts {
    pub sent: u64,
    pub bytes_sent: u64,
    pub retries: u64,
    /// Given up after retrying for a window period.
    pub given_up: u64,
    /// Refused by the server (a 4xx other than 429).
    pub refused: u64,
    /// Dropped from the full queue, or unsent at the end's deadline.
    pub dropped: u64,
}

struct State {
    queue: ByteQueue,
    closing: Option<Instant>,
    done: bool,
    counts: Counts,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

/// Sends request bodies to one endpoint from a thread of its own.
pub struct Uploader {
    name: String,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Uploader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uploader").field("name", &self.name).finish()
    }
}

/// Reports failures without flooding: the first, then at most one summary
/// a minute, then the recovery.
struct Reporter {
    name: String,
    failing_since: Option<Instant>,
    failures: u64,
    unreported: u64,
    last_report: Option<Instant>,
    refused_statuses: Vec<u16>,
}

impl Reporter {
    fn failure(&mut self, why: &str) {
        self.failures += 1;
        if self.failing_since.is_none() {
            self.failing_since = Some(Instant::now());
            self.last_report = Some(Instant::now());
            eprintln!("corsnap: warning: {}: {why}; retrying (the program is not affected)", self.name);
            return;
        }
        self.unreported += 1;
        if self.last_report.is_some_and(|t| t.elapsed() >= REPORT_EVERY) {
            self.last_report = Some(Instant::now());
            eprintln!(
                "corsnap: warning: {}: still failing ({} more failures; last: {why})",
                self.name, self.unreported
            );
            self.unreported = 0;
        }
    }

    fn success(&mut self) {
        if let Some(since) = self.failing_since.take() {
            eprintln!(
                "corsnap: {}: working again after {} failures over {:.0} s",
                self.name,
                self.failures,
                since.elapsed().as_secs_f64()
            );
            self.failures = 0;
            self.unreported = 0;
        }
    }

    fn refused(&mut self, window: u64, status: u16, why: &str) {
        if !self.refused_statuses.contains(&status) {
            self.refused_statuses.push(status);
            eprintln!(
                "corsnap: error: {}: the server refused window {window} ({why}); windows it refuses are dropped, \
                 not retried",
                self.name
            );
        }
    }
}

impl Uploader {
    /// Starts the thread. `period`: how long a window is retried.
    pub fn start(
        name: String,
        endpoint: Endpoint,
        content_type: &'static str,
        content_encoding: Option<&'static str>,
        period: Duration,
        queue_bytes: usize,
    ) -> Uploader {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: ByteQueue::new(queue_bytes),
                closing: None,
                done: false,
                counts: Counts::default(),
            }),
            wake: Condvar::new(),
        });
        let thread_shared = shared.clone();
        let reporter_name = name.clone();
        let spawned = std::thread::Builder::new().name("corsnap-upload".to_string()).spawn(move || {
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .timeout_global(Some(REQUEST_TIMEOUT))
                .http_status_as_error(false)
                .max_redirects(0)
                .user_agent(format!("corsnap/{}", env!("CARGO_PKG_VERSION")))
                .build()
                .into();
            let send = |body: &[u8]| -> Outcome {
                let mut request = agent.post(&endpoint.url).header("Content-Type", content_type);
                if let Some(encoding) = content_encoding {
                    request = request.header("Content-Encoding", encoding);
                }
                for (k, v) in &endpoint.headers {
                    request = request.header(k.as_str(), v.as_str());
                }
                match request.send(body) {
                    Ok(mut response) => {
                        let status = response.status().as_u16();
                        let retry_after =
                            response.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_string);
                        let text = if status >= 300 {
                            response.body_mut().with_config().limit(4096).read_to_string().unwrap_or_default()
                        } else {
                            String::new()
                        };
                        classify(status, retry_after.as_deref(), &text)
                    }
                    Err(e) => Outcome::Retry { why: e.to_string(), after: None },
                }
            };
            let mut reporter = Reporter {
                name: reporter_name,
                failing_since: None,
                failures: 0,
                unreported: 0,
                last_report: None,
                refused_statuses: Vec::new(),
            };
            run(&thread_shared, period, &mut reporter, send);
        });
        if let Err(e) = spawned {
            eprintln!("corsnap: error: {name}: cannot start the upload thread ({e}); nothing will be sent");
            shared.state.lock().unwrap_or_else(|p| p.into_inner()).done = true;
        }
        Uploader { name, shared }
    }

    /// Queues a body; returns at once.
    pub fn send(&self, job: Job) {
        let mut state = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.done {
            state.counts.dropped += 1;
            return;
        }
        let dropped = state.queue.push(job);
        state.counts.dropped += dropped;
        drop(state);
        self.shared.wake.notify_all();
    }

    /// Sends what is queued until `deadline`, then stops: the counts.
    pub fn finish(&self, deadline: Instant) -> Counts {
        let mut state = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        state.closing = Some(deadline);
        self.shared.wake.notify_all();
        while !state.done {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            state = self.shared.wake.wait_timeout(state, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
        // Whatever is left is not sent (the thread ends with the process).
        state.counts.dropped += state.queue.len() as u64;
        while state.queue.pop().is_some() {}
        state.counts.clone()
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The upload thread: takes jobs in order and tries each until it is sent,
/// refused, or its period is over.
fn run(shared: &Shared, period: Duration, reporter: &mut Reporter, mut send: impl FnMut(&[u8]) -> Outcome) {
    let lock = || shared.state.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let job = {
            let mut state = lock();
            loop {
                if let Some(job) = state.queue.pop() {
                    break Some(job);
                }
                if state.closing.is_some() {
                    break None;
                }
                state = shared.wake.wait(state).unwrap_or_else(|p| p.into_inner());
            }
        };
        let Some(job) = job else { break };
        if job.queued.elapsed() > MAX_AGE {
            lock().counts.dropped += 1;
            continue;
        }
        let first_try = Instant::now();
        let mut attempt = 0u32;
        loop {
            match send(&job.body) {
                Outcome::Sent => {
                    reporter.success();
                    let mut state = lock();
                    state.counts.sent += 1;
                    state.counts.bytes_sent += job.body.len() as u64;
                    break;
                }
                Outcome::Refused { status, why } => {
                    reporter.refused(job.window, status, &why);
                    lock().counts.refused += 1;
                    break;
                }
                Outcome::Retry { why, after } => {
                    reporter.failure(&why);
                    let wait = after.unwrap_or_else(|| backoff(attempt, period));
                    attempt += 1;
                    let give_up_at = first_try + period;
                    let mut state = lock();
                    let closing = state.closing;
                    let until = Instant::now() + wait;
                    // Past the window's period, or the end's deadline: give up.
                    if until > give_up_at || closing.is_some_and(|d| until > d) {
                        state.counts.given_up += 1;
                        break;
                    }
                    state.counts.retries += 1;
                    // Sleep, but wake for the end.
                    while Instant::now() < until {
                        let left = until - Instant::now();
                        state = shared.wake.wait_timeout(state, left).unwrap_or_else(|p| p.into_inner()).0;
                        if state.closing.is_some_and(|d| until > d) {
                            break;
                        }
                    }
                    if state.closing.is_some_and(|d| Instant::now() >= d) {
                        state.counts.given_up += 1;
                        break;
                    }
                }
            }
        }
        if lock().closing.is_some_and(|d| Instant::now() >= d) {
            break;
        }
    }
    lock().done = true;
    shared.wake.notify_all();
}

/// The wait before retry `attempt` (0 first): 0.5 s doubling, capped at a
/// quarter of the period and 30 s, with full jitter over its upper half so
/// that a fleet does not retry in step.
fn backoff(attempt: u32, period: Duration) -> Duration {
    let cap = (period / 4).clamp(Duration::from_millis(100), Duration::from_secs(30));
    let base = Duration::from_millis(500).saturating_mul(1 << attempt.min(16)).min(cap);
    base / 2 + base.mul_f64(fastrand::f64() / 2.0)
}

/// `3 windows sent (41 KiB)` and what went wrong, for the final line.
pub fn describe_counts(counts: &Counts) -> String {
    let mut parts = vec![format!("{} windows sent ({} KiB)", counts.sent, counts.bytes_sent.div_ceil(1024))];
    if counts.retries > 0 {
        parts.push(format!("{} retries", counts.retries));
    }
    if counts.given_up > 0 {
        parts.push(format!("{} given up after a window period of retries", counts.given_up));
    }
    if counts.refused > 0 {
        parts.push(format!("{} refused by the server", counts.refused));
    }
    if counts.dropped > 0 {
        parts.push(format!("{} dropped (queue full, or unsent at the end)", counts.dropped));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(bytes: usize, window: u64) -> Job {
        Job::new(vec![0; bytes], window)
    }

    #[test]
    fn the_queue_stays_within_its_bytes_and_drops_the_oldest() {
        let mut q = ByteQueue::new(10_000);
        // An hour of 3 s windows of 1,000 bytes each, none ever sent.
        for w in 0..1200 {
            q.push(job(1000, w));
            assert!(q.bytes() <= 10_000);
        }
        assert_eq!(q.len(), 10);
        assert_eq!(q.dropped, 1190);
        // The newest are kept.
        assert_eq!(q.pop().unwrap().window, 1190);
        // Too big for the whole queue: dropped itself.
        assert_eq!(q.push(job(20_000, 9999)), 1);
        assert_eq!(q.len(), 9);
    }

    #[test]
    fn statuses_are_retried_or_refused_as_the_protocols_say() {
        assert_eq!(classify(200, None, ""), Outcome::Sent);
        assert!(matches!(classify(503, None, ""), Outcome::Retry { after: None, .. }));
        assert_eq!(
            classify(429, Some("7"), "slow down"),
            Outcome::Retry { why: "HTTP 429: slow down".into(), after: Some(Duration::from_secs(7)) }
        );
        assert!(matches!(classify(400, None, "too many samples"), Outcome::Refused { status: 400, .. }));
        assert!(matches!(classify(401, None, ""), Outcome::Refused { status: 401, .. }));
    }

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let period = Duration::from_secs(15);
        for attempt in 0..20 {
            let wait = backoff(attempt, period);
            assert!(wait <= Duration::from_millis(3750), "{attempt}: {wait:?}");
        }
        let first = backoff(0, period);
        assert!(first >= Duration::from_millis(250) && first <= Duration::from_millis(500));
    }

    #[test]
    fn credentials_leave_the_url_and_are_never_shown() {
        let auth = Auth { tenant: Some("t1".into()), ..Auth::default() };
        let e =
            Endpoint::new("https://123:s%40cret@host:4040/", "/push.v1.PusherService/Push", &auth, "--push").unwrap();
        assert_eq!(e.url, "https://host:4040/push.v1.PusherService/Push");
        assert_eq!(e.headers[0], ("Authorization".to_string(), format!("Basic {}", base64(b"123:s@cret"))));
        assert_eq!(e.headers[1], ("X-Scope-OrgID".to_string(), "t1".to_string()));
        assert!(!format!("{e:?}").contains("cret"));
        assert_eq!(redact("https://123:secret@host:4040/x"), "https://***@host:4040/x");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(base64(b"abc"), "YWJj");
        assert_eq!(base64(b"a"), "YQ==");
        let already = Endpoint::new("http://h/v1development/profiles", "/v1development/profiles", &auth, "--otlp");
        assert_eq!(already.unwrap().url, "http://h/v1development/profiles");
        assert!(Endpoint::new("h:4040", "/x", &auth, "--push").unwrap_err().to_string().contains("not a URL"));
    }

    #[test]
    fn a_dead_backend_gives_up_within_the_period_and_the_end_keeps_its_deadline() {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: ByteQueue::new(1 << 20),
                closing: None,
                done: false,
                counts: Counts::default(),
            }),
            wake: Condvar::new(),
        });
        for w in 0..3 {
            shared.state.lock().unwrap().queue.push(job(100, w));
        }
        let thread_shared = shared.clone();
        let started = Instant::now();
        let thread = std::thread::spawn(move || {
            let mut reporter = Reporter {
                name: "test".into(),
                failing_since: None,
                failures: 0,
                unreported: 0,
                last_report: None,
                refused_statuses: Vec::new(),
            };
            run(&thread_shared, Duration::from_millis(600), &mut reporter, |_| Outcome::Retry {
                why: "HTTP 503".into(),
                after: None,
            });
        });
        let uploader = Uploader { name: "test".into(), shared };
        let counts = uploader.finish(Instant::now() + Duration::from_secs(5));
        thread.join().unwrap();
        assert_eq!(counts.given_up, 3, "{counts:?}");
        assert!(counts.retries >= 3, "{counts:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
