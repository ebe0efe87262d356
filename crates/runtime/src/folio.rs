//! The life of a managed folio: its states, the transitions between them, and what
//! each transition does to the budget, the store's kept copy and the counters. Every
//! path that changes where a folio's data lives (fault, reclaim, drop, fork, region
//! drop) does its mechanism (the ioctls) and then records the transition here; none
//! holds a copy of these rules. As mm/zswap.c has one `zswap_entry` life cycle.
//!
//! ```text
//! state      data is                                 charged to     kept copy in the store
//! ---------  --------------------------------------  -------------  ----------------------
//! EMPTY      nowhere: reads as zeros                 -              no
//! RESIDENT   mapped in the region, writable          resident       no
//! CLEAN      mapped, every page write-protected      resident       yes, byte for byte
//! PARTIAL    in the store; some pages also mapped,   its mapped     yes: the data itself
//!            write-protected (the rest missing)      pages
//! PROBATION  in the shadow, uncompressed             resident and   yes if it went out
//!                                                    probation      clean, else no
//! SWAPPED    in the store (pool or backing file)     (the pool)     yes: the data itself
//! SHARED     mapped, every page write-protected,     - (the parent  no
//!            shared copy-on-write with the parent     is charged)
//! POISONED   lost (unreadable): SIGBUS on access     -              no
//! UNMAPPED   gone with the mapping (terminal)        -              no
//! BUSY       the folio lock (PG_locked): whoever changes where the data lives holds it
//!
//! transition        from                     to                 kept copy       counted
//! ----------------  -----------------------  -----------------  --------------  -----------------
//! ZeroFilled        EMPTY                    RESIDENT           -               faults zero_fill
//! FilledAhead       EMPTY                    RESIDENT           -               zero_ahead
//! Adopted           EMPTY                    RESIDENT           -               adopted
//! Carried           EMPTY                    SWAPPED            set             fork_carried
//! Shared            EMPTY                    SHARED             -               fork_shared
//! Unshared          SHARED                   RESIDENT           -               fork_unshared
//! Touched           RESIDENT CLEAN PARTIAL   (same)             -               faults
//!                   POISONED                 (same)             -               faults
//! Dirtied           CLEAN                    RESIDENT           freed (stale)   kept_freed
//! SwappedIn         SWAPPED PARTIAL          RESIDENT           taken by load   faults zswpin
//! SwappedInClean    SWAPPED                  CLEAN              kept            faults zswpin zswpin_kept
//! InAhead           SWAPPED                  CLEAN              kept            zswpin zswpin_kept swapin_ahead
//! PartIn            SWAPPED PARTIAL          PARTIAL            kept            faults partial_in
//! PartFilled        PARTIAL                  CLEAN              kept            faults zswpin zswpin_kept
//! Refaulted         PROBATION                RESIDENT           freed (stale)   faults probation_refault
//! RefaultedClean    PROBATION (kept)         CLEAN              kept            faults probation_refault
//! Poisoned          EMPTY SWAPPED PARTIAL    POISONED           freed (lost)    poisoned
//!                   PROBATION                POISONED           freed (lost)    poisoned
//! ToProbation       RESIDENT CLEAN           PROBATION          kept if CLEAN   probation_out
//! Stored            RESIDENT PROBATION       SWAPPED            set             zswpout
//! CleanEvicted      CLEAN PARTIAL            SWAPPED            kept            clean_evict
//!                   PROBATION (kept)         SWAPPED            kept            clean_evict
//! Refused           RESIDENT CLEAN PROBATION RESIDENT           freed (stale)   reject_reclaim_fail
//!                   PARTIAL                  PARTIAL            kept            reject_reclaim_fail
//! Dropped{unmap}    all but UNMAPPED         EMPTY / UNMAPPED   freed           invalidated
//! PartDropped       RESIDENT CLEAN           RESIDENT           freed           invalidated
//!                   SWAPPED PARTIAL          (same)             kept (marked)   -
//!                   PROBATION                PROBATION          freed           invalidated
//!                   EMPTY POISONED UNMAPPED  (same)             -               -
//!                   SHARED                   SHARED             -               -
//! ForkIn            SWAPPED PARTIAL          RESIDENT           taken by load   zswpin
//!                   PROBATION                RESIDENT           freed (stale)   -
//! ```
//!
//! `Dirtied` is also what the reclaimer records for a CLEAN folio whose bytes taken out
//! for a clean eviction differ from its copy's checksum (reclaim.rs
//! `changed_since_stored`, also counted `clean_changed`), and `SwappedIn` for a PARTIAL
//! one it was about to evict and found with a page no longer write-protected
//! (`still_protected`, `clean_unprotected`).
//!
//! The budget charges follow from the states alone: a folio in RESIDENT, CLEAN or
//! PROBATION is charged its size to `resident`, one in PROBATION also to `probation`,
//! and one in PARTIAL the pages it has mapped (its `placed` count, set by `PartIn`).
//! One in SHARED is charged nothing, and counted in `shared`.
//!
//! SHARED is fork without compression: a forked child takes over the pages its
//! parent had in place as they are, shared copy-on-write, write-protected (fork.rs).
//! They are the parent's pages, charged to the parent as a memory cgroup charges a
//! shared page to the process that faulted it first; the child's first touch of a
//! folio (a write, or a read of a page the parent never had) makes it the child's
//! (`Unshared`: charged, unprotected, the kernel copying a page on write). The
//! reclaimer releases SHARED folios the same way when the group needs room (the
//! parent cannot move out a page the child maps too), and then takes them out first
//! (reclaim.rs `release_shared`). A fork hold releases them too (a folio held for
//! fork must be writable).
//!
//! PARTIAL is partial swap-in, which none of the kernel's swap systems has: a read
//! fault at random in a SWAPPED folio maps only the compression unit around it
//! (`read_range` decodes just that unit), write-protected, and the store keeps the
//! whole folio. More read faults map more units (`PartIn`); a write, a fork or the
//! last unit brings the rest in (`PartFilled`, `SwappedIn`, `ForkIn`); eviction needs
//! no compression (`CleanEvicted`). A folio with missing pages never goes on
//! probation: its shadow would hold holes where its data is only in the store.
//!
//! A drop of part of a folio that is out (SWAPPED, PARTIAL: `PartDropped`) maps
//! nothing: the dropped pages stay marked (region.rs) and come in as zeros whenever the
//! folio does, and a folio with marks is never evicted. So the reader never fills a
//! folio to apply a drop: a fill fails (EAGAIN) while any other drop is queued, and a
//! thread dropping in a loop (an allocator purging) kept it from ever finishing one.
//! A PARTIAL folio stays charged the pages the drop unmapped until it next changes.
//! A munmap of part of a folio (UNMAP) is a `PartDropped` too, and leaves it *torn*
//! (region.rs, "Pages unmapped"): never taken out again, and brought in, protected or
//! poisoned only where it is still mapped; unmapped in pieces down to the last page,
//! it is `Dropped { unmap }` as if unmapped whole.
//! A transition that raises the charge may take it before its mechanism runs ([`Book::
//! reserve`], as a memory cgroup charges before it maps: faults see each other's
//! charges when they throttle); every other change is made when the transition is
//! recorded, after the mechanism (so usage falls only once the memory is free).
//!
//! The kept copy follows from the states too: `kept` is set exactly when the folio is
//! SWAPPED or CLEAN, or PROBATION having gone out clean ([`kept_allowed`]). A copy is
//! freed before the pages it describes can change: `Dirtied` is recorded *before* the
//! write protection is lifted, `Refaulted` and `Refused` after pages came back
//! writable but before the folio is unlocked, so nobody can see a stale copy.
//!
//! Everything here is lock-free and allocation-free (atomics, and the store's
//! `invalidate`), so the SIGBUS handler may record transitions.

