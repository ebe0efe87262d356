//! Fork without swap-in (fork.rs), with real forks: the parent's swapped-out folios,
//! in its pool and its backing file, are not brought back; the child takes them over
//! encoded into a runtime of its own (or, with none, decodes them into place), and
//! both see every byte; the parent brings nothing back across the fork; fork in a
//! loop while other threads fault and the reclaimer evicts comes out right in both.

mod common;

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uzswap_runtime::{fds, fork, FaultPath, Runtime, RuntimeConfig};

const MIB: usize = 1 << 20;
const PAGE: usize = 4096;
const FOLIO: usize = 64 << 10;

fn config(path: FaultPath, dir: &std::path::Path) -> RuntimeConfig {
    let mut cfg = RuntimeConfig::new(4 * MIB as u64);
    cfg.fault_path = path;
    cfg.publish_stats = false;
    cfg.writeback_dir = Some(dir.to_path_buf());
    cfg.fork_carry = true;
    cfg
}

/// Word `i` of page `p` at version `v`: half of them name all three, the other half
/// are noise from them, so a folio compresses to about half (much is written back).
fn word(p: usize, v: u64, i: usize) -> u64 {
    let named = ((p as u64) << 32) | (v << 16) | i as u64;
    if i.is_multiple_of(2) {
        return named;
    }
    let mut z = named.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn fill(base: usize, p: usize, v: u64) {
    // SAFETY: a page of the test's region.
    let words = unsafe { std::slice::from_raw_parts_mut((base + p * PAGE) as *mut u64, PAGE / 8) };
    for (i, w) in words.iter_mut().enumerate() {
        *w = word(p, v, i);
    }
}

fn holds(base: usize, p: usize, v: u64) -> bool {
    // SAFETY: a page of the test's region.
    let words = unsafe { std::slice::from_raw_parts((base + p * PAGE) as *const u64, PAGE / 8) };
    words.iter().enumerate().all(|(i, &w)| w == word(p, v, i))
}

fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// What the child does with what it inherits.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Child {
    /// A runtime of its own, as the shim starts one, which takes the folios over.
    OwnRuntime,
    /// No runtime: every carried folio decoded into place.
    NoRuntime,
}

fn carried_across_fork(path: FaultPath, child: Child) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(path, dir.path());
    let Some(rt) = common::or_skip(Runtime::new(cfg.clone())) else { return };
    let len = 24 * MIB;
    let region = rt.create_region(len, FOLIO).unwrap();
    let base = region.as_ptr() as usize;
    let pages = len / PAGE;
    for p in 0..pages {
        fill(base, p, 1);
    }
    wait_for("writeback", || rt.store().stats().totals.backing_pages > 0 && rt.usage() <= 4 * MIB as u64);
    let before = rt.stats();
    let hold = rt.hold_for_fork(|_, _| true);
    assert!(hold.carried() > 100, "only {} folios carried", hold.carried());
    // SAFETY: the child runs only this test's code (glibc's fork leaves its malloc
    // usable) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = (|| {
            let inherited = hold.into_child();
            fds::drop_in_child(inherited.parent_fd());
            fork::forget_parent_in_child();
            let own = match child {
                Child::OwnRuntime => match Runtime::new(cfg) {
                    Ok(rt) => Some(rt),
                    Err(_) => return 3,
                },
                Child::NoRuntime => None,
            };
            let regions = inherited.take_over(own.as_ref());
            if regions.len() != usize::from(own.is_some()) {
                return 4;
            }
            // Nothing shared with the parent is charged here: what was resident in the
            // parent the child keeps compressed, and faults in as its own.
            if own.as_ref().is_some_and(|own| own.stats().resident_bytes != 0) {
                return 5;
            }
            if !(0..pages).all(|p| holds(base, p, 1)) {
                return 1;
            }
            if let Some(own) = &own {
                let st = own.stats();
                // Taken over swapped out, brought in by the child's own faults, its pool
                // kept to its limit by writing back to its own file.
                if st.total().fork_carried < 100 || st.total().zswpin == 0 || own.store().stats().totals.zswpwb == 0 {
                    return 2;
                }
            }
            0
        })();
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(code) };
    }
    hold.resume();
    let after = rt.stats();
    let mut status = 0;
    // SAFETY: our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child died: status {status:#x}");
    let code = libc::WEXITSTATUS(status);
    assert_eq!(code, 0, "the child: 1 wrong bytes, 2 nothing taken over, 3 no runtime, 4 regions, 5 charged for shared pages ({child:?})");
    assert_eq!(after.total().zswpin, before.total().zswpin, "the fork brought folios back in the parent");
    for p in 0..pages {
        assert!(holds(base, p, 1), "page {p} in the parent after fork");
    }
    for p in 0..pages {
        fill(base, p, 2);
    }
    for p in 0..pages {
        assert!(holds(base, p, 2), "page {p} in the parent, rewritten");
    }
    drop(region);
    assert_eq!(rt.store().len(), 0, "store entries left");
}

