//! Many threads store, read and free objects of every kind while another thread
//! compacts in a loop; every read checks the object's content.

mod common;

use common::{matches, pattern};
use rand::{rngs::SmallRng, seq::SliceRandom, Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uzswap_pool::{Handle, Pool};

const WORKERS: u64 = 4;
const RUN_FOR: Duration = Duration::from_millis(2500);
/// Objects a worker keeps live at most.
const LIVE_PER_WORKER: usize = 3000;

fn random_size(rng: &mut SmallRng) -> usize {
    match rng.gen_range(0..100) {
        0..=59 => rng.gen_range(800..3600), // compressed 4 KiB pages
        60..=79 => rng.gen_range(10_240..40_960), // compressed 64 KiB folios
        80..=89 => rng.gen_range(1..256),
        90..=95 => rng.gen_range(3600..10_240),
        96..=97 => 0,
        _ => rng.gen_range(100_000..400_000), // both sides of the large threshold
    }
}

#[test]
fn store_read_free_while_compacting() {
    let pool = Arc::new(Pool::new());
    let baseline = pool.total_size();
    let stop = Arc::new(AtomicBool::new(false));
    let moved = Arc::new(AtomicU64::new(0));
    let compactions = Arc::new(AtomicU64::new(0));

    let compactor = {
        let (pool, stop, moved, compactions) = (
            pool.clone(),
            stop.clone(),
            moved.clone(),
            compactions.clone(),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                moved.fetch_add(pool.compact().moved_objects, Ordering::Relaxed);
                compactions.fetch_add(1, Ordering::Relaxed);
                std::thread::yield_now();
            }
        })
    };

    let workers: Vec<_> = (0..WORKERS)
        .map(|worker| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(worker);
                let mut live: Vec<(Handle, u64, usize)> = Vec::new();
                let mut ops = 0u64;
                let start = Instant::now();
                let mut counter = 0u64;
                while start.elapsed() < RUN_FOR {
                    ops += 1;
                    let grow = live.len() < LIVE_PER_WORKER / 2
                        || (live.len() < LIVE_PER_WORKER && rng.gen_bool(0.5));
                    if grow {
                        counter += 1;
                        let seed = worker << 40 | counter;
                        let size = random_size(&mut rng);
                        let h = pool.store(&pattern(seed, size)).expect("store");
                        live.push((h, seed, size));
                    } else {
                        let victim = rng.gen_range(0..live.len());
                        let (h, seed, size) = live.swap_remove(victim);
                        pool.read(h, |b| {
                            assert!(
                                b.len() == size && matches(seed, b),
                                "object changed before free"
                            )
                        });
                        pool.free(h);
                    }
                    // Read a few random live objects.
                    for _ in 0..2 {
                        if let Some(&(h, seed, size)) =
                            live.get(rng.gen_range(0..live.len().max(1)))
                        {
                            let ok = pool.read(h, |b| b.len() == size && matches(seed, b));
                            assert!(ok, "worker {worker}: {h:?} ({size} B) read back wrong");
                        }
                    }
                }
                (live, ops)
            })
        })
        .collect();

    let mut all_live = Vec::new();
    let mut total_ops = 0;
    for w in workers {
        let (live, ops) = w.join().expect("worker panicked");
        all_live.extend(live);
        total_ops += ops;
    }
    stop.store(true, Ordering::Relaxed);
    compactor.join().expect("compactor panicked");

    let stats = pool.stats();
    assert_eq!(stats.objects, all_live.len() as u64);
    assert_eq!(
        stats.object_bytes,
        all_live.iter().map(|&(_, _, s)| s as u64).sum::<u64>()
    );
    for &(h, seed, size) in &all_live {
        assert!(pool.read(h, |b| b.len() == size && matches(seed, b)));
    }
    eprintln!(
        "hammer: {total_ops} ops, {} compactions moved {} objects; {} live objects, {} B in {} B",
        compactions.load(Ordering::Relaxed),
        moved.load(Ordering::Relaxed),
        stats.objects,
        stats.object_bytes,
        stats.total_size
    );
    assert!(
        moved.load(Ordering::Relaxed) > 0,
        "compaction never moved anything: the test proves nothing"
    );

    let peak = pool.total_size();
    for (h, _, _) in all_live {
        pool.free(h);
    }
    pool.compact();
    let end = pool.total_size();
    // Only the span and handle tables stay: a small fraction of what was held.
    assert!(
        end - baseline < peak / 50,
        "{end} B held after freeing everything (baseline {baseline}, peak {peak})"
    );
}

/// Readers on several threads read the same long-lived objects over and over while a
/// churn thread keeps punching holes around them and compaction keeps moving them.
#[test]
fn readers_of_moving_objects_always_see_them_whole() {
    const SHARED: usize = 2000;
    const READERS: u64 = 3;
    let pool = Arc::new(Pool::new());
    let mut rng = SmallRng::seed_from_u64(99);
    // Shared objects interleaved with fillers, so freeing the fillers leaves every
    // span holding shared objects sparse.
    let mut shared = Vec::new();
    let mut fillers = Vec::new();
    for i in 0..SHARED as u64 {
        let size = if i % 2 == 0 {
            rng.gen_range(800..3600)
        } else {
            rng.gen_range(10_240..20_480)
        };
        shared.push((pool.store(&pattern(i, size)).unwrap(), i, size));
        for _ in 0..3 {
            fillers.push(pool.store(&vec![0xEE; size]).unwrap());
        }
    }
    let shared = Arc::new(shared);
    let stop = Arc::new(AtomicBool::new(false));
    let moved = Arc::new(AtomicU64::new(0));

    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let (pool, shared, stop) = (pool.clone(), shared.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(r);
                let mut reads = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let (h, seed, size) = shared[rng.gen_range(0..shared.len())];
                    assert!(
                        pool.read(h, |b| b.len() == size && matches(seed, b)),
                        "{h:?} seen torn or wrong"
                    );
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    let churn = {
        let (pool, stop, moved) = (pool.clone(), stop.clone(), moved.clone());
        std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(1234);
            let start = Instant::now();
            let mut rounds = 0;
            while rounds < 2 || start.elapsed() < Duration::from_millis(1500) {
                fillers.shuffle(&mut rng);
                let keep = fillers.len() / 4;
                for h in fillers.drain(keep..) {
                    pool.free(h);
                }
                moved.fetch_add(pool.compact().moved_objects, Ordering::Relaxed);
                while fillers.len() < 3 * SHARED {
                    let size = if rng.gen_bool(0.5) {
                        rng.gen_range(800..3600)
                    } else {
                        rng.gen_range(10_240..20_480)
                    };
                    fillers.push(pool.store(&vec![0xEE; size]).unwrap());
                }
                rounds += 1;
            }
            stop.store(true, Ordering::Relaxed);
            rounds
        })
    };
    let rounds = churn.join().expect("churn panicked");
    let reads: u64 = readers
        .into_iter()
        .map(|r| r.join().expect("reader panicked"))
        .sum();
    eprintln!(
        "moving readers: {rounds} churn rounds, {} objects moved, {reads} checked reads",
        moved.load(Ordering::Relaxed)
    );
    assert!(
        moved.load(Ordering::Relaxed) > SHARED as u64 / 2,
        "compaction hardly moved anything"
    );
    for &(h, seed, size) in shared.iter() {
        assert!(pool.read(h, |b| b.len() == size && matches(seed, b)));
    }
}
