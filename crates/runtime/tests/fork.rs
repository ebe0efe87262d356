//! Fork without swap-in (fork.rs), with real forks: the parent's swapped-out folios,
//! in its pool and its backing file, are not brought back; the child takes them over
//! encoded into a runtime of its own (or, with none, decodes them into place), and
//! both see every byte; the parent brings nothing back across the fork; fork in a
//! loop while other threads fault and the reclaimer evicts comes out right in both.

mod common;

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uzswap_runtime::{FaultPath, Runtime, RuntimeConfig};

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

/// A runtime on a 4 MiB budget and a 24 MiB region of it written once (version 1),
/// much of it written back: what the tests fork with. `None`: no userfaultfd here.
fn swapped_out(path: FaultPath, dir: &std::path::Path) -> Option<(Runtime, uzswap_runtime::Region, usize)> {
    let rt = common::or_skip(Runtime::new(config(path, dir)))?;
    let region = rt.create_region(24 * MIB, FOLIO).unwrap();
    let base = region.as_ptr() as usize;
    for p in 0..24 * MIB / PAGE {
        fill(base, p, 1);
    }
    wait_for("writeback", || rt.store().stats().totals.backing_pages > 0 && rt.usage() <= 4 * MIB as u64);
    Some((rt, region, base))
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
    let Some((rt, region, base)) = swapped_out(path, dir.path()) else { return };
    let pages = 24 * MIB / PAGE;
    let before = rt.stats();
    let hold = rt.hold_for_fork(|_, _| true, |_| {});
    assert!(hold.carried() > 100, "only {} folios carried", hold.carried());
    // SAFETY: the child runs only this test's code (glibc's fork leaves its malloc
    // usable) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = (|| {
            let inherited = hold.into_child();
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
            // Borrowed, not copied: nothing of the parent's written to the child's file.
            if own.as_ref().is_some_and(|own| own.store().borrowed() < 100) {
                return 6;
            }
            if !(0..pages).all(|p| holds(base, p, 1)) {
                return 1;
            }
            // Every folio rewritten (a clean one read keeps its record): no loan is
            // left, and the copies of the parent's pool are unmapped.
            if let Some(own) = &own {
                for p in 0..pages {
                    fill(base, p, 4);
                }
                if !(0..pages).all(|p| holds(base, p, 4)) {
                    return 1;
                }
                if own.store().borrowed() != 0 || own.store().lent_mappings() != 0 {
                    eprintln!("child: {} loans, {} lent mappings left", own.store().borrowed(), own.store().lent_mappings());
                    return 7;
                }
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
    assert_eq!(code, 0, "the child: 1 wrong bytes, 2 nothing taken over, 3 no runtime, 4 regions, 5 charged for shared pages, 6 not borrowed, 7 loans left after writing all ({child:?})");
    assert_eq!(rt.store().loans_out(), 0, "the child exited: its loans are returned");
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

/// A hold dropped with no fork and no resume (a panic between the two) lets go as
/// a resume does: the store thaws and every folio unlocks, so faults, reclaim and
/// the region's release go on. Left in effect, it once hung a test unwinding from a
/// failed assertion: its region's release waited for the folios the hold kept.
#[test]
fn a_hold_dropped_unresumed_lets_go() {
    let dir = tempfile::tempdir().unwrap();
    let Some((rt, region, base)) = swapped_out(FaultPath::Thread, dir.path()) else { return };
    let hold = rt.hold_for_fork(|_, _| true, |_| {});
    assert!(hold.carried() > 0, "nothing carried");
    drop(hold);
    let pages = 24 * MIB / PAGE;
    // On a thread of its own: with the folios still locked its first fault would wait
    // for ever, and this one reports that instead.
    let done = Arc::new(AtomicBool::new(false));
    let toucher = {
        let done = done.clone();
        std::thread::spawn(move || {
            for p in 0..pages {
                assert!(holds(base, p, 1), "page {p} after the hold");
                fill(base, p, 2);
            }
            done.store(true, SeqCst);
        })
    };
    let until = Instant::now() + Duration::from_secs(20);
    while !done.load(SeqCst) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    if !done.load(SeqCst) {
        // Its release would wait for the folios too: the failure is said, not hung.
        std::mem::forget(region);
        panic!("the pages were not read back and rewritten within 20 s of the hold's drop");
    }
    toucher.join().unwrap();
    wait_for("eviction after the rewrite", || rt.usage() <= 4 * MIB as u64);
    for p in 0..pages {
        assert!(holds(base, p, 2), "page {p} rewritten");
    }
    drop(region);
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
        let hold = rt.hold_for_fork(|_, _| true, |_| {});
        carried += hold.carried();
        // SAFETY: as above.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let inherited = hold.into_child();
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

/// A pipe's (read, write) ends, for the test's own signals between parent and child.
fn pipe() -> (i32, i32) {
    let mut fds = [0; 2];
    // SAFETY: pipe writes two descriptors into `fds`.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    (fds[0], fds[1])
}

fn signal(fd: i32) {
    // SAFETY: writes one byte of a live array.
    assert_eq!(unsafe { libc::write(fd, [1u8].as_ptr().cast(), 1) }, 1);
}

fn await_signal(fd: i32) -> bool {
    let mut b = [0u8];
    // SAFETY: reads one byte into a live array.
    unsafe { libc::read(fd, b.as_mut_ptr().cast(), 1) == 1 }
}

/// In a child: closes its copies of the parent's ends of the test's pipes, so that
/// the parent's close (or death) reads as EOF there.
fn close_parents_ends(fds: &[i32]) {
    for &fd in fds {
        // SAFETY: the child's copy of a descriptor the parent owns.
        unsafe { libc::close(fd) };
    }
}

/// The loan (uzswap-store carry.rs "Loans"): the child borrows the records of the
/// parent's backing file and reads them only after the parent has rewritten all of
/// its memory twice (every record it had freed, new ones written): the parent must
/// have kept every slot the child borrowed, or the child reads another record there
/// (a checksum failure: its folio poisoned, SIGBUS).
fn borrowed_records_outlive_the_parents_rewrites(path: FaultPath) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(path, dir.path());
    let Some((rt, region, base)) = swapped_out(path, dir.path()) else { return };
    let pages = 24 * MIB / PAGE;
    let (ready_rd, ready_wr) = pipe();
    let (go_rd, go_wr) = pipe();
    let hold = rt.hold_for_fork(|_, _| true, |_| {});
    // SAFETY: the child runs only this test's code and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = (|| {
            close_parents_ends(&[ready_rd, go_wr]);
            let inherited = hold.into_child();
            let Ok(own) = Runtime::new(cfg) else { return 3 };
            let _regions = inherited.take_over(Some(&own));
            if own.store().borrowed() < 100 {
                eprintln!("child: borrowed {} stats {:?}", own.store().borrowed(), own.store().stats().totals);
                return 2;
            }
            let lent = own.store().lent_mappings();
            signal(ready_wr);
            if !await_signal(go_rd) {
                return 4;
            }
            // The parent rewrote its memory: pool pages it wrote to or freed are the
            // child's alone now, and its reclaimer moves their records into its own
            // store (fork.rs `rehome_lent`), letting those mappings go.
            let until = Instant::now() + Duration::from_secs(20);
            while lent > 0 && own.store().lent_mappings() >= lent {
                if Instant::now() >= until {
                    eprintln!("child: {lent} lent mappings, none let go");
                    return 5;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            if !(0..pages).all(|p| holds(base, p, 1)) {
                return 1;
            }
            0
        })();
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(code) };
    }
    hold.resume();
    // SAFETY: the child's ends of the test's pipes, ours to close here.
    unsafe {
        libc::close(ready_wr);
        libc::close(go_rd);
    }
    if !await_signal(ready_rd) {
        let mut status = 0;
        // SAFETY: our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        panic!("the child never took over: status {status:#x} (exit 2: nothing borrowed, 3: no runtime)");
    }
    let written = rt.store().stats().totals.written_back_pages;
    for v in [2, 3] {
        for p in 0..pages {
            fill(base, p, v);
        }
    }
    // The reclaimer writes back behind the writes: what it wrote meanwhile would have
    // reused the freed slots, were they not held. Half the region at least: a folio
    // rewritten while its first rewrite's record is still in the pool is dropped
    // from there, not written back (0.9 of the region was, beside the other tests).
    let until = Instant::now() + Duration::from_secs(20);
    while rt.store().stats().totals.written_back_pages <= written + pages as u64 / 2 {
        if Instant::now() >= until {
            // The child holds the other tests' descriptors (one process): it goes first.
            // SAFETY: our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("timed out waiting for the parent's writeback of a rewrite: {written} pages before, {:?}", rt.store().stats().totals);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    rt.store().reap();
    signal(go_wr);
    let mut status = 0;
    // SAFETY: our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child died (a borrowed record read wrong: SIGBUS?): status {status:#x}");
    assert_eq!(libc::WEXITSTATUS(status), 0, "the child: 1 wrong bytes, 2 nothing borrowed, 3 no runtime, 4 no go, 5 no lent mapping let go");
    assert!((0..pages).all(|p| holds(base, p, 3)), "the parent's own memory");
    drop(region);
}

#[test]
fn borrowed_records_outlive_the_parents_rewrites_thread() {
    borrowed_records_outlive_the_parents_rewrites(FaultPath::Thread);
}

#[test]
fn borrowed_records_outlive_the_parents_rewrites_sigbus() {
    borrowed_records_outlive_the_parents_rewrites(FaultPath::Sigbus);
}

/// How a child that borrows from its parent's file ends.
#[derive(Clone, Copy, Debug)]
enum End {
    Exec,
    Killed,
}

/// A child's loans end when it execs or is killed (its keeper's copy of the loan
/// pipe goes with it), not only when it exits: the parent's slot frees go on.
fn loans_end(path: FaultPath, end: End) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(path, dir.path());
    let Some((rt, region, base)) = swapped_out(path, dir.path()) else { return };
    let len = 24 * MIB;
    let (ready_rd, ready_wr) = pipe();
    let (go_rd, go_wr) = pipe();
    let sleep = std::ffi::CString::new("/bin/sleep").unwrap();
    let args = [sleep.as_ptr(), c"30".as_ptr(), std::ptr::null()];
    let hold = rt.hold_for_fork(|_, _| true, |_| {});
    // SAFETY: the child runs only this test's code and leaves with exec or _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = (|| {
            close_parents_ends(&[ready_rd, go_wr]);
            let inherited = hold.into_child();
            let Ok(own) = Runtime::new(cfg) else { return 3 };
            let _regions = inherited.take_over(Some(&own));
            if own.store().borrowed_from_file() == 0 {
                return 2;
            }
            signal(ready_wr);
            if !await_signal(go_rd) {
                return 4;
            }
            // SAFETY: a NUL-terminated argument list of live strings.
            unsafe { libc::execv(sleep.as_ptr(), args.as_ptr()) };
            5
        })();
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(code) };
    }
    hold.resume();
    // SAFETY: the child's ends of the test's pipes, ours to close here.
    unsafe {
        libc::close(ready_wr);
        libc::close(go_rd);
    }
    let took_over = await_signal(ready_rd);
    let out = rt.store().loans_out();
    if took_over && matches!(end, End::Exec) {
        signal(go_wr);
        wait_for("the loan's end at exec", || rt.store().loans_out() == 0);
    }
    // SAFETY: our own child.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let mut status = 0;
    // SAFETY: our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(took_over, "the child never took over: status {status:#x} (exit 2: nothing borrowed, 3: no runtime)");
    assert_eq!(out, 1, "a child borrowing from the file holds a loan");
    assert_eq!(rt.store().loans_out(), 0, "{end:?}: the loan is returned");
    for p in 0..len / PAGE {
        assert!(holds(base, p, 1), "page {p} in the parent");
    }
    drop(region);
}