use crate::stats::{bump, SizeCounters};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering::*};
use uzswap_store::Store;

pub(crate) const EMPTY: u8 = 0;
pub(crate) const RESIDENT: u8 = 1;
pub(crate) const SWAPPED: u8 = 2;
pub(crate) const PROBATION: u8 = 3;
pub(crate) const UNMAPPED: u8 = 4;
pub(crate) const BUSY: u8 = 5;
pub(crate) const CLEAN: u8 = 6;
/// The store could not give the folio back (an I/O error or a corrupt record in the
/// backing file) or it could not be mapped (an ioctl failed unexpectedly): its pages
/// hold poison markers (UFFDIO_POISON), so every access raises SIGBUS, as the kernel
/// does for a hardware memory error or a swap read error, rather than read wrong
/// bytes. Dropping the whole folio (MADV_DONTNEED, munmap) clears it.
pub(crate) const POISONED: u8 = 7;
/// In the store, part of it mapped as well (see the module comment).
pub(crate) const PARTIAL: u8 = 8;
/// In place, shared with the parent since fork, charged to it (see the module comment).
pub(crate) const SHARED: u8 = 9;

/// The recorded transitions; see the table in the module comment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transition {
    ZeroFilled,
    /// Filled with zeros with no fault, ahead of a program writing fresh memory in
    /// order (fault.rs `fill_ahead`).
    FilledAhead,
    /// Memory the program already had, taken over in place (`Runtime::adopt_region`).
    Adopted,
    /// A folio a forked child took over from its parent still swapped out: its record
    /// imported into the child's store (fork.rs).
    Carried,
    /// A folio a forked child took over with its pages in place, shared copy-on-write
    /// with its parent, write-protected (fork.rs).
    Shared,
    /// A SHARED folio made the child's own: touched, released by the reclaimer, or
    /// held for fork (write protection lifted; the coldest, with no stamp).
    Unshared,
    Touched,
    Dirtied,
    SwappedIn,
    SwappedInClean,
    /// Brought back with no fault, ahead of a sequential pass (fault.rs
    /// `swap_in_ahead`), as a read brings it: write-protected, its entry kept.
    InAhead,
    /// Some pages of a SWAPPED or PARTIAL folio mapped, protected: see [`Book::record_part`].
    PartIn,
    /// The rest of a PARTIAL folio mapped, protected: CLEAN now.
    PartFilled,
    Refaulted,
    RefaultedClean,
    Poisoned,
    ToProbation,
    Stored,
    CleanEvicted,
    Refused,
    Dropped { unmap: bool },
    PartDropped,
    ForkIn,
}

