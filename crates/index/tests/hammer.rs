//! Readers and writers on overlapping and disjoint keys at once. Every value
//! encodes its key and a version, with a checksum over heap data, so a reader
//! notices a value of another key, a torn value or freed memory.
#![cfg(not(loom))]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use uzswap_index::Index;

#[derive(Debug, PartialEq, Eq)]
struct Payload {
    key: u64,
    version: u64,
    words: [u64; 4],
}

type Value = Arc<Payload>;

fn payload(key: u64, version: u64) -> Value {
    let mut words = [0u64; 4];
    for (i, w) in words.iter_mut().enumerate() {
        *w = (key ^ version.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(i as u64);
    }
    Arc::new(Payload { key, version, words })
}

fn check(key: u64, value: &Payload) {
    assert_eq!(value.key, key, "value of key {} found under key {key}", value.key);
    assert_eq!(*value, *payload(key, value.version), "torn or freed value under key {key}");
}

const SHARED_KEYS: u64 = 300;
const WRITERS: u64 = 3;
const OWNED_PER_WRITER: u64 = 2000;

/// Keys only writer `w` changes: spread over many leaves, mids and shards.
fn owned_key(w: u64, i: u64) -> u64 {
    ((w + 1) << 40) | (i * 37)
}

#[test]
fn readers_and_writers_on_shared_and_owned_keys() {
    let index = Arc::new(Index::<Value>::new());
    let stop = Arc::new(AtomicBool::new(false));
    // Highest version each owned key has been given, for the readers' monotonicity check.
    let published: Arc<Vec<AtomicU64>> = Arc::new((0..WRITERS * OWNED_PER_WRITER).map(|_| AtomicU64::new(0)).collect());
    let barrier = Arc::new(Barrier::new(WRITERS as usize + 3));
    let run_for = Duration::from_millis(1500);

    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (index, stop, published, barrier) = (index.clone(), stop.clone(), published.clone(), barrier.clone());
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(w);
                let mut model: Vec<Option<u64>> = vec![None; OWNED_PER_WRITER as usize];
                let mut version = 0u64;
                let mut ops = 0u64;
                barrier.wait();
                while !stop.load(Ordering::Relaxed) {
                    version += 1;
                    ops += 1;
                    if rng.gen_bool(0.5) {
                        let key = rng.gen_range(0..SHARED_KEYS);
                        match rng.gen_range(0..3) {
                            0 => {
                                if let Some(old) = index.insert(key, payload(key, version)) {
                                    check(key, &old);
                                }
                            }
                            1 => {
                                if let Some(old) = index.remove(key) {
                                    check(key, &old);
                                }
                            }
                            _ => {
                                if let Some(old) = index.remove_if(key, |v| v.version % 2 == 0) {
                                    check(key, &old);
                                    assert_eq!(old.version % 2, 0);
                                }
                            }
                        }
                    } else {
                        let i = rng.gen_range(0..OWNED_PER_WRITER);
                        let key = owned_key(w, i);
                        let slot = &mut model[i as usize];
                        if rng.gen_bool(0.6) {
                            published[(w * OWNED_PER_WRITER + i) as usize].store(version, Ordering::Release);
                            let old = index.insert(key, payload(key, version));
                            assert_eq!(old.map(|v| v.version), *slot);
                            *slot = Some(version);
                        } else if rng.gen_bool(0.5) {
                            assert_eq!(index.remove(key).map(|v| v.version), slot.take());
                        } else {
                            let expected = slot.filter(|v| v % 3 == 0);
                            let got = index.remove_if(key, |v| v.version % 3 == 0);
                            assert_eq!(got.map(|v| v.version), expected);
                            if expected.is_some() {
                                *slot = None;
                            }
                        }
                    }
                }
                (model, ops)
            })
        })
        .collect();

    let readers: Vec<_> = (0..2u64)
        .map(|r| {
            let (index, stop, published, barrier) = (index.clone(), stop.clone(), published.clone(), barrier.clone());
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(100 + r);
                let mut last_seen = vec![0u64; (WRITERS * OWNED_PER_WRITER) as usize];
                let mut hits = 0u64;
                barrier.wait();
                while !stop.load(Ordering::Relaxed) {
                    if rng.gen_bool(0.3) {
                        let key = rng.gen_range(0..SHARED_KEYS);
                        if let Some(v) = index.get(key) {
                            check(key, &v);
                            hits += 1;
                        }
                    } else {
                        let (w, i) = (rng.gen_range(0..WRITERS), rng.gen_range(0..OWNED_PER_WRITER));
                        let key = owned_key(w, i);
                        let n = (w * OWNED_PER_WRITER + i) as usize;
                        let seen = index.with(key, |v| {
                            check(key, v);
                            v.version
                        });
                        if let Some(version) = seen {
                            hits += 1;
                            // Single writer per key and rising versions: a reader
                            // must never go back in time, nor see the future.
                            assert!(version >= last_seen[n], "key {key}: saw {version} after {}", last_seen[n]);
                            assert!(version <= published[n].load(Ordering::Acquire));
                            last_seen[n] = version;
                        }
                    }
                }
                hits
            })
        })
        .collect();

    barrier.wait();
    let start = Instant::now();
    thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    let mut present = 0;
    let mut total_ops = 0;
    for (w, handle) in writers.into_iter().enumerate() {
        let (model, ops) = handle.join().expect("writer panicked");
        total_ops += ops;
        for (i, version) in model.into_iter().enumerate() {
            let key = owned_key(w as u64, i as u64);
            assert_eq!(index.get(key).map(|v| v.version), version);
            present += version.is_some() as usize;
        }
    }
    let hits: u64 = readers.into_iter().map(|h| h.join().expect("reader panicked")).sum();
    for key in 0..SHARED_KEYS {
        if let Some(v) = index.get(key) {
            check(key, &v);
            present += 1;
        }
    }
    assert_eq!(index.len(), present);
    assert!(hits > 1000, "readers found only {hits} values");
    eprintln!("{total_ops} writes, {hits} read hits in {:?}", start.elapsed());

    // Emptying everything unlinks every node.
    for key in 0..SHARED_KEYS {
        index.remove(key);
    }
    for w in 0..WRITERS {
        for i in 0..OWNED_PER_WRITER {
            index.remove(owned_key(w, i));
        }
    }
    let stats = index.stats();
    assert_eq!((stats.entries, stats.nodes), (0, 0), "{stats:?}");
}

