//! Unit tests that look inside the pool: exact accounting, compaction's effect on
//! spans, invalid handles. Concurrency and model tests are in `tests/`.

use super::*;
use class::LARGE_THRESHOLD;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn page() -> u64 {
    sys::page_size() as u64
}

fn span_slot_segment_bytes() -> u64 {
    64 * std::mem::size_of::<spans::SpanSlot>() as u64
}

#[test]
fn objects_of_every_kind_round_trip() {
    let pool = Pool::new();
    let sizes = [
        0,
        1,
        15,
        16,
        17,
        800,
        3600,
        4096,
        4097,
        40_000,
        LARGE_THRESHOLD,
        LARGE_THRESHOLD + 1,
        1 << 20,
        Pool::MAX_OBJECT_SIZE,
    ];
    let handles: Vec<Handle> = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| pool.store(&pattern(i as u64, size)).unwrap())
        .collect();
    let distinct: std::collections::HashSet<_> = handles.iter().collect();
    assert_eq!(distinct.len(), handles.len());
    for (i, (&size, &h)) in sizes.iter().zip(&handles).enumerate() {
        pool.read(h, |bytes| {
            assert_eq!(bytes, &pattern(i as u64, size)[..], "size {size}")
        });
    }
    let stats = pool.stats();
    assert_eq!(stats.objects, sizes.len() as u64);
    assert_eq!(stats.object_bytes, sizes.iter().sum::<usize>() as u64);
    for h in handles {
        pool.try_free(h).unwrap();
    }
    assert_eq!(pool.stats().objects, 0);
    assert_eq!(pool.stats().object_bytes, 0);
}

#[test]
fn too_large_is_rejected() {
    let pool = Pool::new();
    let data = vec![0u8; Pool::MAX_OBJECT_SIZE + 1];
    assert_eq!(
        pool.store(&data),
        Err(PoolError::TooLarge(Pool::MAX_OBJECT_SIZE + 1))
    );
    assert_eq!(pool.stats().objects, 0);
}

#[test]
fn accounting_is_exact() {
    let pool = Pool::new();
    let fixed = (std::mem::size_of::<Pool>() + std::mem::size_of_val(&*pool.classes)) as u64;
    assert_eq!(pool.total_size(), fixed);

    let size = 1000;
    let info = pool.table.classes[pool.table.class_of(size).unwrap()];
    let first = pool.store(&pattern(1, size)).unwrap();
    let rmap = info.objs_per_span as u64 * 4;
    // Span table segment, the span's reverse map, one touched page, one handle page.
    let one = fixed + span_slot_segment_bytes() + rmap + page() + page();
    assert_eq!(pool.total_size(), one);

    // Filling the span touches its pages one by one, and no more.
    let mut handles = vec![first];
    for i in 1..info.objs_per_span {
        handles.push(pool.store(&pattern(i as u64, size)).unwrap());
    }
    let span_pages = (info.objs_per_span as u64 * info.size as u64).div_ceil(page());
    assert_eq!(
        pool.total_size(),
        fixed + span_slot_segment_bytes() + rmap + span_pages * page() + page()
    );
    // The next object needs a second span.
    handles.push(pool.store(&pattern(99, size)).unwrap());
    assert_eq!(
        pool.total_size(),
        fixed + span_slot_segment_bytes() + 2 * rmap + (span_pages + 1) * page() + page()
    );

    // A large object costs its page-rounded mapping.
    let before = pool.total_size();
    let large = pool.store(&pattern(5, LARGE_THRESHOLD + 1)).unwrap();
    assert_eq!(
        pool.total_size(),
        before + sys::round_up_to_page(LARGE_THRESHOLD + 1) as u64
    );
    pool.free(large);
    assert_eq!(pool.total_size(), before);

    // Empty objects cost only their handle.
    let empty = pool.store(&[]).unwrap();
    pool.read(empty, |b| assert!(b.is_empty()));
    assert_eq!(pool.total_size(), before);
    pool.free(empty);

    // Freeing everything unmaps the spans at once; only the tables stay.
    for h in handles {
        pool.free(h);
    }
    assert_eq!(
        pool.total_size(),
        fixed + span_slot_segment_bytes() + page()
    );
    assert_eq!(
        pool.stats(),
        PoolStats {
            objects: 0,
            object_bytes: 0,
            total_size: pool.total_size()
        }
    );
}