/// What a transition does to the kept copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copy {
    /// Left as it is.
    Keep,
    /// Freed if there is one; counted as going stale (`kept_freed`) ...
    FreeStale,
    /// ... as dropped with the mapping (`invalidated`) ...
    FreeDropped,
    /// ... or not at all (the data is lost; `poisoned` says so).
    FreeLost,
    /// A load already took the entry out of the store.
    Taken,
    /// A new entry was stored.
    Set,
}

/// One edge of the table: where it goes, what it does to the copy, what it counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Edge {
    pub next: u8,
    copy: Copy,
    counts: &'static [Counter],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Counter {
    Adopted,
    ForkCarried,
    ForkShared,
    ForkUnshared,
    Faults,
    ZeroFill,
    ZeroAhead,
    SwapinAhead,
    Zswpin,
    ZswpinKept,
    PartialIn,
    Zswpout,
    ProbationOut,
    ProbationRefault,
    CleanEvict,
    RejectReclaimFail,
    Poisoned,
}

impl Counter {
    fn of(self, st: &SizeCounters) -> &AtomicU64 {
        match self {
            Counter::Adopted => &st.adopted,
            Counter::ForkCarried => &st.fork_carried,
            Counter::ForkShared => &st.fork_shared,
            Counter::ForkUnshared => &st.fork_unshared,
            Counter::Faults => &st.faults,
            Counter::ZeroFill => &st.zero_fill,
            Counter::ZeroAhead => &st.zero_ahead,
            Counter::SwapinAhead => &st.swapin_ahead,
            Counter::Zswpin => &st.zswpin,
            Counter::ZswpinKept => &st.zswpin_kept,
            Counter::PartialIn => &st.partial_in,
            Counter::Zswpout => &st.zswpout,
            Counter::ProbationOut => &st.probation_out,
            Counter::ProbationRefault => &st.probation_refault,
            Counter::CleanEvict => &st.clean_evict,
            Counter::RejectReclaimFail => &st.reject_reclaim_fail,
            Counter::Poisoned => &st.poisoned,
        }
    }
}

