//! Mixed lookup/insert/erase throughput of `Index<u64>` against
//! `Mutex<BTreeMap<u64, u64>>` (zswap's rbtree under a spinlock, before it moved to
//! an xarray), at 1, 2, 4 and 8 threads, both run in the same process.
//!
//! `cargo run --release -p uzswap-index --example mixed_throughput -- [keys] [millis] [get%] [threads]`
//! (defaults: 1048576 keys, 1000 ms per run, 70% lookups; the rest split
//! evenly between insert and erase, so about half the keys stay present).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use uzswap_index::Index;

trait Map: Send + Sync + 'static {
    fn get(&self, key: u64) -> Option<u64>;
    fn insert(&self, key: u64, value: u64) -> Option<u64>;
    fn remove(&self, key: u64) -> Option<u64>;
}

impl Map for Index<u64> {
    fn get(&self, key: u64) -> Option<u64> {
        Index::get(self, key)
    }
    fn insert(&self, key: u64, value: u64) -> Option<u64> {
        Index::insert(self, key, value)
    }
    fn remove(&self, key: u64) -> Option<u64> {
        Index::remove(self, key)
    }
}

impl Map for Mutex<BTreeMap<u64, u64>> {
    fn get(&self, key: u64) -> Option<u64> {
        self.lock().unwrap().get(&key).copied()
    }
    fn insert(&self, key: u64, value: u64) -> Option<u64> {
        self.lock().unwrap().insert(key, value)
    }
    fn remove(&self, key: u64) -> Option<u64> {
        self.lock().unwrap().remove(&key)
    }
}

/// Operations per second over `run` with `threads` threads.
fn run<M: Map>(map: Arc<M>, threads: usize, keys: u64, run: Duration, get_percent: u32) -> f64 {
    let mut rng = SmallRng::seed_from_u64(1);
    for _ in 0..keys / 2 {
        let key = rng.gen_range(0..keys);
        map.insert(key, key);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let total = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (map, stop, total, barrier) = (map.clone(), stop.clone(), total.clone(), barrier.clone());
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t as u64 + 7);
                let mut ops = 0u64;
                let mut found = 0u64;
                barrier.wait();
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..64 {
                        let key = rng.gen_range(0..keys);
                        let dice = rng.gen_range(0..100);
                        let hit = if dice < get_percent {
                            map.get(key)
                        } else if dice % 2 == 0 {
                            map.insert(key, key)
                        } else {
                            map.remove(key)
                        };
                        found += hit.map_or(0, |v| (v == key) as u64);
                    }
                    ops += 64;
                }
                assert!(found > 0);
                total.fetch_add(ops, Ordering::Relaxed);
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    thread::sleep(run);
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    total.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: u64| args.get(i).map_or(default, |a| a.parse().expect("numeric argument"));
    let keys = arg(1, 1 << 20);
    let millis = Duration::from_millis(arg(2, 1000));
    let get_percent = arg(3, 70) as u32;
    println!("keys {keys}, {get_percent}% lookups, {} ms per run, {} CPUs",
        millis.as_millis(), thread::available_parallelism().map_or(0, |n| n.get()));
    println!("{:>7} {:>14} {:>14} {:>7} {:>12}", "threads", "index Mops/s", "btree Mops/s", "ratio", "index B/key");
    let counts: Vec<usize> = match args.get(4) {
        Some(t) => vec![t.parse().expect("numeric thread count")],
        None => vec![1, 2, 4, 8],
    };
    for threads in counts {
        let index = Arc::new(Index::<u64>::new());
        let index_rate = run(index.clone(), threads, keys, millis, get_percent);
        let bytes_per_key = index.memory_bytes() as f64 / index.len().max(1) as f64;
        drop(index);
        let btree_rate = run(Arc::new(Mutex::new(BTreeMap::new())), threads, keys, millis, get_percent);
        println!("{threads:>7} {:>14.2} {:>14.2} {:>7.2} {:>12.1}",
            index_rate / 1e6, btree_rate / 1e6, index_rate / btree_rate, bytes_per_key);
    }
}