#[test]
fn invalid_handles_are_reported_and_ignored() {
    let pool = Pool::new();
    let keep = pool.store(&pattern(1, 2000)).unwrap();
    let h = pool.store(&pattern(2, 2000)).unwrap();
    let large = pool.store(&pattern(3, 300_000)).unwrap();
    for bogus in [
        Handle(0),
        Handle(u64::MAX),
        Handle(1 << 40 | 1),
        Handle(12345),
    ] {
        assert_eq!(pool.try_read(bogus, |_| ()), Err(PoolError::InvalidHandle));
        assert_eq!(pool.try_free(bogus), Err(PoolError::InvalidHandle));
    }
    pool.free(h);
    pool.free(large);
    let stats = pool.stats();
    // Double frees and reads after free: errors, and nothing changes.
    for stale in [h, large] {
        assert_eq!(pool.try_free(stale), Err(PoolError::InvalidHandle));
        pool.free(stale);
        assert_eq!(pool.try_read(stale, |_| ()), Err(PoolError::InvalidHandle));
    }
    assert_eq!(pool.stats(), stats);
    // The slot is reused with a new generation: the old handle still does not work.
    let reused = pool.store(&pattern(4, 2000)).unwrap();
    assert_ne!(reused, h);
    assert_eq!(
        reused.0 as u32, h.0 as u32,
        "freed handle slots are reused first"
    );
    assert_eq!(pool.try_read(h, |_| ()), Err(PoolError::InvalidHandle));
    pool.read(keep, |b| assert_eq!(b, &pattern(1, 2000)[..]));
    pool.read(reused, |b| assert_eq!(b, &pattern(4, 2000)[..]));
}

#[test]
#[should_panic(expected = "invalid or stale pool handle")]
fn read_of_a_freed_handle_panics_with_a_clear_message() {
    let pool = Pool::new();
    let h = pool.store(b"hello").unwrap();
    pool.free(h);
    pool.read(h, |_| ());
}

#[test]
fn compaction_empties_sparse_spans_and_keeps_content() {
    let pool = Pool::new();
    let size = 1500;
    let info = pool.table.classes[pool.table.class_of(size).unwrap()];
    let objs = info.objs_per_span as usize;
    let spans = 6;
    let handles: Vec<Handle> = (0..objs * spans)
        .map(|i| pool.store(&pattern(i as u64, size)).unwrap())
        .collect();
    // Keep every third object: no span empties by itself.
    let kept: Vec<(usize, Handle)> = handles
        .iter()
        .copied()
        .enumerate()
        .filter(|(i, _)| i % 3 == 0)
        .collect();
    for (i, h) in handles.iter().enumerate() {
        if i % 3 != 0 {
            pool.free(*h);
        }
    }
    let before = pool.total_size();
    let stats = pool.compact();
    let after = pool.total_size();
    assert!(stats.moved_objects > 0);
    assert_eq!(before - after, stats.freed_bytes);
    // What is left fits in ceil(kept / objs) spans, with the last one's tail given back.
    let live_spans = kept.len().div_ceil(objs) as u64;
    let fixed = (std::mem::size_of::<Pool>() + std::mem::size_of_val(&*pool.classes)) as u64;
    let handle_pages = pool.handles.resident_bytes();
    let full_span_pages = info.span_bytes as u64 / page();
    let last = (kept.len() - (live_spans as usize - 1) * objs) as u64;
    let last_pages = (last * info.size as u64).div_ceil(page());
    let touched = (live_spans - 1) * full_span_pages + last_pages;
    assert_eq!(
        after,
        fixed
            + span_slot_segment_bytes()
            + handle_pages
            + live_spans * objs as u64 * 4
            + touched * page()
    );
    for (i, h) in &kept {
        pool.read(*h, |b| assert_eq!(b, &pattern(*i as u64, size)[..]));
    }
    // A second compaction has nothing to do.
    assert_eq!(pool.compact(), CompactStats::default());
    // New objects go into the packed span's tail first.
    let more: Vec<Handle> = (0..objs)
        .map(|i| pool.store(&pattern(1000 + i as u64, size)).unwrap())
        .collect();
    for (i, h) in more.iter().enumerate() {
        pool.read(*h, |b| assert_eq!(b, &pattern(1000 + i as u64, size)[..]));
    }
    for (_, h) in kept {
        pool.free(h);
    }
    for h in more {
        pool.free(h);
    }
    pool.compact();
    assert_eq!(
        pool.total_size(),
        fixed + span_slot_segment_bytes() + handle_pages
    );
}

