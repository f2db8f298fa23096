//! The safe interface the agent uses: installing and removing the handler,
//! giving threads their slots and clocks, publishing code maps.

use super::*;

/// Why the signal sampler could not start.
#[derive(Debug)]
pub enum InstallError {
    /// The application has its own `SIGPROF` handler; corsnap will not
    /// replace it or steal its signals.
    SignalInUse,
    /// A system call failed.
    Os(std::io::Error),
}

impl std::fmt::Display for InstallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InstallError::SignalInUse => write!(f, "the program has its own SIGPROF handler"),
            InstallError::Os(e) => write!(f, "{e}"),
        }
    }
}

static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The installed signal handler. Only one exists at a time; dropping it
/// without [`SignalSampler::uninstall`] leaves the handler installed, so the
/// agent always uninstalls.
#[derive(Debug)]
pub struct SignalSampler {
    pub(super) trampoline: Trampoline,
    pub(super) previous: libc::sigaction,
    retired: Vec<*mut CodeMap>,
    pub(super) timers: Vec<(usize, i32)>,
    perf_fds: Vec<(usize, i32)>,
    /// Perf events replaced by timers (fd, ring page), closed once no
    /// handler runs ([`Sampler::reclaim`]).
    closing_perf: Vec<(i32, usize)>,
    perf_usable: bool,
    perf_refusal: Option<String>,
    free_slots: Vec<usize>,
    next_slot: usize,
    /// The process tables of the last map published, already mapped (see
    /// [`SignalSampler::publish`]).
    populated_tables: [(usize, usize); 2],
}

// SAFETY: the raw map pointers are owned (Arc::into_raw) and only freed here.
unsafe impl Send for SignalSampler {}

/// A thread's timer, identified by its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId(usize);

impl SignalSampler {
    /// Installs the handler for [`SAMPLE_SIGNAL`] (refusing if the program
    /// has one of its own) with sampling disabled.
    /// `use_perf`: sample with perf events where the kernel allows them
    /// (else, or with `false`, POSIX CPU timers).
    pub fn install(use_perf: bool) -> Result<SignalSampler, InstallError> {
        if INSTALLED.swap(true, Ordering::SeqCst) {
            return Err(InstallError::Os(std::io::Error::other("the signal sampler is already installed")));
        }
        let result = Self::install_inner(use_perf);
        if result.is_err() {
            INSTALLED.store(false, Ordering::SeqCst);
        }
        result
    }

    fn install_inner(use_perf: bool) -> Result<SignalSampler, InstallError> {
        // SAFETY: querying a disposition into a zeroed struct.
        let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        if unsafe { libc::sigaction(SAMPLE_SIGNAL, null_mut(), &mut previous) } != 0 {
            return Err(InstallError::Os(std::io::Error::last_os_error()));
        }
        let trampoline = Trampoline::get().map_err(InstallError::Os)?;
        POOL.create();
        map_handler_statics();
        if previous.sa_sigaction != libc::SIG_DFL
            && previous.sa_sigaction != libc::SIG_IGN
            && previous.sa_sigaction != trampoline.entry()
        {
            return Err(InstallError::SignalInUse);
        }
        if previous.sa_sigaction == trampoline.entry() {
            // A detach that could not restore the disposition: what was there
            // before it is the default.
            previous.sa_sigaction = libc::SIG_DFL;
        }
        let handler: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = on_signal;
        trampoline.target().store(handler as usize, Ordering::SeqCst);
        // SAFETY: zeroed sigaction, then filled in.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = trampoline.entry();
        // SA_RESTART: interrupted system calls resume (most of them: socket
        // calls with timeouts do not, which is why timers count CPU time and
        // blocked threads are never signalled). No SA_ONSTACK: the handler
        // runs on the interrupted stack. No SA_NODEFER: never re-entered.
        action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        // SAFETY: valid mask pointer.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: valid action; the entry point is our trampoline's code.
        if unsafe { libc::sigaction(SAMPLE_SIGNAL, &action, null_mut()) } != 0 {
            return Err(InstallError::Os(std::io::Error::last_os_error()));
        }
        let perf_usable = use_perf;
        Ok(SignalSampler {
            trampoline,
            previous,
            retired: Vec::new(),
            timers: Vec::new(),
            perf_fds: Vec::new(),
            closing_perf: Vec::new(),
            perf_usable,
            perf_refusal: (!perf_usable).then(|| "POSIX timers were asked for".to_string()),
            free_slots: Vec::new(),
            next_slot: 0,
            populated_tables: [(0, 0); 2],
        })
    }

