//! Injected failures (StoreFaults), a pool limit changed while in use, and the
//! two-step exclusive load: every refusal is an error and a counter, and what the
//! store still holds comes back bit for bit.

use std::sync::Arc;
use uzswap_store::faults::ALWAYS;
use uzswap_store::{Store, StoreConfig, StoreError, StoreFaults};

fn folio(seed: u64, len: usize) -> Vec<u8> {
    uzswap_corpus::realistic(len, seed)
}

fn faulty_store(limit: Option<u64>) -> (Store, Arc<StoreFaults>) {
    let faults = Arc::new(StoreFaults::new());
    let cfg = StoreConfig { faults: Some(faults.clone()), max_pool_bytes: limit, ..StoreConfig::default() };
    (Store::new(cfg).unwrap(), faults)
}

#[test]
fn failed_compressions_are_refused_and_counted() {
    let (store, faults) = faulty_store(None);
    let data: Vec<Vec<u8>> = (0..8).map(|i| folio(i, 16384)).collect();
    faults.fail_compressions(3);
    let mut refused = Vec::new();
    for (i, d) in data.iter().enumerate() {
        match store.store(i as u64, d) {
            Ok(()) => {}
            Err(StoreError::Injected("compression")) => refused.push(i),
            Err(e) => panic!("folio {i}: {e}"),
        }
    }
    assert_eq!(refused, [0, 1, 2]);
    assert_eq!(faults.injected(), 3);
    let s = store.stats();
    assert_eq!(s.totals.reject_compress_fail, 3);
    assert_eq!(s.totals.zswpout, 5 * 4);
    let mut out = vec![0u8; 16384];
    for (i, d) in data.iter().enumerate() {
        let held = store.load(i as u64, &mut out).unwrap();
        assert_eq!(held, !refused.contains(&i), "folio {i}");
        if held {
            assert_eq!(&out, d, "folio {i}");
        }
    }
    assert!(store.is_empty());
}

#[test]
fn failed_pool_allocations_are_refused_and_counted() {
    let (store, faults) = faulty_store(None);
    faults.fail_allocations(ALWAYS);
    let d = folio(1, 65536);
    for key in 0..5 {
        assert!(matches!(store.store(key, &d), Err(StoreError::Injected("pool allocation"))));
    }
    // A same-filled folio needs no pool memory: it still goes in.
    store.store(9, &vec![7u8; 65536]).unwrap();
    assert_eq!(store.stats().totals.reject_alloc_fail, 5);
    assert_eq!(store.len(), 1);
    faults.fail_allocations(0);
    store.store(0, &d).unwrap();
    let mut out = vec![0u8; 65536];
    assert!(store.load(0, &mut out).unwrap());
    assert_eq!(out, d);
    assert_eq!(faults.injected(), 5);
}

#[test]
fn a_lower_pool_limit_applies_to_the_next_store() {
    let (store, _) = faulty_store(None);
    assert_eq!(store.max_pool_bytes(), None);
    let data: Vec<Vec<u8>> = (0..16).map(|i| folio(i, 65536)).collect();
    for (i, d) in data.iter().enumerate().take(8) {
        store.store(i as u64, d).unwrap();
    }
    let held = store.pool_total_size();
    store.set_max_pool_bytes(Some(held / 2));
    assert_eq!(store.max_pool_bytes(), Some(held / 2));
    // No backing file: over the new limit, stores are refused, nothing held is lost.
    assert!(matches!(store.store(100, &data[8]), Err(StoreError::PoolLimit { .. })));
    assert!(store.stats().totals.pool_limit_hit >= 1);
    let mut out = vec![0u8; 65536];
    for (i, d) in data.iter().enumerate().take(8) {
        assert!(store.load(i as u64, &mut out).unwrap());
        assert_eq!(&out, d);
    }
    store.set_max_pool_bytes(None);
    store.store(100, &data[8]).unwrap();
}

#[test]
fn two_step_load_frees_the_entry_only_when_committed() {
    let (store, _) = faulty_store(None);
    let d = folio(5, 16384);
    store.store(3, &d).unwrap();
    let mut out = vec![0u8; 16384];
    assert!(store.read_range(3, 0, &mut out).unwrap());
    assert_eq!(out, d);
    assert!(store.contains(3));
    assert!(store.commit_load(3));
    assert!(!store.contains(3));
    assert!(!store.commit_load(3));
    let s = store.stats();
    assert_eq!(s.totals.zswpin, 4);
    assert_eq!(s.totals.stored_pages, 0);
    assert_eq!(s.compressed_bytes, 0);
}