/// The transition `t` from state `prev` (with `kept` as it is), or `None` if the
/// table has no such edge: a caller's bug, which callers treat as fatal.
pub(crate) fn edge(prev: u8, kept: bool, t: Transition) -> Option<Edge> {
    use Counter::*;
    use Transition as T;
    let e = |next, copy, counts| Some(Edge { next, copy, counts });
    match (t, prev) {
        (T::ZeroFilled, EMPTY) => e(RESIDENT, Copy::Keep, &[Faults, ZeroFill]),
        (T::FilledAhead, EMPTY) => e(RESIDENT, Copy::Keep, &[ZeroAhead]),
        (T::Adopted, EMPTY) => e(RESIDENT, Copy::Keep, &[Adopted]),
        (T::Carried, EMPTY) => e(SWAPPED, Copy::Set, &[ForkCarried]),
        (T::Shared, EMPTY) => e(SHARED, Copy::Keep, &[ForkShared]),
        (T::Unshared, SHARED) => e(RESIDENT, Copy::Keep, &[ForkUnshared]),
        (T::Touched, RESIDENT | CLEAN | PARTIAL | POISONED) => e(prev, Copy::Keep, &[Faults]),
        (T::Dirtied, CLEAN) => e(RESIDENT, Copy::FreeStale, &[]),
        (T::SwappedIn, SWAPPED | PARTIAL) => e(RESIDENT, Copy::Taken, &[Faults, Zswpin]),
        (T::SwappedInClean, SWAPPED) => e(CLEAN, Copy::Keep, &[Faults, Zswpin, ZswpinKept]),
        (T::InAhead, SWAPPED) => e(CLEAN, Copy::Keep, &[Zswpin, ZswpinKept, SwapinAhead]),
        (T::PartIn, SWAPPED | PARTIAL) => e(PARTIAL, Copy::Keep, &[Faults, PartialIn]),
        (T::PartFilled, PARTIAL) => e(CLEAN, Copy::Keep, &[Faults, Zswpin, ZswpinKept]),
        (T::Refaulted, PROBATION) => e(RESIDENT, Copy::FreeStale, &[Faults, ProbationRefault]),
        (T::RefaultedClean, PROBATION) if kept => e(CLEAN, Copy::Keep, &[Faults, ProbationRefault]),
        (T::Poisoned, EMPTY | SWAPPED | PARTIAL | PROBATION) => e(POISONED, Copy::FreeLost, &[Poisoned]),
        (T::ToProbation, RESIDENT | CLEAN) => e(PROBATION, Copy::Keep, &[ProbationOut]),
        (T::Stored, RESIDENT) => e(SWAPPED, Copy::Set, &[Zswpout]),
        (T::Stored, PROBATION) if !kept => e(SWAPPED, Copy::Set, &[Zswpout]),
        (T::CleanEvicted, CLEAN | PARTIAL) => e(SWAPPED, Copy::Keep, &[CleanEvict]),
        (T::CleanEvicted, PROBATION) if kept => e(SWAPPED, Copy::Keep, &[CleanEvict]),
        (T::Refused, RESIDENT | CLEAN | PROBATION) => e(RESIDENT, Copy::FreeStale, &[RejectReclaimFail]),
        // Its missing pages are only in the store: the copy stays, and the pages that
        // came back are protected again (reclaim.rs).
        (T::Refused, PARTIAL) => e(PARTIAL, Copy::Keep, &[RejectReclaimFail]),
        (T::Dropped { unmap }, s) if s != UNMAPPED && s != BUSY => {
            e(if unmap { UNMAPPED } else { EMPTY }, Copy::FreeDropped, &[])
        }
        (T::PartDropped, RESIDENT | CLEAN) => e(RESIDENT, Copy::FreeDropped, &[]),
        // The entry stays; the dropped pages stay marked (region.rs) and come in as
        // zeros. Nothing is mapped, so the reader never fills for a drop.
        (T::PartDropped, SWAPPED | PARTIAL) => e(prev, Copy::Keep, &[]),
        (T::PartDropped, PROBATION) => e(PROBATION, Copy::FreeDropped, &[]),
        (T::PartDropped, EMPTY | POISONED | UNMAPPED | SHARED) => e(prev, Copy::Keep, &[]),
        (T::ForkIn, SWAPPED | PARTIAL) => e(RESIDENT, Copy::Taken, &[Zswpin]),
        (T::ForkIn, PROBATION) => e(RESIDENT, Copy::FreeStale, &[]),
        _ => None,
    }
}

