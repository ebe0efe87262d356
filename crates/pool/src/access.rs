//! The move protocol: how a reader pins an object that compaction may move.
//!
//! zsmalloc pins an object by taking the pool's migrate lock (read) to decode the
//! handle, then the zspage lock before dropping the pool lock. We have no pool-wide
//! lock on this path; instead a reader validates after locking, seqlock style:
//!
//! 1. load the handle's word (Acquire);
//! 2. take the lock of the span the word names, shared;
//! 3. load the word again: if it changed, the object moved (or was freed) between 1
//!    and 2: unlock and start over; if not, the object is at that place and stays
//!    there while the lock is held, because a move needs the source span's lock
//!    exclusively ([`relocate`]).
//!
//! A mover holds the source span's lock exclusively, copies the bytes to a free slot
//! (which no word names yet, so nobody reads it), then stores the new word (Release):
//! whoever loads the new word also sees the copied bytes. The source slot is freed
//! only after that, so a reader that still holds the old word fails step 3 before it
//! touches anything. An old word that comes back (the object moved away and back:
//! ABA) is harmless: step 3 checks where the object is now, not what happened to it.
//! Span locks live in the span table, which never shrinks, so locking the span of a
//! stale word is always safe even if that span was unmapped in the meantime.
//!
//! The generic form lets the loom model below check this with loom's atomics and
//! locks; the pool instantiates it with `AtomicU64` and std's `RwLock`.

use std::sync::atomic::{AtomicU64, Ordering};

/// A handle table word.
pub(crate) trait Word {
    fn load_acquire(&self) -> u64;
    fn store_release(&self, word: u64);
}

impl Word for AtomicU64 {
    fn load_acquire(&self) -> u64 {
        self.load(Ordering::Acquire)
    }
    fn store_release(&self, word: u64) {
        self.store(word, Ordering::Release)
    }
}

/// A span's lock: shared for readers and writers of objects, exclusive for moves.
pub(crate) trait SpanLock {
    type Shared<'a>
    where
        Self: 'a;
    type Exclusive<'a>
    where
        Self: 'a;
    fn shared(&self) -> Self::Shared<'_>;
    fn exclusive(&self) -> Self::Exclusive<'_>;
}

/// The pool's span lock. Readers of one span share it, so only a move out of the span
/// (or a reader of it when a move waits) ever blocks a reader. A std rwlock: it is
/// futex-based and allocates nothing to wait, so a reader on a signal handler's path
/// (the runtime's SIGBUS loads) may block on a move briefly but never allocates, as
/// parking_lot's first park on a thread would. A panic under it leaves no state
/// behind (it guards `()`), so poisoning is ignored.
#[derive(Default)]
pub(crate) struct RwSpanLock(std::sync::RwLock<()>);

impl SpanLock for RwSpanLock {
    type Shared<'a> = std::sync::RwLockReadGuard<'a, ()>;
    type Exclusive<'a> = std::sync::RwLockWriteGuard<'a, ()>;
    fn shared(&self) -> Self::Shared<'_> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }
    fn exclusive(&self) -> Self::Exclusive<'_> {
        self.0.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs `f` with the handle's word, held stable: if `lock_of` says the word names an
/// object that can move, `f` runs under that span's shared lock and after the
/// revalidation above. Words `lock_of` maps to `None` (free slots, objects that never
/// move) are passed straight to `f`.
pub(crate) fn with_pinned<'l, W, L, R>(
    word: &W,
    lock_of: impl Fn(u64) -> Option<&'l L>,
    f: impl FnOnce(u64) -> R,
) -> R
where
    W: Word,
    L: SpanLock + 'l,
{
    loop {
        let seen = word.load_acquire();
        let Some(lock) = lock_of(seen) else {
            return f(seen);
        };
        let pin = lock.shared();
        if word.load_acquire() == seen {
            let result = f(seen);
            drop(pin);
            return result;
        }
        // Moved while we were getting the lock: follow it.
    }
}

/// Publishes an object's new place. The caller holds the source span's lock
/// exclusively (`_source_held` is the proof) and has already copied the bytes to the
/// place `new_word` names.
pub(crate) fn relocate<'a, L: SpanLock + 'a, W: Word>(
    _source_held: &L::Exclusive<'a>,
    word: &W,
    new_word: u64,
) {
    word.store_release(new_word);
}

#[cfg(all(test, loom))]
mod loom_model {
    //! One object, two spans. A mover moves it from span 0 to span 1 and back, and then
    //! stores a different object in the slot it left in span 1 (under that span's
    //! shared lock, as `Pool::store` writes). A reader, concurrently, pins the object
    //! and reads it. loom checks every interleaving: the reader must always see the
    //! whole object, and its read must never race with the mover's writes.
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::AtomicU64 as LoomU64;
    use loom::sync::{Arc, RwLock};

    impl Word for LoomU64 {
        fn load_acquire(&self) -> u64 {
            self.load(Ordering::Acquire)
        }
        fn store_release(&self, word: u64) {
            self.store(word, Ordering::Release)
        }
    }

    struct LoomLock(RwLock<()>);
    impl SpanLock for LoomLock {
        type Shared<'a> = loom::sync::RwLockReadGuard<'a, ()>;
        type Exclusive<'a> = loom::sync::RwLockWriteGuard<'a, ()>;
        fn shared(&self) -> Self::Shared<'_> {
            self.0.read().unwrap()
        }
        fn exclusive(&self) -> Self::Exclusive<'_> {
            self.0.write().unwrap()
        }
    }

    struct Span {
        lock: LoomLock,
        /// One object slot of two words, so a torn copy would show.
        slot: UnsafeCell<[u64; 2]>,
    }

    struct World {
        spans: [Span; 2],
        /// The handle's word: the index of the span holding the object.
        word: LoomU64,
    }

    const OBJECT: [u64; 2] = [0xA1, 0xA2];
    const OTHER: [u64; 2] = [0xB1, 0xB2];

    impl World {
        fn move_object(&self, from: usize, to: usize) {
            let held = self.spans[from].lock.exclusive();
            let bytes = self.spans[from].slot.with(|p| unsafe { *p });
            self.spans[to].slot.with_mut(|p| unsafe { *p = bytes });
            relocate::<LoomLock, _>(&held, &self.word, to as u64);
        }
    }

    #[test]
    fn readers_never_see_a_half_moved_object() {
        loom::model(|| {
            let world = Arc::new(World {
                spans: [
                    Span {
                        lock: LoomLock(RwLock::new(())),
                        slot: UnsafeCell::new(OBJECT),
                    },
                    Span {
                        lock: LoomLock(RwLock::new(())),
                        slot: UnsafeCell::new([0; 2]),
                    },
                ],
                word: LoomU64::new(0),
            });
            let mover = {
                let world = world.clone();
                loom::thread::spawn(move || {
                    world.move_object(0, 1);
                    world.move_object(1, 0);
                    // Span 1's slot is free again: a new object goes there.
                    let _writer = world.spans[1].lock.shared();
                    world.spans[1].slot.with_mut(|p| unsafe { *p = OTHER });
                })
            };
            let seen = with_pinned(
                &world.word,
                |w| Some(&world.spans[w as usize].lock),
                |w| world.spans[w as usize].slot.with(|p| unsafe { *p }),
            );
            assert_eq!(seen, OBJECT);
            mover.join().unwrap();
        });
    }
}
