//! The reclaimer: our kswapd. One thread per runtime.
//!
//! Woken when the policy says (by default when usage, resident + pool, passes the high
//! watermark), it works while the policy says (down to the low one). Candidates are resident folios in fault-in order (oldest first,
//! from a per-folio stamp), learnt from the fault queue (queue.rs; a full scan of the
//! regions only when it overflowed or the lists run dry), kept in two lists as the
//! kernel keeps file and anon LRUs:
//! - *clean* (CLEAN: a valid copy is in the store): eviction is a MOVE out and a
//!   DONTNEED, no compression;
//! - *dirty* (RESIDENT): eviction compresses.
//!
//! When to work, which list, whether a run goes out at once or onto probation first,
//! and how long a run may be are the policy's calls (policy.rs: `Fifo`, `Probation`),
//! made from numbers alone; this module is the mechanism. Contiguous candidates of a
//! list (a sequential pass faults folios in address order) are taken as one *run*:
//! one MOVE and one DONTNEED for the run, one TLB flush each (the policies keep dirty
//! runs short: their folios are compressed in turn). Compression goes to a helper thread when it has room (`Outbox`), so two CPUs
//! compress while a program writes. On probation a run's pages sit in the shadow
//! (UFFDIO_MOVE, out of the program's view but still uncompressed) and its folios on a
//! probation queue; a touch there faults a folio back without decompression (a MOVE,
//! or a protected COPY for a folio that went out clean) with a fresh stamp.
//!
//! A folio whose pages another process maps too (a child since a fork) cannot be moved
//! out while it does: it is counted (`reject_reclaim_fail`, `reject_shared`) and passed
//! over until the next `SHARED_EPOCH` (see `pass_over`). When a move fails otherwise
//! (a pinned page, a mapping changing under us) or the store refuses folios (failed
//! compression, a full pool with nowhere to write back), each refusal is counted
//! (`reject_reclaim_fail`) and the folio stays resident, moved back untouched; after
//! `MAX_REFUSED` in a row the reclaimer rests
//! for `REFUSED_BACKOFF`, and faults run over the budget (`over_budget`) rather than
//! wait for it. So they do when it finds nothing to evict (everything is out already
//! and the pool alone is over the budget).
//!
//! The evict race (a write landing between copy and discard) cannot happen: the pages
//! are moved, not copied, so a concurrent access faults and waits on the folio lock;
//! and a clean folio's pages are write-protected, so no write lands unseen before.

use crate::fault::{ioctl_fatal, move_back, TableGuard, PAGE};
use crate::region::*;
use crate::stats::bump;
use crate::uffd::{self, Exist, IoctlError};
use crate::policy::{self, Kind, Levels, Policy, Step, View};
use crate::{Shared, PM_EXCLUSIVE, PM_PRESENT, PM_UFFD_WP};
use std::collections::VecDeque;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Candidates gathered per scan of the regions, at least (a quarter of all, if more).
const MIN_BATCH: usize = 4096;
/// Evictions in a row that the store refused (compression failing, a full pool and
/// nowhere to write back) before the reclaimer backs off ...
const MAX_REFUSED: u32 = 8;
/// ... for this long, whatever kicks it: retrying at once would only burn the CPU
/// the program needs. Faults meanwhile run over the budget (counted `over_budget`).
const REFUSED_BACKOFF: Duration = Duration::from_millis(50);
/// How long a folio another process maps too is passed over (`pass_over`).
const SHARED_EPOCH: Duration = Duration::from_secs(1);
/// In a group, how often a process with nothing listed may scan to learn how cold its
/// memory is (and never for more than a fifth of the time, as the reclaimer's scans).
const TAIL_SCAN_EVERY: Duration = Duration::from_secs(1);

/// Most shadow ranges freed in one call...
const SHADOW_FREE_BATCH: usize = 64;
/// ... and most bytes: the pages wait uncounted (the folios are no longer resident).
const SHADOW_FREE_BYTES: usize = 2 << 20;

/// Shadow pages of evicted folios, freed together by one process_madvise(2): one TLB
/// flush for the batch instead of one per folio. A flush interrupts every CPU that
/// runs the program (an IPI; costly in a VM), and random faults evict folio by folio.
/// The ranges hold their regions so no shadow is unmapped while in here; a MOVE into
/// a range still in here would fail, so `take_out` flushes first (`flush_if_overlaps`).
struct ShadowFrees {
    /// A pidfd of this process, or -1 where process_madvise is missing (each range is
    /// then freed at once with madvise).
    pidfd: i32,
    ranges: Vec<(Arc<RegionInner>, usize, usize)>,
    bytes: usize,
}

impl ShadowFrees {
    fn new(sh: &Shared) -> ShadowFrees {
        ShadowFrees { pidfd: sh.pidfd, ranges: Vec::with_capacity(SHADOW_FREE_BATCH), bytes: 0 }
    }

    fn push(&mut self, r: &Arc<RegionInner>, addr: usize, len: usize) {
        if self.pidfd < 0 {
            crate::region::discard_shadow(addr, len);
            return;
        }
        self.ranges.push((r.clone(), addr, len));
        self.bytes += len;
        if self.ranges.len() >= SHADOW_FREE_BATCH || self.bytes >= SHADOW_FREE_BYTES {
            self.flush();
        }
    }

    fn flush_if_overlaps(&mut self, addr: usize, len: usize) {
        if self.ranges.iter().any(|&(_, a, l)| a < addr + len && addr < a + l) {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.ranges.is_empty() {
            return;
        }
        let iov: Vec<libc::iovec> = self.ranges.iter().map(|&(_, a, l)| libc::iovec { iov_base: a as *mut _, iov_len: l }).collect();
        // SAFETY: shadow ranges of regions kept alive by `ranges`.
        let done = unsafe { libc::syscall(libc::SYS_process_madvise, self.pidfd, iov.as_ptr(), iov.len(), libc::MADV_DONTNEED, 0) };
        if done < 0 || done as usize != self.bytes {
            // An older kernel refuses MADV_DONTNEED here: free them one by one, from now on.
            for &(_, a, l) in &self.ranges {
                crate::region::discard_shadow(a, l);
            }
            if done < 0 {
                self.pidfd = -1; // Shared's: it closes it
            }
        }
        self.ranges.clear();
        self.bytes = 0;
    }
}

impl Drop for ShadowFrees {
    fn drop(&mut self) {
        self.flush();
    }
}

/// What evictions hand on: shadow ranges to free (`ShadowFrees`), and dirty folios to
/// compress, to the compression helper when there is one and it has room.
///
/// The helper is a second thread that compresses while the reclaimer picks and takes
/// out the next folios: when a program writes, compression is most of the reclaimer's
/// time (perf, `uzswap bench kernel` seqswap at 4 KiB: the reclaimer ~90% of a CPU,
/// mostly in zstd, the other CPU idle a quarter of the time while the program waited
/// for room), as zswap compresses on every CPU that reclaims. A folio
/// goes to it locked, its pages in the shadow; the helper stores it, hands its shadow
/// range back (`returned`) and only then unlocks it. We collect those ranges into our
/// batch before every take-out (`flush_if_overlaps`): a folio we lock afterwards was
/// unlocked after its range came back, so no MOVE ever lands on a range whose DONTNEED
/// is still pending.
struct Outbox {
    frees: ShadowFrees,
    helper: Option<Helper>,
}

struct Helper {
    jobs: std::sync::mpsc::SyncSender<(Arc<RegionInner>, usize, u8)>,
    /// Folios sent and not yet unlocked.
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
    returned: std::sync::mpsc::Receiver<(Arc<RegionInner>, usize, usize)>,
    thread: std::thread::JoinHandle<()>,
}

/// Folios queued for the helper at most (each holds its pages in the shadow).
const HELPER_QUEUE: usize = 4;

impl Outbox {
    /// With a helper when this machine has a second CPU for it.
    fn new(sh: &Arc<Shared>) -> Outbox {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let helper = (cpus > 1).then(|| Helper::spawn(sh)).flatten();
        Outbox { frees: ShadowFrees::new(sh), helper }
    }

