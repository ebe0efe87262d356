//! A gate between many *makers* and one *excluder*: while the excluder holds it closed,
//! no maker is inside and none can enter. The shim's use: uzswap's own mappings are
//! made inside the gate (between the mmap and its record), and the scan that adopts
//! the program's memory closes it from its last look at a range to the range's
//! registration, so that no mapping of uzswap's can appear in the range meanwhile
//! (shim own.rs and cover.rs).
//!
//! Not a lock around data: makers run side by side, and a maker may leave on another
//! thread than the one that entered (a new thread ends the mark its creator made for
//! its stack). Waits spin and yield: nothing here allocates, so it is usable from the
//! shim's allocator and before the runtime exists. The excluder waits for makers that
//! got in first to leave, so a maker must never wait for the excluder while inside.
//!
//! A maker that has other work may only try (`try_enter`), and a gate may be closed for
//! good (`close_for_good`): the reclaimer and the process's exit (runtime reclaim.rs).
//!
//! A loom model checks the protocol
//! (`RUSTFLAGS="--cfg loom" cargo test -p uzswap-runtime --lib --release loom`).

#[cfg(loom)]
use loom::sync::atomic::AtomicUsize;
#[cfg(not(loom))]
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::SeqCst;

/// One word: the makers inside, and the closed flag in the top bit. A single word, so
/// that "enter unless closed" and "close, then count who is inside" are each one
/// read-modify-write on it, totally ordered (two words would need a store-load
/// fence between them, Dekker's way).
pub struct Gate {
    state: AtomicUsize,
}

const CLOSED: usize = 1 << (usize::BITS - 1);

fn relax() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}

impl Gate {
    #[cfg(not(loom))]
    pub const fn new() -> Gate {
        Gate { state: AtomicUsize::new(0) }
    }
    #[cfg(loom)]
    pub fn new() -> Gate {
        Gate { state: AtomicUsize::new(0) }
    }

    /// Enters as a maker, waiting while the gate is closed. Pair with [`Gate::leave`].
    pub fn enter(&self) {
        let mut s = self.state.load(SeqCst);
        loop {
            if s & CLOSED != 0 {
                relax();
                s = self.state.load(SeqCst);
                continue;
            }
            match self.state.compare_exchange_weak(s, s + 1, SeqCst, SeqCst) {
                Ok(_) => return,
                Err(now) => s = now,
            }
        }
    }

    /// Enters as a maker unless the gate is closed (then false, and not inside). For a
    /// maker that has other work than waiting: the reclaimer, whose gate exit closes
    /// for good (`Runtime::hold_reclaim_for_exit`).
    pub fn try_enter(&self) -> bool {
        let mut s = self.state.load(SeqCst);
        loop {
            if s & CLOSED != 0 {
                return false;
            }
            match self.state.compare_exchange_weak(s, s + 1, SeqCst, SeqCst) {
                Ok(_) => return true,
                Err(now) => s = now,
            }
        }
    }

    /// Leaves as a maker (on any thread).
    pub fn leave(&self) {
        self.state.fetch_sub(1, SeqCst);
    }

    /// Whether the gate is closed: a maker inside that sees it should leave soon.
    pub fn closing(&self) -> bool {
        self.state.load(SeqCst) & CLOSED != 0
    }

    /// Whether a maker is inside.
    pub fn busy(&self) -> bool {
        self.state.load(SeqCst) & !CLOSED != 0
    }

    /// Closes the gate and waits for the makers inside to leave; it opens again when
    /// the result drops. One excluder at a time.
    pub fn close(&self) -> Closed<'_> {
        let was = self.state.fetch_or(CLOSED, SeqCst);
        debug_assert!(was & CLOSED == 0, "one excluder at a time");
        while self.state.load(SeqCst) & !CLOSED != 0 {
            relax();
        }
        Closed(self)
    }

    /// Closes the gate and waits for the makers inside to leave; it never opens again.
    pub fn close_for_good(&self) {
        std::mem::forget(self.close());
    }

    /// After fork, in the child: makers and an excluder of the parent's other threads
    /// will never leave (those threads are not here).
    pub fn reset_in_child(&self) {
        self.state.store(0, SeqCst);
    }
}

#[cfg(not(loom))]
impl Default for Gate {
    fn default() -> Gate {
        Gate::new()
    }
}

/// The gate held closed; opens on drop.
pub struct Closed<'a>(&'a Gate);