    /// Whether our handler is still the one installed (a program may replace
    /// it later).
    pub fn handler_in_place(&self) -> bool {
        // SAFETY: querying into a zeroed struct.
        let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        let ok = unsafe { libc::sigaction(SAMPLE_SIGNAL, null_mut(), &mut current) == 0 };
        ok && current.sa_sigaction == self.trampoline.entry()
    }

    /// glibc's signal return trampoline (`__restore_rt`), which the kernel
    /// puts as the return address of every handler glibc installs: the mark
    /// of a signal frame on a stack. 0 if no handler has one.
    ///
    /// Read from the sampling signal's handler when there is one, else from
    /// the runtime's own fault handlers: the event walker needs it without
    /// CPU sampling, for a hardware exception (`SIGFPE`: an integer divided
    /// by zero) is dispatched from a handler on the faulting thread's own
    /// stack, and a walk that did not know the mark went on by frame
    /// pointers from the faulting frame's `rbp`, dropping that frame.
    pub fn sigreturn_trampoline() -> u64 {
        [SAMPLE_SIGNAL, libc::SIGSEGV, libc::SIGFPE, libc::SIGBUS, libc::SIGILL, libc::SIGTRAP, libc::SIGRTMIN()]
            .into_iter()
            .find_map(|signal| {
                // SAFETY: querying into a zeroed struct.
                let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
                // SAFETY: valid out-pointer; a query changes nothing.
                if unsafe { libc::sigaction(signal, null_mut(), &mut current) } != 0 {
                    return None;
                }
                current.sa_restorer.map(|f| f as usize as u64).filter(|&r| r != 0)
            })
            .unwrap_or(0)
    }

    /// Whether the handler copies the stack and leaves the walk to the
    /// agent's thread when it can ([`DEFERRED`]), rather than walking.
    pub fn set_copy_first(&self, on: bool) {
        COPY_FIRST.store(on, Ordering::Relaxed);
    }

    /// Starts or stops turning signals into samples.
    pub fn set_enabled(&self, on: bool) {
        ENABLED.store(on, Ordering::Release);
        // Paused perf events cost nothing; timers keep running and their
        // signals are dropped while sampling is off.
        // Each thread's own clock only: one moved to a timer keeps its perf
        // event off.
        for &(index, fd) in &self.perf_fds {
            // SAFETY: slots are freed only with `&mut self`.
            let perf_is_clock = unsafe { SLOTS[index].load(Ordering::Acquire).as_ref() }
                .is_some_and(|slot| slot.clock.load(Ordering::Acquire) == CLOCK_PERF);
            enable_perf_event(fd, on && perf_is_clock);
        }
        if on {
            // A timer that fired while sampling was off was stopped. The
            // first sample weighs the CPU time from now, not the pause.
            for &(index, timer) in &self.timers {
                // SAFETY: slots are freed only with `&mut self`.
                if let Some(slot) = unsafe { SLOTS[index].load(Ordering::Acquire).as_ref() } {
                    if slot.clock.load(Ordering::Acquire) == CLOCK_TIMER {
                        slot.timer_rebased();
                        let _ = arm_timer_once(timer, slot.interval_ns.load(Ordering::Relaxed));
                    }
                }
            }
        }
    }