    fn push(&mut self, r: &Arc<RegionInner>, addr: usize, len: usize) {
        self.frees.push(r, addr, len);
    }

    fn flush(&mut self) {
        self.collect();
        self.frees.flush();
    }

    /// Before a MOVE into `[addr, addr + len)` of a shadow: frees it if a DONTNEED of
    /// it is pending.
    fn flush_if_overlaps(&mut self, addr: usize, len: usize) {
        self.collect();
        self.frees.flush_if_overlaps(addr, len);
    }

    /// Folios the helper holds: what it frees is still to come.
    fn busy(&self) -> bool {
        self.helper.as_ref().is_some_and(|h| h.in_flight.load(SeqCst) > 0)
    }

    /// Takes in the shadow ranges the helper is done with.
    fn collect(&mut self) {
        if let Some(h) = &self.helper {
            hand_back(&h.returned, &mut self.frees);
        }
    }

    /// Compresses folio `idx` (locked, its pages in the shadow) and unlocks it: on the
    /// helper if it has room, else here.
    fn compress(&mut self, sh: &Shared, r: &Arc<RegionInner>, idx: usize, prev: u8) {
        if let Some(h) = &self.helper {
            h.in_flight.fetch_add(1, SeqCst);
            if h.jobs.try_send((r.clone(), idx, prev)).is_ok() {
                return;
            }
            h.in_flight.fetch_sub(1, SeqCst);
        }
        let frees = &mut self.frees;
        let next = compress_out(sh, r, idx, prev, &mut |r, addr, len| frees.push(r, addr, len));
        r.unlock(idx, next);
    }
}

impl Helper {
    fn spawn(sh: &Arc<Shared>) -> Option<Helper> {
        let (jobs, job_rx) = std::sync::mpsc::sync_channel::<(Arc<RegionInner>, usize, u8)>(HELPER_QUEUE);
        let (done, returned) = std::sync::mpsc::channel();
        let in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (sh, count) = (sh.clone(), in_flight.clone());
        let thread = crate::spawn_thread("uzswap-compress", None, move || {
            for (r, idx, prev) in job_rx {
                // The range goes back before the unlock: see `Outbox`.
                let next = compress_out(&sh, &r, idx, prev, &mut |r, addr, len| {
                    let _ = done.send((r.clone(), addr, len));
                });
                r.unlock(idx, next);
                count.fetch_sub(1, SeqCst);
            }
        })
        .ok()?;
        Some(Helper { jobs, in_flight, returned, thread })
    }
}

/// Puts the shadow ranges of the folios the helper has finished into `frees`.
fn hand_back(returned: &std::sync::mpsc::Receiver<(Arc<RegionInner>, usize, usize)>, frees: &mut ShadowFrees) {
    while let Ok((r, addr, len)) = returned.try_recv() {
        frees.push(&r, addr, len);
    }
}

impl Drop for Outbox {
    /// Lets the helper finish what it holds, then frees every range.
    fn drop(&mut self) {
        if let Some(Helper { jobs, returned, thread, .. }) = self.helper.take() {
            drop(jobs);
            let _ = thread.join();
            hand_back(&returned, &mut self.frees);
        }
        self.frees.flush();
    }
}

#[derive(Clone)]
struct Candidate {
    region: Arc<RegionInner>,
    idx: usize,
    stamp: u64,
}

/// Resident folios oldest first, clean and dirty apart.
#[derive(Default)]
struct Lists {
    clean: VecDeque<Candidate>,
    dirty: VecDeque<Candidate>,
    /// When the last scan ended and how long it took: scans take at most a fifth of
    /// the reclaimer's time.
    scan_end: Option<Instant>,
    scan_cost: Duration,
}

/// Starts the reclaimer and its compression helper from the caller's thread, so that
/// every thread of the runtime exists once it is returned: thread creation allocates
/// (TLS) through the program's malloc, which the shim lets happen only before main.
pub(crate) fn start(sh: &Arc<Shared>) -> std::io::Result<std::thread::JoinHandle<()>> {
    let out = Outbox::new(sh);
    let sh = sh.clone();
    crate::spawn_thread("uzswap-reclaim", None, move || reclaim_loop(sh, out))
}

/// Lent records a child keeps alone moved into its own store per look (fork.rs
/// `rehome_lent`); a look that moves this much looks again at once.
const REHOME_BATCH_BYTES: usize = 16 << 20;

fn reclaim_loop(sh: Arc<Shared>, mut out: Outbox) {
    let mut lists = Lists::default();
    let mut probation: VecDeque<Candidate> = VecDeque::new();
    let mut last_compact = Instant::now() - Duration::from_secs(10);
    let mut last_rehome = Instant::now();
    let mut last_epoch = Instant::now();
    let mut backoff_until: Option<Instant> = None;
    let mut policy = policy::new(sh.cfg.policy);
    let mut sparse = Sparse::default();
    let mut fds = [libc::pollfd { fd: sh.reclaim_fd, events: libc::POLLIN, revents: 0 }, libc::pollfd {
        fd: sh.stop_fd,
        events: libc::POLLIN,
        revents: 0,
    }];
    while !sh.stopping() {
        out.flush();
        // Say we sleep, then look once more (see `kick_reclaimer`): work that came in
        // meanwhile is not left waiting for the timeout.
        sh.reclaimer_asleep.store(true, SeqCst);
        std::sync::atomic::fence(SeqCst);
        // A reclaimer with nothing to evict (stuck) waits for a kick or the timeout
        // like a resting one, rather than spin.
        let resting = sh.reclaim_paused.load(Relaxed)
            || sh.reclaim_stuck.load(Relaxed)
            || backoff_until.is_some_and(|t| Instant::now() < t);
        let timeout = if !resting && policy.wake(&levels(&sh, sh.usage())) { 0 } else { 5 };
        // SAFETY: valid pollfds; the eventfd is drained so it can be kicked again.
        unsafe {
            libc::poll(fds.as_mut_ptr(), 2, timeout);
            if fds.iter().any(|p| p.revents & libc::POLLNVAL != 0) {
                // The program closed ours behind the shim (a raw close_range).
                crate::fds::restore_or_stop();
            }
            sh.reclaimer_asleep.store(false, SeqCst);
            let mut v = 0u64;
            libc::read(sh.reclaim_fd, (&mut v as *mut u64).cast(), 8);
        }
        if sh.stopping() {
            break;
        }
        publish_usage(&sh, &mut lists, &probation);
        if last_compact.elapsed() >= Duration::from_secs(1) {
            sparse.compact_if_sparse(&sh);
            last_compact = Instant::now();
        }
        if last_epoch.elapsed() >= SHARED_EPOCH {
            sh.shared_epoch.fetch_add(1, Relaxed);
            last_epoch = Instant::now();
        }
        // Not only when over the budget: the group counts what a child keeps alone as
        // memory it cannot reclaim, and squeezes the others for it.
        if last_rehome.elapsed() >= Duration::from_secs(1) {
            let full = crate::fork::rehome_lent(&sh, REHOME_BATCH_BYTES) >= REHOME_BATCH_BYTES;
            last_rehome = if full { Instant::now() - Duration::from_secs(1) } else { Instant::now() };
        }
        // Released folios have no stamp: the scan lists them first.
        if sh.charges.shared.load(Relaxed) > 0 && group_needs_room(&sh) && release_shared(&sh, RELEASE_BATCH_BYTES) > 0 {
            rescan(&sh, &mut lists);
        }
        // A pool past a limit that fell (the group's share moved, records came in by
        // `rehome_lent`) while the program stores nothing is written back here; a store
        // would have done it. An error (the file full) is the store's counted refusal.
        let _ = sh.store.fit_limit();
        if sh.reclaim_paused.load(Relaxed) || backoff_until.is_some_and(|t| Instant::now() < t) {
            continue;
        }
        // Closed for good once the process exits (`Runtime::hold_reclaim_for_exit`).
        if sh.reclaim_gate.try_enter() {
            evict_while_asked(&sh, &mut lists, &mut probation, &mut *policy, &mut out, &mut backoff_until);
            sh.reclaim_gate.leave();
        }
        // Entries whose region is gone would keep it alive; drop them.
        probation.retain(|p| p.region.folios.peek(p.idx) != UNMAPPED);
    }
}

/// SHARED folios made ours per wake of the reclaimer, at most (`release_shared`).
const RELEASE_BATCH_BYTES: usize = 4 << 20;

/// Whether SHARED folios should be released (`release_shared`): the group is at its
/// high watermark. With no group (a budget per process) nothing says whether the
/// parent needs room: always, as each child once compressed all it shared at fork.
fn group_needs_room(sh: &Shared) -> bool {
    match &sh.group {
        Some(m) => m.group_usage() >= m.group_budget() / 100 * u64::from(sh.cfg.high_watermark_percent),
        None => true,
    }
}

/// Makes up to `max_bytes` of SHARED folios ours (`Unshared`: charged, write
/// protection lifted). They are the parent's pages, which it cannot move out while
/// we map them too (UFFDIO_MOVE takes only a page mapped once): kept shared, they
/// would stay in memory, charged to the parent, for as long as we live. Released,
/// they are our coldest folios (no stamp) and go out next, each page we still share
/// copied first (`make_exclusive`); the parent's pages are then its alone. Returns
/// the bytes released.
fn release_shared(sh: &Shared, max_bytes: usize) -> usize {
    let regions: Vec<Arc<RegionInner>> = sh.regions.lock().iter().filter(|r| r.inherited).cloned().collect();
    let mut released = 0;
    for r in regions {
        for idx in 0..r.folios() {
            if released >= max_bytes {
                return released;
            }
            if r.folios.peek(idx) != SHARED {
                continue;
            }
            let Some(state) = r.try_lock(idx) else { continue };
            if state != SHARED {
                r.unlock(idx, state);
                continue;
            }
            match r.unprotect_folio(idx, false) {
                Ok(()) | Err(IoctlError::Gone) => {
                    r.finish(idx, SHARED, Transition::Unshared, None);
                    released += r.folio_size;
                }
                // A change of the mapping pending: the next wake tries again.
                Err(IoctlError::Again) => r.unlock(idx, SHARED),
                Err(IoctlError::Unexpected(e)) => ioctl_fatal(b"UFFDIO_WRITEPROTECT (a folio shared since fork)", e),
            }
        }
    }
    released
}

/// One bout of work, inside the reclaimer's gate: evicts while the policy asks for it;
/// sets `backoff_until` when the store keeps refusing.
fn evict_while_asked(
    sh: &Shared,
    lists: &mut Lists,
    probation: &mut VecDeque<Candidate>,
    policy: &mut dyn Policy,
    out: &mut Outbox,
    backoff_until: &mut Option<Instant>,
) {
    *backoff_until = None;
    if !policy.wake(&levels(sh, usage_now(sh))) {
        sh.clear_reclaim_trouble();
        return;
    }
    let mut refused = 0;
    while policy.keep_going(&levels(sh, usage_now(sh))) && !sh.stopping() && !sh.reclaim_paused.load(Relaxed) && !sh.reclaim_gate.closing() {
        let (fails_before, usage_before, evicted_before) = (reclaim_fails(sh), sh.usage(), sh.evicted());
        let progressed = step(sh, lists, probation, policy, out);
        if !progressed && out.busy() {
            // Nothing more to take out, but the helper is still compressing: what it
            // frees is on the way, so faults should wait for it rather than run over.
            std::thread::sleep(Duration::from_micros(50));
            continue;
        }
        if !progressed {
            // Nothing left to evict: faults must not wait for us.
            sh.declare_reclaim_stuck();
            break;
        }
        // Progress is memory freed: moving folios to probation and back (when
        // their compression is refused) frees nothing. Folios evicted are progress
        // even when faults charged more meanwhile: with usage alone, 16 threads
        // writing at once kept a fault's declaration (stuck: it waited too long)
        // in force while we evicted, every fault ran past the throttle, and the
        // program reached twice its budget.
        if reclaim_fails(sh) == fails_before {
            if usage_now(sh) < usage_before || sh.evicted() > evicted_before {
                refused = 0;
                sh.clear_reclaim_trouble();
            }
        } else {
            refused += 1;
            if refused >= MAX_REFUSED {
                sh.declare_reclaim_stuck();
                *backoff_until = Some(Instant::now() + REFUSED_BACKOFF);
                break;
            }
        }
    }
}

/// Pool memory that holds nothing is given back by compaction. A freed object leaves
/// a hole in its span, and a span goes back to the system only once empty, so a pool
/// that shrank by loads, invalidations and writeback of scattered records can hold
/// several times what it stores (python filling buffers under 128M ended with 8.5 MiB
/// of pool holding 320 KiB), all of it charged to the budget. The kernel compacts
/// zsmalloc from its shrinker for the same reason. Looked at once a second.
#[derive(Default)]
struct Sparse {
    /// Pool bytes not holding objects that compaction left last time (tables, spans
    /// it could not empty): compacted again only when the holes grow past it.
    floor: u64,
}

/// Holes worth a compaction: this many bytes, and a quarter of the pool.
const SPARSE_MIN_BYTES: u64 = 2 << 20;

impl Sparse {
    fn compact_if_sparse(&mut self, sh: &Shared) {
        let holes = || sh.store.pool_bytes().saturating_sub(sh.store.stats().compressed_bytes);
        let h = holes();
        if h < self.floor + SPARSE_MIN_BYTES || h * 4 < sh.store.pool_bytes() {
            self.floor = self.floor.min(h);
            return;
        }
        sh.store.compact();
        self.floor = holes();
    }
}

/// Usage (`usage`, as the caller measured it) against this process's watermarks.
fn levels(sh: &Shared, usage: u64) -> Levels {
    Levels { usage, high: sh.high_watermark(), low: sh.low_watermark() }
}

/// Samples usage for the peak, and in a group tells the ledger what this process
/// charges and how cold its coldest memory is (the oldest candidate's stamp); the
/// pool's limit follows the share the group gives this process.
fn publish_usage(sh: &Shared, lists: &mut Lists, probation: &VecDeque<Candidate>) {
    let usage = sh.refresh_usage();
    let before = sh.peak_usage.fetch_max(usage, Relaxed);
    let budget = sh.budget();
    if usage > budget + budget / 8 && before <= budget + budget / 8 && sh.store.tier().is_none() {
        // Said once, as it happens: nothing here can bring usage down.
        eprintln!(
            "uzswap: pid {}: WARNING: over the budget ({} against {}) with no backing file (writeback_dir none): what does not compress stays in memory",
            std::process::id(),
            crate::settings::format_bytes(usage),
            crate::settings::format_bytes(budget)
        );
    }
    let Some(m) = &sh.group else { return };
    let resident = sh.charges.resident.load(Relaxed);
    drop_stale_heads(lists);
    if resident > 0 && lists.clean.is_empty() && lists.dirty.is_empty() {
        // A process that has not had to evict yet has not listed its folios: learn its
        // coldest from the fault queue, or a scan now and then (a new process that is
        // still growing would otherwise look coldest of all and be squeezed first).
        drain_queue(sh, lists);
        if lists.clean.is_empty() && lists.dirty.is_empty() && lists.scan_end.is_none_or(|t| t.elapsed() >= TAIL_SCAN_EVERY.max(lists.scan_cost * 4)) {
            rescan(sh, lists);
        }
    }
    let tail = [lists.clean.front(), lists.dirty.front(), probation.front()].into_iter().flatten().map(|c| c.stamp).min();
    // Holding memory but none found to list: unknown, which the group takes as
    // coldest, so that this process is asked first and then says.
    let tail = tail.unwrap_or(if resident > 0 { 0 } else { crate::group::TAIL_NONE });
    // What the process holds, unmanaged memory in full: the group's share of the
    // budget is made from what members really hold.
    let held = resident + sh.pool_cached.load(Relaxed) + sh.unmanaged.load(Relaxed);
    if m.publish(held, resident, sh.pool_cached.load(Relaxed), sh.store.written_back_bytes(), tail) {
        sh.charges.wake_all();
    }
    sh.pool_follows_budget();
}

/// Usage, once what loads and drops left to free (they may run in a signal handler,
/// or on the reader, which free nothing) is freed: here, on the reclaimer.
fn usage_now(sh: &Shared) -> u64 {
    sh.store.reap();
    sh.refresh_usage()
}

/// Faults are waiting for memory (or about to).
fn faults_waiting(sh: &Shared) -> bool {
    sh.usage() > sh.throttle_limit()
}

/// One step of reclaim, as the policy says; false if there was nothing to do.
fn step(sh: &Shared, lists: &mut Lists, probation: &mut VecDeque<Candidate>, policy: &mut dyn Policy, out: &mut Outbox) -> bool {
    loop {
        refill(sh, lists);
        let view = View {
            faults_waiting: faults_waiting(sh),
            probation_bytes: sh.charges.probation.load(Relaxed),
            probation_target: sh.probation_target(),
            clean: !lists.clean.is_empty(),
            dirty: !lists.dirty.is_empty(),
            probation: !probation.is_empty(),
        };
        let (kind, evict) = match policy.next(&view) {
            Step::Idle => return false,
            Step::EvictProbation => return evict_probation(sh, probation, policy.run_bytes(None), out),
            Step::Evict(kind) => (kind, true),
            Step::Probation(kind) => (kind, false),
        };
        // The head may have changed since the lists were filled: then look again.
        let Some(run) = take_run(lists, kind, policy.run_bytes(Some(kind))) else { continue };
        policy.taken(kind, run.count);
        // A PARTIAL folio never goes on probation: its shadow would have holes where
        // its data is only in the store (folio.rs).
        if evict || run.state == PARTIAL {
            evict_run(sh, &run, out);
        } else {
            probation.extend(to_probation(sh, run, out));
        }
        return true;
    }
}

/// Evictions refused so far, all sizes: failed evictions less the folios shared with
/// another process, which are passed over instead (`pass_over`) and so do not stop
/// the reclaimer: a parent whose heap a child shares refused a move every step, backed
/// off after eight, and let its faults run past the budget meanwhile (a Python parent
/// under a 64 MiB group with a child alive held 100 MiB).
fn reclaim_fails(sh: &Shared) -> u64 {
    sh.stats.sizes.iter().map(|s| s.reject_reclaim_fail.load(Relaxed).saturating_sub(s.reject_shared.load(Relaxed))).sum()
}

/// A run of contiguous folios of one region, locked by us, all in one `state`:
/// RESIDENT, CLEAN or PARTIAL.
struct Run {
    region: Arc<RegionInner>,
    first: usize,
    count: usize,
    state: u8,
}

impl Run {
    /// The state its folios were locked in.
    fn state(&self) -> u8 {
        self.state
    }
    fn indices(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.count
    }
    fn unlock_all(&self, state: u8) {
        for idx in self.indices() {
            self.region.unlock(idx, state);
        }
    }
}

/// Whether a candidate still is what the scan saw: mapped and not touched since.
fn current(c: &Candidate) -> Option<u8> {
    let s = c.region.folios.peek(c.idx);
    let same = c.region.stamps[c.idx].load(Relaxed) == c.stamp;
    (mapped(s) && same).then_some(s)
}

/// The list a folio in a `mapped` state belongs on: clean ones (CLEAN, PARTIAL) have
/// their data in the store.
fn is_clean(state: u8) -> bool {
    state != RESIDENT
}

/// Drops the heads of the lists that are no longer what they were listed as.
fn drop_stale_heads(lists: &mut Lists) {
    for list in [&mut lists.clean, &mut lists.dirty] {
        while list.front().is_some_and(|c| current(c).is_none()) {
            list.pop_front();
        }
    }
}

/// Gets the lists ready for a choice: stale heads dropped, new candidates taken from
/// the fault queue, and a full scan when the queue dropped entries or both lists are
/// dry (it finds the folios the lists lost, e.g. ones skipped while locked; scans take
/// at most a fifth of the reclaimer's time).
fn refill(sh: &Shared, lists: &mut Lists) {
    drop_stale_heads(lists);
    if lists.clean.is_empty() || lists.dirty.is_empty() {
        drain_queue(sh, lists);
    }
    let dry = lists.clean.is_empty() && lists.dirty.is_empty();
    let may_scan = lists.scan_end.is_none_or(|t| t.elapsed() >= lists.scan_cost * 4);
    if sh.fault_queue.take_overflow() || (dry && may_scan) {
        rescan(sh, lists);
    }
}

/// The oldest candidate of the `kind` list, locked, with the candidates right after it
/// that continue it in the same region; `None` if the head is no longer what the list
/// thought (it is dropped).
fn take_run(lists: &mut Lists, kind: Kind, max_bytes: usize) -> Option<Run> {
    let dirty = kind == Kind::Dirty;
    let list = if dirty { &mut lists.dirty } else { &mut lists.clean };
    let head = list.pop_front()?;
    let r = &head.region;
    if passed_over(&r.shared, r, head.idx) || r.torn(head.idx) {
        return None;
    }
    // Checked again under the lock; pages the program dropped must be gone first
    // (region.rs: pending drops). A run is of one state.
    let want = match r.try_lock(head.idx) {
        Some(s) if mapped(s) && is_clean(s) != dirty && r.settle_drops(head.idx, s) => s,
        Some(s) => {
            r.unlock(head.idx, s);
            return None;
        }
        None => return None,
    };
    // As long as the policy says (one MOVE, one TLB flush for all of it).
    let max = (max_bytes >> r.folio_shift).max(1);
    let mut count = 1;
    while count < max {
        let Some(c) = list.front() else { break };
        if !Arc::ptr_eq(&c.region, r) || c.idx != head.idx + count || current(c).is_none() || passed_over(&r.shared, r, c.idx) || r.torn(c.idx) {
            break;
        }
        match r.try_lock(c.idx) {
            Some(s) if s == want && r.settle_drops(c.idx, s) => {}
            Some(s) => {
                r.unlock(c.idx, s);
                break;
            }
            None => break,
        }
        list.pop_front();
        count += 1;
    }
    Some(Run { region: head.region, first: head.idx, count, state: want })
}

/// Moves up to a batch of the fault queue's entries into the lists, checked against
/// the folios as they are now (stale entries are dropped).
fn drain_queue(sh: &Shared, lists: &mut Lists) {
    let guard = TableGuard::enter();
    let mut regions: Vec<Arc<RegionInner>> = Vec::new();
    for _ in 0..MIN_BATCH {
        let Some(e) = sh.fault_queue.pop() else { break };
        let Some(r) = guard.at(e.slot, sh.id) else { continue };
        if e.idx >= r.folios() {
            continue;
        }
        let (state, stamp) = (r.folios.peek(e.idx), r.stamps[e.idx].load(Relaxed));
        if !mapped(state) || !e.stamp_matches(stamp) || passed_over(sh, r, e.idx) || r.torn(e.idx) {
            continue;
        }
        // Candidates hold their region; the few regions seen in a batch are looked up once.
        let region = match regions.iter().find(|a| std::ptr::eq(Arc::as_ptr(a), r)) {
            Some(a) => a.clone(),
            None => match sh.regions.lock().iter().find(|a| std::ptr::eq(Arc::as_ptr(a), r)) {
                Some(a) => {
                    regions.push(a.clone());
                    a.clone()
                }
                None => continue,
            },
        };
        let c = Candidate { region, idx: e.idx, stamp };
        if is_clean(state) { lists.clean.push_back(c) } else { lists.dirty.push_back(c) }
    }
}

/// Gathers the oldest resident folios of all regions into the lists, and empties the
/// fault queue (what it holds, the scan sees).
fn rescan(sh: &Shared, lists: &mut Lists) {
    lists.clean.clear();
    lists.dirty.clear();
    while sh.fault_queue.pop().is_some() {}
    let start = Instant::now();
    scan(sh, lists);
    lists.scan_end = Some(Instant::now());
    lists.scan_cost = start.elapsed();
}

fn scan(sh: &Shared, lists: &mut Lists) {
    let regions: Vec<Arc<RegionInner>> = sh.regions.lock().clone();
    let mut all: Vec<(u64, u32, usize, bool)> = Vec::new();
    for (ri, r) in regions.iter().enumerate() {
        for idx in 0..r.folios() {
            let s = r.folios.peek(idx);
            if mapped(s) && !passed_over(sh, r, idx) && !r.torn(idx) {
                all.push((r.stamps[idx].load(Relaxed), ri as u32, idx, is_clean(s)));
            }
        }
    }
    let batch = MIN_BATCH.max(all.len() / 4);
    if all.len() > batch {
        all.select_nth_unstable_by_key(batch, |c| c.0);
        all.truncate(batch);
    }
    all.sort_unstable_by_key(|c| c.0);
    for (stamp, ri, idx, clean) in all {
        let c = Candidate { region: regions[ri as usize].clone(), idx, stamp };
        if clean { lists.clean.push_back(c) } else { lists.dirty.push_back(c) }
    }
}

/// Moves a locked range of folios' pages to the shadow, through the pivot
/// (`Shared::pivot`): first out of the region on the region context, then on into the
/// shadow on the staging context (the shadow's). On failure (a pinned page, a range the
/// program made PROT_NONE, a vma gone, a change of the mapping pending) what moved is
/// in the shadow, for [`put_back_run`] to put back once out of the move gate; the
/// error says why. The shadow range must be empty: see `ShadowFrees::flush_if_overlaps`.
/// Call only between `Shared::begin_move` and `end_move` (see `take_out_run`).
///
/// Why the pivot: UFFDIO_MOVE checks that its destination is registered with the
/// context it is issued on, not its source, and fails with EAGAIN only while a change
/// of the mappings of *that* context is unread. Moved straight into the shadow (on
/// the staging context), a take-out saw nothing of a munmap of the region that the
/// reader had yet to read, and if another thread of the program had mapped the same
/// addresses meanwhile and written there, it moved that thread's bytes to the store
/// and left it zeros. Moved first on the region context, it fails with EAGAIN from the
/// munmap's start until the reader has read it (the kernel holds the move and the
/// munmap's mark apart: `map_changing_lock`), and the reader reads nothing while we
/// are inside the move gate; once read, the unmapped pages are marked gone, which
/// `take_out_run` looks at inside the gate before it moves.
fn take_out(sh: &Shared, r: &RegionInner, first: usize, count: usize) -> Result<(), IoctlError> {
    let (src, dst, len) = (r.folio_addr(first), r.shadow_addr(first), count << r.folio_shift);
    let mut at = 0;
    while at < len {
        // Pieces that keep their offset within the pivot's alignment, so that a huge
        // page moves whole.
        let off = (src + at) % crate::PIVOT;
        let n = (len - at).min(crate::PIVOT - off);
        let pivot = sh.pivot + off;
        // No page by page past a range with no mapping (ENOENT, which `retry` would
        // skip): part of the run was unmapped under us, and what is mapped there next
        // is not ours to move (region.rs, "Pages unmapped"). Refused, as one gone whole.
        // EAGAIN is not waited for: the reader, which clears it, waits for us.
        let out = uffd::retry(n, false, Exist::Error, None, |o, k| match sh.uffd.move_pages(pivot + o, src + at + o, k) {
            uffd::Partial::Failed { errno: libc::ENOENT, done } => uffd::Partial::Failed { errno: libc::ESRCH, done },
            other => other,
        });
        // Whatever reached the pivot goes on to the shadow, moved or not: the pivot is
        // empty again for the next take-out, and a failed one is put back from the shadow.
        // All of it, in one move, when the first moved all (the common case); page by
        // page as the pagemap says otherwise.
        let whole = out.is_ok() && matches!(sh.staging.move_pages(dst + at, pivot, n), uffd::Partial::Done);
        if !whole {
            pivot_to_shadow(sh, r.order(), pivot, dst + at, n);
        }
        out?;
        at += n;
    }
    Ok(())
}

/// Moves every page in `[pivot, pivot + len)` to `[shadow, shadow + len)` (the staging
/// context: nothing pending there). A shadow page in the way (EEXIST) is either one
/// this move already made and 6.18's UFFDIO_MOVE did not count (see
/// `put_back_present`), skipped, or one the program wrote into the shadow (redis tests
/// all its memory so after a crash): freed, counted and said once, and the move made
/// again. If pages are left in the pivot after that, or the pagemap cannot be read,
/// the program stops rather than lose them.
fn pivot_to_shadow(sh: &Shared, order: usize, pivot: usize, shadow: usize, len: usize) {
    const WHAT: &[u8] = b"UFFDIO_MOVE (from the pivot to the shadow)";
    for _ in 0..3 {
        let moved = match crate::fault::move_present(sh, &sh.staging, shadow, pivot, len, true, Exist::Skip) {
            Ok(read) => read,
            // The address space is going (the process exits): nothing left to keep.
            Err(IoctlError::Gone) => true,
            Err(IoctlError::Unexpected(e)) => ioctl_fatal(WHAT, e),
            Err(IoctlError::Again) => ioctl_fatal(WHAT, libc::EAGAIN),
        };
        let freed = moved
            && sh.page_runs(pivot, len, crate::holds_data, |p, k| {
                let then = b": a page the program wrote into uzswap's shadow, freed (said once; see ioctl_errors)\n";
                crate::fault::unexpected_once!(sh, order, WHAT, libc::EEXIST, then);
                crate::region::discard_shadow(shadow + (p - pivot), k);
                true
            });
        if !moved || !freed {
            ioctl_fatal(b"pagemap (the pivot of a take-out)", libc::EIO);
        }
        if !sh.any_page(pivot, len, crate::holds_data) {
            return;
        }
    }
    ioctl_fatal(WHAT, libc::EEXIST)
}

/// Marks folio `idx` of `r` to be passed over (neither listed nor taken) until the
/// next `SHARED_EPOCH` begins: its pages are mapped by another process too, which
/// neither of us can move out (UFFDIO_MOVE takes only pages mapped once). So the
/// kernel's reclaim activates a folio another process keeps referenced. Tried again
/// at once, they stayed the coldest: a Python parent beside a sleeping child that
/// shares its heap and arenas met them 722,000 times in 10 s. Tried again once a
/// second: the other process may have let go (exited, written its copy) meanwhile.
/// Only the reclaimer reads and writes the marks.
fn pass_over(sh: &Shared, r: &RegionInner, idx: usize) {
    r.passed_over[idx].store(epoch_mark(sh), Relaxed);
}

/// Whether folio `idx` of `r` is passed over now (`pass_over`).
fn passed_over(sh: &Shared, r: &RegionInner, idx: usize) -> bool {
    r.passed_over[idx].load(Relaxed) == epoch_mark(sh)
}

/// The mark of the epoch now: never 0, which marks nothing.
fn epoch_mark(sh: &Shared) -> u8 {
    sh.shared_epoch.load(Relaxed) % 255 + 1
}

/// What became of a run `take_out` was asked to move out.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum TakeOut {
    /// Left in place: a page of it another process maps too (EBUSY, and pagemap says a
    /// present page is not ours alone), as long as that process keeps it.
    Shared,
    /// Left in place for any other reason (pinned, a mapping changing, gone).
    Refused,
}

