//! uzswap's locks: [`Mutex`], [`RwLock`] and [`Condvar`] are std's, which on Linux are
//! one futex word each, under an API that does not poison (a panic while a lock is
//! held is reported where it happens; the state is used as it is, as the kernel's
//! locks do).
//!
//! What it is for: every lock of the runtime and of the layers under it (pool,
//! backing file, store), because of fork(2). A lock must come out of a fork sound in
//! the child, which starts a runtime of its own while the parent's threads, some of
//! them waiting on a lock at that moment, do not exist there:
//! - a futex lock keeps its waiters in the kernel, keyed by the lock word. fork copies
//!   the word and no waiter: a lock made in the child is as new, and one copied from
//!   the parent is at worst marked contended (one spare wake);
//! - parking_lot, which uzswap used before, keeps every waiter of every lock in one
//!   process-wide table whose entries point into the waiting threads' stacks. The child
//!   inherits the table with the parent's waiters in it; glibc gives the child's new
//!   threads the dead threads' stacks, so a new thread's entry overwrites a ghost's in
//!   place and the queue of that bucket breaks: a waiter of an unrelated, new lock is
//!   never woken. Measured: four threads parked on a parking_lot mutex at fork, four
//!   new threads in the child taking 64 new mutexes: the child hung in 2 runs of 10
//!   (std's: 0 of 30); the runtime's fork tests hung the same way (a child's reclaimer
//!   parked for ever on a lock with no owner). `tests/fork.rs` keeps this.
//!
//! std's locks also allocate nothing to wait, where parking_lot's first wait on a thread
//! allocates that thread's entry: the fault path's few locks relied on that already.
//!
//! [`Freeze`] is the one lock of its own here: held shared by many, frozen by one without
//! a guard, for a fork's freeze of the store (frozen in fork's prepare, thawed after it
//! in the parent), which std's rwlock cannot do (its write guard must be dropped to
//! unlock, and cannot be kept across the return from a fork handler). Its waits block;
//! the runtime's `gate` spins instead, for the shim's allocator, and lets a maker leave
//! on another thread.
//!
//! [`futex`] is a bare wait and wake on a word, for the few waits a signal handler may
//! make (bounded by a timeout, nothing to unlock).
//!
//! What it is not: the rule for which of these a signal handler may take. That is the
//! runtime's (its fault module's comment): only locks the code it interrupted cannot be
//! holding, held briefly by whoever holds them.

pub mod futex;

use std::sync::{LockResult, TryLockError, TryLockResult};

pub use std::sync::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

/// The guard of a lock whose holder panicked: the state as it was left.
fn unpoison<G>(r: LockResult<G>) -> G {
    r.unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn try_unpoison<G>(r: TryLockResult<G>) -> Option<G> {
    match r {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// A mutual exclusion lock: std's, without poisoning.
#[derive(Debug, Default)]
pub struct Mutex<T: ?Sized>(std::sync::Mutex<T>);

impl<T> Mutex<T> {
    pub const fn new(value: T) -> Self {
        Mutex(std::sync::Mutex::new(value))
    }

    pub fn into_inner(self) -> T {
        unpoison(self.0.into_inner())
    }
}

impl<T: ?Sized> Mutex<T> {
    pub fn lock(&self) -> MutexGuard<'_, T> {
        unpoison(self.0.lock())
    }

    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        try_unpoison(self.0.try_lock())
    }

    pub fn get_mut(&mut self) -> &mut T {
        unpoison(self.0.get_mut())
    }
}

/// A reader-writer lock: std's, without poisoning.
#[derive(Debug, Default)]
pub struct RwLock<T: ?Sized>(std::sync::RwLock<T>);

impl<T> RwLock<T> {
    pub const fn new(value: T) -> Self {
        RwLock(std::sync::RwLock::new(value))
    }
}

impl<T: ?Sized> RwLock<T> {
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        unpoison(self.0.read())
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        unpoison(self.0.write())
    }

    pub fn try_read(&self) -> Option<RwLockReadGuard<'_, T>> {
        try_unpoison(self.0.try_read())
    }

    pub fn try_write(&self) -> Option<RwLockWriteGuard<'_, T>> {
        try_unpoison(self.0.try_write())
    }
}

/// A condition variable for [`Mutex`]: std's, without poisoning.
#[derive(Debug, Default)]
pub struct Condvar(std::sync::Condvar);

impl Condvar {
    pub const fn new() -> Self {
        Condvar(std::sync::Condvar::new())
    }

    /// Waits for a notification, the lock released meanwhile (wakes may be spurious:
    /// the caller checks its condition in a loop).
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        unpoison(self.0.wait(guard))
    }

    pub fn notify_one(&self) {
        self.0.notify_one()
    }

    pub fn notify_all(&self) {
        self.0.notify_all()
    }
}

/// What [`Freeze`] is built on: std's, or loom's in the model.
mod imp {
    #[cfg(loom)]
    pub(crate) use loom::sync::{Condvar, Mutex};
    #[cfg(not(loom))]
    pub(crate) use std::sync::{Condvar, Mutex};
}

/// A lock held by many at once ([`Freeze::hold`]) and frozen by one ([`Freeze::freeze`]:
/// turns away new holds until [`Freeze::thaw`], and waits for those held to end).
/// Freezing is not a guard, so it may last across a return (a fork's prepare handler to
/// its parent handler). A freeze goes before holds (no hold starts while a freeze
/// waits), so a thread must not hold twice at once: it could wait for itself.
#[derive(Debug)]
pub struct Freeze {
    state: imp::Mutex<FreezeState>,
    changed: imp::Condvar,
}