    /// Publishes a new code map for walks; the old one is freed once no
    /// handler can be using it.
    pub fn publish(&mut self, map: Arc<CodeMap>) {
        // The process's tables are new only with new natives: mapped once
        // (see `populate`), before a handler can read them.
        let tables = map.table_blocks();
        if tables != self.populated_tables {
            for (at, len) in tables {
                crate::process::populate(at, len);
            }
            self.populated_tables = tables;
        }
        let new = Arc::into_raw(map) as *mut CodeMap;
        let old = MAP.swap(new, Ordering::SeqCst);
        if !old.is_null() {
            self.retired.push(old);
        }
        self.reclaim();
    }

    /// Frees replaced maps if no handler is running now: a handler that read
    /// the old pointer counted itself in before reading it.
    pub fn reclaim(&mut self) {
        if (self.retired.is_empty() && self.closing_perf.is_empty())
            || self.trampoline.in_flight().load(Ordering::SeqCst) != 0
        {
            return;
        }
        for (fd, page) in self.closing_perf.drain(..) {
            // SAFETY: our own descriptor and mapping, which no slot refers to
            // any more and no handler holds (count observed at zero after
            // they were taken out of the slot).
            unsafe { libc::close(fd) };
            unmap_perf_ring(page);
        }
        for p in self.retired.drain(..) {
            // SAFETY: made by Arc::into_raw in `publish`, no longer in MAP,
            // and no handler holds it (count observed at zero after the swap).
            drop(unsafe { Arc::from_raw(p as *const CodeMap) });
        }
    }