/// Whether a page of `[addr, addr+len)` is present and not mapped by us alone
/// (pagemap's exclusively-mapped bit clear): a forked child maps it too. Asked only
/// after a move failed with EBUSY: the zero page reads the same in pagemap, but moves.
/// Allocation-free.
fn mapped_by_another(sh: &Shared, addr: usize, len: usize) -> bool {
    sh.any_page(addr, len, |e| e & PM_PRESENT != 0 && e & PM_EXCLUSIVE == 0)
}

/// After a fork, the parent's pages are no longer marked exclusive to it, even once
/// the child has gone, until each is written again; UFFDIO_MOVE refuses such pages
/// (EBUSY), so a program that ever forked could never be brought back under its
/// budget. A write fault on a page no one else maps makes it exclusive again without
/// changing a byte: MADV_POPULATE_WRITE takes it for every such page in `[addr,
/// addr+len)` (pagemap's exclusively-mapped bit), a dirty run's (so its write
/// protection, which would send that fault to the reader, is lifted first: no kept
/// copy depends on it). With `copy`, pages another process maps too are written as
/// well: the kernel copies each for us (a forked child's, in a region it took over
/// with its pages shared: `RegionInner::inherited`), and the other's page is then its
/// alone. Only between `begin_move` and `end_move`, where no page of the
/// run can go missing (a drop waits for the reader, which waits for the move): a
/// missing page would be a fault for the reader, which we would wait for while
/// holding the folios' locks. False if it could not.
fn make_exclusive(sh: &Shared, r: &RegionInner, addr: usize, len: usize, copy: bool) -> bool {
    // Not waiting on EAGAIN (a change of the mapping pending, which the reader settles
    // only after this move): the run is then refused, to be tried again later.
    if sh.cfg.keep_clean && crate::fault::unprotect_range(sh, addr, len, false).is_err() {
        return false;
    }
    // Present and mapped by us alone: a write fault reuses the page as it is. One a
    // child still maps would be copied, and evicting our copy would free nothing while
    // the child keeps the original: left (the move fails again, until the child has
    // gone). So are zero pages, which move as they are.
    let ours = |e: u64| e & PM_PRESENT != 0 && (copy || e & PM_EXCLUSIVE != 0);
    if copy {
        let mut pages = 0;
        sh.page_runs(addr, len, |e| e & PM_PRESENT != 0 && e & PM_EXCLUSIVE == 0, |_, bytes| {
            pages += (bytes / crate::fault::PAGE) as u64;
            true
        });
        sh.stats.sizes[r.order()].unshared_pages.fetch_add(pages, Relaxed);
    }
    sh.page_runs(addr, len, ours, |start, bytes| {
        // SAFETY: madvise on pages of our region that are there: populating them for
        // writing changes no byte.
        unsafe { libc::madvise(start as *mut _, bytes, libc::MADV_POPULATE_WRITE) == 0 }
    })
}