#[derive(Debug, Default)]
struct FreezeState {
    held: usize,
    frozen: bool,
}

/// One hold of a [`Freeze`]: no freeze completes until it is dropped.
#[must_use = "the hold ends when dropped"]
pub struct Held<'a>(&'a Freeze);

impl Default for Freeze {
    fn default() -> Self {
        Self::new()
    }
}

impl Freeze {
    pub fn new() -> Self {
        Freeze { state: imp::Mutex::new(FreezeState::default()), changed: imp::Condvar::new() }
    }

    /// Waits while frozen (or while a freeze waits), then holds.
    pub fn hold(&self) -> Held<'_> {
        let mut s = unpoison(self.state.lock());
        while s.frozen {
            s = unpoison(self.changed.wait(s));
        }
        s.held += 1;
        Held(self)
    }

    /// Freezes: at once for new holds, then waits for the holds under way to end. A
    /// second freeze waits for the first's thaw.
    pub fn freeze(&self) {
        let mut s = unpoison(self.state.lock());
        while s.frozen {
            s = unpoison(self.changed.wait(s));
        }
        s.frozen = true;
        while s.held > 0 {
            s = unpoison(self.changed.wait(s));
        }
    }

    /// Ends a [`Freeze::freeze`]. Panics if not frozen: a thaw without its freeze is a
    /// bug the caller must hear of.
    pub fn thaw(&self) {
        let mut s = unpoison(self.state.lock());
        assert!(s.frozen, "uzswap_sync::Freeze::thaw without a freeze");
        s.frozen = false;
        drop(s);
        self.changed.notify_all();
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut s = unpoison(self.0.state.lock());
        s.held -= 1;
        let last = s.held == 0 && s.frozen;
        drop(s);
        if last {
            self.0.changed.notify_all();
        }
    }
}

/// The model: a freeze never overlaps a hold, and nothing waits for ever.
#[cfg(all(test, loom))]
mod loom_freeze {
    use super::Freeze;
    use loom::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use loom::sync::Arc;

    #[test]
    fn loom_a_freeze_never_overlaps_a_hold() {
        loom::model(|| {
            let lock = Arc::new(Freeze::new());
            let inside = Arc::new(AtomicUsize::new(0));
            let passers: Vec<_> = (0..2)
                .map(|_| {
                    let (lock, inside) = (lock.clone(), inside.clone());
                    loom::thread::spawn(move || {
                        let _held = lock.hold();
                        inside.fetch_add(1, SeqCst);
                        inside.fetch_sub(1, SeqCst);
                    })
                })
                .collect();
            lock.freeze();
            assert_eq!(inside.load(SeqCst), 0, "held while frozen");
            lock.thaw();
            for p in passers {
                p.join().unwrap();
            }
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_panic_under_the_lock_leaves_the_state_usable() {
        let m = Arc::new(Mutex::new(1));
        let r = Arc::new(RwLock::new(1));
        let (m2, r2) = (m.clone(), r.clone());
        let joined = std::thread::spawn(move || {
            let _g = m2.lock();
            let _w = r2.write();
            panic!("held");
        })
        .join();
        assert!(joined.is_err());
        *m.lock() += 1;
        assert_eq!(*m.try_lock().unwrap(), 2);
        assert_eq!(*r.read(), 1);
        *r.try_write().unwrap() += 1;
        assert_eq!(*r.try_read().unwrap(), 2);
    }

    #[test]
    fn threads_hammering_one_mutex_and_condvar_lose_no_update() {
        const THREADS: usize = 4;
        const EACH: usize = 20_000;
        let shared = Arc::new((Mutex::new(0usize), Condvar::new()));
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                let s = shared.clone();
                std::thread::spawn(move || {
                    for _ in 0..EACH {
                        *s.0.lock() += 1;
                        s.1.notify_all();
                    }
                })
            })
            .collect();
        let mut n = shared.0.lock();
        while *n < THREADS * EACH {
            n = shared.1.wait(n);
        }
        drop(n);
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(*shared.0.lock(), THREADS * EACH);
    }

    /// Threads hold while one freezes and thaws again and again: no hold is under way
    /// while frozen, and every hold and freeze gets through.
    #[test]
    fn threads_holding_while_one_freezes_never_overlap_a_freeze() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
        let lock = Arc::new(Freeze::new());
        let frozen = Arc::new(AtomicBool::new(false));
        let holds = Arc::new(AtomicUsize::new(0));
        let holders: Vec<_> = (0..3)
            .map(|_| {
                let (lock, frozen, holds) = (lock.clone(), frozen.clone(), holds.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let _held = lock.hold();
                        assert!(!frozen.load(SeqCst), "held while frozen");
                        holds.fetch_add(1, SeqCst);
                    }
                })
            })
            .collect();
        for _ in 0..2_000 {
            lock.freeze();
            frozen.store(true, SeqCst);
            std::hint::spin_loop();
            frozen.store(false, SeqCst);
            lock.thaw();
        }
        for h in holders {
            h.join().unwrap();
        }
        assert_eq!(holds.load(SeqCst), 3 * 20_000);
    }

    #[test]
    #[should_panic(expected = "thaw without a freeze")]
    fn a_thaw_without_a_freeze_is_refused() {
        Freeze::new().thaw();
    }
}
