//! The pool's memory targets, on sizes drawn like real compressed data:
//! - at most 48 B of pool overhead per stored 4 KiB page (handle, class rounding,
//!   span tails, metadata: everything `total_size` counts beyond the object bytes);
//! - after freeing a random half of the objects and compacting, `total_size` within
//!   10% of the live object bytes;
//! - after freeing everything and compacting, only table pages are left.

mod common;

use common::{matches, pattern};
use rand::{rngs::SmallRng, seq::SliceRandom, Rng, SeedableRng};
use uzswap_pool::{Handle, Pool};

struct Outcome {
    overhead_per_4k: f64,
    after_compact_ratio: f64,
}

/// Stores `count` objects with sizes from `size`, each standing for `pages_per_object`
/// 4 KiB pages, then frees a random half and compacts.
fn run(count: usize, pages_per_object: f64, size: impl Fn(&mut SmallRng) -> usize) -> Outcome {
    let mut rng = SmallRng::seed_from_u64(42);
    let pool = Pool::new();
    let empty = pool.total_size();
    // One buffer, sliced at a seed-dependent offset, keeps the test fast.
    let source = pattern(7, 1024 * 1024);
    let mut live: Vec<(Handle, usize, usize)> = (0..count)
        .map(|i| {
            let len = size(&mut rng);
            let offset = i % 4096;
            (
                pool.store(&source[offset..offset + len]).unwrap(),
                offset,
                len,
            )
        })
        .collect();
    let stats = pool.stats();
    let peak = stats.total_size;
    let overhead_per_4k =
        (stats.total_size - stats.object_bytes) as f64 / (count as f64 * pages_per_object);

    live.shuffle(&mut rng);
    for (h, _, _) in live.drain(count / 2..) {
        pool.free(h);
    }
    pool.compact();
    let stats = pool.stats();
    let after_compact_ratio = stats.total_size as f64 / stats.object_bytes as f64;
    for &(h, offset, len) in &live {
        pool.read(h, |b| assert_eq!(b, &source[offset..offset + len]));
    }

    for (h, _, _) in live {
        pool.free(h);
    }
    pool.compact();
    let left = pool.total_size() - empty;
    assert!(
        left < peak / 100,
        "{left} B held after freeing everything (peak {peak})"
    );
    Outcome {
        overhead_per_4k,
        after_compact_ratio,
    }
}

#[test]
fn compressed_4k_pages() {
    let out = run(60_000, 1.0, |rng| rng.gen_range(800..=3600));
    eprintln!(
        "4 KiB pages (800..3600 B): {:.1} B overhead per page; after half freed + compact: {:.3} x live bytes",
        out.overhead_per_4k, out.after_compact_ratio
    );
    assert!(
        out.overhead_per_4k <= 48.0,
        "{:.1} B per 4 KiB page",
        out.overhead_per_4k
    );
    assert!(
        out.after_compact_ratio <= 1.10,
        "{:.3}",
        out.after_compact_ratio
    );
}

#[test]
fn compressed_64k_folios() {
    let out = run(5_000, 16.0, |rng| rng.gen_range(10 * 1024..=40 * 1024));
    eprintln!(
        "64 KiB folios (10..40 KiB): {:.1} B overhead per 4 KiB page; after half freed + compact: {:.3} x live bytes",
        out.overhead_per_4k, out.after_compact_ratio
    );
    assert!(
        out.overhead_per_4k <= 48.0,
        "{:.1} B per 4 KiB page",
        out.overhead_per_4k
    );
    assert!(
        out.after_compact_ratio <= 1.10,
        "{:.3}",
        out.after_compact_ratio
    );
}

#[test]
fn mixed_sizes_including_large_objects() {
    // 2 MiB folios compress to hundreds of KiB and get their own mappings.
    let out = run(3_000, 8.0, |rng| match rng.gen_range(0..10) {
        0 => rng.gen_range(200 * 1024..=600 * 1024),
        1..=5 => rng.gen_range(800..=3600),
        _ => rng.gen_range(10 * 1024..=40 * 1024),
    });
    assert!(
        out.after_compact_ratio <= 1.10,
        "{:.3}",
        out.after_compact_ratio
    );
}

#[test]
fn large_objects_cost_their_pages() {
    let pool = Pool::new();
    let empty = pool.total_size();
    let sizes = [200_000usize, 700_000, 1_500_000, Pool::MAX_OBJECT_SIZE];
    let handles: Vec<Handle> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| pool.store(&pattern(i as u64, s)).unwrap())
        .collect();
    let bytes: usize = sizes.iter().sum();
    let over = pool.total_size() - empty - bytes as u64;
    // Page rounding (under a page each) plus a handle page and span table.
    assert!(
        over < (sizes.len() as u64 + 1) * 4096 + 16 * 1024,
        "{over} B over"
    );
    for (i, (&h, &s)) in handles.iter().zip(&sizes).enumerate() {
        assert!(pool.read(h, |b| b.len() == s && matches(i as u64, b)));
    }
}
