//! The store end to end: every compressor and granularity, many threads, counters.

use rand::{Rng, RngCore, SeedableRng};
use std::sync::Arc;
use uzswap_store::{Algorithm, CodecConfig, Granularity, Store, StoreConfig, StoreError};

fn config(algorithm: Algorithm, level: i32, granularity: Granularity) -> StoreConfig {
    StoreConfig {
        codec: CodecConfig { algorithm, level, granularity, raw_threshold_percent: 90, verify: false },
        ..StoreConfig::default()
    }
}

const GRANULARITIES: [Granularity; 5] = [
    Granularity::Bytes(4096),
    Granularity::Bytes(16384),
    Granularity::Bytes(65536),
    Granularity::Bytes(262144),
    Granularity::Folio,
];
const CODECS: [(Algorithm, i32); 4] = [(Algorithm::Lz4, 0), (Algorithm::Zstd, 3), (Algorithm::Zstd, -5), (Algorithm::Deflate, 6)];

/// Test folios of each kind of content, for a folio size.
fn folios(len: usize, seed: u64) -> Vec<(&'static str, Vec<u8>)> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut random = vec![0u8; len];
    rng.fill_bytes(&mut random);
    let same: Vec<u8> = 0xdead_beef_0123_4567u64.to_ne_bytes().iter().copied().cycle().take(len).collect();
    let mut mixed = uzswap_corpus::realistic(len, seed);
    mixed[..len / 2].copy_from_slice(&random[..len / 2]);
    vec![
        ("zero", vec![0u8; len]),
        ("same", same),
        ("random", random),
        ("realistic", uzswap_corpus::realistic(len, seed + 1)),
        ("mixed", mixed),
    ]
}

#[test]
fn round_trip_every_codec_and_granularity() {
    for (algorithm, level) in CODECS {
        for granularity in GRANULARITIES {
            let store = Store::new(config(algorithm, level, granularity)).unwrap();
            let mut key = 0;
            for folio_len in [4096, 16384, 65536, 2 << 20] {
                for (what, data) in folios(folio_len, key) {
                    store.store(key, &data).unwrap();
                    let mut out = vec![0xAAu8; folio_len];
                    // A partial read first: the entry stays.
                    let (off, n) = (folio_len / 3, folio_len / 4);
                    assert!(store.read_range(key, off, &mut out[..n]).unwrap());
                    assert!(out[..n] == data[off..off + n], "{algorithm} {granularity} {what} {folio_len} range");
                    assert!(store.load(key, &mut out).unwrap());
                    assert!(out == data, "{algorithm} {granularity} {what} {folio_len}");
                    assert!(!store.load(key, &mut out).unwrap(), "load is exclusive");
                    key += 1;
                }
            }
            let s = store.stats();
            assert_eq!(s.totals.zswpout, s.totals.zswpin);
            assert_eq!(s.totals.stored_pages, 0);
            assert_eq!(s.compressed_bytes, 0);
            assert!(store.is_empty());
        }
    }
}

#[test]
fn counters_follow_the_kernel_names() {
    let store = Store::new(config(Algorithm::Lz4, 0, Granularity::Bytes(4096))).unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(9);
    let mut random = vec![0u8; 16384];
    rng.fill_bytes(&mut random);
    store.store(1, &vec![0u8; 65536]).unwrap();
    store.store(2, &random).unwrap();
    store.store(3, &uzswap_corpus::realistic(65536, 3)).unwrap();
    let s = store.stats();
    assert_eq!(s.totals.zswpout, 16 + 4 + 16);
    assert_eq!(s.totals.stored_pages, 36);
    assert_eq!(s.totals.same_filled_pages, 16);
    assert_eq!(s.totals.stored_incompressible_pages, 4);
    let per: Vec<(u64, u64)> = s.per_size.iter().map(|p| (p.folio_bytes, p.counters.stored)).collect();
    assert_eq!(per, vec![(16384, 1), (65536, 2)]);
    assert!(s.pool_total_size > 0 && s.compressed_bytes > 16384);
    assert_eq!(store.lru_len(), 2, "raw entries are on the LRU, same-filled ones hold no pool memory");
    assert_eq!(store.coldest(), Some(2));
    assert!(store.invalidate(2));
    assert!(!store.invalidate(2));
    assert_eq!(store.coldest(), Some(3));
    assert_eq!(store.stats().totals.stored_incompressible_pages, 0);
}

