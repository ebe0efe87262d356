//! Every value the index takes is dropped exactly once: after removal or
//! replacement (once the epoch grace period ends) and when the index is dropped.
#![cfg(not(loom))]

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use uzswap_index::Index;

/// Live instances per id (clones included), and whether any went below zero.
struct Registry {
    live: Vec<AtomicI64>,
    double_drop: AtomicBool,
    next_id: AtomicU64,
}

impl Registry {
    fn new(ids: usize) -> Arc<Self> {
        Arc::new(Registry {
            live: (0..ids).map(|_| AtomicI64::new(0)).collect(),
            double_drop: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
        })
    }

    fn make(self: &Arc<Self>) -> Tracked {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) as usize;
        self.live[id].fetch_add(1, Ordering::Relaxed);
        Tracked { id, registry: self.clone() }
    }

    fn live(&self, id: usize) -> i64 {
        self.live[id].load(Ordering::Relaxed)
    }

    fn all_dead(&self) -> bool {
        self.live.iter().all(|l| l.load(Ordering::Relaxed) == 0)
    }
}

struct Tracked {
    id: usize,
    registry: Arc<Registry>,
}

impl Clone for Tracked {
    fn clone(&self) -> Self {
        self.registry.live[self.id].fetch_add(1, Ordering::Relaxed);
        Tracked { id: self.id, registry: self.registry.clone() }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.registry.live[self.id].fetch_sub(1, Ordering::Relaxed) <= 0 {
            self.registry.double_drop.store(true, Ordering::Relaxed);
        }
    }
}

/// With no reader pinned, two reclaims free everything retired: the first moves it
/// past a generation flip, the second frees it (see the crate's `reclaim`).
fn settle(what: &str, index: &Index<Tracked>, done: impl Fn() -> bool) {
    index.reclaim();
    index.reclaim();
    assert!(done(), "{what}: retired values were not dropped after two reclaims");
}

#[test]
fn single_thread_drops_exactly_once() {
    let registry = Registry::new(2000);
    let index = Index::<Tracked>::new();
    for key in 0..1000u64 {
        assert!(index.insert(key * 3, registry.make()).is_none());
    }
    // Replace 0..300 (ids 1000..1300), remove 300..600, remove_if 600..700 (taken)
    // and 700..800 (refused).
    for key in 0..300u64 {
        let old = index.insert(key * 3, registry.make()).expect("present");
        assert_eq!(old.id, key as usize);
    }
    for key in 300..600u64 {
        assert_eq!(index.remove(key * 3).expect("present").id, key as usize);
    }
    for key in 600..700u64 {
        assert!(index.remove_if(key * 3, |v| v.id == key as usize).is_some());
    }
    for key in 700..800u64 {
        assert!(index.remove_if(key * 3, |v| v.id != key as usize).is_none());
    }
    // Returned clones are gone; the originals go once the grace period ends.
    settle("removed values", &index, || (0..700).all(|id| registry.live(id) == 0));
    for id in (700..1000).chain(1000..1300) {
        assert_eq!(registry.live(id), 1, "value {id} is held once by the index");
    }
    assert!(!registry.double_drop.load(Ordering::Relaxed));
    drop(index);
    for id in (700..1000).chain(1000..1300) {
        assert_eq!(registry.live(id), 0, "value {id} dropped with the index");
    }
    assert!(registry.all_dead(), "everything is dropped with the index");
    assert!(!registry.double_drop.load(Ordering::Relaxed), "a value was dropped twice");
}

#[test]
fn concurrent_writers_drop_exactly_once() {
    let registry = Registry::new(200_000);
    let index = Arc::new(Index::<Tracked>::new());
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let (index, registry) = (index.clone(), registry.clone());
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t);
                for _ in 0..40_000 {
                    let key = rng.gen_range(0..500u64) * 11;
                    match rng.gen_range(0..4) {
                        0 | 1 => drop(index.insert(key, registry.make())),
                        2 => drop(index.remove(key)),
                        _ => drop(index.remove_if(key, |v| v.id % 2 == 0)),
                    }
                    drop(index.get(key));
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().expect("writer panicked");
    }
    let made = registry.next_id.load(Ordering::Relaxed) as usize;
    let held = index.len();
    settle("replaced and removed values", &index, || {
        (0..made).filter(|&id| registry.live(id) != 0).count() == held
    });
    drop(index);
    assert!(registry.all_dead(), "everything is dropped with the index");
    assert!(!registry.double_drop.load(Ordering::Relaxed), "a value was dropped twice");
}