    /// Starts sampling thread `tid` every `interval_ns` of its CPU time: by a
    /// perf event where the kernel allows one (exact CPU time, dithered
    /// periods), else by a POSIX CPU-time timer (which the kernel checks only
    /// at its scheduler tick, so samples fall on tick boundaries).
    /// `runtime_thread`: its runtime thread object, 0 if not known yet (see
    /// [`SignalSampler::set_runtime_thread`]).
    pub fn add_thread(&mut self, tid: u32, interval_ns: u64, runtime_thread: u64) -> std::io::Result<SlotId> {
        let index = match self.free_slots.pop() {
            Some(i) => i,
            None if self.next_slot < MAX_SLOTS => {
                self.next_slot += 1;
                self.next_slot - 1
            }
            None => return Err(std::io::Error::other("too many threads")),
        };
        let perf_fd = if self.perf_usable { open_perf_event(tid) } else { Err(std::io::Error::other("off")) };
        let perf_fd = match perf_fd {
            Ok(fd) if (fd as usize) < MAX_PERF_FD => fd,
            Ok(fd) => {
                // SAFETY: our own fd.
                unsafe { libc::close(fd) };
                -1
            }
            Err(e) => {
                if self.perf_usable && e.raw_os_error() != Some(libc::ESRCH) {
                    // Not permitted here (perf_event_paranoid, seccomp): use
                    // timers from now on.
                    self.perf_usable = false;
                    self.perf_refusal = Some(e.to_string());
                }
                -1
            }
        };
        let perf_page = if perf_fd >= 0 {
            match map_perf_ring(perf_fd) {
                Ok(page) => page,
                Err(e) => {
                    // SAFETY: our own fd.
                    unsafe { libc::close(perf_fd) };
                    return Err(e);
                }
            }
        } else {
            0
        };
        let seed = (u64::from(tid) << 32 | index as u64) ^ 0x9e37_79b9_7f4a_7c15;
        // What the handler reads at every sample (see `hot_memory`).
        let slot = crate::hot_memory::allocate_hot(|| {
            Box::new(ThreadSlot {
                tid,
                owner: AtomicUsize::new(0),
                perf_fd: AtomicI32::new(perf_fd),
                perf_page: AtomicUsize::new(perf_page),
                perf_period_ns: AtomicU64::new(0),
                interval_ns: AtomicU64::new(interval_ns),
                timer_id: std::sync::atomic::AtomicI32::new(-1),
                clock: AtomicU8::new(if perf_fd >= 0 { CLOCK_PERF } else { CLOCK_TIMER }),
                timer_base_ns: AtomicU64::new(crate::thread_cpu_time_ns(tid).unwrap_or(0)),
                // Armed once (below, unless a perf event samples the thread):
                // the handler's first sample weighs from the base above.
                timer_arms: AtomicU64::new(1),
                walking: UnsafeCell::new(Walking {
                    cache: WalkCache::new(),
                    frames: [0; MAX_FRAMES],
                    rng: seed | 1,
                    samples: 0,
                    timer: TimerState::default(),
                    stack_generation: 0,
                    stack: 0..0,
                }),
                ring: Ring::new(sample_time::counter_is_the_clock()),
                learned: LearnedMailbox::default(),
                learned_addresses: LearnedMailbox::default(),
                samples: AtomicU64::new(0),
                walk_counts: Default::default(),
                requested_samples: AtomicU64::new(0),
                dropped_full: AtomicU64::new(0),
                unknown_stack: AtomicU64::new(0),
                runtime_thread: AtomicU64::new(runtime_thread),
                copy_end: AtomicU64::new(0),
            })
        });
        // Mapped now, not at the handler's first touches (see `populate`).
        crate::process::populate(&*slot as *const ThreadSlot as usize, std::mem::size_of::<ThreadSlot>());
        crate::process::populate(slot.ring.words.as_ptr() as usize, std::mem::size_of_val(&*slot.ring.words));
        // SAFETY: the slot is ours alone until it is published below.
        for (at, len) in unsafe { &*slot.walking.get() }.cache.heap_blocks() {
            crate::process::populate(at, len);
        }
        let slot = Box::into_raw(slot);
        // Each thread starts with a period of its own. Set before the event
        // can fire; the handler owns it from then on.
        // SAFETY: the slot is ours alone until it is published below.
        let first_period = unsafe {
            let walking = &mut *(*slot).walking.get();
            let period = dithered_period(&mut walking.rng, interval_ns);
            (*slot).perf_period_ns.store(period, Ordering::Relaxed);
            period
        };
        SLOTS[index].store(slot, Ordering::Release);
        if perf_fd >= 0 {
            PERF_FDS[perf_fd as usize].store(index as u32 + 1, Ordering::Release);
            match start_perf_event(perf_fd, tid, first_period) {
                Ok(()) => {
                    self.perf_fds.push((index, perf_fd));
                    return Ok(SlotId(index));
                }
                Err(e) => {
                    PERF_FDS[perf_fd as usize].store(0, Ordering::Release);
                    // SAFETY: our own fd; nothing was started on it.
                    unsafe { libc::close(perf_fd) };
                    unmap_perf_ring(perf_page);
                    let p = SLOTS[index].swap(null_mut(), Ordering::SeqCst);
                    // SAFETY: no event fired for this slot.
                    drop(unsafe { Box::from_raw(p) });
                    self.free_slots.push(index);
                    return Err(e);
                }
            }
        }
        match create_cpu_timer(tid, index) {
            Ok(timer) => {
                // SAFETY: the slot is published and stays until removed by us.
                let slot_ref = unsafe { &*SLOTS[index].load(Ordering::Acquire) };
                slot_ref.timer_id.store(timer, Ordering::Release);
                if let Err(e) = arm_timer_once(timer, first_period) {
                    delete_timer(timer);
                    let p = SLOTS[index].swap(null_mut(), Ordering::SeqCst);
                    // SAFETY: the timer never ran.
                    drop(unsafe { Box::from_raw(p) });
                    self.free_slots.push(index);
                    return Err(e);
                }
                self.timers.push((index, timer));
                Ok(SlotId(index))
            }
            Err(e) => {
                let p = SLOTS[index].swap(null_mut(), Ordering::SeqCst);
                // SAFETY: no timer exists for this slot, so no handler can
                // have found it.
                drop(unsafe { Box::from_raw(p) });
                self.free_slots.push(index);
                Err(e)
            }
        }
    }