/// Write-protects the pages of `[start, start+len)` again (a PARTIAL run's, moved out
/// and back, so writable). Waits for a change of the mapping as `put_back` does; if
/// they cannot be protected the program stops, rather than let a write in that the
/// kept copy would not see.
fn protect_again(sh: &Shared, start: usize, len: usize) {
    let done = uffd::retry(len, true, Exist::Error, None, |off, n| match sh.uffd.write_protect(start + off, n, true) {
        Ok(()) => uffd::Partial::Done,
        Err(errno) => uffd::Partial::Failed { errno, done: 0 },
    });
    match done {
        Ok(()) | Err(IoctlError::Gone) => {}
        Err(IoctlError::Unexpected(e)) => ioctl_fatal(b"UFFDIO_WRITEPROTECT (a partly swapped-in folio put back)", e),
        Err(IoctlError::Again) => ioctl_fatal(b"UFFDIO_WRITEPROTECT (a partly swapped-in folio put back)", libc::EAGAIN),
    }
}

/// Moves back to the region every page of folios `first..first + count` of `r` that
/// the shadow holds where the region has a hole (pagemap says which), not only the
/// bytes the kernel said it moved: the range was empty before (`flush_if_overlaps`),
/// and 6.18's UFFDIO_MOVE can move pages it does not count (after an internal EAGAIN
/// its loop moves the next pages, does not advance, and meets them again: EEXIST, as
/// seen once in usemem's random pass at 4 KiB units). Left there, they would be holes
/// in a RESIDENT folio, zeros on the next access. A shadow page facing a page still in
/// the region did not come from it (the folios are locked, so nothing else fills the
/// region): the program wrote into the shadow, which a program testing every anonymous
/// mapping does (redis' memory test after a crash). The take-out failed on it (EEXIST);
/// it is freed, so the next one can succeed, and the region's page stays. Pages whose
/// place the program unmapped (gone) stay in the shadow, for the caller to free.
///
/// Under `Shared::begin_fill` (as any move into the region off the reader: a drop read
/// meanwhile is either marked when we look, or makes our move fail), and never waits:
/// EAGAIN (a change pending, which the reader reads only once we are out of the gate)
/// is returned, with what went back left there (it is where it belongs: the next call
/// puts back the rest). If the pagemap cannot be read, the program stops rather than
/// guess.
fn put_back_present(sh: &Shared, r: &RegionInner, first: usize, count: usize) -> Result<(), IoctlError> {
    let mut failed = Ok(());
    for idx in first..first + count {
        let folio = r.folio_addr(idx);
        let each = r.live_runs(idx, folio, folio + r.folio_size, |src, len| {
            let dst = r.shadow_addr(idx) + (src - folio);
            let mut region = [0u64; 512];
            let mut shadow = [0u64; 512];
            let mut at = 0;
            while at < len {
                let n = ((len - at) / PAGE).min(region.len());
                if !sh.pagemap(dst + at, &mut shadow[..n]) || !sh.pagemap(src + at, &mut region[..n]) {
                    ioctl_fatal(b"pagemap (the shadow of a failed take-out)", libc::EIO);
                }
                // What a shadow page is for: freed (it faces a page of the region),
                // left (the program dropped it since: the reader has marked it, and it
                // reads as zeros now; the caller frees it), or moved back (a hole).
                #[derive(PartialEq)]
                enum Fate {
                    Free,
                    Dropped,
                    Back,
                }
                let fate = |i: usize| match (crate::holds_data(region[i]), r.drop_pending_at(src + at + i * PAGE)) {
                    (true, _) => Fate::Free,
                    (false, true) => Fate::Dropped,
                    (false, false) => Fate::Back,
                };
                let mut i = 0;
                while i < n {
                    if !crate::holds_data(shadow[i]) {
                        i += 1;
                        continue;
                    }
                    let (start, what) = (i, fate(i));
                    while i < n && crate::holds_data(shadow[i]) && fate(i) == what {
                        i += 1;
                    }
                    let (from, bytes) = (dst + at + start * PAGE, (i - start) * PAGE);
                    match what {
                        Fate::Free => {
                            crate::region::discard_shadow(from, bytes);
                            continue;
                        }
                        Fate::Dropped => continue,
                        Fate::Back => {}
                    }
                    let to = src + at + start * PAGE;
                    match uffd::retry(bytes, false, Exist::Error, None, |o, k| sh.uffd.move_pages(to + o, from + o, k)) {
                        // The program changed the protection of part of it: copied.
                        Err(IoctlError::Unexpected(libc::EINVAL)) => crate::fault::copy_present(sh, to, from, bytes, false)?,
                        other => other?,
                    }
                }
                at += n * PAGE;
            }
            Ok(())
        });
        if let Err(e) = each {
            failed = Err(e);
        }
    }
    failed
}

