//! Deferred destruction of unlinked nodes and values, usable from a signal handler.
//!
//! The index is read and written on the runtime's SIGBUS path, inside a handler
//! that may have interrupted the program anywhere, its own malloc included. So the
//! operations a handler uses — pin, unpin, retire — allocate nothing, free nothing,
//! take no lock and wait for nobody; only [`Reclaim::try_reclaim`] frees, and the
//! index calls it from `insert`, which allocates anyway and so is never on that path.
//! (crossbeam-epoch, used before, registers a thread on its first pin, allocates when
//! a deferred bag fills, and frees whatever it collects on any pin.)
//!
//! # The scheme: two generations of striped reader counts
//!
//! A global generation `gen`, and per stripe (threads spread over cache lines) one
//! reader count per parity of `gen`.
//! - pin: read `gen`, count ourselves in for its parity, SeqCst fence, read `gen`
//!   again; if it moved, count ourselves out and retry (at most once per flip).
//! - unpin: count ourselves out (Release).
//! - retire: push the object onto the lock-free `pending` list, intrusively through
//!   its first word (every retired type starts with a [`Link`]), so it needs no memory.
//! - try_reclaim (one at a time, `try_lock`; callers that lose just go on): if no
//!   reader of the *previous* generation's parity is counted in, free the `waiting`
//!   list, move `pending` to `waiting`, and flip `gen`.
//!
//! Why it is safe. What `waiting` holds was unlinked, then retired, before the flip
//! to the current generation `g` (the flip follows the move, and the flip is a Release
//! that readers Acquire). A reader that can still hold one of those objects pinned
//! before that flip became visible to it, so with generation `g - 1` (readers of
//! `g - 2` and older were drained by an earlier reclaim before it could flip to `g`).
//! The SeqCst fences order each reader's count-in against the reclaimer's check: if
//! the reader's fence comes first, the check sees its count; if the check's comes
//! first, the reader's second read of `gen` sees the flip to `g` and it retries with
//! `g`. A count seen at zero (Acquire, against the readers' Release) therefore means
//! every reader of `g - 1` is gone, and so are its accesses. A reader that read a
//! stale `gen` and counts in late is only a transient count that delays a reclaim.
//!
//! Under loom the same code runs on loom's atomics (its fences model SeqCst), with one
//! stripe, and "freeing" poisons: the objects stay allocated until the index is
//! dropped, and `deref` of a poisoned one, or a second retire, fails the model.

use crate::stripe;
use crate::sync::{fence, AtomicUsize, Mutex, Ordering::*};
use crossbeam_utils::CachePadded;

/// The first field of every retirable allocation (`#[repr(C)]`): its next pointer
/// while it sits on a retired list, tagged with its kind in the low two bits.
#[derive(Default)]
pub(crate) struct Link(AtomicUsize);

impl Link {
    pub(crate) fn new() -> Self {
        Link(AtomicUsize::new(0))
    }
}

/// Reader counts are spread over the index's write-counter stripes.
use crate::STRIPES;

/// Kind tags a retired pointer carries in its low bits (retired types align to 8).
pub(crate) const KIND_BITS: usize = 0b11;

pub(crate) struct Reclaim {
    gen: AtomicUsize,
    /// Per stripe, readers pinned under each parity of `gen`.
    readers: Box<[CachePadded<[AtomicUsize; 2]>]>,
    /// Retired since the last flip: a push-only stack, taken whole by a reclaim.
    pending: AtomicUsize,
    /// Retired before the last flip, freed by the first reclaim that finds the
    /// previous generation drained. The lock also makes reclaims one at a time.
    waiting: Mutex<usize>,
    /// Whether `waiting` holds anything (read without its lock).
    waiting_some: AtomicUsize,
    #[cfg(loom)]
    poisoned: std::sync::Mutex<Vec<usize>>,
}

pub(crate) struct Guard<'r> {
    count: &'r AtomicUsize,
    #[cfg(loom)]
    reclaim: &'r Reclaim,
}


