//! The move gate: the reader reads no userfaultfd event while pages move into or out
//! of a region anywhere but on the reader (the reclaimer's take-outs, a SIGBUS
//! handler's fills).
//!
//! Why: once the reader has read a MADV_DONTNEED (REMOVE) event, the kernel zaps the
//! pages whenever the dropping thread next runs. A take-out racing that zap was seen
//! to spin in the kernel; a fill that looked for the drop's pending marks before the
//! read and copies after the zap maps the old bytes after madvise returned. Under the
//! gate, a move either sees the reader's read (it does not begin, and retries later)
//! or the reader waits for it to end before reading, and then its UFFDIO_COPY or MOVE
//! fails with EAGAIN from the moment the kernel queued the event: so a mover must
//! never wait for EAGAIN while inside.
//!
//! Two words, Dekker's way: the reader raises `closed` then reads `moves`; a mover
//! raises `moves` then reads `closed`; with a SeqCst fence between each one's store
//! and load, one of them sees the other (SeqCst operations alone would do in the
//! language's model, but loom, which checks this, models them as AcqRel and finds
//! the interleaving where neither sees the other). A loom model checks it
//! (`RUSTFLAGS="--cfg loom" cargo test -p uzswap-runtime --lib --release loom`).

#[cfg(loom)]
use loom::sync::atomic::{fence, AtomicBool, AtomicUsize};
use std::sync::atomic::Ordering::SeqCst;
#[cfg(not(loom))]
use std::sync::atomic::{fence, AtomicBool, AtomicUsize};

#[derive(Default)]
pub(crate) struct MoveGate {
    /// The reader is reading messages, or holds REMOVE ranges it has read but not
    /// processed.
    closed: AtomicBool,
    /// Moves under way.
    moves: AtomicUsize,
}

impl MoveGate {
    /// A mover enters; false if the gate is closed (nothing may move now: retry
    /// later). Pair a true with [`MoveGate::end`].
    pub fn begin(&self) -> bool {
        self.moves.fetch_add(1, SeqCst);
        fence(SeqCst);
        if self.closed.load(SeqCst) {
            self.moves.fetch_sub(1, SeqCst);
            return false;
        }
        true
    }

    pub fn end(&self) {
        self.moves.fetch_sub(1, SeqCst);
    }

    /// The reader, before it reads: closes the gate and waits for the moves under way
    /// (none of which waits for the reader, so the wait is short).
    pub fn close_and_drain(&self) {
        self.closed.store(true, SeqCst);
        fence(SeqCst);
        while self.moves.load(SeqCst) != 0 {
            relax();
        }
    }

    /// The reader, after reading or processing: the gate stays closed while it holds
    /// REMOVE ranges not yet processed.
    pub fn set_closed(&self, closed: bool) {
        self.closed.store(closed, SeqCst);
    }
}

fn relax() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}

#[cfg(loom)]
mod loom_model {
    use super::*;
    use loom::sync::Arc;

    /// A mover and the reader: the mover's moment inside the gate (where it looks for
    /// pending marks and copies) never overlaps the reader's read of an event and its
    /// marking of the pages.
    #[test]
    fn loom_no_move_overlaps_a_read() {
        loom::model(|| {
            let gate = Arc::new(MoveGate::default());
            let reading = Arc::new(AtomicBool::new(false));
            let mover = {
                let (gate, reading) = (gate.clone(), reading.clone());
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        if gate.begin() {
                            assert!(!reading.load(SeqCst), "a move inside the gate during a read");
                            gate.end();
                        }
                    }
                })
            };
            gate.close_and_drain();
            reading.store(true, SeqCst);
            reading.store(false, SeqCst);
            gate.set_closed(false);
            mover.join().unwrap();
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    /// Movers on three threads and a reader closing and opening the gate: no mover is
    /// ever inside while the reader reads, and the count ends at zero.
    #[test]
    fn movers_never_meet_a_read() {
        use std::sync::atomic::AtomicU64;
        let gate = Arc::new(MoveGate::default());
        let reading = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let inside = Arc::new(AtomicU64::new(0));
        let movers: Vec<_> = (0..3)
            .map(|_| {
                let (gate, reading, stop, inside) = (gate.clone(), reading.clone(), stop.clone(), inside.clone());
                std::thread::spawn(move || {
                    while !stop.load(SeqCst) {
                        if gate.begin() {
                            assert!(!reading.load(SeqCst), "a move inside the gate during a read");
                            inside.fetch_add(1, SeqCst);
                            gate.end();
                        }
                    }
                })
            })
            .collect();
        // Reads until the movers have been in often, between them.
        let mut reads = 0;
        while reads < 20_000 || inside.load(SeqCst) < 10_000 {
            gate.close_and_drain();
            reading.store(true, SeqCst);
            reading.store(false, SeqCst);
            gate.set_closed(false);
            reads += 1;
        }
        stop.store(true, SeqCst);
        for m in movers {
            m.join().unwrap();
        }
        assert_eq!(gate.moves.load(SeqCst), 0);
    }
}