#[test]
fn loans_end_at_exec_thread() {
    loans_end(FaultPath::Thread, End::Exec);
}

#[test]
fn loans_end_at_exec_sigbus() {
    loans_end(FaultPath::Sigbus, End::Exec);
}

#[test]
fn loans_end_when_killed_thread() {
    loans_end(FaultPath::Thread, End::Killed);
}

#[test]
fn loans_end_when_killed_sigbus() {
    loans_end(FaultPath::Sigbus, End::Killed);
}

/// At most 16 children borrow from the parent's file at once (each holds a
/// descriptor of ours in both processes): a fork past that brings the folios whose
/// records are in the file back first, and its child borrows from the pool only.
#[test]
fn at_most_sixteen_children_borrow_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let Some((rt, region, _base)) = swapped_out(FaultPath::Thread, dir.path()) else { return };
    let cfg = config(FaultPath::Thread, dir.path());
    let (go_rd, go_wr) = pipe();
    let mut children = Vec::new();
    for n in 0..17 {
        let (ready_rd, ready_wr) = pipe();
        let hold = rt.hold_for_fork(|_, _| true, |_| {});
        // SAFETY: the child runs only this test's code and leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = (|| {
                close_parents_ends(&[ready_rd, go_wr]);
                let inherited = hold.into_child();
                let Ok(own) = Runtime::new(cfg.clone()) else { return 3 };
                let _regions = inherited.take_over(Some(&own));
                // Exit 1 if this child borrows from the file and should not, or does
                // not and should.
                let code = if (own.store().borrowed_from_file() > 0) == (n < 16) { 0 } else { 1 };
                signal(ready_wr);
                await_signal(go_rd);
                code
            })();
            // SAFETY: leaves the child at once.
            unsafe { libc::_exit(code) };
        }
        hold.resume();
        // SAFETY: the child's end of the test's pipe, ours to close here.
        unsafe { libc::close(ready_wr) };
        assert!(await_signal(ready_rd), "child {n} never took over");
        // SAFETY: our end, read.
        unsafe { libc::close(ready_rd) };
        children.push(pid);
        // The last fork carried nothing more from the file.
        assert_eq!(rt.store().loans_out(), (n + 1).min(16), "after fork {n}");
    }
    // SAFETY: the write end: every child reads EOF and exits.
    unsafe { libc::close(go_wr) };
    for (n, pid) in children.into_iter().enumerate() {
        let mut status = 0;
        // SAFETY: our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child {n}: status {status:#x} (exit 1: borrowed from the file past 16 or not before)");
    }
    assert_eq!(rt.store().loans_out(), 0, "every child gone");
    drop(region);
}