impl Reclaim {
    pub(crate) fn new() -> Self {
        Reclaim {
            gen: AtomicUsize::new(0),
            readers: (0..STRIPES).map(|_| CachePadded::new([AtomicUsize::new(0), AtomicUsize::new(0)])).collect(),
            pending: AtomicUsize::new(0),
            waiting: Mutex::new(0),
            waiting_some: AtomicUsize::new(0),
            #[cfg(loom)]
            poisoned: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Protects everything loaded from now until the guard drops. Allocation-free,
    /// lock-free; retries only when a reclaim flips the generation meanwhile.
    #[inline]
    pub(crate) fn pin(&self) -> Guard<'_> {
        let counts = &self.readers[stripe()];
        loop {
            let g = self.gen.load(Acquire);
            let count = &counts[g & 1];
            count.fetch_add(1, Relaxed);
            fence(SeqCst);
            if self.gen.load(Acquire) == g {
                #[cfg(loom)]
                return Guard { count, reclaim: self };
                #[cfg(not(loom))]
                return Guard { count };
            }
            count.fetch_sub(1, Release);
        }
    }

    /// Schedules `tagged` (a pointer to an allocation that starts with `link`, with
    /// its kind in the low bits) for destruction. Allocation-free, lock-free.
    ///
    /// # Safety
    /// The object is unreachable for anyone who pins from now on, is retired once,
    /// and `link` is its own first field.
    pub(crate) unsafe fn retire(&self, tagged: usize, link: &Link) {
        #[cfg(loom)]
        {
            let addr = tagged & !KIND_BITS;
            assert!(!self.poisoned.lock().unwrap().contains(&addr), "retired after free: {addr:#x}");
        }
        let mut head = self.pending.load(Relaxed);
        loop {
            link.0.store(head, Relaxed);
            match self.pending.compare_exchange_weak(head, tagged, Release, Relaxed) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Whether anything waits to be freed (a cheap check before `try_reclaim`).
    pub(crate) fn has_retired(&self) -> bool {
        self.pending.load(Relaxed) != 0 || self.waiting_some.load(Relaxed) != 0
    }

    /// Frees what is past its grace period, through `destroy(tagged)`, if no other
    /// reclaim is running and the previous generation's readers are gone; else does
    /// nothing. Frees, so never call it on a signal handler's path.
    pub(crate) fn try_reclaim(&self, mut destroy: impl FnMut(usize)) {
        let Ok(mut waiting) = self.waiting.try_lock() else { return };
        let g = self.gen.load(Relaxed);
        fence(SeqCst);
        if self.readers.iter().any(|counts| counts[(g + 1) & 1].load(Acquire) != 0) {
            return;
        }
        self.free_list(std::mem::take(&mut *waiting), &mut destroy);
        *waiting = self.pending.swap(0, Acquire);
        self.waiting_some.store((*waiting != 0) as usize, Relaxed);
        self.gen.store(g + 1, Release);
    }

    /// Frees every retired object: the caller has the index exclusively (drop).
    pub(crate) fn reclaim_all(&mut self, mut destroy: impl FnMut(usize)) {
        let waiting = match self.waiting.lock() {
            Ok(mut w) => std::mem::take(&mut *w),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        self.free_list(waiting, &mut destroy);
        let pending = self.pending.swap(0, Acquire);
        self.free_list(pending, &mut destroy);
        #[cfg(loom)]
        for addr in std::mem::take(&mut *self.poisoned.lock().unwrap()) {
            destroy(addr);
        }
    }

    fn free_list(&self, mut tagged: usize, destroy: &mut impl FnMut(usize)) {
        while tagged != 0 {
            // SAFETY: a retired object starts with its Link and stays allocated until
            // `destroy` below; reading its link first keeps the walk valid.
            let next = unsafe { &*((tagged & !KIND_BITS) as *const Link) }.0.load(Relaxed);
            #[cfg(not(loom))]
            destroy(tagged);
            #[cfg(loom)]
            {
                let _ = &destroy;
                self.poisoned.lock().unwrap().push(tagged);
            }
            tagged = next;
        }
    }
}

impl Guard<'_> {
    /// # Safety
    /// `ptr` was loaded while this guard was alive and was valid then.
    #[inline]
    pub(crate) unsafe fn deref<T>(&self, ptr: *mut T) -> &T {
        #[cfg(loom)]
        {
            let addr = ptr as usize;
            let poisoned = self.reclaim.poisoned.lock().unwrap();
            assert!(!poisoned.iter().any(|&t| t & !KIND_BITS == addr), "use after free of {ptr:p}");
        }
        &*ptr
    }
}

impl Drop for Guard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.count.fetch_sub(1, Release);
    }
}