/// Puts back what a failed take-out of `run` left in the shadow (`put_back_present`),
/// then frees the rest of its shadow range (pages whose place the program unmapped).
/// Outside the move gate, with the run's folios locked: a change of the mapping pending
/// (EAGAIN) is waited for, here, where the reader can read it (the reclaimer may wait
/// for the reader while it holds folio locks, never inside the gate); each try enters
/// the gate as a fill does, which the reader closes only while it reads and marks (a
/// drop over our locked folios, which it cannot process before we unlock them, leaves
/// the gate closed to take-outs, not to fills). An error that is neither EAGAIN nor a
/// range gone stops the program rather than leave a page of the program's out of its
/// place.
fn put_back_run(sh: &Shared, run: &Run) {
    let r = &run.region;
    loop {
        let Some(filling) = sh.begin_fill() else {
            std::thread::yield_now();
            continue;
        };
        let done = put_back_present(sh, r, run.first, run.count);
        drop(filling);
        match done {
            Ok(()) | Err(IoctlError::Gone) => break,
            Err(IoctlError::Again) => std::thread::yield_now(),
            Err(IoctlError::Unexpected(e)) => ioctl_fatal(b"UFFDIO_MOVE (putting back a failed take-out)", e),
        }
    }
    crate::region::discard_shadow(r.shadow_addr(run.first), run.count << r.folio_shift);
}