/// Whether a folio in `state` may have a kept copy (see the module comment).
pub(crate) fn kept_allowed(state: u8) -> bool {
    matches!(state, SWAPPED | CLEAN | PARTIAL | PROBATION)
}

/// Whether a folio in `state` has data out of place, which a fork hold (or any holder
/// of the folio that needs its bytes where the program sees them) brings back first.
pub(crate) fn out_of_place(state: u8) -> bool {
    matches!(state, SWAPPED | PARTIAL | PROBATION)
}

/// Whether bringing a folio in `state` back in place (or making a SHARED one the
/// process's own) adds to the budget's charge (what it lacks: a reservation is taken
/// first, as a memory cgroup charges before it maps): a PROBATION folio is charged
/// already, in the shadow.
pub(crate) fn charged_on_return(state: u8) -> bool {
    matches!(state, SWAPPED | PARTIAL | SHARED)
}

/// Whether a folio in `state` is charged its whole size to `resident`...
pub(crate) fn charged(state: u8) -> bool {
    matches!(state, RESIDENT | CLEAN | PROBATION)
}

/// Whether a folio in `state` has pages mapped in the region: the reclaimer's
/// candidates.
pub(crate) fn mapped(state: u8) -> bool {
    matches!(state, RESIDENT | CLEAN | PARTIAL)
}

/// ... and to `probation`.
fn on_probation(state: u8) -> bool {
    state == PROBATION
}

/// A region's folios: one state word, one kept flag and one count of pages mapped in
/// PARTIAL each.
pub(crate) struct Folios {
    states: Box<[AtomicU8]>,
    kept: Box<[AtomicBool]>,
    placed: Box<[AtomicU16]>,
    /// The CRC-32C of what the kept copy holds, where known (0: not known, as for a
    /// copy carried from the parent at fork): set by the reclaimer when it stores the
    /// folio, cleared with the copy. A clean eviction compares it with what it took
    /// out (reclaim.rs `changed_since_stored`).
    sums: Box<[AtomicU32]>,
}

