//! Random sequences of pool operations against a model (handle -> bytes).

mod common;

use common::pattern;
use proptest::prelude::*;
use std::collections::HashMap;
use uzswap_pool::{Handle, Pool, PoolError};

#[derive(Clone, Debug)]
enum Op {
    Store {
        size: usize,
        seed: u64,
    },
    /// Free the n-th live object (mod the number live).
    Free(usize),
    Read(usize),
    /// Free an object twice, and read it after the free.
    FreeTwice(usize),
    Compact,
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        1usize..64,
        800usize..3600,
        4000usize..5000,
        10_240usize..40_960,
        126_000usize..136_000,
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (size(), any::<u64>()).prop_map(|(size, seed)| Op::Store { size, seed }),
        3 => any::<usize>().prop_map(Op::Free),
        2 => any::<usize>().prop_map(Op::Read),
        1 => any::<usize>().prop_map(Op::FreeTwice),
        1 => Just(Op::Compact),
    ]
}

fn check_all(pool: &Pool, model: &HashMap<Handle, Vec<u8>>) {
    for (h, bytes) in model {
        pool.read(*h, |b| assert_eq!(b, &bytes[..], "{h:?}"));
    }
    let stats = pool.stats();
    assert_eq!(stats.objects, model.len() as u64);
    assert_eq!(
        stats.object_bytes,
        model.values().map(|b| b.len() as u64).sum::<u64>()
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn pool_behaves_like_a_map(ops in prop::collection::vec(op(), 1..250)) {
        let pool = Pool::new();
        let empty_size = pool.total_size();
        let mut model: HashMap<Handle, Vec<u8>> = HashMap::new();
        let mut order: Vec<Handle> = Vec::new();
        for op in ops {
            match op {
                Op::Store { size, seed } => {
                    let data = pattern(seed, size);
                    let h = pool.store(&data).unwrap();
                    prop_assert!(model.insert(h, data).is_none(), "handle {:?} handed out twice", h);
                    order.push(h);
                }
                Op::Free(n) | Op::Read(n) | Op::FreeTwice(n) if order.is_empty() => { let _ = n; }
                Op::Free(n) => {
                    let h = order.swap_remove(n % order.len());
                    model.remove(&h);
                    prop_assert_eq!(pool.try_free(h), Ok(()));
                }
                Op::Read(n) => {
                    let h = order[n % order.len()];
                    let same = pool.read(h, |b| b == &model[&h][..]);
                    prop_assert!(same);
                }
                Op::FreeTwice(n) => {
                    let h = order.swap_remove(n % order.len());
                    model.remove(&h);
                    pool.free(h);
                    prop_assert_eq!(pool.try_free(h), Err(PoolError::InvalidHandle));
                    prop_assert_eq!(pool.try_read(h, |_| ()), Err(PoolError::InvalidHandle));
                }
                Op::Compact => {
                    let before = pool.total_size();
                    let stats = pool.compact();
                    prop_assert_eq!(before - pool.total_size(), stats.freed_bytes);
                }
            }
            let stats = pool.stats();
            prop_assert_eq!(stats.objects, model.len() as u64);
        }
        check_all(&pool, &model);
        pool.compact();
        check_all(&pool, &model);
        for h in order {
            pool.free(h);
        }
        pool.compact();
        prop_assert_eq!(pool.stats().objects, 0);
        // Only the tables' high-water pages remain.
        prop_assert!(pool.total_size() - empty_size < 64 * 1024, "{} B left", pool.total_size() - empty_size);
    }
}