/// Moves pages the reclaimer took out (`len` bytes at `shadow`) back into the region
/// at `dst`. If they cannot come back, the program stops with the errno (`what`)
/// rather than lose them silently.
fn put_back(sh: &Shared, dst: usize, shadow: usize, len: usize, what: &[u8]) {
    if let Err(e) = move_back(sh, dst, shadow, len, true) {
        let errno = match e {
            IoctlError::Unexpected(errno) => errno,
            _ => libc::EAGAIN,
        };
        ioctl_fatal(what, errno);
    }
}

/// Compresses a folio (locked, in `prev`: RESIDENT, or PROBATION that went out dirty)
/// whose pages sit in the shadow, and hands the shadow range to `free`. On failure
/// moves the pages back. Returns the state to unlock with.
fn compress_out(sh: &Shared, r: &Arc<RegionInner>, idx: usize, prev: u8, free: &mut dyn FnMut(&Arc<RegionInner>, usize, usize)) -> u8 {
    let fs = r.folio_size;
    let shadow = r.shadow_addr(idx);
    // SAFETY: the shadow range is ours and holds the folio's pages (holes read as zeros).
    let data = unsafe { std::slice::from_raw_parts(shadow as *const u8, fs) };
    // What the copy holds, for a clean eviction to compare (`changed_since_stored`);
    // with `keep_clean` off no copy is ever reused, so none is compared (0: unknown).
    let sum = if sh.cfg.keep_clean { crc32c::crc32c(data) } else { 0 };
    match sh.store.store_cut(r.key(idx), data, r.cut()) {
        Ok(()) => {
            free(r, shadow, fs);
            let next = r.book().record(idx, prev, Transition::Stored, None);
            r.folios.set_sum(idx, sum);
            next
        }
        Err(_) => {
            // Where the program still has it (it may have unmapped part meanwhile:
            // region.rs, "Pages unmapped"); what is left in the shadow then is only
            // pages whose place is gone.
            let folio = r.folio_addr(idx);
            let _ = r.live_runs(idx, folio, folio + fs, |at, n| {
                put_back(sh, at, shadow + (at - folio), n, b"UFFDIO_MOVE (putting back a refused folio)");
                Ok::<(), ()>(())
            });
            if r.torn(idx) {
                crate::region::discard_shadow(shadow, fs);
            }
            r.book().record(idx, prev, Transition::Refused, None)
        }
    }
}

