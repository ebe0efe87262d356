//! The move gate: the reader reads no userfaultfd event while pages move into or out
//! of a region anywhere but on the reader (the reclaimer's take-outs, fills of a folio
//! by a SIGBUS handler or a fork or kernel-access hold).
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
//! Take-outs stay out until the reader has *processed* the REMOVE ranges it read
//! (`closed`), and marked the pages of the UNMAPs it read as gone (a take-out of a
//! torn folio would move what the program maps there next: region.rs); fills only
//! until it has *marked* their pages (`reading`), which it does at once: a fill then
//! sees the marks and maps zeros there. So a fill never waits for
//! a range the reader cannot finish, e.g. one over a folio a fork hold keeps locked.
//! A new region goes into the fault table on the fill side too (lib.rs `install`):
//! an unmap read before is marked on the regions that were there, never on it.
//!
//! Dekker's way: the reader raises `closed` and `reading`, then reads `moves`; a mover
//! raises `moves`, then reads `closed` (a fill, `reading`); with a SeqCst fence
//! between each one's store and load, one of them sees the other (SeqCst operations
//! alone would do in the language's model, but loom, which checks this, models them
//! as AcqRel and finds the interleaving where neither sees the other). A loom model checks it
//! (`RUSTFLAGS="--cfg loom" cargo test -p uzswap-runtime --lib --release loom`).

#[cfg(loom)]
use loom::sync::atomic::{fence, AtomicBool, AtomicUsize};
use std::sync::atomic::Ordering::SeqCst;
#[cfg(not(loom))]
use std::sync::atomic::{fence, AtomicBool, AtomicUsize};

#[derive(Default)]
pub(crate) struct MoveGate {
    /// The reader is reading messages, or holds REMOVE ranges it has read but not
    /// processed: no take-out.
    closed: AtomicBool,
    /// The reader is reading messages, or marking the pages of the drops it read: no
    /// fill.
    reading: AtomicBool,
    /// Moves under way.
    moves: AtomicUsize,
}

impl MoveGate {
    /// A mover enters; false if the gate is closed (nothing may move now: retry
    /// later). Pair a true with [`MoveGate::end`].
    pub fn begin(&self) -> bool {
        self.enter(&self.closed)
    }

    /// A fill enters; false while the reader reads or marks (retry later). Pair a true
    /// with [`MoveGate::end`].
    pub fn begin_fill(&self) -> bool {
        self.enter(&self.reading)
    }

    fn enter(&self, shut: &AtomicBool) -> bool {
        // Movers refused over and over (handlers whose access faults again) must not
        // keep `moves` from ever reading zero: while the gate is seen shut, they do
        // not touch it.
        if shut.load(SeqCst) {
            return false;
        }
        self.moves.fetch_add(1, SeqCst);
        fence(SeqCst);
        if shut.load(SeqCst) {
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
        self.reading.store(true, SeqCst);
        fence(SeqCst);
        while self.moves.load(SeqCst) != 0 {
            relax();
        }
    }

    /// The reader, once the pages of the drops it read are marked: fills may go on.
    pub fn marked(&self) {
        self.reading.store(false, SeqCst);
    }

    /// The reader, after reading or processing: the gate stays closed to take-outs
    /// while it holds REMOVE ranges not yet processed.
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

    /// A take-out (`fill` false) or a fill against the reader: neither is inside the
    /// gate while the reader reads an event and marks its pages; a take-out is not
    /// inside until the reader has processed the range either.
    fn no_move_overlaps_a_read(fill: bool) {
        loom::model(move || {
            let gate = Arc::new(MoveGate::default());
            // 1: reading and marking; 2: processing the range; 0: done.
            let phase = Arc::new(AtomicUsize::new(0));
            let mover = {
                let (gate, phase) = (gate.clone(), phase.clone());
                loom::thread::spawn(move || {
                    if if fill { gate.begin_fill() } else { gate.begin() } {
                        let p = phase.load(SeqCst);
                        assert!(p != 1 && (fill || p != 2), "a move inside the gate during phase {p} (fill: {fill})");
                        gate.end();
                    }
                })
            };
            gate.close_and_drain();
            phase.store(1, SeqCst);
            phase.store(2, SeqCst);
            gate.marked();
            phase.store(0, SeqCst);
            gate.set_closed(false);
            mover.join().unwrap();
        });
    }

    #[test]
    fn loom_no_take_out_overlaps_a_read() {
        no_move_overlaps_a_read(false);
    }

    #[test]
    fn loom_no_fill_overlaps_a_read() {
        no_move_overlaps_a_read(true);
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
                    let mut fill = false;
                    while !stop.load(SeqCst) {
                        fill = !fill;
                        if if fill { gate.begin_fill() } else { gate.begin() } {
                            assert!(!reading.load(SeqCst), "a move inside the gate during a read");
                            inside.fetch_add(1, SeqCst);
                            gate.end();
                        } else {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        // Reads until the movers have been in often, between them (the gate left
        // open for a moment after each).
        let mut reads = 0;
        while reads < 20_000 || (inside.load(SeqCst) < 1000 && reads < 200_000) {
            gate.close_and_drain();
            reading.store(true, SeqCst);
            reading.store(false, SeqCst);
            gate.marked();
            gate.set_closed(false);
            for _ in 0..200 {
                std::hint::spin_loop();
            }
            reads += 1;
        }
        assert!(inside.load(SeqCst) > 0, "the movers never got in");
        stop.store(true, SeqCst);
        for m in movers {
            m.join().unwrap();
        }
        assert_eq!(gate.moves.load(SeqCst), 0);
    }
}
