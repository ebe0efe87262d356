//! Reclaim policy: when the reclaimer works ([`Policy::wake`], [`Policy::keep_going`],
//! from the [`Levels`] of usage), what it does next ([`Policy::next`], from a [`View`]
//! of the access record: which candidate lists have folios, how pressed memory is) and
//! how much it takes at once ([`Policy::run_bytes`]), with no knowledge of
//! userfaultfd, regions or the store. reclaim.rs keeps the mechanism: the access
//! record itself (candidate lists in fault-in order, oldest first, clean and dirty
//! apart, and the probation queue in the order folios went there), runs, take-outs,
//! compression. A policy is a [`Policy`]; to add one, implement it and name it in
//! [`new`]. Every call is a pure function of its arguments and the policy's own state,
//! tested below without userfaultfd.
//!
//! Both policies share the kernel's swappiness in small ([`Balance`]): clean folios
//! (a valid copy is in the store: eviction costs no compression) go first, but one
//! dirty run for every `CLEAN_PER_DIRTY` clean folios, so cold dirty folios still
//! leave and a re-read of swapped data never waits behind compression of what was
//! written. When faults wait for room, what frees memory soonest goes first.

use crate::ReclaimPolicy;

/// Clean folios evicted per dirty run while both lists have candidates.
const CLEAN_PER_DIRTY: u32 = 8;
/// Largest run taken in one go (one MOVE, one TLB flush for all of it) ...
const MAX_RUN_BYTES: usize = 2 << 20;
/// ... and largest run of dirty folios, compressed in turn: short, so the clean ones
/// are not kept waiting behind a long compression.
const MAX_DIRTY_RUN_BYTES: usize = 64 << 10;

/// Usage against the watermarks, for when to work.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Levels {
    pub usage: u64,
    pub high: u64,
    pub low: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// CLEAN folios: their copy is in the store.
    Clean,
    /// RESIDENT folios: evicting them compresses.
    Dirty,
}

/// What a policy sees.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct View {
    /// Faults are waiting for room (usage is past the throttle limit).
    pub faults_waiting: bool,
    pub probation_bytes: u64,
    /// The share of the budget the probation queue may hold.
    pub probation_target: u64,
    /// Whether each candidate list has a folio, and the probation queue.
    pub clean: bool,
    pub dirty: bool,
    pub probation: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Evict the oldest run of this kind now.
    Evict(Kind),
    /// Move the oldest run of this kind out of view, onto the probation queue.
    Probation(Kind),
    /// Evict the head of the probation queue.
    EvictProbation,
    /// Nothing to take.
    Idle,
}

pub(crate) trait Policy: Send {
    /// Whether to start working: as kswapd, past the high watermark.
    fn wake(&self, l: &Levels) -> bool {
        l.usage > l.high
    }
    /// Whether to take one more step once working: down to the low watermark.
    fn keep_going(&self, l: &Levels) -> bool {
        l.usage > l.low
    }
    /// The next step, given the view.
    fn next(&mut self, v: &View) -> Step;
    /// `count` folios of `kind` were taken by an `Evict` or `Probation` step.
    fn taken(&mut self, kind: Kind, count: usize);
    /// The most a step takes at once, in bytes (whole folios, at least one): a run of
    /// contiguous folios of `kind`, or of the probation queue (`None`).
    fn run_bytes(&self, kind: Option<Kind>) -> usize {
        match kind {
            Some(Kind::Dirty) => MAX_DIRTY_RUN_BYTES,
            Some(Kind::Clean) | None => MAX_RUN_BYTES,
        }
    }
}

/// The policy named by the configuration.
pub(crate) fn new(p: ReclaimPolicy) -> Box<dyn Policy> {
    match p {
        ReclaimPolicy::Fifo => Box::new(Fifo::default()),
        ReclaimPolicy::Probation => Box::new(Probation::default()),
    }
}

/// Clean versus dirty (see the module comment).
#[derive(Default)]
struct Balance {
    clean_streak: u32,
}

impl Balance {
    fn pick(&self, v: &View) -> Option<Kind> {
        match (v.clean, v.dirty) {
            (false, false) => None,
            (false, true) => Some(Kind::Dirty),
            (true, false) => Some(Kind::Clean),
            (true, true) if self.clean_streak >= CLEAN_PER_DIRTY => Some(Kind::Dirty),
            (true, true) => Some(Kind::Clean),
        }
    }
    fn taken(&mut self, kind: Kind, count: usize) {
        self.clean_streak = match kind {
            Kind::Dirty => 0,
            Kind::Clean => self.clean_streak.saturating_add(count as u32),
        };
    }
}

/// Oldest fault-in first, evicted at once (the baseline).
#[derive(Default)]
struct Fifo(Balance);

impl Policy for Fifo {
    fn next(&mut self, v: &View) -> Step {
        // Faults waiting for memory get a clean run first: no compression.
        if v.faults_waiting && v.clean {
            return Step::Evict(Kind::Clean);
        }
        self.0.pick(v).map_or(Step::Idle, Step::Evict)
    }
    fn taken(&mut self, kind: Kind, count: usize) {
        self.0.taken(kind, count)
    }
}