/// Evicts `count` folios from `first` (locked, in `prev`) that went out clean: their
/// pages sit in the shadow and the store holds their copies, so one DONTNEED of the
/// shadow, no compression. Unlocks them as SWAPPED.
fn drop_clean(r: &Arc<RegionInner>, first: usize, count: usize, prev: u8, out: &mut Outbox) {
    out.push(r, r.shadow_addr(first), count << r.folio_shift);
    for idx in first..first + count {
        r.finish(idx, prev, Transition::CleanEvicted, None);
    }
}

/// Whether every present page of a PARTIAL run is still write-protected (pagemap's
/// uffd-wp bit), as its store entry needs (lib.rs, the invariant's (1)): a write that
/// got in without a fault would be lost with the clean eviction that reuses the entry.
/// Pages were seen to lose it with no ioctl of ours on them since their protected copy
/// (clean_reloads_sigbus_4k_fifo, 6.18: in up to one run of two for a while, then in
/// none of fifty; the page took a write through /proc/self/mem; whether the kernel or
/// a race of ours, not found), and dontneed_concurrent_thread lost writes to folios
/// brought in clean, written with no fault, evicted clean. A CLEAN run is checked by
/// its bytes after the move (`changed_since_stored`), which sees any such write, a
/// page still marked protected too (a stale TLB entry): a pagemap walk for it as well
/// would only add cost (counted once over `bench region --quick`: no clean page open
/// after about 720,000 clean bring-ins, nor at as many clean take-outs). A
/// PARTIAL run's units cannot be checked so (its copy is the whole folio), so they are
/// checked here, before the move (one pagemap walk of the run). A folio with a present
/// page that is not protected (or whose pagemap cannot be read) is brought in whole,
/// as a write fault would (the store entry holds its other pages), counted
/// (`clean_unprotected`). False then: the run is left, each folio unlocked as it is
/// now, to be taken again for what it is. True if the run may go on.
fn still_protected(sh: &Shared, run: &Run) -> bool {
    let r = &run.region;
    let writable = |e: u64| e & PM_PRESENT != 0 && e & PM_UFFD_WP == 0;
    // One walk of the run's pagemap (a read per 2 MiB: one per folio cost 4 KiB runs
    // half their speed), noting the folios of each open stretch.
    let addr = r.folio_addr(run.first);
    let mut open: Vec<usize> = Vec::new();
    let read = sh.page_runs(addr, run.count << r.folio_shift, writable, |start, bytes| {
        let (first, last) = ((start - addr) >> r.folio_shift, (start + bytes - 1 - addr) >> r.folio_shift);
        for idx in run.first + first..=run.first + last {
            if open.last() != Some(&idx) {
                open.push(idx);
            }
        }
        true
    });
    if !read {
        open = run.indices().collect();
    }
    if open.is_empty() {
        return true;
    }
    for idx in run.indices().filter(|idx| !open.contains(idx)) {
        r.unlock(idx, run.state);
    }
    let mut buf = vec![0; r.folio_size];
    for idx in open {
        bump(&sh.stats.sizes[r.order()].clean_unprotected);
        let res = r.book().reserve(idx, PARTIAL);
        let write = crate::fault::Why::Fault { keep: false };
        // None: put off (a drop of it read meanwhile), unlocked PARTIAL as it was.
        if let Some(next) = crate::fault::bring_back(r, idx, PARTIAL, &mut buf, write, crate::fault::Caller::Holder, Some(res)) {
            r.unlock_in(idx, next);
        }
    }
    false
}

/// Tries of a take-out that met a change of the mapping pending (`take_out_run`).
const AGAIN_TRIES: u32 = 128;
/// Tries one after the other before waiting for the reader to read again.
const AGAIN_BURST: u32 = 4;
/// Yields at most, between two of those tries, waiting for the reader to read.
const AGAIN_WAIT: u32 = 64;