impl Folios {
    pub fn new(n: usize) -> Folios {
        Folios {
            states: (0..n).map(|_| AtomicU8::new(EMPTY)).collect(),
            kept: (0..n).map(|_| AtomicBool::new(false)).collect(),
            placed: (0..n).map(|_| AtomicU16::new(0)).collect(),
            sums: (0..n).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// The checksum of the kept copy of a folio the caller has locked (0: not known).
    pub fn sum(&self, idx: usize) -> u32 {
        self.sums[idx].load(Relaxed)
    }

    /// Notes the checksum of the copy just stored for folio `idx` (locked, `Stored`).
    pub fn set_sum(&self, idx: usize, sum: u32) {
        self.sums[idx].store(sum, Relaxed);
    }

    /// Pages a PARTIAL folio (locked by the caller) has mapped, as last recorded.
    pub fn placed(&self, idx: usize) -> u16 {
        self.placed[idx].load(Relaxed)
    }

    pub fn len(&self) -> usize {
        self.states.len()
    }

    /// The state as last published (BUSY while locked): for scans, not decisions.
    pub fn peek(&self, idx: usize) -> u8 {
        self.states[idx].load(Relaxed)
    }

    /// The kept flag of a folio the caller has locked.
    pub fn kept(&self, idx: usize) -> bool {
        self.kept[idx].load(Relaxed)
    }

    pub fn try_lock(&self, idx: usize) -> Option<u8> {
        let s = self.states[idx].load(Acquire);
        if s == BUSY {
            return None;
        }
        self.states[idx].compare_exchange(s, BUSY, Acquire, Relaxed).ok()
    }

    /// Spins until the folio is unlocked, then locks it. Only for threads that the
    /// current holder never waits for (see the lock order in lib.rs). Async-signal-safe.
    pub fn lock(&self, idx: usize) -> u8 {
        let mut spins = 0u32;
        loop {
            if let Some(s) = self.try_lock(idx) {
                return s;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // SAFETY: sched_yield takes no arguments and is async-signal-safe.
                unsafe { libc::sched_yield() };
            }
        }
    }

    /// Unlocks a folio the caller locked, in `state`: its old state when nothing was
    /// recorded, or the `next` of the transitions recorded meanwhile.
    pub fn unlock(&self, idx: usize, state: u8) {
        debug_assert!(state != BUSY);
        debug_assert!(kept_allowed(state) || !self.kept(idx), "a kept copy in state {state}");
        self.states[idx].store(state, Release);
    }
}

/// The transitions in the order of their codes (`Transition::code`), by name.
const TRANSITION_NAMES: [&str; 24] = [
    "ZeroFilled", "FilledAhead", "Adopted", "Carried", "Touched", "Dirtied", "SwappedIn", "SwappedInClean", "InAhead",
    "PartIn", "PartFilled", "Refaulted", "RefaultedClean", "Poisoned", "ToProbation", "Stored", "CleanEvicted", "Refused",
    "Dropped", "Dropped (unmap)", "PartDropped", "ForkIn", "Shared", "Unshared",
];

impl Transition {
    /// A small number naming the transition, for the flight recorder (trace.rs).
    fn code(self) -> u8 {
        use Transition as T;
        match self {
            T::ZeroFilled => 0,
            T::FilledAhead => 1,
            T::Adopted => 2,
            T::Carried => 3,
            T::Touched => 4,
            T::Dirtied => 5,
            T::SwappedIn => 6,
            T::SwappedInClean => 7,
            T::InAhead => 8,
            T::PartIn => 9,
            T::PartFilled => 10,
            T::Refaulted => 11,
            T::RefaultedClean => 12,
            T::Poisoned => 13,
            T::ToProbation => 14,
            T::Stored => 15,
            T::CleanEvicted => 16,
            T::Refused => 17,
            T::Dropped { unmap: false } => 18,
            T::Dropped { unmap: true } => 19,
            T::PartDropped => 20,
            T::ForkIn => 21,
            T::Shared => 22,
            T::Unshared => 23,
        }
    }
}

/// The name of transition code `code` (`Transition::code`).
pub(crate) fn transition_name(code: u8) -> &'static str {
    TRANSITION_NAMES.get(usize::from(code)).copied().unwrap_or("?")
}

/// The name of state `s`.
pub(crate) fn state_name(s: u8) -> &'static str {
    ["EMPTY", "RESIDENT", "SWAPPED", "PROBATION", "UNMAPPED", "BUSY", "CLEAN", "POISONED", "PARTIAL", "SHARED"].get(usize::from(s)).copied().unwrap_or("?")
}

