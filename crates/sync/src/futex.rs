//! Bare futex waits and wakes on an `AtomicU32`, for waits a signal handler may make
//! (the fault path's sleep for room, the remote tier's fetch): one system call each,
//! nothing allocated, no lock. A wait returns when the word is not `expected` (at
//! once, if it already differs), on a wake, on a signal or at the timeout, without
//! saying which: callers check their condition and the clock again in a loop.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `word` holds `expected`, for at most `timeout` (none: until woken).
pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|d| libc::timespec { tv_sec: d.as_secs() as libc::time_t, tv_nsec: d.subsec_nanos() as libc::c_long });
    let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: FUTEX_WAIT on a live atomic with a timespec on our stack (or none); it
    // returns at once if the word changed. Any error (EAGAIN, EINTR, ETIMEDOUT) only
    // sends the caller round its loop, which checks the word and the clock again.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG, expected, tsp);
    }
}

/// Wakes up to `n` threads waiting on `word`.
pub fn wake(word: &AtomicU32, n: i32) {
    // SAFETY: FUTEX_WAKE on a live atomic touches no memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::SeqCst;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn a_wait_returns_at_once_on_a_changed_word_and_at_its_timeout() {
        let w = AtomicU32::new(1);
        let t = Instant::now();
        wait(&w, 0, Some(Duration::from_secs(10)));
        assert!(t.elapsed() < Duration::from_secs(5));
        let t = Instant::now();
        wait(&w, 1, Some(Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn a_wake_ends_the_wait() {
        let w = Arc::new(AtomicU32::new(0));
        let w2 = w.clone();
        let waiter = std::thread::spawn(move || {
            while w2.load(SeqCst) == 0 {
                wait(&w2, 0, None);
            }
        });
        w.store(1, SeqCst);
        wake(&w, 1);
        waiter.join().unwrap();
    }
}
