//! The CPU sampling engines behind one interface, as async-profiler's
//! engines are: the sampler thread starts the one asked for (falling back
//! to `suspend` when `signal` cannot run here), runs each when it is due,
//! and stops it; what an engine samples goes to the CLI through the one
//! [`Recorder`], which names frames and threads the same way for both.
//!
//! - `signal` ([`SignalCpuEngine`]): each thread's own CPU clock interrupts
//!   it, and the handler walks its stack with corsnap's unwinder; the
//!   sampler thread drains the handlers' buffers and names the frames.
//! - `suspend` ([`crate::suspend_engine::SuspendEngine`]): the runtime is
//!   suspended and every thread walked by `DoStackSnapshot`; it also takes
//!   wall samples and `dump`'s snapshots, and is the referee the signal
//!   engine's walks are checked against.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use corsnap_wire::SamplerStats;

use crate::native_modules::SharedNativeModules;
use crate::recorder::Recorder;
use crate::signal_engine::{Sample, SignalEngine};
use crate::Shared;

pub(crate) trait Engine {
    /// As `--sampler` calls it.
    fn name(&self) -> &'static str;
    /// When the sampler thread is next to call [`Engine::run`] (`None`:
    /// nothing is due on a timer).
    fn next_run(&mut self, now: Instant) -> Option<Instant>;
    /// Takes (a suspension) or collects (the handlers' buffers) the samples
    /// due and hands them to `recorder`. `true` when these were the
    /// recording's first samples, which go out at once: the user is waiting.
    fn run(&mut self, recorder: &mut Recorder, now: Instant) -> bool;
    fn fill_stats(&mut self, stats: &mut SamplerStats);
    /// Stops sampling; what was still buffered goes to `recorder`.
    fn stop(&mut self, recorder: &mut Recorder);
}

/// How often the signal engine's buffers are drained (and new threads
/// looked for, when the runtime announced some): about every 5 samples of a
/// busy thread, between 10 and 50 ms, so a thread's buffer never fills and
/// the agent's thread wakes no more than it must.
fn signal_drain_every(rate_hz: u32) -> Duration {
    Duration::from_millis((5000 / u64::from(rate_hz.max(1))).clamp(10, 50))
}
/// How often samples are drained while they meet code not learned yet.
const LEARNING_DRAIN_EVERY: Duration = Duration::from_millis(5);
/// The least time between two rounds that learn freshly compiled code
/// between drains: soon enough that few samples land in a body before the
/// handlers' map has it, seldom enough that a program compiling thousands of
/// methods at start does not keep the agent's thread publishing maps.
pub(crate) const LEARN_COMPILED_EVERY: Duration = Duration::from_millis(2);

/// The `signal` engine as the sampler thread drives it.
pub(crate) struct SignalCpuEngine {
    shared: Arc<Shared>,
    pub(crate) engine: SignalEngine,
    samples: Vec<Sample>,
    rate: u32,
    next_drain: Instant,
    /// When compiled code was last learned between drains.
    last_learned: Instant,
}

impl SignalCpuEngine {
    pub(crate) fn start(shared: Arc<Shared>, native_modules: SharedNativeModules) -> Result<SignalCpuEngine, String> {
        let rate = shared.signal.rate();
        let engine = SignalEngine::start(shared.clone(), rate, native_modules)?;
        Ok(SignalCpuEngine {
            shared,
            engine,
            samples: Vec::new(),
            rate,
            next_drain: Instant::now() + LEARNING_DRAIN_EVERY,
            last_learned: Instant::now(),
        })
    }

    /// Drains the handlers' buffers now and sends what they held. `true` if
    /// any sample went out.
    pub(crate) fn collect(&mut self, recorder: &mut Recorder, announced: bool) -> bool {
        let rate = self.shared.signal.rate();
        if rate != self.rate {
            self.rate = rate;
            self.engine.set_rate(rate);
        }
        if announced {
            self.engine.thread_announced();
        }
        self.engine.collect(&mut self.samples);
        self.send(recorder)
    }

    fn send(&mut self, recorder: &mut Recorder) -> bool {
        let sent = recorder.send_os_thread_samples(self.engine.take_names(), &self.samples);
        // The buffer is kept for the next round.
        self.samples.clear();
        sent
    }
}

impl Engine for SignalCpuEngine {
    fn name(&self) -> &'static str {
        "signal"
    }

    fn next_run(&mut self, now: Instant) -> Option<Instant> {
        // A thread the runtime just announced is looked for at once.
        let announced = self.shared.threads_changed.load(Ordering::Relaxed);
        if announced {
            return Some(now);
        }
        // Code the runtime just compiled is learned soon.
        if self.shared.code_compiled.load(Ordering::Relaxed) {
            return Some(self.next_drain.min((self.last_learned + LEARN_COMPILED_EVERY).max(now)));
        }
        Some(self.next_drain)
    }

    fn run(&mut self, recorder: &mut Recorder, now: Instant) -> bool {
        let announced = self.shared.threads_changed.swap(false, Ordering::Relaxed);
        if now < self.next_drain && !announced {
            if now >= self.last_learned + LEARN_COMPILED_EVERY
                && self.shared.code_compiled.swap(false, Ordering::Relaxed)
            {
                // Between drains: the new code learned and published, the
                // samples left where they are.
                self.engine.learn_compiled_now();
                self.last_learned = Instant::now();
            }
            return false;
        }
        // A drain learns what was compiled too.
        self.shared.code_compiled.store(false, Ordering::Relaxed);
        self.last_learned = now;
        let first = recorder.stats.samples == 0;
        let sent = self.collect(recorder, announced);
        // Samples in code not learned yet carry stack copies, which fill a
        // thread's ring in a few samples: while the program compiles, drain
        // often.
        let every = signal_drain_every(self.shared.signal.rate());
        self.next_drain = now + if self.engine.learning() { every.min(LEARNING_DRAIN_EVERY) } else { every };
        sent && first
    }

    fn fill_stats(&mut self, stats: &mut SamplerStats) {
        self.engine.fill_stats(stats);
    }

    fn stop(&mut self, recorder: &mut Recorder) {
        self.collect(recorder, false);
        self.engine.stop();
        self.send(recorder);
    }
}