impl Drop for Closed<'_> {
    fn drop(&mut self) {
        self.0.state.fetch_and(!CLOSED, SeqCst);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
    use std::sync::Arc;

    /// Makers on three threads, one of them leaving on a thread of its own, and an
    /// excluder: while it holds the gate closed, no maker is inside, and what makers
    /// record inside does not change.
    #[test]
    fn makers_and_an_excluder_hammer() {
        let gate = Arc::new(Gate::new());
        let made = Arc::new(AtomicU64::new(0));
        let inside = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let makers: Vec<_> = (0..3)
            .map(|t| {
                let (gate, made, inside, stop) = (gate.clone(), made.clone(), inside.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Relaxed) {
                        gate.enter();
                        inside.fetch_add(1, SeqCst);
                        made.fetch_add(1, SeqCst);
                        inside.fetch_sub(1, SeqCst);
                        if t == 2 {
                            // Left by another thread, as a new thread ends its creator's mark.
                            let g = gate.clone();
                            std::thread::spawn(move || g.leave()).join().unwrap();
                        } else {
                            gate.leave();
                        }
                    }
                })
            })
            .collect();
        for _ in 0..2000 {
            let closed = gate.close();
            assert_eq!(inside.load(SeqCst), 0, "a maker inside a closed gate");
            let before = made.load(SeqCst);
            std::thread::yield_now();
            assert_eq!(made.load(SeqCst), before, "a maker got in while closed");
            drop(closed);
            std::thread::yield_now();
        }
        stop.store(true, Relaxed);
        for m in makers {
            m.join().unwrap();
        }
        assert!(!gate.busy());
        assert!(made.load(SeqCst) > 0);
    }

    /// Makers that try and do other work when refused (as the reclaimer does), and one
    /// close for good: once it returns no maker is inside and none gets in again.
    #[test]
    fn trying_makers_and_a_close_for_good_hammer() {
        for _ in 0..200 {
            let gate = Arc::new(Gate::new());
            let (made, inside, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
            let makers: Vec<_> = (0..2)
                .map(|_| {
                    let (gate, made, inside, refused) = (gate.clone(), made.clone(), inside.clone(), refused.clone());
                    std::thread::spawn(move || {
                        while refused.load(SeqCst) < 100 {
                            if gate.try_enter() {
                                inside.fetch_add(1, SeqCst);
                                made.fetch_add(1, SeqCst);
                                inside.fetch_sub(1, SeqCst);
                                gate.leave();
                            } else {
                                refused.fetch_add(1, SeqCst);
                            }
                        }
                    })
                })
                .collect();
            while made.load(SeqCst) == 0 {
                std::thread::yield_now();
            }
            gate.close_for_good();
            assert_eq!(inside.load(SeqCst), 0, "a maker inside a closed gate");
            let before = made.load(SeqCst);
            for m in makers {
                m.join().unwrap();
            }
            assert_eq!(made.load(SeqCst), before, "a maker got in after the close");
        }
    }
}

#[cfg(loom)]
mod loom_model {
    use super::*;
    use loom::sync::Arc;
    use std::sync::atomic::Ordering::SeqCst;

    /// A maker and the excluder: the excluder never sees the maker's work half done,
    /// and both always finish.
    #[test]
    fn loom_excluder_sees_no_maker_inside() {
        loom::model(|| {
            let gate = Arc::new(Gate::new());
            let work = Arc::new(loom::sync::atomic::AtomicUsize::new(0));
            let maker = {
                let (gate, work) = (gate.clone(), work.clone());
                loom::thread::spawn(move || {
                    gate.enter();
                    work.fetch_add(1, SeqCst);
                    work.fetch_add(1, SeqCst);
                    gate.leave();
                })
            };
            {
                let _closed = gate.close();
                let w = work.load(SeqCst);
                assert!(w == 0 || w == 2, "the maker was inside: {w}");
                assert_eq!(work.load(SeqCst), w);
            }
            maker.join().unwrap();
            assert!(!gate.busy());
        });
    }

    /// A maker that tries, and a close for good: once the close returns the maker is
    /// not inside, its work is whole, and it never gets in after.
    #[test]
    fn loom_close_for_good_keeps_a_trying_maker_out() {
        loom::model(|| {
            let gate = Arc::new(Gate::new());
            let work = Arc::new(loom::sync::atomic::AtomicUsize::new(0));
            let maker = {
                let (gate, work) = (gate.clone(), work.clone());
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        if gate.try_enter() {
                            work.fetch_add(1, SeqCst);
                            work.fetch_add(1, SeqCst);
                            gate.leave();
                        }
                    }
                })
            };
            gate.close_for_good();
            let w = work.load(SeqCst);
            assert!(w % 2 == 0, "the maker was inside: {w}");
            maker.join().unwrap();
            assert_eq!(work.load(SeqCst), w, "the maker got in after the close");
        });
    }
}
