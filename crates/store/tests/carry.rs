//! Fork without swap-in (the store's `carry`): records carried from a frozen store
//! into another come out bit for bit, from the pool, the backing file and as
//! same-filled markers; a frozen store lets loads through and holds writeback; and
//! a real forked child reads its copy of the parent's pool and file.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use uzswap_backing::{BackingConfig, BackingFile};
use uzswap_store::{carry_buffer, decode_carried, Algorithm, Carried, CodecConfig, Granularity, Store, StoreConfig};

fn config(max_pool: u64) -> StoreConfig {
    StoreConfig {
        codec: CodecConfig { algorithm: Algorithm::Lz4, level: 1, granularity: Granularity::Bytes(16384), raw_threshold_percent: 90, verify: false },
        max_pool_bytes: Some(max_pool),
        ..StoreConfig::default()
    }
}

/// 64 folios of 64 KiB: realistic data, one same-filled, one incompressible; with a
/// pool of 1 MiB most of them end up in the file.
fn filled(dir: &std::path::Path, encrypt: bool) -> (Store, Vec<Vec<u8>>) {
    let file = BackingFile::create(BackingConfig { encrypt, ..BackingConfig::new(dir, 64 << 20) }).unwrap();
    let store = Store::with_backing(config(1 << 20), Some(file)).unwrap();
    let data = uzswap_corpus::realistic(4 << 20, 65536);
    let mut folios: Vec<Vec<u8>> = data.chunks(65536).map(|c| c.to_vec()).collect();
    folios[3] = vec![0x5a; 65536];
    use rand::{RngCore, SeedableRng};
    rand::rngs::SmallRng::seed_from_u64(7).fill_bytes(&mut folios[5]);
    for (i, f) in folios.iter().enumerate() {
        store.store(i as u64, f).unwrap();
    }
    let s = store.stats();
    assert!(s.totals.zswpwb > 0 && store.pool_total_size() > 0, "both tiers hold some");
    (store, folios)
}

#[test]
fn carried_records_come_out_bit_for_bit_in_another_store() {
    for encrypt in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (parent, folios) = filled(dir.path(), encrypt);
        let child_dir = tempfile::tempdir().unwrap();
        let child_file = BackingFile::create(BackingConfig::new(child_dir.path(), 64 << 20)).unwrap();
        // A pool a quarter the parent's limit: what it imports (all the parent held, in
        // both tiers: about 1 MiB compressed, depending on the machine's files) must
        // make room by writeback.
        let child = Store::with_backing(config(256 << 10), Some(child_file)).unwrap();
        let mut buf = carry_buffer(&parent.config().codec).unwrap();
        parent.freeze();
        let carried: Vec<_> = (0..folios.len()).map(|i| parent.carry(i as u64).expect("every record is carried")).collect();
        assert!(carried.iter().any(|c| c.in_tier()) && carried.iter().any(|c| !c.in_tier()));
        let mut out = vec![0u8; 65536];
        for (i, c) in carried.iter().enumerate() {
            let bytes = parent.carried_bytes(c, &mut buf).unwrap();
            decode_carried(&parent.config().codec, c, bytes, &mut out).unwrap();
            assert!(out == folios[i], "folio {i} decoded in place");
            child.import(i as u64, c, bytes).unwrap();
        }
        parent.thaw();
        assert!(child.stats().totals.zswpwb > 0, "the child's pool made room by writeback");
        for (i, f) in folios.iter().enumerate() {
            assert!(child.load(i as u64, &mut out).unwrap(), "folio {i} in the child");
            assert!(out == *f, "folio {i} in the child");
            assert!(parent.load(i as u64, &mut out).unwrap(), "folio {i} still in the parent");
            assert!(out == *f, "folio {i} in the parent");
        }
        assert!(child.is_empty() && parent.is_empty());
    }
}

