//! The reclaimer gives back pool memory that holds nothing: after the program drops
//! every other swapped-out folio, the pool's spans are half holes, and within a few
//! seconds compaction has moved the objects together and unmapped the empty spans.

mod common;
use uzswap_runtime::*;

const MIB: usize = 1 << 20;
const FOLIO: usize = 64 << 10;

/// The test's pseudo-random words, in order (xorshift).
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn holes_left_by_dropped_folios_are_compacted() {
    let mut cfg = RuntimeConfig::new(4 * MIB as u64);
    cfg.publish_stats = false;
    let Some(rt) = common::or_skip(Runtime::new(cfg)) else { return };
    let len = 64 * MIB;
    let region = rt.create_region(len, FOLIO).unwrap();
    let base = region.as_ptr() as usize;
    // Poorly compressible folios (a pool object of several KiB each): a pseudo-random
    // first half, zeros after.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for f in 0..len / FOLIO {
        let p = (base + f * FOLIO) as *mut u64;
        for w in 0..FOLIO / 16 {
            // SAFETY: inside the live region.
            unsafe { p.add(w).write_volatile(next(&mut x)) };
        }
    }
    let wait = |done: &dyn Fn() -> bool| {
        for _ in 0..1000 {
            if done() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    };
    wait(&|| rt.stats().resident_bytes <= 4 * MIB as u64);
    let before = rt.store().pool_bytes();
    let stored = rt.store().stats().compressed_bytes;
    assert!(stored > 16 * MIB as u64, "the pool holds the folios: {stored}");
    // Every other folio dropped: its object is freed, a hole in its span.
    for f in (0..len / FOLIO).step_by(2) {
        // SAFETY: a range of our region.
        assert_eq!(unsafe { libc::madvise((base + f * FOLIO) as *mut _, FOLIO, libc::MADV_DONTNEED) }, 0);
    }
    wait(&|| rt.store().stats().totals.compactions > 0 && rt.store().pool_bytes() < before * 3 / 4);
    let st = rt.store().stats();
    assert!(st.totals.compactions > 0 && st.totals.compacted_bytes > 0, "no compaction: {st:?}");
    let after = rt.store().pool_bytes();
    assert!(after < before * 3 / 4, "pool {after} bytes after compaction, {before} before, {} stored", st.compressed_bytes);
    // What is left reads back right.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for f in 0..len / FOLIO {
        let p = (base + f * FOLIO) as *const u64;
        for w in 0..FOLIO / 16 {
            let x = next(&mut x);
            let want = if f % 2 == 0 { 0 } else { x };
            // SAFETY: inside the live region.
            assert_eq!(unsafe { p.add(w).read_volatile() }, want, "folio {f} word {w}");
        }
    }
    drop(region);
}