#[test]
fn carried_into_the_childs_runtime_thread() {
    carried_across_fork(FaultPath::Thread, Child::OwnRuntime);
}

#[test]
fn carried_into_the_childs_runtime_sigbus() {
    carried_across_fork(FaultPath::Sigbus, Child::OwnRuntime);
}

#[test]
fn carried_and_decoded_in_place_without_a_runtime() {
    carried_across_fork(FaultPath::Thread, Child::NoRuntime);
}

/// Forks in a loop while two threads read at random (faulting folios in as the
/// reclaimer evicts others: folios in flight at every fork) and the forking thread
/// rewrites the region between forks: every child sees every page at the version of
/// its fork, through a runtime of its own (even rounds) or decoded in place (odd),
/// and after all of it the parent's bytes are right.
fn fork_loop(path: FaultPath) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(path, dir.path());
    let Some(rt) = common::or_skip(Runtime::new(cfg)) else { return };
    let len = 16 * MIB;
    let region = rt.create_region(len, FOLIO).unwrap();
    let base = region.as_ptr() as usize;
    let pages = len / PAGE;
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2u64)
        .map(|seed| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = seed + 1;
                while !stop.load(SeqCst) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // SAFETY: a word of the test's region; only read.
                    unsafe { std::ptr::read_volatile((base + (x as usize % pages) * PAGE) as *const u64) };
                }
            })
        })
        .collect();
    let mut carried = 0;
    for round in 0..12u64 {
        let v = round + 1;
        for p in 0..pages {
            fill(base, p, v);
        }
        let hold = rt.hold_for_fork(|_, _| true);
        carried += hold.carried();
        // SAFETY: as above.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let inherited = hold.into_child();
            fds::drop_in_child(inherited.parent_fd());
            fork::forget_parent_in_child();
            let child_dir = std::env::temp_dir();
            let own = if round % 2 == 0 { Runtime::new(config(path, &child_dir)).ok() } else { None };
            let _regions = inherited.take_over(own.as_ref());
            let ok = (0..pages).all(|p| holds(base, p, v));
            // SAFETY: leaves the child at once.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        hold.resume();
        let mut status = 0;
        // SAFETY: our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "round {round}: the child saw wrong bytes (status {status:#x})");
        for p in 0..pages {
            assert!(holds(base, p, v), "round {round}: page {p} in the parent after fork");
        }
    }
    stop.store(true, SeqCst);
    for r in readers {
        r.join().unwrap();
    }
    assert!(carried > 0, "no fork carried anything");
    drop(region);
    assert_eq!(rt.store().len(), 0, "store entries left");
}

#[test]
fn fork_loop_while_reading_thread() {
    fork_loop(FaultPath::Thread);
}

#[test]
fn fork_loop_while_reading_sigbus() {
    fork_loop(FaultPath::Sigbus);
}