#[test]
fn a_frozen_store_loads_but_holds_writeback_until_thawed() {
    let dir = tempfile::tempdir().unwrap();
    let (store, folios) = filled(dir.path(), false);
    let store = Arc::new(store);
    store.freeze();
    let mut out = vec![0u8; 65536];
    assert!(store.load(0, &mut out).unwrap() && out == folios[0], "a load runs while frozen");
    let before = store.stats().totals.zswpwb;
    let started = Arc::new(AtomicBool::new(false));
    let t = {
        let (store, started) = (store.clone(), started.clone());
        std::thread::spawn(move || {
            started.store(true, Ordering::SeqCst);
            store.writeback_batch(1 << 20).unwrap()
        })
    };
    while !started.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    // Ordering, not timing, makes it right; 20 ms (a writeback of 1 MiB takes about
    // one) is how long the test gives a wrong one to show.
    let until = std::time::Instant::now() + std::time::Duration::from_millis(20);
    while std::time::Instant::now() < until {
        assert_eq!(store.stats().totals.zswpwb, before, "writeback ran while the store was frozen");
        std::thread::yield_now();
    }
    store.thaw();
    assert!(t.join().unwrap() > 0, "the writeback held by the freeze ran after the thaw");
}

/// Freezes `parent`, carries its first `n` records, forks with its pool mappings made
/// inheritable, and runs `child` in the child (with the parent's store, its carried
/// records and its pool mappings) as its exit status; then, in the parent, makes the
/// mappings private again, waits for the child, thaws, and gives back the store and
/// the child's wait status.
fn fork_frozen(
    parent: Store,
    n: usize,
    child: impl FnOnce(Store, Vec<Carried>, &[(usize, usize)]) -> i32,
) -> (Store, i32) {
    parent.freeze();
    let carried: Vec<_> = (0..n).map(|i| parent.carry(i as u64).unwrap()).collect();
    // SAFETY: frozen; the list is used before the thaw.
    let maps = unsafe { parent.pool_mappings() };
    for &(a, l) in &maps {
        // SAFETY: the pool's own mappings, made inheritable for this fork only.
        assert_eq!(unsafe { libc::madvise(a as *mut _, l, libc::MADV_DOFORK) }, 0);
    }
    // SAFETY: the child runs `child` on its copies and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = child(parent, carried, &maps);
        // SAFETY: leaves the child at once, as it should after fork.
        unsafe { libc::_exit(code) };
    }
    for &(a, l) in &maps {
        // SAFETY: as above.
        unsafe { libc::madvise(a as *mut _, l, libc::MADV_DONTFORK) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    parent.thaw();
    (parent, status)
}

#[test]
fn a_forked_child_reads_its_copy_of_the_pool_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (parent, folios) = filled(dir.path(), true);
    let mut buf = carry_buffer(&parent.config().codec).unwrap();
    let (_, status) = fork_frozen(parent, folios.len(), |parent, carried, _| {
        let mut out = vec![0u8; 65536];
        let mut bad = 0;
        for (i, c) in carried.iter().enumerate() {
            let ok = parent
                .carried_bytes(c, &mut buf)
                .and_then(|b| decode_carried(&parent.config().codec, c, b, &mut out))
                .is_ok();
            if !ok || out != folios[i] {
                bad += 1;
            }
        }
        bad
    });
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child found {} folios wrong", libc::WEXITSTATUS(status));
}