/// The budget's charges (`Shared` holds one for all regions of a runtime).
#[derive(Default)]
pub(crate) struct Charges {
    /// Bytes of folios in RESIDENT, CLEAN and PROBATION, and of charges reserved.
    pub resident: AtomicU64,
    /// Bytes of folios in PROBATION.
    pub probation: AtomicU64,
    /// Bytes of folios in SHARED (charged to the parent, not here).
    pub shared: AtomicU64,
    /// Bumped each time a charge is given back: the futex word faults past the throttle
    /// limit sleep on (`sleep_for_room`).
    room: AtomicU32,
    /// Faults sleeping on `room` (or about to): a free wakes one only if there are.
    sleepers: AtomicU32,
}

impl Charges {
    /// Takes `bytes` off `resident` and wakes one fault sleeping for room: one per
    /// folio freed, so that a folio's worth of room lets one fault in (waking all made
    /// them charge past the limit again and sleep again, 20% slower). Async-signal-safe.
    fn uncharge(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.resident.fetch_sub(bytes, Relaxed);
        // SeqCst against `sleep_for_room`: either it sees this bump (and the charge
        // given back, which comes before it), or we see its sleeper.
        self.room.fetch_add(1, SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            uzswap_sync::futex::wake(&self.room, 1);
        }
    }

    /// Wakes every fault sleeping for room: room came other than by a charge given back
    /// (the pool shrank, the limit moved), or waiting no longer helps (the reclaimer
    /// has nothing to evict, the process exits).
    pub fn wake_all(&self) {
        self.room.fetch_add(1, SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            uzswap_sync::futex::wake(&self.room, i32::MAX);
        }
    }

    /// Sleeps while `full()` holds, until a charge is given back, `wake_all` or
    /// `timeout`, whichever is first (it may also return early: callers look again).
    /// A futex wait: nothing allocated, no lock, bounded. Async-signal-safe.
    pub fn sleep_for_room(&self, timeout: std::time::Duration, full: impl Fn() -> bool) {
        self.sleepers.fetch_add(1, SeqCst);
        let seen = self.room.load(SeqCst);
        // Looked at after `seen`: a charge given back before it is seen here; one after
        // it changes the word, and the wait returns at once or is woken.
        if full() {
            uzswap_sync::futex::wait(&self.room, seen, Some(timeout));
        }
        self.sleepers.fetch_sub(1, SeqCst);
    }
}

/// A charge taken ahead of a transition (see [`Book::reserve`]).
#[must_use = "a reservation is consumed by `record` or given back by `release`"]
pub(crate) struct Reservation {
    bytes: u64,
}

/// Everything a transition of one region's folio touches.
pub(crate) struct Book<'a> {
    pub folios: &'a Folios,
    pub charges: &'a Charges,
    pub stats: &'a SizeCounters,
    pub store: &'a Store,
    /// The store key of folio 0: folio `idx` is kept under `key_base | idx`.
    pub key_base: u64,
    pub folio_bytes: u64,
}

