//! Loads racing writeback (and recut, which follows writeback's hand-over) on the same
//! entries: a load that finds its entry's LRU node held by writeback joins it instead
//! of waiting, and whoever is last frees the pool object (see the store's design
//! comment and recut.rs). Threads load, read, commit and invalidate their own keys
//! while another writes back (or recuts) the coldest entries in small batches, over
//! and over; every byte read is checked, and in the end nothing is left behind.

use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use uzswap_backing::{BackingConfig, BackingFile};
use uzswap_store::{Algorithm, CodecConfig, Granularity, Store, StoreConfig};

const FOLIO: usize = 16384;

fn folio(key: u64, version: u64) -> Vec<u8> {
    let mut v = vec![0u8; FOLIO];
    for (i, chunk) in v.chunks_mut(8).enumerate() {
        let w = if i % 64 == 0 { key.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version ^ i as u64 } else { key ^ version << 32 };
        chunk.copy_from_slice(&w.to_ne_bytes());
    }
    v
}

#[test]
fn loads_racing_writeback_lose_nothing_and_leak_nothing() {
    race(Granularity::Folio, false);
}

/// Records stored in 4 KiB units; the mover recuts (cuts whole) the coldest ones and
/// writes back in turn, so loads meet both, and recut records written back too.
#[test]
fn loads_racing_recut_and_writeback_lose_nothing_and_leak_nothing() {
    race(Granularity::Bytes(4096), true);
}

fn race(granularity: Granularity, recut: bool) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        codec: CodecConfig { algorithm: Algorithm::Lz4, level: 1, granularity, raw_threshold_percent: 90, verify: false },
        ..StoreConfig::default()
    };
    let store = Store::with_backing(cfg, Some(BackingFile::create(BackingConfig::new(dir.path(), 256 << 20)).unwrap())).unwrap();
    store.reserve_contexts(4).unwrap();
    let threads = 3u64;
    let keys_per_thread = 48u64;
    let stop = AtomicBool::new(false);
    let written_back = AtomicU64::new(0);
    std::thread::scope(|s| {
        let store = &store;
        let (stop, written_back) = (&stop, &written_back);
        s.spawn(move || {
            let mut turn = 0u64;
            while !stop.load(Relaxed) {
                turn += 1;
                if recut && !turn.is_multiple_of(3) {
                    if store.recut_coldest(3 * 4096) == 0 {
                        std::thread::yield_now();
                    }
                    continue;
                }
                let n = store.writeback_batch(3 * 1024).unwrap();
                written_back.fetch_add(n, Relaxed);
                if n == 0 {
                    std::thread::yield_now();
                }
            }
        });
        let loaders: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(t);
                    let keys: Vec<u64> = (0..keys_per_thread).map(|i| i * threads + t).collect();
                    let mut version: Vec<Option<u64>> = vec![None; keys.len()];
                    let mut out = vec![0u8; FOLIO];
                    for round in 0..6000u64 {
                        let i = rng.gen_range(0..keys.len());
                        let key = keys[i];
                        let Some(v) = version[i] else {
                            store.store(key, &folio(key, round)).unwrap();
                            version[i] = Some(round);
                            continue;
                        };
                        match rng.gen_range(0..5) {
                            0 => {
                                assert!(store.load(key, &mut out).unwrap());
                                assert!(out == folio(key, v), "load of key {key} version {v}");
                                version[i] = None;
                            }
                            1 => {
                                let at = rng.gen_range(0..FOLIO / 4096) * 4096;
                                assert!(store.read_range(key, at, &mut out[..4096]).unwrap());
                                assert!(out[..4096] == folio(key, v)[at..at + 4096], "read_range of key {key}");
                            }
                            2 => {
                                assert!(store.read_range(key, 0, &mut out).unwrap());
                                assert!(out == folio(key, v), "two-step load of key {key}");
                                assert!(store.commit_load(key));
                                version[i] = None;
                            }
                            3 => {
                                assert!(store.invalidate(key));
                                version[i] = None;
                            }
                            _ => {
                                store.store(key, &folio(key, round)).unwrap();
                                version[i] = Some(round);
                            }
                        }
                        assert_eq!(store.contains(key), version[i].is_some());
                    }
                    for (i, &key) in keys.iter().enumerate() {
                        if let Some(v) = version[i] {
                            assert!(store.load(key, &mut out).unwrap());
                            assert!(out == folio(key, v), "final load of key {key}");
                        }
                    }
                })
            })
            .collect();
        for l in loaders {
            l.join().unwrap();
        }
        stop.store(true, Relaxed);
    });
    assert!(written_back.load(Relaxed) > 0, "writeback ran");
    store.reap();
    let st = store.stats();
    assert!(store.is_empty(), "{st:?}");
    assert_eq!(store.lru_len(), 0);
    assert_eq!((st.totals.stored_pages, st.totals.backing_pages, st.compressed_bytes), (0, 0, 0), "{st:?}");
    assert_eq!(store.pool_objects(), 0, "every pool object freed: {st:?}");
    assert_eq!(recut, st.totals.recut_pages > 0, "recut ran (only where asked): {st:?}");
    assert!(st.totals.pswpin > 0, "loads came from the file too: {st:?}");
    eprintln!("{st:?}");
}