/// Takes a run's pages out to the shadow (a pending DONTNEED of that shadow range is
/// flushed first). True if it did; otherwise the run is unlocked and false returned:
/// - a REMOVE event may be in flight (the move gate, moves.rs): nothing moved,
///   the run is unlocked as it was, to be tried later. We hold folio locks the reader
///   may need to finish that event, so we must not wait for it here;
/// - the take-out failed: whatever moved came back writable, so kept copies are no
///   longer trusted and the run is unlocked RESIDENT, counted as a failed reclaim.
fn take_out_run(sh: &Shared, run: &Run, out: &mut Outbox) -> bool {
    let r = &run.region;
    if run.state == PARTIAL && !still_protected(sh, run) {
        return false;
    }
    let (addr, len) = (r.folio_addr(run.first), run.count << r.folio_shift);
    out.flush_if_overlaps(r.shadow_addr(run.first), len);
    let mut outcome = TakeOut::Refused;
    // Tries: the first, one after `make_exclusive`, and a few more where a change of
    // the mapping was pending (EAGAIN): a thread of the program dropping pages in a
    // loop keeps one pending most of the time, which the reader reads once we are out
    // of the gate (partial_write_racing_drops starved the reclaimer when the first
    // EAGAIN refused the run).
    // `exclusive`: made ours once (`make_exclusive`); `copy`: copying what another
    // process maps too (a region inherited at fork).
    let (mut attempt, mut again, mut exclusive, mut copy) = (0, 0, false, false);
    loop {
        if attempt > 0 && again >= AGAIN_TRIES {
            break;
        }
        if !sh.begin_move() {
            if attempt == 0 {
                run.unlock_all(run.state());
                bump(&sh.stats.sizes[r.order()].reclaim_deferred);
                std::thread::yield_now();
                return false;
            }
            again += 1;
            std::thread::yield_now();
            continue;
        }
        // Torn since it was listed (an UNMAP read meanwhile: its pages are marked before
        // take-outs may enter again): never taken out (region.rs, "Pages unmapped").
        if run.indices().any(|idx| r.torn(idx)) {
            sh.end_move();
            if attempt == 0 {
                run.unlock_all(run.state());
                return false;
            }
            break;
        }
        // After a fork, the parent's pages are not its alone until written again
        // (`make_exclusive`): once, then the run is taken out again.
        if exclusive && !make_exclusive(sh, r, addr, len, copy) {
            sh.end_move();
            break;
        }
        attempt += 1;
        let moved = take_out(sh, r, run.first, run.count);
        // The reader reads nothing while we are in the gate: what it has read so far.
        let reads = sh.reads.load(Acquire);
        sh.end_move();
        let Err(e) = moved else { return true };
        if sh.any_page(r.shadow_addr(run.first), len, crate::holds_data) {
            put_back_run(sh, run);
        }
        if e == IoctlError::Again {
            // Tried again once the reader has read what is pending, a few times (its
            // thread, woken by the read, ends the pending state as it runs), and then
            // after the next read (bounded: the one pending may be read already).
            again += 1;
            if again % AGAIN_BURST != 0 {
                std::thread::yield_now();
                continue;
            }
            for _ in 0..AGAIN_WAIT {
                if sh.reads.load(Acquire) != reads {
                    break;
                }
                std::thread::yield_now();
            }
            continue;
        }
        // EINVAL: part of the region is no longer like the rest (mprotect, the shim's
        // PROT_NONE over a part the program unmapped); EBUSY: a page is pinned, or
        // shared since a fork; gone: unmapped under us (the UNMAP event frees the
        // rest). Expected: put back. Anything else is counted and said too (the data
        // stays in place: nothing is lost).
        if let IoctlError::Unexpected(errno) = e {
            if errno != libc::EINVAL && errno != libc::EBUSY {
                let then = b": the folios stay in place (said once; see ioctl_errors)\n";
                crate::fault::unexpected_once!(sh, r.order(), b"UFFDIO_MOVE (taking folios out)", errno, then);
            }
        }
        let busy = matches!(e, IoctlError::Unexpected(libc::EBUSY));
        // Pages another process maps too: left to it (it may exit or exec soon, and
        // our copy would free nothing while it keeps the original), but for a forked
        // child's in a region it took over, which copies them once: the parent's
        // pages, charged to both until one lets go (fork.rs).
        let shared = busy && mapped_by_another(sh, addr, len);
        if shared && (copy || !r.inherited || run.state != RESIDENT) {
            outcome = TakeOut::Shared;
            break;
        }
        if !(run.state == RESIDENT && busy) || (exclusive && !shared) {
            break;
        }
        // Made ours once, and copied once at most (a second refusal breaks above).
        copy = shared;
        exclusive = true;
    }
    if run.state == PARTIAL {
        // What came back is writable: protected again before the folios are unlocked,
        // as their copies in the store are all there is of their other pages.
        protect_again(sh, addr, len);
    }
    // Shared: passed over for now (`pass_over`). A refusal that may pass (a page
    // pinned or being split, a mapping changing) keeps its place, and counts toward
    // the rest after `MAX_REFUSED`: passing those over put a hammer of 2 MiB folios
    // under 16 MiB at rest every few steps, its faults running past the budget.
    let shared = outcome == TakeOut::Shared;
    for idx in run.indices() {
        if shared {
            pass_over(sh, r, idx);
        }
        r.finish(idx, run.state(), Transition::Refused, None);
    }
    if shared {
        sh.stats.sizes[r.order()].reject_shared.fetch_add(run.count as u64, Relaxed);
    }
    false
}

fn evict_run(sh: &Shared, run: &Run, out: &mut Outbox) {
    if !take_out_run(sh, run, out) {
        return;
    }
    let r = &run.region;
    match run.state {
        PARTIAL => drop_clean(r, run.first, run.count, PARTIAL, out),
        CLEAN => {
            // Those that still hold their copy's bytes go in runs, as one free each.
            let mut from = run.first;
            for idx in run.indices() {
                if changed_since_stored(r, idx) {
                    if idx > from {
                        drop_clean(r, from, idx - from, CLEAN, out);
                    }
                    out.compress(sh, r, idx, RESIDENT);
                    from = idx + 1;
                }
            }
            let end = run.first + run.count;
            if end > from {
                drop_clean(r, from, end - from, CLEAN, out);
            }
        }
        _ => {
            for idx in run.indices() {
                out.compress(sh, r, idx, RESIDENT);
            }
        }
    }
}

/// Whether a CLEAN folio just taken out (locked, its pages in the shadow) holds other
/// bytes than its kept copy (the checksum noted when it was stored), and if so makes
/// it dirty (`Dirtied`: the copy freed, RESIDENT, still locked), counted as
/// `clean_changed`. A write that got in without a fault is all that can do it (a page
/// left open, or opened and closed again, a stale TLB entry): the bytes taken out are
/// stored anew, never replaced by an old copy. A copy whose checksum is not known
/// (carried at fork) is trusted, as before.
fn changed_since_stored(r: &RegionInner, idx: usize) -> bool {
    let sum = r.folios.sum(idx);
    if sum == 0 {
        return false;
    }
    // SAFETY: the folio's shadow range, locked, holding what was taken out (holes
    // read as zeros, as compression read them).
    let data = unsafe { std::slice::from_raw_parts(r.shadow_addr(idx) as *const u8, r.folio_size) };
    if crc32c::crc32c(data) == sum {
        return false;
    }
    r.book().record(idx, CLEAN, Transition::Dirtied, None);
    bump(&r.shared.stats.sizes[r.order()].clean_changed);
    true
}

/// Puts a run on probation; returns its folios for the probation queue. A clean
/// folio keeps its copy through probation (folio.rs).
fn to_probation(sh: &Shared, run: Run, out: &mut Outbox) -> Vec<Candidate> {
    if !take_out_run(sh, &run, out) {
        return Vec::new();
    }
    let r = &*run.region;
    run.indices()
        .map(|idx| {
            let c = Candidate { region: run.region.clone(), idx, stamp: r.stamps[idx].load(Relaxed) };
            // A clean one keeps its copy on probation only if it still holds what it took out.
            let state = if run.state == CLEAN && changed_since_stored(r, idx) { RESIDENT } else { run.state() };
            r.finish(idx, state, Transition::ToProbation, None);
            c
        })
        .collect()
}

/// Evicts the head of the probation queue, with the entries after it that continue it
/// (same region, next folio, same kind) as one run. False if the queue is empty.
fn evict_probation(sh: &Shared, queue: &mut VecDeque<Candidate>, max_bytes: usize, out: &mut Outbox) -> bool {
    let Some(head) = queue.pop_front() else { return false };
    let r = &head.region;
    // Still on probation since we put it there: nobody touched it.
    let untouched = |c: &Candidate| c.region.stamps[c.idx].load(Relaxed) == c.stamp;
    match r.try_lock(head.idx) {
        Some(PROBATION) if untouched(&head) => {}
        Some(s) => {
            r.unlock(head.idx, s);
            return true;
        }
        None => return true,
    }
    let clean = r.folios.kept(head.idx);
    let max = (max_bytes >> r.folio_shift).max(1);
    let mut count = 1;
    while count < max {
        let Some(c) = queue.front() else { break };
        if !Arc::ptr_eq(&c.region, &head.region) || c.idx != head.idx + count || !untouched(c) {
            break;
        }
        match r.try_lock(c.idx) {
            Some(PROBATION) if untouched(c) && r.folios.kept(c.idx) == clean => {}
            Some(s) => {
                r.unlock(c.idx, s);
                break;
            }
            None => break,
        }
        queue.pop_front();
        count += 1;
    }
    if clean {
        drop_clean(r, head.idx, count, PROBATION, out);
    } else {
        for idx in head.idx..head.idx + count {
            out.compress(sh, r, idx, PROBATION);
        }
    }
    true
}