impl Book<'_> {
    pub fn key(&self, idx: usize) -> u64 {
        self.key_base | idx as u64
    }

    /// Charges a folio now in `prev` for becoming resident, before the mechanism that
    /// brings it in: nothing if it is charged already, what it lacks if PARTIAL.
    pub fn reserve(&self, idx: usize, prev: u8) -> Reservation {
        self.reserve_bytes(self.folio_bytes - self.charge(idx, prev))
    }

    /// Charges `bytes` ahead of a `PartIn`.
    pub fn reserve_bytes(&self, bytes: u64) -> Reservation {
        self.charges.resident.fetch_add(bytes, Relaxed);
        Reservation { bytes }
    }

    /// What folio `idx` in `state` is charged to `resident` (module comment).
    fn charge(&self, idx: usize, state: u8) -> u64 {
        match state {
            PARTIAL => u64::from(self.folios.placed(idx)) * crate::fault::PAGE as u64,
            s if charged(s) => self.folio_bytes,
            _ => 0,
        }
    }

    /// Gives back a reservation whose transition did not happen.
    pub fn release(&self, res: Reservation) {
        self.charges.uncharge(res.bytes);
    }

    /// Records transition `t` of folio `idx` (locked by the caller, in state `prev`)
    /// after its mechanism succeeded, with the charge `res` taken for it if any, and
    /// returns the state to unlock with. Frees or takes over the kept copy, moves the
    /// charges and bumps the counters the table says. A transition the table does not
    /// have is a bug in the caller: it aborts rather than corrupt the accounting.
    pub fn record(&self, idx: usize, prev: u8, t: Transition, res: Option<Reservation>) -> u8 {
        debug_assert!(t != Transition::PartIn, "PartIn is recorded with record_part");
        self.record_placed(idx, prev, t, res, 0)
    }

    /// Records `PartIn`: folio `idx` (locked, SWAPPED or PARTIAL) now has `placed`
    /// pages mapped, charged as such.
    pub fn record_part(&self, idx: usize, prev: u8, placed: u16, res: Option<Reservation>) -> u8 {
        self.record_placed(idx, prev, Transition::PartIn, res, placed)
    }

    fn record_placed(&self, idx: usize, prev: u8, t: Transition, res: Option<Reservation>, placed: u16) -> u8 {
        let kept = self.folios.kept(idx);
        let Some(edge) = edge(prev, kept, t) else {
            crate::fault::fatal(b"uzswap: a folio transition the life cycle does not have\n")
        };
        match edge.copy {
            Copy::Keep => {}
            Copy::FreeStale => self.free_copy(idx, Some(&self.stats.kept_freed)),
            Copy::FreeDropped => self.free_copy(idx, Some(&self.stats.invalidated)),
            Copy::FreeLost => self.free_copy(idx, None),
            Copy::Taken => {
                self.folios.sums[idx].store(0, Relaxed);
                if self.folios.kept[idx].swap(false, Relaxed) {
                    self.stats.stored.fetch_sub(1, Relaxed);
                }
            }
            Copy::Set => {
                debug_assert!(!kept, "stored over a kept copy");
                self.folios.kept[idx].store(true, Relaxed);
                self.stats.stored.fetch_add(1, Relaxed);
            }
        }
        let bytes = self.folio_bytes;
        let reserved = res.map_or(0, |r| r.bytes);
        let had = self.charge(idx, prev) + reserved;
        // PartIn sets the count; other edges within PARTIAL (Touched, Refused) keep it.
        let placed = match (t, edge.next) {
            (Transition::PartIn, _) => placed,
            (_, PARTIAL) => self.folios.placed(idx),
            _ => 0,
        };
        self.folios.placed[idx].store(placed, Relaxed);
        let want = self.charge(idx, edge.next);
        if want > had {
            self.charges.resident.fetch_add(want - had, Relaxed);
        } else if had > want {
            self.charges.uncharge(had - want);
        }
        match (on_probation(prev), on_probation(edge.next)) {
            (false, true) => self.charges.probation.fetch_add(bytes, Relaxed),
            (true, false) => self.charges.probation.fetch_sub(bytes, Relaxed),
            _ => 0,
        };
        match (prev == SHARED, edge.next == SHARED) {
            (false, true) => self.charges.shared.fetch_add(bytes, Relaxed),
            (true, false) => self.charges.shared.fetch_sub(bytes, Relaxed),
            _ => 0,
        };
        for c in edge.counts {
            bump(c.of(self.stats));
        }
        crate::trace::note(self.key(idx), crate::trace::Event::Moved { from: prev, to: edge.next, t: t.code() });
        edge.next
    }

    fn free_copy(&self, idx: usize, why: Option<&AtomicU64>) {
        self.folios.sums[idx].store(0, Relaxed);
        if self.folios.kept[idx].swap(false, Relaxed) && self.store.invalidate(self.key(idx)) {
            self.stats.stored.fetch_sub(1, Relaxed);
            if let Some(c) = why {
                bump(c);
            }
        }
    }
}

#[cfg(test)]
mod tests;