    /// The slot of a sampled thread, for draining.
    pub fn slot(&self, id: SlotId) -> Option<&ThreadSlot> {
        // SAFETY: slots are freed only by `remove_exited_thread` and
        // `uninstall`, which take `&mut self`.
        unsafe { SLOTS.get(id.0)?.load(Ordering::Acquire).as_ref() }
    }

    /// Stops sampling a thread that has exited, and frees its slot. The
    /// caller drains it first. Must only be called once the thread is gone:
    /// a live thread could still have a signal pending.
    pub fn remove_exited_thread(&mut self, id: SlotId) {
        if let Some(pos) = self.timers.iter().position(|&(i, _)| i == id.0) {
            let (_, timer) = self.timers.swap_remove(pos);
            delete_timer(timer);
        }
        if let Some(pos) = self.perf_fds.iter().position(|&(i, _)| i == id.0) {
            let (_, fd) = self.perf_fds.swap_remove(pos);
            close_perf_event(fd);
        }
        let p = SLOTS[id.0].swap(null_mut(), Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: the thread has exited, so no handler runs on it; only
            // its handler ever dereferences the slot.
            drop(unsafe { Box::from_raw(p) });
            self.free_slots.push(id.0);
        }
    }

    /// Changes every thread's interval.
    pub fn set_interval(&self, interval_ns: u64) {
        for slot in SLOTS.iter().take(self.next_slot) {
            // SAFETY: slots are freed only with `&mut self`.
            if let Some(s) = unsafe { slot.load(Ordering::Acquire).as_ref() } {
                s.interval_ns.store(interval_ns, Ordering::Relaxed);
            }
        }
    }