/// Pages of `[base, base+len)` present and mapped by another process too (pagemap's
/// exclusively-mapped bit clear).
fn shared_pages(base: usize, len: usize) -> usize {
    let mut entries = vec![0u64; len / PAGE];
    let f = std::fs::File::open("/proc/self/pagemap").unwrap();
    let n = std::os::unix::fs::FileExt::read_at(&f, bytemuck_bytes(&mut entries), (base / PAGE * 8) as u64).unwrap();
    assert_eq!(n, len / PAGE * 8);
    entries.iter().filter(|&&e| e & (1 << 63) != 0 && e & (1 << 56) == 0).count()
}

/// A region wholly resident at fork (nothing of it swapped out) is taken over by the
/// child too, its pages left in place, shared with the parent (SHARED: nothing
/// compressed at fork): the child reads them as they are, and a write of its own is
/// its own. Released (here: no group, so always) and taken out under a small budget,
/// the child copies what it shares and moves its copies out, and the parent's pages
/// are its alone again, to move out. Left unmanaged, such a region stayed shared for
/// the child's life and neither could move any of it out (a Python parent's 1 MiB
/// buffers beside a sleeping child).
#[test]
fn a_wholly_resident_region_is_taken_over_too() {
    let dir = tempfile::tempdir().unwrap();
    let Some(rt) = common::or_skip(Runtime::new(config(FaultPath::Thread, dir.path()))) else { return };
    let len = MIB;
    let region = rt.create_region(len, FOLIO).unwrap();
    let base = region.as_ptr() as usize;
    for p in 0..len / PAGE {
        fill(base, p, 1);
    }
    assert_eq!(rt.store().len(), 0, "1 MiB under a 4 MiB budget: nothing swapped out");
    // The child says it let go (up), and waits for the parent's look (down: EOF).
    let ((up_rd, up_wr), (down_rd, down_wr)) = (pipe(), pipe());
    let hold = rt.hold_for_fork(|_, _| true, |_| {});
    // SAFETY: the child only takes over what it inherits, checks it, and leaves.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        close_parents_ends(&[up_rd, down_wr]);
        let inherited = hold.into_child();
        let own = Runtime::new(config(FaultPath::Thread, &std::env::temp_dir())).ok();
        let regions = inherited.take_over(own.as_ref());
        let code = (|| {
            let own = own.as_ref().ok_or(4)?;
            if !regions.iter().any(|(b, _)| *b == base) {
                return Err(2);
            }
            let st = own.stats().total();
            if !own.store().is_empty() || st.fork_shared != (len / FOLIO) as u64 || st.zswpout != 0 {
                return Err(3);
            }
            if !(0..len / PAGE).all(|p| holds(base, p, 1)) {
                return Err(1);
            }
            // Our write is ours (the kernel copies the page), the rest still shared.
            fill(base, 0, 2);
            if !holds(base, 0, 2) || !(1..len / PAGE).all(|p| holds(base, p, 1)) {
                return Err(1);
            }
            // Under a budget of two folios the released folios go out, copied first.
            own.set_budget(2 * FOLIO as u64).map_err(|_| 5)?;
            wait_for("the child's shared pages copied and moved out", || shared_pages(base, len) == 0 && own.stats().total().unshared_pages > 0);
            let st = own.stats().total();
            if st.fork_unshared != (len / FOLIO) as u64 {
                return Err(6);
            }
            if !holds(base, 0, 2) || !(1..len / PAGE).all(|p| holds(base, p, 1)) {
                return Err(1);
            }
            Ok(())
        })();
        signal(up_wr);
        // Stays until the parent has looked at its pages.
        await_signal(down_rd);
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(code.err().unwrap_or(0)) };
    }
    hold.resume();
    // SAFETY: the child's ends, closed in the parent.
    unsafe {
        libc::close(up_wr);
        libc::close(down_rd);
    }
    assert!(await_signal(up_rd), "the child did not take over");
    // Every page present in the parent, and its own alone (pagemap's exclusive bit).
    let shared = shared_pages(base, len);
    // SAFETY: our ends: the child leaves on the EOF.
    unsafe {
        libc::close(down_wr);
        libc::close(up_rd);
    }
    let mut status = 0;
    // SAFETY: our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child: status {status:#x} (2: not taken over, 3: compressed or not shared at fork, 1: wrong bytes, 4: no runtime, 5: budget, 6: not all released)"
    );
    assert_eq!(shared, 0, "pages still shared with the child");
    assert!((0..len / PAGE).all(|p| holds(base, p, 1)), "the child's write reached the parent");
}