/// The kernel's active/inactive lists in small: runs go out of view onto a probation
/// queue first (uncompressed, in the shadow), and are evicted from its head once it
/// holds `probation_target` bytes; a touch meanwhile brings a folio back without
/// decompression, so a hot set that never faults is still seen to be hot.
#[derive(Default)]
struct Probation(Balance);

impl Policy for Probation {
    fn next(&mut self, v: &View) -> Step {
        if v.faults_waiting {
            // What frees memory soonest: a clean run (no compression, so it skips
            // probation), then the head of the probation queue, then a dirty run.
            if v.clean {
                return Step::Evict(Kind::Clean);
            }
            if v.probation {
                return Step::EvictProbation;
            }
            return self.0.pick(v).map_or(Step::Idle, Step::Evict);
        }
        if v.probation_bytes < v.probation_target || !v.probation {
            match self.0.pick(v) {
                Some(kind) => Step::Probation(kind),
                None if v.probation => Step::EvictProbation,
                None => Step::Idle,
            }
        } else {
            Step::EvictProbation
        }
    }
    fn taken(&mut self, kind: Kind, count: usize) {
        self.0.taken(kind, count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Kind::*;

    fn view(clean: bool, dirty: bool, probation: bool) -> View {
        View { clean, dirty, probation, probation_target: 100, ..View::default() }
    }

    /// Runs `p` for `n` steps on a view that does not change, as if each run were one
    /// folio; returns the steps.
    fn steps(p: &mut dyn Policy, v: View, n: usize) -> Vec<Step> {
        (0..n)
            .map(|_| {
                let s = p.next(&v);
                if let Step::Evict(k) | Step::Probation(k) = s {
                    p.taken(k, 1);
                }
                s
            })
            .collect()
    }

    #[test]
    fn fifo_takes_clean_first_and_one_dirty_run_per_eight_clean() {
        let mut p = new(ReclaimPolicy::Fifo);
        let s = steps(&mut *p, view(true, true, false), 18);
        assert_eq!(s.iter().filter(|&&s| s == Step::Evict(Dirty)).count(), 2, "{s:?}");
        assert_eq!(s[8], Step::Evict(Dirty));
        assert_eq!(s[..8], [Step::Evict(Clean); 8]);
        // Only dirty, or only clean: that one. Nothing: idle.
        assert_eq!(steps(&mut *p, view(false, true, false), 3), [Step::Evict(Dirty); 3]);
        assert_eq!(steps(&mut *p, view(true, false, false), 3), [Step::Evict(Clean); 3]);
        assert_eq!(p.next(&view(false, false, false)), Step::Idle);
    }

    #[test]
    fn fifo_gives_waiting_faults_clean_runs_even_when_a_dirty_one_is_due() {
        let mut p = new(ReclaimPolicy::Fifo);
        steps(&mut *p, view(true, true, false), 8);
        let waiting = View { faults_waiting: true, ..view(true, true, false) };
        assert_eq!(p.next(&waiting), Step::Evict(Clean));
        assert_eq!(p.next(&view(true, true, false)), Step::Evict(Dirty));
    }

    #[test]
    fn probation_fills_its_queue_to_the_target_then_evicts_from_its_head() {
        let mut p = new(ReclaimPolicy::Probation);
        assert_eq!(p.next(&view(false, true, false)), Step::Probation(Dirty));
        // Under the target: more goes on probation; at it: the head is evicted.
        assert_eq!(p.next(&View { probation_bytes: 50, ..view(true, true, true) }), Step::Probation(Clean));
        assert_eq!(p.next(&View { probation_bytes: 100, ..view(true, true, true) }), Step::EvictProbation);
        // Nothing left to put there: the queue drains.
        assert_eq!(p.next(&View { probation_bytes: 10, ..view(false, false, true) }), Step::EvictProbation);
        assert_eq!(p.next(&view(false, false, false)), Step::Idle);
    }

    #[test]
    fn both_work_between_the_watermarks_and_take_short_dirty_runs() {
        for p in [new(ReclaimPolicy::Fifo), new(ReclaimPolicy::Probation)] {
            let at = |usage| Levels { usage, high: 90, low: 80 };
            assert!(!p.wake(&at(90)) && p.wake(&at(91)));
            assert!(p.keep_going(&at(81)) && !p.keep_going(&at(80)));
            // A dirty run is compressed folio by folio: short; clean ones and the
            // probation queue's go in one MOVE and one TLB flush, up to 2 MiB.
            assert_eq!(p.run_bytes(Some(Dirty)), 64 << 10);
            assert_eq!(p.run_bytes(Some(Clean)), 2 << 20);
            assert_eq!(p.run_bytes(None), 2 << 20);
        }
    }

    #[test]
    fn probation_frees_soonest_first_when_faults_wait() {
        let mut p = new(ReclaimPolicy::Probation);
        let w = |clean, dirty, probation| View { faults_waiting: true, ..view(clean, dirty, probation) };
        assert_eq!(p.next(&w(true, true, true)), Step::Evict(Clean));
        assert_eq!(p.next(&w(false, true, true)), Step::EvictProbation);
        assert_eq!(p.next(&w(false, true, false)), Step::Evict(Dirty));
        assert_eq!(p.next(&w(false, false, false)), Step::Idle);
    }
}
