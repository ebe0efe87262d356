//! Single-threaded semantics against a BTreeMap model.
#![cfg(not(loom))]

use std::collections::BTreeMap;

use proptest::prelude::*;
use uzswap_index::Index;

#[derive(Debug, Clone)]
enum Op {
    Insert(u64, u32),
    Get(u64),
    With(u64),
    Remove(u64),
    /// Remove if the value is below the threshold.
    RemoveIf(u64, u32),
}

/// Keys that share leaves (dense low range), neighbour shards, and sparse
/// 64-bit keys (folio addresses >> 12 up to 2^52, and the extremes).
fn key() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..200,
        2 => (0u64..4).prop_map(|s| (s << 18) + 4000),
        2 => prop::sample::select(vec![1u64 << 52, (1 << 52) - 1, 0x7_f123_4567, u64::MAX, u64::MAX - 63]),
        1 => any::<u64>(),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (key(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
        2 => key().prop_map(Op::Get),
        1 => key().prop_map(Op::With),
        3 => key().prop_map(Op::Remove),
        2 => (key(), any::<u32>()).prop_map(|(k, t)| Op::RemoveIf(k, t)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn behaves_like_a_btreemap(ops in prop::collection::vec(op(), 1..400)) {
        let index = Index::<u32>::new();
        let mut model = BTreeMap::<u64, u32>::new();
        let empty_memory = index.memory_bytes();
        for op in ops {
            match op {
                Op::Insert(k, v) => prop_assert_eq!(index.insert(k, v), model.insert(k, v)),
                Op::Get(k) => prop_assert_eq!(index.get(k), model.get(&k).copied()),
                Op::With(k) => prop_assert_eq!(index.with(k, |v| *v as u64 + 1), model.get(&k).map(|v| *v as u64 + 1)),
                Op::Remove(k) => prop_assert_eq!(index.remove(k), model.remove(&k)),
                Op::RemoveIf(k, t) => {
                    let expected = match model.get(&k) {
                        Some(&v) if v < t => model.remove(&k),
                        _ => None,
                    };
                    prop_assert_eq!(index.remove_if(k, |v| *v < t), expected);
                }
            }
            prop_assert_eq!(index.len(), model.len());
            prop_assert_eq!(index.is_empty(), model.is_empty());
        }
        for (k, v) in &model {
            prop_assert_eq!(index.get(*k), Some(*v));
        }
        let stats = index.stats();
        prop_assert_eq!(stats.entries, model.len());
        prop_assert!(stats.memory_bytes > empty_memory || model.is_empty());
        // Emptying the index frees every node; only shards remain.
        for k in model.keys() {
            prop_assert!(index.remove(*k).is_some());
        }
        let stats = index.stats();
        prop_assert_eq!((stats.entries, stats.nodes), (0, 0));
    }
}

#[test]
fn extreme_keys_are_distinct() {
    let index = Index::<u64>::new();
    let keys = [0, 1, 63, 64, 4095, 4096, (1 << 18) - 1, 1 << 18, 1 << 52, u64::MAX - 1, u64::MAX];
    for &k in &keys {
        assert_eq!(index.insert(k, k ^ 0xABCD), None);
    }
    for &k in &keys {
        assert_eq!(index.get(k), Some(k ^ 0xABCD));
    }
    assert_eq!(index.get(2), None);
    assert_eq!(index.get(u64::MAX - 2), None);
    assert_eq!(index.len(), keys.len());
}