/// `words` as bytes, for a read into it.
fn bytemuck_bytes(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64s have no invalid bit patterns and no padding; same memory, same life.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), std::mem::size_of_val(words)) }
}

/// Folios shared with the parent since fork (SHARED), raced: in the child, two threads
/// write and read pages at random (each write a first touch, a write fault lifting the
/// protection) while its reclaimer, on a budget far below what it shares, releases
/// the rest and takes them out, copying the pages it still shares; in the parent, a
/// thread rewrites every page meanwhile. Every page reads what its own process last
/// wrote, in both, and the parent's pages are its alone at the end.
fn shared_folios_raced(path: FaultPath) {
    const LEN: usize = 8 * MIB;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(path, dir.path());
    cfg.budget_bytes = 16 * MIB as u64;
    let Some(rt) = common::or_skip(Runtime::new(cfg.clone())) else { return };
    let region = rt.create_region(LEN, FOLIO).unwrap();
    let base = region.as_ptr() as usize;
    let pages = LEN / PAGE;
    for p in 0..pages {
        fill(base, p, 1);
    }
    let ((up_rd, up_wr), (down_rd, down_wr)) = (pipe(), pipe());
    let hold = rt.hold_for_fork(|_, _| true, |_| {});
    // SAFETY: the child runs only this test's code and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        close_parents_ends(&[up_rd, down_wr]);
        let code = (|| {
            let inherited = hold.into_child();
            let Ok(own) = Runtime::new(cfg) else { return 4 };
            let _regions = inherited.take_over(Some(&own));
            if own.stats().total().fork_shared != (LEN / FOLIO) as u64 {
                return 3;
            }
            signal(up_wr);
            // Two writers over disjoint halves, version 2 then 3, reading back as they go.
            let bad = AtomicBool::new(false);
            std::thread::scope(|s| {
                for half in 0..2 {
                    let bad = &bad;
                    s.spawn(move || {
                        let mut seed = 0x9e37_79b9_u64 + half as u64;
                        for v in 2..4 {
                            for _ in 0..pages {
                                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                                let p = half * pages / 2 + (seed >> 33) as usize % (pages / 2);
                                if !holds(base, p, v - 1) && !holds(base, p, v) {
                                    bad.store(true, SeqCst);
                                }
                                fill(base, p, v);
                            }
                            for p in half * pages / 2..(half + 1) * pages / 2 {
                                if !holds(base, p, v) {
                                    if !holds(base, p, v - 1) {
                                        bad.store(true, SeqCst);
                                    }
                                    fill(base, p, v);
                                }
                            }
                        }
                    });
                }
                // Meanwhile the budget falls far below what is shared: the reclaimer
                // releases and takes out what the writers have not touched yet.
                own.set_budget(2 * MIB as u64).unwrap();
            });
            if bad.load(SeqCst) {
                return 1;
            }
            if !(0..pages).all(|p| holds(base, p, 3)) {
                return 1;
            }
            let st = own.stats().total();
            eprintln!("child: fork_unshared {} unshared_pages {} zswpout {} zswpin {}", st.fork_unshared, st.unshared_pages, st.zswpout, st.zswpin);
            if st.zswpout == 0 {
                return 5;
            }
            // Until the parent has checked its pages.
            await_signal(down_rd);
            0
        })();
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(code) };
    }
    hold.resume();
    // SAFETY: the child's ends, closed in the parent.
    unsafe {
        libc::close(up_wr);
        libc::close(down_rd);
    }
    assert!(await_signal(up_rd), "the child did not take over");
    // The parent rewrites all of its memory while the child works (version 7).
    for p in 0..pages {
        fill(base, p, 7);
    }
    assert!((0..pages).all(|p| holds(base, p, 7)), "the parent's own writes");
    // SAFETY: our end: the child leaves on the EOF.
    unsafe { libc::close(down_wr) };
    let mut status = 0;
    // SAFETY: our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child: status {status:#x} (1: wrong bytes, 3: not shared at fork, 4: no runtime, 5: nothing taken out)");
    assert!((0..pages).all(|p| holds(base, p, 7)), "the parent's pages after the child");
    // SAFETY: our end.
    unsafe { libc::close(up_rd) };
}

