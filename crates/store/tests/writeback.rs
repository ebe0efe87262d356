//! Writeback to the backing file: round trips, failures survived, corruption caught,
//! and random interleavings against a model.

use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use uzswap_backing::fault::{Fault, FaultPlan, FaultyIo};
use uzswap_backing::{BackingConfig, BackingFile, PrivateFile};
use uzswap_store::{Algorithm, CodecConfig, Granularity, Store, StoreConfig, StoreError};

fn config(algorithm: Algorithm, granularity: Granularity, max_pool: u64) -> StoreConfig {
    StoreConfig {
        codec: CodecConfig { algorithm, level: 1, granularity, raw_threshold_percent: 90, verify: false },
        max_pool_bytes: Some(max_pool),
        ..StoreConfig::default()
    }
}

fn backing(dir: &std::path::Path) -> BackingFile {
    BackingFile::create(BackingConfig::new(dir, 256 << 20)).unwrap()
}

#[test]
fn round_trips_through_the_file_for_every_codec_and_folio_size() {
    let dir = tempfile::tempdir().unwrap();
    for algorithm in [Algorithm::Lz4, Algorithm::Zstd, Algorithm::Deflate] {
        for folio in [4096usize, 16384, 65536, 2 << 20] {
            let store =
                Store::with_backing(config(algorithm, Granularity::Bytes(16384), 1 << 20), Some(backing(dir.path())))
                    .unwrap();
            let data = uzswap_corpus::realistic(8 << 20, folio as u64);
            let n = data.len() / folio;
            for i in 0..n {
                store.store(i as u64, &data[i * folio..(i + 1) * folio]).unwrap();
            }
            let s = store.stats();
            assert!(s.totals.zswpwb > 0, "{algorithm} {folio}: nothing written back");
            assert_eq!(s.totals.zswpwb, s.totals.pswpout);
            assert!(store.pool_total_size() <= 1 << 20);
            let mut out = vec![0u8; folio];
            for i in (0..n).rev() {
                assert!(store.load(i as u64, &mut out).unwrap());
                assert!(out[..] == data[i * folio..(i + 1) * folio], "{algorithm} {folio} folio {i}");
            }
            let s = store.stats();
            assert!(s.totals.pswpin > 0 && s.totals.pswpin <= s.totals.pswpout);
            assert_eq!(s.totals.backing_pages, 0);
            assert!(store.is_empty());
            assert!(s.per_size.iter().all(|p| p.folio_bytes == folio as u64 && p.counters.zswpwb > 0));
        }
    }
}

#[test]
fn writeback_takes_the_coldest_first_raw_ones_included() {
    use rand::RngCore;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::with_backing(config(Algorithm::Lz4, Granularity::Folio, u64::MAX), Some(backing(dir.path())))
        .unwrap();
    let mut random = vec![0u8; 65536];
    rand::rngs::SmallRng::seed_from_u64(1).fill_bytes(&mut random);
    let text = uzswap_corpus::realistic(65536 * 3, 2);
    store.store(10, &random).unwrap();
    store.store(11, &text[..65536]).unwrap();
    store.store(12, &text[65536..131072]).unwrap();
    assert_eq!(store.writeback_batch(1).unwrap(), 16, "one entry: the coldest, raw");
    assert_eq!(store.coldest(), Some(11));
    let s = store.stats();
    assert_eq!(s.totals.backing_pages, 16);
    assert_eq!(s.totals.stored_incompressible_pages, 0, "the raw entry left memory");
    let mut out = vec![0u8; 65536];
    assert!(store.load(10, &mut out).unwrap());
    assert_eq!(out, random);
}

#[test]
fn failed_writes_keep_entries_in_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let bcfg = BackingConfig::new(dir.path(), 64 << 20);
    let plan = FaultPlan::new();
    let io = FaultyIo::new(PrivateFile::open(&bcfg).unwrap(), plan.clone());
    let file = BackingFile::with_io(bcfg, Box::new(io)).unwrap();
    let store = Store::with_backing(config(Algorithm::Zstd, Granularity::Folio, u64::MAX), Some(file)).unwrap();
    let data = uzswap_corpus::realistic(4 << 20, 3);
    for (i, folio) in data.chunks(65536).enumerate() {
        store.store(i as u64, folio).unwrap();
    }
    let before = store.stats();
    let lru = store.lru_len();
    for (k, fault) in [Fault::NoSpace, Fault::Eio, Fault::NoProgress].into_iter().enumerate() {
        // A write that makes no progress is retried a few times before it is an error.
        plan.fail_every_write(Some(fault));
        let err = store.writeback_batch(1 << 20).unwrap_err();
        plan.fail_every_write(None);
        assert!(matches!(err, StoreError::Backing(_)), "{fault:?}: {err}");
        let s = store.stats();
        assert_eq!(s.totals.reject_reclaim_fail, k as u64 + 1);
        assert_eq!(s.totals.stored_pages, before.totals.stored_pages, "{fault:?} lost pages");
        assert_eq!(s.totals.zswpwb, 0);
        assert_eq!(store.lru_len(), lru);
        assert_eq!(store.coldest(), Some(0), "the batch went back in LRU order");
    }
    // A short write that progresses is completed, and the data is right.
    plan.fail_next_write(Fault::Short(8192));
    assert!(store.writeback_batch(1 << 20).unwrap() > 0);
    let mut out = vec![0u8; 65536];
    for (i, folio) in data.chunks(65536).enumerate() {
        assert!(store.load(i as u64, &mut out).unwrap());
        assert!(out == folio, "folio {i}");
    }
    assert!(plan.injected() >= 4);
}

