//! Loom models of the slot and node protocol, on a tree with fan-out 2 (keys
//! 0 and 1 share a leaf, 0..4 a mid node, 0..8 a shard).
//!
//! Run (a few seconds after the build, preemption bound 4):
//! `CARGO_TARGET_DIR=/work/target-loom RUSTFLAGS="--cfg loom" cargo test -p uzswap-index --release --test loom`
//! A deeper search: add `LOOM_MAX_PREEMPTIONS=6` (about a minute on 2 cores).
//!
//! The reclamation protocol (src/reclaim.rs) runs as it is, on loom's atomics and
//! fences; freeing poisons instead, so the models also check that nothing is read or
//! retired after its grace period ended.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use uzswap_index::Index;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(4);
    }
    builder.check(f);
}

/// A reader racing an insert and a remove of one key sees the old or the new
/// value, and the end state follows from which writer went last.
#[test]
fn insert_remove_get_one_key() {
    model(|| {
        let index = Arc::new(Index::<u64>::new());
        let inserter = {
            let index = index.clone();
            thread::spawn(move || index.insert(0, 7))
        };
        let remover = {
            let index = index.clone();
            thread::spawn(move || index.remove(0))
        };
        let seen = index.get(0);
        assert!(seen.is_none() || seen == Some(7), "{seen:?}");
        assert_eq!(inserter.join().unwrap(), None);
        let removed = remover.join().unwrap();
        let expected = if removed.is_some() { None } else { Some(7) };
        assert_eq!(index.get(0), expected);
        assert_eq!(index.len(), expected.is_some() as usize);
    });
}

/// Removing the last key of a leaf condemns the leaf and its mid node while an
/// insert into the same leaf is under way: the insert must not be lost.
#[test]
fn leaf_death_races_insert() {
    model(|| {
        let index = Arc::new(Index::<u64>::new());
        index.insert(0, 1);
        let remover = {
            let index = index.clone();
            thread::spawn(move || index.remove(0))
        };
        assert_eq!(index.insert(1, 10), None);
        assert_eq!(remover.join().unwrap(), Some(1));
        assert_eq!(index.get(1), Some(10));
        assert_eq!(index.get(0), None);
        let stats = index.stats();
        assert_eq!((stats.entries, stats.nodes), (1, 2), "{stats:?}");
    });
}

/// Two inserts that both need the same missing mid node (different leaves).
#[test]
fn concurrent_node_creation() {
    model(|| {
        let index = Arc::new(Index::<u64>::new());
        let other = {
            let index = index.clone();
            thread::spawn(move || index.insert(2, 20))
        };
        assert_eq!(index.insert(0, 10), None);
        assert_eq!(other.join().unwrap(), None);
        assert_eq!((index.get(0), index.get(2)), (Some(10), Some(20)));
        let stats = index.stats();
        assert_eq!((stats.entries, stats.nodes), (2, 3), "{stats:?}");
    });
}

/// Emptying a whole mid node (two leaves) while a key in it is re-inserted.
#[test]
fn mid_death_races_reinsert() {
    model(|| {
        let index = Arc::new(Index::<u64>::new());
        index.insert(0, 1);
        index.insert(2, 2);
        let remover = {
            let index = index.clone();
            thread::spawn(move || (index.remove(0), index.remove(2)))
        };
        let replaced = index.insert(2, 30);
        let (first, second) = remover.join().unwrap();
        assert_eq!(first, Some(1));
        // Exactly one of the two saw the original value of key 2.
        match (replaced, second) {
            (Some(2), Some(30)) => assert_eq!(index.get(2), None),
            (None, Some(2)) => assert_eq!(index.get(2), Some(30)),
            other => panic!("impossible outcome {other:?}"),
        }
        let stats = index.stats();
        let present = index.get(2).is_some() as usize;
        assert_eq!((stats.entries, stats.nodes), (present, 2 * present), "{stats:?}");
    });
}

/// remove_if's check-then-CAS against a replacement: the replaced value is
/// returned exactly once and the new value survives.
#[test]
fn remove_if_races_replace() {
    model(|| {
        let index = Arc::new(Index::<u64>::new());
        index.insert(0, 1);
        let replacer = {
            let index = index.clone();
            thread::spawn(move || index.insert(0, 2))
        };
        let taken = index.remove_if(0, |v| *v == 1);
        let replaced = replacer.join().unwrap();
        match (taken, replaced) {
            (Some(1), None) | (None, Some(1)) => {}
            other => panic!("impossible outcome {other:?}"),
        }
        assert_eq!(index.get(0), Some(2));
        assert_eq!(index.len(), 1);
    });
}

/// The reclamation protocol itself: a reader pinned on a value while another thread
/// removes it and reclaims (twice: enough to free anything a pin does not hold
/// back) must never see it freed (the loom build poisons freed objects).
#[test]
fn reclaim_waits_for_pinned_readers() {
    model(|| {
        let index = Arc::new(Index::<u64>::new());
        index.insert(0, 5);
        let remover = {
            let index = index.clone();
            thread::spawn(move || {
                let removed = index.remove(0);
                index.reclaim();
                index.reclaim();
                removed
            })
        };
        let seen = index.with(0, |v| *v);
        assert!(seen.is_none() || seen == Some(5), "{seen:?}");
        assert_eq!(remover.join().unwrap(), Some(5));
        assert_eq!(index.get(0), None);
    });
}

/// `replace` racing a remove of the same key (the last in its leaf, so the leaf
/// may die): it replaces the present value or gives the prepared one back, never
/// revives the key or loses the other thread's work.
#[test]
fn replace_races_remove() {
    model(|| {
        let index = Arc::new(Index::<u64>::new());
        index.insert(0, 1);
        let remover = {
            let index = index.clone();
            thread::spawn(move || index.remove(0))
        };
        let replaced = index.replace(0, index.prepare(2)).ok();
        let removed = remover.join().unwrap();
        match (replaced, removed) {
            // Replaced first, then removed.
            (Some(1), Some(2)) => assert_eq!(index.get(0), None),
            // Removed first: nothing to replace.
            (None, Some(1)) => assert_eq!(index.get(0), None),
            other => panic!("{other:?}"),
        }
        assert!(index.is_empty());
    });
}

/// Reclaimer, remover and reader on three threads: the remove may land between a
/// reclaim's check of the readers and its flip, with the reader pinned under the old
/// generation; the next reclaim must still wait for that reader.
#[test]
fn reclaim_waits_for_readers_of_the_previous_generation() {
    model(|| {
        let index = Arc::new(Index::<u64>::new());
        index.insert(0, 5);
        let reader = {
            let index = index.clone();
            thread::spawn(move || index.with(0, |v| *v))
        };
        let remover = {
            let index = index.clone();
            thread::spawn(move || index.remove(0))
        };
        index.reclaim();
        index.reclaim();
        let seen = reader.join().unwrap();
        assert!(seen.is_none() || seen == Some(5), "{seen:?}");
        assert_eq!(remover.join().unwrap(), Some(5));
    });
}