#[test]
fn shared_folios_raced_thread() {
    shared_folios_raced(FaultPath::Thread);
}

#[test]
fn shared_folios_raced_sigbus() {
    shared_folios_raced(FaultPath::Sigbus);
}

/// The program unmaps half of a carried folio of a region of ours behind the
/// runtime's back (a raw munmap, or another thread's between the hold and the fork).
/// The child takes over no region it does not map whole: registered over the hole,
/// the region would claim whatever the child maps there next. It places the carried
/// folios as plain memory instead, the torn one on the pages it still has, and the
/// hole is free for it to map.
#[test]
fn a_region_unmapped_in_part_is_not_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(FaultPath::Thread, dir.path());
    let Some((rt, region, base)) = swapped_out(FaultPath::Thread, dir.path()) else { return };
    let pages = 24 * MIB / PAGE;
    let hold = rt.hold_for_fork(|_, _| true, |_| {});
    // A folio the hold carries: out of place (mincore), the hold holding it there.
    let out = (0..24 * MIB / FOLIO)
        .find(|&f| {
            let mut v = 0u8;
            // SAFETY: mincore of one page of the region into a byte we own.
            unsafe { libc::mincore((base + f * FOLIO) as *mut _, PAGE, &mut v) == 0 && v & 1 == 0 }
        })
        .expect("a folio out");
    let (hole, hole_len) = (base + out * FOLIO + FOLIO / 2, FOLIO / 2);
    // SAFETY: half of a folio of the test's own region.
    assert_eq!(unsafe { libc::munmap(hole as *mut _, hole_len) }, 0);
    let kept = |p: usize| !(hole..hole + hole_len).contains(&(base + p * PAGE));
    common::fork_past_a_hole(hold, cfg, || (0..pages).filter(|&p| kept(p)).all(|p| holds(base, p, 1)) && common::free_at(hole, hole_len));
    for p in (0..pages).filter(|&p| kept(p)) {
        assert!(holds(base, p, 1), "page {p} in the parent after fork");
    }
    drop(region);
}