#[test]
fn bad_input_is_an_error_and_loses_nothing() {
    let store = Store::new(config(Algorithm::Zstd, 1, Granularity::Folio)).unwrap();
    assert!(matches!(store.store(1, &[0u8; 5000]), Err(StoreError::FolioSize(5000))));
    assert!(matches!(store.store(1, &vec![0u8; 4 << 20]), Err(StoreError::FolioSize(_))));
    let data = uzswap_corpus::realistic(16384, 1);
    store.store(7, &data).unwrap();
    let mut small = vec![0u8; 4096];
    assert!(matches!(store.load(7, &mut small), Err(StoreError::SizeMismatch { .. })));
    let mut out = vec![0u8; 16384];
    assert!(store.load(7, &mut out).unwrap());
    assert_eq!(out, data);

    let strict = StoreConfig { store_incompressible: false, ..config(Algorithm::Lz4, 0, Granularity::Folio) };
    assert!(Store::new(StoreConfig { accept_threshold_percent: 0, ..strict.clone() }).is_err());
    let store = Store::new(strict).unwrap();
    let mut random = vec![0u8; 4096];
    rand::rngs::SmallRng::seed_from_u64(1).fill_bytes(&mut random);
    assert!(matches!(store.store(1, &random), Err(StoreError::Incompressible)));
    assert_eq!(store.stats().totals.reject_compress_poor, 1);
    assert!(store.is_empty());

    let bad_level = config(Algorithm::Deflate, 99, Granularity::Folio);
    assert!(Store::new(bad_level).is_err());
}

#[test]
fn a_full_pool_without_backing_refuses_stores() {
    let limited = StoreConfig { max_pool_bytes: Some(256 << 10), ..config(Algorithm::Lz4, 0, Granularity::Folio) };
    let store = Store::new(limited).unwrap();
    let data = uzswap_corpus::realistic(8 << 20, 5);
    let mut refused = None;
    for (i, folio) in data.chunks(65536).enumerate() {
        if let Err(e) = store.store(i as u64, folio) {
            assert!(matches!(e, StoreError::PoolLimit { .. }), "{e}");
            refused = Some(i);
            break;
        }
    }
    let refused = refused.expect("the pool filled up");
    // The limit is checked before each store, as zswap does; one store may add a span.
    assert!(store.pool_total_size() <= (256 << 10) + (128 << 10), "{}", store.pool_total_size());
    assert!(store.stats().totals.pool_limit_hit >= 1);
    // What went in before the limit is intact.
    let mut out = vec![0u8; 65536];
    for i in 0..refused {
        assert!(store.load(i as u64, &mut out).unwrap());
        assert!(out[..] == data[i * 65536..(i + 1) * 65536]);
    }
    // Below the accept threshold, stores are taken again.
    store.store(1000, &data[..65536]).unwrap();
}

#[test]
fn replacing_an_entry_frees_the_old_one() {
    let store = Store::new(config(Algorithm::Lz4, 0, Granularity::Folio)).unwrap();
    let a = uzswap_corpus::realistic(65536, 1);
    let b = uzswap_corpus::realistic(16384, 2);
    store.store(5, &a).unwrap();
    store.store(5, &b).unwrap();
    assert_eq!(store.len(), 1);
    assert_eq!(store.lru_len(), 1);
    assert_eq!(store.stats().totals.stored_pages, 4);
    let mut out = vec![0u8; 16384];
    assert!(store.load(5, &mut out).unwrap());
    assert_eq!(out, b);
}

/// Several threads store, partially read, load and invalidate their own keys while
/// sharing the store, the way the runtime's fault and reclaim threads do.
#[test]
fn hammered_by_threads() {
    for granularity in [Granularity::Bytes(4096), Granularity::Bytes(16384), Granularity::Folio] {
        let store = Arc::new(Store::new(config(Algorithm::Lz4, 0, granularity)).unwrap());
        let corpus = Arc::new(uzswap_corpus::realistic(4 << 20, 11));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let (store, corpus) = (store.clone(), corpus.clone());
                std::thread::spawn(move || {
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(t);
                    let mut live: Vec<(u64, usize, usize)> = Vec::new();
                    for i in 0..3000u64 {
                        let key = (t << 32) | i;
                        if live.len() < 64 && rng.gen_bool(0.6) || live.is_empty() {
                            let len = 4096 << rng.gen_range(0..5);
                            let at = rng.gen_range(0..(corpus.len() - len) / 4096) * 4096;
                            store.store(key, &corpus[at..at + len]).unwrap();
                            live.push((key, at, len));
                        } else {
                            let (key, at, len) = live.swap_remove(rng.gen_range(0..live.len()));
                            let want = &corpus[at..at + len];
                            if rng.gen_bool(0.1) {
                                assert!(store.invalidate(key));
                                continue;
                            }
                            let mut out = vec![0u8; len];
                            let off = rng.gen_range(0..len);
                            assert!(store.read_range(key, off, &mut out[..len - off]).unwrap());
                            assert!(out[..len - off] == want[off..]);
                            assert!(store.load(key, &mut out).unwrap());
                            assert!(out == want, "key {key:#x}");
                        }
                    }
                    for (key, ..) in live {
                        assert!(store.invalidate(key));
                    }
                })
            })
            .collect();
        // Compaction runs alongside, as the pool's shrinker would.
        for _ in 0..20 {
            store.compact();
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        for t in threads {
            t.join().unwrap();
        }
        let s = store.stats();
        assert!(store.is_empty());
        assert_eq!(s.totals.stored_pages, 0);
        assert_eq!(s.compressed_bytes, 0);
        assert_eq!(store.lru_len(), 0);
        store.compact();
        assert!(store.pool_bytes() < 1 << 20, "pool keeps {} bytes when empty", store.pool_bytes());
    }
}
