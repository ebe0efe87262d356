//! `index_ops`: a sequence of index operations checked against a `BTreeMap`.
//!
//! Keys are drawn near a few bases chosen to cross every boundary of the tree: a
//! leaf (64 keys), a mid node (4096), a shard (2^18), the directory's 512 buckets
//! (shards 512 apart share one), and the top of the key space. So leaves and mid
//! nodes fill, empty, are freed and are made again, and shards chain in one bucket.
//! Values are heap vectors, so a value read after it was freed, or freed twice, is
//! caught by AddressSanitizer rather than compared by luck.
//!
//! After every operation `len()` must equal the model's; `get`, `with`, `insert`,
//! `remove` and `remove_if` must return exactly what the model says, and
//! `remove_if`'s predicate must see the current value. When the model is empty
//! again, the index must hold no nodes (xarray-style freeing of emptied nodes).

#![no_main]

use std::collections::BTreeMap;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use uzswap_index::Index;

const BASES: [u64; 10] = [
    0,
    64 - 8,
    4096 - 8,
    (1 << 18) - 8,
    (1 << 18) * 512 - 8, // shard 511 and 512: the last bucket, then bucket 0 again
    (1 << 18) * 1024,    // bucket 0 once more
    1 << 36,             // a user address >> 12
    (1 << 47) >> 12 << 6,
    u64::MAX / 2,
    u64::MAX - 15,
];

#[derive(Arbitrary, Debug, Clone, Copy)]
struct Key {
    base: u8,
    offset: u8,
}

impl Key {
    fn get(self) -> u64 {
        BASES[self.base as usize % BASES.len()].wrapping_add(u64::from(self.offset % 24))
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    Insert {
        key: Key,
        value: u16,
    },
    /// Insert `count` consecutive keys from `key` (fills leaves quickly).
    InsertRun {
        key: Key,
        count: u8,
        value: u16,
    },
    Get {
        key: Key,
    },
    Remove {
        key: Key,
    },
    /// Remove `count` consecutive keys from `key`.
    RemoveRun {
        key: Key,
        count: u8,
    },
    /// Remove if the value equals `value` (the store's identity re-check).
    RemoveIf {
        key: Key,
        value: u16,
    },
    /// Any 64-bit key, looked up or removed.
    Wild {
        key: u64,
        remove: bool,
    },
}

type Value = Vec<u8>;

fn value(v: u16) -> Value {
    // Sizes vary with the value, so clones of different values differ in length too.
    let mut bytes = v.to_le_bytes().to_vec();
    bytes.resize(2 + (v % 29) as usize, v as u8);
    bytes
}

fn insert(index: &Index<Value>, model: &mut BTreeMap<u64, Value>, key: u64, v: Value) {
    let old = index.insert(key, v.clone());
    assert_eq!(old, model.insert(key, v), "insert({key:#x})");
}

fn remove(index: &Index<Value>, model: &mut BTreeMap<u64, Value>, key: u64) {
    assert_eq!(index.remove(key), model.remove(&key), "remove({key:#x})");
    assert_eq!(index.get(key), None, "get({key:#x}) after remove");
}

fuzz_target!(|ops: Vec<Op>| {
    let index: Index<Value> = Index::new();
    let mut model: BTreeMap<u64, Value> = BTreeMap::new();
    for op in ops {
        match op {
            Op::Insert { key, value: v } => insert(&index, &mut model, key.get(), value(v)),
            Op::InsertRun {
                key,
                count,
                value: v,
            } => {
                for i in 0..u64::from(count % 130) {
                    insert(
                        &index,
                        &mut model,
                        key.get().wrapping_add(i),
                        value(v.wrapping_add(i as u16)),
                    );
                }
            }
            Op::Get { key } => {
                let key = key.get();
                assert_eq!(index.get(key).as_ref(), model.get(&key), "get({key:#x})");
                assert_eq!(
                    index.with(key, |v| v.len()),
                    model.get(&key).map(|v| v.len()),
                    "with({key:#x})"
                );
            }
            Op::Remove { key } => remove(&index, &mut model, key.get()),
            Op::RemoveRun { key, count } => {
                for i in 0..u64::from(count % 130) {
                    remove(&index, &mut model, key.get().wrapping_add(i));
                }
            }
            Op::RemoveIf { key, value: v } => {
                let key = key.get();
                let wanted = value(v);
                let mut seen = None;
                let removed = index.remove_if(key, |current| {
                    seen = Some(current.clone());
                    *current == wanted
                });
                assert_eq!(
                    seen.as_ref(),
                    model.get(&key),
                    "remove_if({key:#x}) predicate saw"
                );
                let expected = match model.get(&key) {
                    Some(current) if *current == wanted => model.remove(&key),
                    _ => None,
                };
                assert_eq!(removed, expected, "remove_if({key:#x})");
            }
            Op::Wild { key, remove: true } => remove(&index, &mut model, key),
            Op::Wild { key, remove: false } => {
                assert_eq!(index.get(key).as_ref(), model.get(&key), "get({key:#x})");
            }
        }
        assert_eq!(index.len(), model.len(), "len");
        assert_eq!(index.is_empty(), model.is_empty(), "is_empty");
    }
    for (&key, v) in &model {
        assert_eq!(index.get(key).as_ref(), Some(v), "get({key:#x}) at the end");
    }
    assert_eq!(index.stats().entries, model.len());
    // Half the time empty the index, which must then hold no nodes (xarray-style
    // freeing of emptied nodes); otherwise drop it with its entries, and its Drop
    // must free every value exactly once.
    if model.len().is_multiple_of(2) {
        for key in std::mem::take(&mut model).into_keys() {
            assert!(index.remove(key).is_some(), "remove({key:#x}) at the end");
        }
        let stats = index.stats();
        assert_eq!(
            (stats.entries, stats.nodes),
            (0, 0),
            "an emptied index still holds nodes"
        );
    }
    drop(index);
    // Let the epoch collector run what the index deferred, so that each run frees
    // what it allocated: LeakSanitizer then has no reachable garbage to scan for
    // and stays quiet, and a value freed too early or twice shows at once.
    for _ in 0..4 {
        crossbeam_epoch::pin().flush();
    }
});