/// A child that borrows its parent's pool records moves them into its own store
/// (`rehome`: a child keeps pages its parent let go of alone, and could never write a
/// lent record back): the lent mappings go with the last record in each, the child's
/// pool makes room by writeback, and every folio comes out bit for bit.
#[test]
fn a_child_rehomes_its_lent_pool_records_and_lets_their_mappings_go() {
    let dir = tempfile::tempdir().unwrap();
    let (parent, folios) = filled(dir.path(), false);
    let child_dir = tempfile::tempdir().unwrap();
    let child_file = BackingFile::create(BackingConfig::new(child_dir.path(), 64 << 20)).unwrap();
    let mut buf = carry_buffer(&parent.config().codec).unwrap();
    // Half of what the parent's pool holds (what the child rehomes), so that the child
    // must make room by writeback whatever the machine's files compress to.
    let child_pool = parent.pool_total_size() / 2;
    let (_, status) = fork_frozen(parent, folios.len(), |parent, carried, maps| {
        let check = || -> Result<(), String> {
            let child = Store::with_backing(config(child_pool), Some(child_file)).map_err(|e| e.to_string())?;
            let lender: &'static Store = Box::leak(Box::new(parent));
            child.start_borrowing(lender, maps).map_err(|e| e.to_string())?;
            for (i, c) in carried.iter().enumerate() {
                if child.borrow(i as u64, c).is_err() {
                    let bytes = lender.carried_bytes(c, &mut buf).map_err(|e| e.to_string())?;
                    child.import(i as u64, c, bytes).map_err(|e| e.to_string())?;
                }
            }
            child.end_borrowing();
            let (lent, in_file) = (child.lent_mappings(), child.borrowed_from_file());
            if lent == 0 || child.borrowed() == in_file {
                return Err(format!("nothing lent from the pool ({lent} mappings)"));
            }
            let mut moved = 0;
            for i in 0..folios.len() as u64 {
                moved += child.rehome(i).map_err(|e| e.to_string())?.is_some() as usize;
            }
            if moved == 0 || child.lent_mappings() != 0 || child.borrowed() != in_file {
                return Err(format!("{moved} moved, {} mappings left, {} borrowed", child.lent_mappings(), child.borrowed()));
            }
            if child.rehome(0).map_err(|e| e.to_string())?.is_some() {
                return Err("a record moved twice".into());
            }
            if child.stats().totals.zswpwb == 0 {
                return Err("the child's pool made no room by writeback".into());
            }
            let mut out = vec![0u8; 65536];
            for (i, f) in folios.iter().enumerate() {
                if !child.load(i as u64, &mut out).map_err(|e| e.to_string())? || out != *f {
                    return Err(format!("folio {i} wrong in the child"));
                }
            }
            Ok(())
        };
        match check() {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("child: {e}");
                1
            }
        }
    });
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child failed (see its stderr)");
}

/// A loan keeps the file slots a child may read and no others: the parent's frees of
/// records written back before it wait for its end; those of records written back
/// after it are carried out at once, so a parent whose child lives long does not see
/// its file grow by all it writes back and frees meanwhile.
#[test]
fn a_loan_keeps_only_the_slots_written_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let (store, folios) = filled(dir.path(), false);
    let file = |s: &Store| s.tier().unwrap().stats();
    let mut fds = [0; 2];
    // SAFETY: a pipe of the test's own.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    store.lend(fds[0], |fd| {
        // SAFETY: the test's pipe's read end, closed once by the store.
        unsafe { libc::close(fd) };
    });
    assert_eq!(store.loans_out(), 1);
    let lent = file(&store);
    assert!(lent.stored_records > 0);
    for i in 0..folios.len() {
        assert!(store.invalidate(i as u64));
    }
    store.reap();
    assert_eq!(file(&store).records_freed, lent.records_freed, "the slots a child may read are kept");
    // Written back after the loan, then dropped: freed at once.
    for (i, f) in folios.iter().enumerate() {
        store.store(1000 + i as u64, f).unwrap();
    }
    let written = file(&store).records_written - lent.records_written;
    assert!(written > 0, "the new records went to the file too");
    for i in 0..folios.len() {
        assert!(store.invalidate(1000 + i as u64));
    }
    store.reap();
    assert_eq!(file(&store).records_freed - lent.records_freed, written, "slots written after the loan are freed");
    // The loan ends: the rest goes.
    // SAFETY: the write end, ours.
    unsafe { libc::close(fds[1]) };
    store.reap();
    assert_eq!(store.loans_out(), 0);
    assert_eq!(file(&store).stored_records, 0, "every slot freed once the loan is back");
}