    /// Asks thread `id` for one sample now, with a signal queued to it
    /// (`rt_tgsigqueueinfo`); the record carries [`REQUESTED`]. For walk
    /// verification only: unlike the clocks, this signals a thread whether
    /// it runs or not. `false` if the signal could not be sent.
    pub fn request_sample(&self, id: SlotId) -> bool {
        // SAFETY: slots are freed only with `&mut self`.
        let Some(slot) = (unsafe { SLOTS[id.0].load(Ordering::Acquire).as_ref() }) else { return false };
        // SAFETY: a zeroed siginfo_t filled in at the offsets asserted above.
        unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let raw = &mut info as *mut libc::siginfo_t as *mut u8;
            (raw as *mut c_int).write_unaligned(SAMPLE_SIGNAL);
            (raw.add(SI_CODE_OFFSET) as *mut c_int).write_unaligned(SI_QUEUE);
            (raw.add(SI_PID_OFFSET) as *mut c_int).write_unaligned(libc::getpid());
            (raw.add(SI_PID_OFFSET + 4) as *mut u32).write_unaligned(libc::getuid());
            (raw.add(SI_VALUE_OFFSET) as *mut usize).write_unaligned(id.0);
            libc::syscall(
                libc::SYS_rt_tgsigqueueinfo,
                libc::getpid(),
                slot.tid as c_int,
                SAMPLE_SIGNAL,
                &info as *const libc::siginfo_t,
            ) == 0
        }
    }

    /// Tells thread `id`'s handler which runtime thread object is its own
    /// (0: none).
    pub fn set_runtime_thread(&self, id: SlotId, thread: u64) {
        if let Some(slot) = self.slot(id) {
            slot.runtime_thread.store(thread, Ordering::Relaxed);
        }
    }

    /// Samples the slot has stored so far.
    pub fn samples_of(&self, id: SlotId) -> u64 {
        self.slot(id).map_or(0, |s| s.samples.load(Ordering::Acquire))
    }

    /// Samples stored for thread `id` on request so far.
    pub fn requested_samples_of(&self, id: SlotId) -> u64 {
        self.slot(id).map_or(0, |s| s.requested_samples.load(Ordering::Acquire))
    }

    /// Moves thread `id` from its perf event to a POSIX CPU timer
    /// (`timer`) or back. A perf event costs at every context switch (the
    /// kernel schedules it out and in and reprograms its timer), even
    /// disabled, a timer nothing until it fires; so a thread that switches
    /// often is cheaper on a timer, and a thread that runs long stretches
    /// keeps the exact clock. A replaced event is closed once no handler
    /// can be using it, and a new one opened on the way back. `Ok(false)`
    /// if nothing changed (already on that clock, or perf events are not
    /// allowed here).
    pub fn set_thread_clock(&mut self, id: SlotId, timer: bool) -> std::io::Result<bool> {
        // SAFETY: slots are freed only with `&mut self`.
        let Some(slot) = (unsafe { SLOTS.get(id.0).and_then(|s| s.load(Ordering::Acquire).as_ref()) }) else {
            return Ok(false);
        };
        let wanted = if timer { CLOCK_TIMER } else { CLOCK_PERF };
        if !self.perf_usable || slot.clock.load(Ordering::Acquire) == wanted {
            return Ok(false);
        }
        let enabled = ENABLED.load(Ordering::Acquire);
        if timer {
            let mut id_of_timer = slot.timer_id.load(Ordering::Acquire);
            if id_of_timer < 0 {
                id_of_timer = create_cpu_timer(slot.tid, id.0)?;
                slot.timer_id.store(id_of_timer, Ordering::Release);
                self.timers.push((id.0, id_of_timer));
            }
            // The perf event's last period is weighed by its last sample;
            // the timer's first weighs the CPU time from here.
            slot.timer_rebased();
            slot.clock.store(CLOCK_TIMER, Ordering::SeqCst);
            if enabled {
                arm_timer_once(id_of_timer, slot.interval_ns.load(Ordering::Relaxed))?;
            }
            // The event leaves the slot first (a handler then neither
            // signals through it nor finds it), and is closed later.
            let fd = slot.perf_fd.swap(-1, Ordering::SeqCst);
            let page = slot.perf_page.swap(0, Ordering::SeqCst);
            if fd >= 0 {
                self.perf_fds.retain(|&(i, f)| !(i == id.0 && f == fd));
                self.retire_perf_event(fd, page);
            }
        } else {
            let fd = open_perf_event(slot.tid)?;
            if fd as usize >= MAX_PERF_FD {
                // SAFETY: our own fd.
                unsafe { libc::close(fd) };
                return Err(std::io::Error::other("no room for another perf event"));
            }
            let page = match map_perf_ring(fd) {
                Ok(page) => page,
                Err(e) => {
                    // SAFETY: our own fd.
                    unsafe { libc::close(fd) };
                    return Err(e);
                }
            };
            PERF_FDS[fd as usize].store(id.0 as u32 + 1, Ordering::SeqCst);
            slot.perf_page.store(page, Ordering::SeqCst);
            slot.perf_fd.store(fd, Ordering::SeqCst);
            // Started before it is the clock: a signal it raises meanwhile
            // is marked read and dropped by the handler.
            if let Err(e) = start_perf_event(fd, slot.tid, slot.perf_period_ns.load(Ordering::Relaxed)) {
                slot.perf_fd.store(-1, Ordering::SeqCst);
                slot.perf_page.store(0, Ordering::SeqCst);
                self.retire_perf_event(fd, page);
                return Err(e);
            }
            if !enabled {
                enable_perf_event(fd, false);
            }
            self.perf_fds.push((id.0, fd));
            slot.clock.store(CLOCK_PERF, Ordering::SeqCst);
            // Disarmed (a zero delay): a handler that read the old clock
            // just before may arm it once more; its signal then finds the
            // clock changed and is dropped, and re-arms nothing.
            let _ = arm_timer_once(slot.timer_id.load(Ordering::Acquire), 0);
        }
        Ok(true)
    }

    /// Stops a perf event taken out of its slot (no handler finds it any
    /// more): silenced now, closed with its ring once no handler that might
    /// have loaded it is in flight ([`Self::reclaim`]).
    fn retire_perf_event(&mut self, fd: i32, page: usize) {
        PERF_FDS[fd as usize].store(0, Ordering::SeqCst);
        // SAFETY: ioctl and fcntl on our own fd: stopped, and no more
        // signals from it.
        unsafe {
            libc::ioctl(fd, PERF_EVENT_IOC_DISABLE, 0);
            libc::fcntl(fd, libc::F_SETFL, 0);
        }
        self.closing_perf.push((fd, page));
        self.reclaim();
    }

    /// How many threads each clock samples now: (perf events, timers).
    pub fn clocks_in_use(&self) -> (usize, usize) {
        let mut counts = (0, 0);
        for slot in SLOTS.iter().take(self.next_slot) {
            // SAFETY: slots are freed only with `&mut self`.
            if let Some(s) = unsafe { slot.load(Ordering::Acquire).as_ref() } {
                if s.clock.load(Ordering::Relaxed) == CLOCK_PERF {
                    counts.0 += 1;
                } else {
                    counts.1 += 1;
                }
            }
        }
        counts
    }

    /// How many threads perf events sample, and why perf events are not
    /// used (if they are not).
    pub fn perf_status(&self) -> (usize, usize, Option<&str>) {
        (self.perf_fds.len(), self.timers.len(), self.perf_refusal.as_deref())
    }

    /// Stops sampling because the program replaced our handler with its
    /// own: timers and events go, the program's handler stays, and our
    /// buffers are freed once no handler of ours runs.
    pub fn abandon(self, timeout: Duration) -> bool {
        self.leave(timeout, false)
    }

    /// Takes the handler out of the process: no timer, no pending signal, no
    /// handler running, the previous disposition back. After this returns,
    /// no signal can reach the library's code. `false` if handlers were
    /// still running after `timeout` (the slots are then leaked, not freed).
    pub fn uninstall(self, timeout: Duration) -> bool {
        self.leave(timeout, true)
    }

    fn leave(mut self, timeout: Duration, restore: bool) -> bool {
        ENABLED.store(false, Ordering::SeqCst);
        for (_, timer) in std::mem::take(&mut self.timers) {
            delete_timer(timer);
        }
        for (_, fd) in std::mem::take(&mut self.perf_fds) {
            close_perf_event(fd);
        }
        if restore {
            // SAFETY: zeroed sigaction with SIG_IGN: setting a pending signal
            // to be ignored discards it on every thread (POSIX, and Linux
            // does so).
            unsafe {
                let mut ignore: libc::sigaction = std::mem::zeroed();
                ignore.sa_sigaction = libc::SIG_IGN;
                libc::sigemptyset(&mut ignore.sa_mask);
                libc::sigaction(SAMPLE_SIGNAL, &ignore, null_mut());
                libc::sigaction(SAMPLE_SIGNAL, &self.previous, null_mut());
            }
        }
        self.trampoline.target().store(self.trampoline.idle(), Ordering::SeqCst);
        let deadline = Instant::now() + timeout;
        let mut quiet = false;
        while Instant::now() < deadline {
            if self.trampoline.in_flight().load(Ordering::SeqCst) == 0 {
                quiet = true;
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        INSTALLED.store(false, Ordering::SeqCst);
        if !quiet {
            return false;
        }
        let map = MAP.swap(null_mut(), Ordering::SeqCst);
        if !map.is_null() {
            self.retired.push(map);
        }
        self.reclaim();
        debug_assert!(self.closing_perf.is_empty());
        for slot in SLOTS.iter().take(self.next_slot) {
            let p = slot.swap(null_mut(), Ordering::SeqCst);
            if !p.is_null() {
                // SAFETY: no signal is pending or can be raised, and no
                // handler is running (count at zero with the target idle).
                drop(unsafe { Box::from_raw(p) });
            }
        }
        POOL.destroy();
        true
    }
}
