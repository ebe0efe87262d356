//! `uzswap bench index`: our index against a `Mutex<BTreeMap>` (zswap's rbtree
//! under a spinlock, before it moved to an xarray) at 1, 2, 4 and 8 threads of mixed
//! lookups, inserts and erases over a shared key space, as the zswap tree sees them.

use crate::report::Report;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};
use uzswap_index::Index;

pub struct IndexBenchOpts {
    pub quick: bool,
    pub json: bool,
}

#[derive(Serialize)]
pub struct IndexRow {
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    pub threads: usize,
    pub mops: f64,
}

/// The operations a benchmark thread performs; both sides implement it.
trait Map: Sync {
    fn lookup(&self, key: u64) -> bool;
    fn insert(&self, key: u64, value: u64);
    fn erase(&self, key: u64);
}

impl Map for Index<u64> {
    fn lookup(&self, key: u64) -> bool {
        self.get(key).is_some()
    }
    fn insert(&self, key: u64, value: u64) {
        Index::insert(self, key, value);
    }
    fn erase(&self, key: u64) {
        self.remove(key);
    }
}

impl Map for Mutex<BTreeMap<u64, u64>> {
    fn lookup(&self, key: u64) -> bool {
        self.lock().unwrap().contains_key(&key)
    }
    fn insert(&self, key: u64, value: u64) {
        self.lock().unwrap().insert(key, value);
    }
    fn erase(&self, key: u64) {
        self.lock().unwrap().remove(&key);
    }
}

/// Keys are the slots of 4 GiB of swap; half are present at the start.
const KEYS: u64 = 1 << 20;

pub fn run(opts: &IndexBenchOpts) -> Result<Report, String> {
    let secs = if opts.quick { 0.4 } else { 2.0 };
    let mut report = Report::new(opts.json);
    for threads in [1, 2, 4, 8] {
        let ours: Index<u64> = Index::new();
        let theirs = Mutex::new(BTreeMap::new());
        for k in (0..KEYS).step_by(2) {
            ours.insert(k, k);
            theirs.lock().unwrap().insert(k, k);
        }
        report.row(&IndexRow { implementation: "uzswap-index", threads, mops: mixed(&ours, threads, secs) });
        report.row(&IndexRow { implementation: "mutex-btreemap", threads, mops: mixed(&theirs, threads, secs) });
    }
    Ok(report)
}

/// Runs `threads` threads of 80% lookups, 10% inserts and 10% erases for `secs`;
/// returns millions of operations per second.
fn mixed(map: &dyn Map, threads: usize, secs: f64) -> f64 {
    let stop = AtomicBool::new(false);
    let start = Barrier::new(threads + 1);
    let total: u64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (stop, start) = (&stop, &start);
                s.spawn(move || {
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(t as u64);
                    let mut ops = 0u64;
                    start.wait();
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..256 {
                            let key = rng.gen_range(0..KEYS);
                            match rng.gen_range(0..10) {
                                0 => map.insert(key, key),
                                1 => map.erase(key),
                                _ => {
                                    std::hint::black_box(map.lookup(key));
                                }
                            }
                        }
                        ops += 256;
                    }
                    ops
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(secs));
        stop.store(true, Ordering::Relaxed);
        let ops: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
        let elapsed = t.elapsed().as_secs_f64();
        (ops as f64 / elapsed) as u64
    });
    total as f64 / 1e6
}