/// Inserts and removes that keep creating and condemning the same leaf and mid
/// node from several threads: an insert must never land in a detached node.
#[test]
fn node_churn_never_loses_an_insert() {
    let index = Arc::new(Index::<u64>::new());
    let threads = 4u64;
    let rounds = 20_000u64;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let index = index.clone();
            thread::spawn(move || {
                for round in 0..rounds {
                    // Each thread owns one key of the same leaf.
                    let key = (5 << 18) + t;
                    let value = round << 8 | t;
                    assert_eq!(index.insert(key, value), None);
                    assert_eq!(index.get(key), Some(value), "insert lost");
                    assert_eq!(index.remove(key), Some(value));
                    assert_eq!(index.get(key), None);
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().expect("churn thread panicked");
    }
    let stats = index.stats();
    assert_eq!((stats.entries, stats.nodes, stats.shards), (0, 0, 1), "{stats:?}");
}

/// Threads racing to create the same shards (and their first nodes): no insert
/// may land in a duplicate shard that lookups never reach.
#[test]
fn concurrent_shard_creation() {
    let index = Arc::new(Index::<u64>::new());
    let threads = 4u64;
    let shards = 3000u64;
    let barrier = Arc::new(Barrier::new(threads as usize));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (index, barrier) = (index.clone(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                for s in 0..shards {
                    let key = (s.wrapping_mul(0x1_0000_0001) << 18) + t * 4096;
                    assert_eq!(index.insert(key, key ^ t), None);
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().expect("thread panicked");
    }
    for t in 0..threads {
        for s in 0..shards {
            let key = (s.wrapping_mul(0x1_0000_0001) << 18) + t * 4096;
            assert_eq!(index.get(key), Some(key ^ t), "key {key:#x} lost");
        }
    }
    let stats = index.stats();
    assert_eq!((stats.entries, stats.shards), ((threads * shards) as usize, shards as usize), "{stats:?}");
}

/// Reclamation under load: readers check values in place (a value freed under a
/// reader would show torn words, or crash) while writers replace and remove them and
/// reclaim as often as they can.
#[test]
fn readers_never_see_reclaimed_values() {
    let index = Arc::new(Index::<[u64; 8]>::new());
    let keys = 256u64;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (index, stop) = (index.clone(), stop.clone());
            thread::spawn(move || {
                let mut seen = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for key in 0..keys {
                        index.with(key, |v| {
                            assert!(v.iter().all(|&w| w == v[0]), "torn value {v:?} under key {key}");
                            assert_eq!(v[0] >> 32, key, "value of another key under key {key}");
                            seen += 1;
                        });
                    }
                }
                seen
            })
        })
        .collect();
    let writers: Vec<_> = (0..2u64)
        .map(|t| {
            let index = index.clone();
            thread::spawn(move || {
                for round in 0..20_000u64 {
                    let key = (round * 7 + t) % keys;
                    let word = key << 32 | round;
                    if round % 3 == 0 {
                        index.remove(key);
                    } else {
                        index.insert(key, [word; 8]);
                    }
                    index.reclaim();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().expect("writer panicked");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen: u64 = readers.into_iter().map(|r| r.join().expect("reader panicked")).sum();
    assert!(seen > 0);
}

/// `replace` swaps present values only, from several threads at once, while others
/// remove and re-insert: every key ends with a value some writer gave it, and an
/// absent key gives the prepared value back.
#[test]
fn replace_only_touches_present_keys() {
    let index = Arc::new(Index::<u64>::new());
    assert!(index.replace(5, index.prepare(1)).is_err());
    let keys = 512u64;
    for key in 0..keys {
        index.insert(key, key << 32);
    }
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let index = index.clone();
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t);
                for round in 0..20_000u64 {
                    let key = rng.gen_range(0..keys);
                    let value = key << 32 | (t << 24) | (round & 0xFF_FFFF);
                    match t {
                        0 => {
                            if index.remove(key).is_some() {
                                index.insert(key, value);
                            }
                        }
                        _ => {
                            if let Ok(old) = index.replace(key, index.prepare(value)) {
                                assert_eq!(old >> 32, key, "replaced a value of another key");
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("thread panicked");
    }
    for key in 0..keys {
        let v = index.get(key).expect("every key is present at the end");
        assert_eq!(v >> 32, key);
    }
    assert_eq!(index.len(), keys as usize);
}
