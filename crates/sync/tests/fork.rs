//! A child of fork starts with sound locks: the parent's threads were parked on locks
//! at the fork, and the child's new threads (glibc gives them the dead threads'
//! stacks) take new locks and the inherited ones. With parking_lot this child hung in
//! 2 runs of 10 (the crate comment); each round here forks once.

use std::sync::Arc;
use std::time::{Duration, Instant};
use uzswap_sync::{Condvar, Mutex, RwLock};

const ROUNDS: usize = 8;
const LOCKS: usize = 64;

/// Forks with `parked` threads waiting on locks the caller holds; the child hammers
/// new and inherited locks from four threads and exits 0. Returns the child's status,
/// or None if it had not exited within `limit` (then it is killed).
fn fork_with_parked_waiters(limit: Duration) -> Option<i32> {
    let m = Arc::new(Mutex::new(0u64));
    let rw = Arc::new(RwLock::new(0u64));
    let cv = Arc::new((Mutex::new(false), Condvar::new()));
    let held_m = m.lock();
    let held_rw = rw.write();
    let mut parked = Vec::new();
    for i in 0..6 {
        let (m, rw, cv) = (m.clone(), rw.clone(), cv.clone());
        parked.push(std::thread::spawn(move || match i % 3 {
            0 => *m.lock() += 1,
            1 => *rw.write() += 1,
            _ => {
                let mut go = cv.0.lock();
                while !*go {
                    go = cv.1.wait(go);
                }
            }
        }));
    }
    // Let them park (if one has not yet, the round tests less, never wrongly).
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: the child runs only code that is sound after fork in a threaded process
    // (std threads and locks, glibc's fork-safe malloc) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        drop(held_m);
        drop(held_rw);
        let locks: Arc<Vec<(Mutex<u64>, RwLock<u64>)>> =
            Arc::new((0..LOCKS).map(|_| (Mutex::new(0), RwLock::new(0))).collect());
        let workers: Vec<_> = (0..4)
            .map(|t| {
                let (locks, m, rw) = (locks.clone(), m.clone(), rw.clone());
                std::thread::spawn(move || {
                    for i in 0..50_000usize {
                        let k = (i * 7 + t) % LOCKS;
                        *locks[k].0.lock() += 1;
                        *locks[k].1.write() += 1;
                        if i % 1000 == 0 {
                            *m.lock() += 1;
                            let _ = *rw.read();
                        }
                    }
                })
            })
            .collect();
        let mut ok = true;
        for w in workers {
            ok &= w.join().is_ok();
        }
        let total: u64 = locks.iter().map(|l| *l.0.lock() + *l.1.read()).sum();
        ok &= total == 2 * 4 * 50_000;
        // SAFETY: _exit is async-signal-safe and ends the child without running the
        // test harness's exit path.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    drop(held_m);
    drop(held_rw);
    *cv.0.lock() = true;
    cv.1.notify_all();
    for p in parked {
        p.join().unwrap();
    }
    let start = Instant::now();
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child, status a valid out pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        assert!(r >= 0, "waitpid: {}", std::io::Error::last_os_error());
        if r == pid {
            return Some(status);
        }
        if start.elapsed() > limit {
            // SAFETY: kills and reaps our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_child_of_fork_takes_new_and_inherited_locks_while_parents_threads_were_parked() {
    for round in 0..ROUNDS {
        match fork_with_parked_waiters(Duration::from_secs(20)) {
            Some(status) => assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "round {round}: the child failed (status {status:#x})"
            ),
            None => panic!("round {round}: the child hung on a lock (killed after 20 s)"),
        }
    }
}