#[test]
fn span_bookkeeping_stays_consistent() {
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    let pool = Pool::new();
    let mut rng = SmallRng::seed_from_u64(7);
    let mut live: Vec<(Handle, u64, usize)> = Vec::new();
    for round in 0..20u64 {
        for i in 0..500 {
            let size = rng.gen_range(1..6000);
            let seed = round * 1000 + i;
            live.push((pool.store(&pattern(seed, size)).unwrap(), seed, size));
        }
        for _ in 0..300 {
            let victim = rng.gen_range(0..live.len());
            pool.free(live.swap_remove(victim).0);
        }
        if round % 3 == 0 {
            pool.compact();
        }
        check_bookkeeping(&pool);
    }
    for (h, seed, size) in &live {
        pool.read(*h, |b| assert_eq!(b, &pattern(*seed, *size)[..]));
    }
}

/// Every span's reverse map, counters and list membership agree with the handle words.
fn check_bookkeeping(pool: &Pool) {
    let mut expected_held =
        (std::mem::size_of::<Pool>() + std::mem::size_of_val(&*pool.classes)) as u64;
    let mut segment_bytes = 0;
    let issued = pool.spans.issued();
    let mut seg_len = 64;
    while segment_bytes / std::mem::size_of::<spans::SpanSlot>() as u64
        <= u64::from(issued.saturating_sub(1))
    {
        segment_bytes += seg_len * std::mem::size_of::<spans::SpanSlot>() as u64;
        seg_len *= 2;
    }
    expected_held += segment_bytes;
    for (c, class) in pool.classes.iter().enumerate() {
        let state = class.state.lock();
        let mut listed = std::collections::HashSet::new();
        for (group, &head) in state.partial.iter().enumerate() {
            let mut id = head;
            while id != NO_SPAN {
                let meta = unsafe { pool.spans.get(id).meta() };
                assert_eq!(meta.group as usize, group);
                assert!(meta.inuse > 0 && meta.inuse < class.info.objs_per_span);
                listed.insert(id);
                id = meta.next;
            }
        }
        for id in 0..issued {
            let slot = pool.spans.get(id);
            let meta = unsafe { slot.meta() };
            if slot.base().is_null() || meta.rmap.len() != class.info.objs_per_span as usize {
                continue;
            }
            // This span belongs to class c if its live objects say so.
            let mut live = 0;
            let mut owner = None;
            for (pos, &entry) in meta.rmap.iter().enumerate() {
                if entry & FREE_POS == 0 {
                    let loc = Location::decode(pool.word(entry).load(Ordering::Relaxed)).unwrap();
                    assert_eq!((loc.span, loc.pos as usize), (id, pos));
                    owner = pool.table.class_of(loc.size);
                    live += 1;
                }
            }
            if owner != Some(c) {
                continue;
            }
            assert_eq!(meta.inuse, live);
            assert_eq!(listed.contains(&id), live < class.info.objs_per_span);
            let mut free = 0;
            let mut pos = meta.free_pos;
            while pos != NO_POS {
                assert!(meta.rmap[pos as usize] & FREE_POS != 0);
                free += 1;
                pos = meta.rmap[pos as usize] & !FREE_POS;
            }
            assert_eq!(free + live, class.info.objs_per_span);
            expected_held += u64::from(meta.touched_pages) * page() + meta.rmap.len() as u64 * 4;
        }
    }
    assert_eq!(pool.held.load(Ordering::Relaxed), expected_held);
}