#[test]
fn a_corrupted_byte_in_the_file_is_an_error_not_wrong_data() {
    let dir = tempfile::tempdir().unwrap();
    let bcfg = BackingConfig::new(dir.path(), 64 << 20);
    let plan = FaultPlan::new();
    let io = FaultyIo::new(PrivateFile::open(&bcfg).unwrap(), plan.clone());
    let file = BackingFile::with_io(bcfg, Box::new(io)).unwrap();
    let store = Store::with_backing(config(Algorithm::Lz4, Granularity::Folio, u64::MAX), Some(file)).unwrap();
    let data = uzswap_corpus::realistic(65536, 4);
    store.store(1, &data).unwrap();
    store.writeback_batch(usize::MAX).unwrap();
    plan.fail_next_read(Fault::Flip);
    let mut out = vec![0u8; 65536];
    let err = store.load(1, &mut out).unwrap_err();
    assert!(err.to_string().contains("slot") || err.to_string().contains("corrupt"), "{err}");
    assert_eq!(store.stats().totals.decompress_fail, 1);
    // The entry is still there; a clean read gets the data.
    assert!(store.load(1, &mut out).unwrap());
    assert_eq!(out, data);
}

/// Random stores, loads, partial reads, invalidates and writebacks from several
/// threads, each thread checking its own keys against its model, while writeback
/// runs in the background.
#[test]
fn random_interleavings_match_a_model() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(
        Store::with_backing(config(Algorithm::Lz4, Granularity::Bytes(16384), 2 << 20), Some(backing(dir.path())))
            .unwrap(),
    );
    let corpus = Arc::new(uzswap_corpus::realistic(8 << 20, 6));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut batches = 0;
            while !stop.load(Ordering::Relaxed) {
                store.writeback_batch(256 << 10).unwrap();
                batches += 1;
                std::thread::yield_now();
            }
            batches
        })
    };
    let workers: Vec<_> = (0..3u64)
        .map(|t| {
            let (store, corpus) = (store.clone(), corpus.clone());
            std::thread::spawn(move || {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(t + 100);
                let mut model: HashMap<u64, (usize, usize)> = HashMap::new();
                for _ in 0..2500 {
                    let key = (t << 32) | rng.gen_range(0..200u64);
                    let mut out = vec![0u8; 65536];
                    match rng.gen_range(0..10) {
                        0..=4 => {
                            let len = 4096 << rng.gen_range(0..5);
                            let at = rng.gen_range(0..(corpus.len() - len) / 4096) * 4096;
                            store.store(key, &corpus[at..at + len]).unwrap();
                            model.insert(key, (at, len));
                        }
                        5..=6 => match model.remove(&key) {
                            Some((at, len)) => {
                                assert!(store.load(key, &mut out[..len]).unwrap());
                                assert!(out[..len] == corpus[at..at + len], "key {key:#x}");
                            }
                            None => assert!(!store.load(key, &mut out[..4096]).unwrap()),
                        },
                        7 => {
                            if let Some(&(at, len)) = model.get(&key) {
                                let off = rng.gen_range(0..len);
                                assert!(store.read_range(key, off, &mut out[..len - off]).unwrap());
                                assert!(out[..len - off] == corpus[at + off..at + len]);
                            }
                        }
                        _ => assert_eq!(store.invalidate(key), model.remove(&key).is_some()),
                    }
                }
                for (key, (at, len)) in model {
                    let mut out = vec![0u8; len];
                    assert!(store.load(key, &mut out).unwrap());
                    assert!(out[..] == corpus[at..at + len]);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    assert!(writer.join().unwrap() > 0);
    let s = store.stats();
    assert!(store.is_empty());
    assert_eq!(s.totals.stored_pages + s.totals.backing_pages, 0);
    assert!(s.totals.zswpwb > 0, "writeback ran");
    assert_eq!(store.lru_len(), 0);
}
