//! The runtime's descriptors out of the program's reach (fds.rs): placed at the top of
//! the descriptor limit, and restored from the keeper when the program closes them
//! with raw system calls while its threads fault, on both fault paths, with
//! writeback. One test in this binary: closing descriptors is process-wide, and a
//! runtime that another test was still making could not be restored.

mod common;
use std::sync::atomic::{AtomicBool, Ordering::*};
use uzswap_runtime::*;

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;

fn word(page: usize, version: u64, w: usize) -> u64 {
    if w < 8 {
        (page as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.rotate_left(17) ^ w as u64
    } else {
        version ^ 0x5555_0000
    }
}

fn fill(base: usize, page: usize, version: u64) {
    for w in 0..PAGE / 8 {
        // SAFETY: the page lies inside a live region.
        unsafe { ((base + page * PAGE) as *mut u64).add(w).write_volatile(word(page, version, w)) };
    }
}

fn check(base: usize, page: usize, version: u64) {
    for w in 0..PAGE / 8 {
        // SAFETY: as above.
        let got = unsafe { ((base + page * PAGE) as *const u64).add(w).read_volatile() };
        assert_eq!(got, word(page, version, w), "page {page} word {w} version {version}");
    }
}

/// Every registered descriptor, closed by the close system call itself (the shim
/// would refuse; a static binary or a raw close_range would not ask it).
fn close_ours_raw() -> usize {
    let mut ours = [0; fds::SLOTS];
    let n = fds::ours(&mut ours);
    for &fd in &ours[..n] {
        // SAFETY: closing a descriptor: what the test means to do to the runtime.
        unsafe { libc::syscall(libc::SYS_close, fd) };
    }
    n
}

#[test]
fn raw_closes_are_restored_while_threads_fault() {
    for path in [FaultPath::Thread, FaultPath::Sigbus] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = RuntimeConfig::new(16 * MIB as u64);
        cfg.fault_path = path;
        cfg.publish_stats = false;
        cfg.writeback_dir = Some(dir.path().to_path_buf());
        cfg.backing_max_bytes = 256 << 20;
        cfg.max_pool_percent = 3;
        // A pipe of the program's, open when the runtime starts: its keeper's copy of
        // the table must not hold it, or closing the write end would never give EOF.
        let mut pipe = [0; 2];
        // SAFETY: pipe2 writes two descriptors into our array.
        assert_eq!(unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) }, 0);
        let Some(rt) = common::or_skip(Runtime::new(cfg)) else { return };
        // SAFETY: our own pipe's descriptors, closed once; read into our buffer.
        unsafe {
            libc::close(pipe[1]);
            let mut byte = 0u8;
            let got = libc::read(pipe[0], (&raw mut byte).cast(), 1);
            assert_eq!(got, 0, "the write end is still open somewhere (the keeper kept it): {}", std::io::Error::last_os_error());
            libc::close(pipe[0]);
        }

        // Placed at the top of the soft limit, and the lowest free number is the program's.
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes our struct.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        let soft = lim.rlim_cur.min(1 << 16) as i32;
        let mut ours = [0; fds::SLOTS];
        let n = fds::ours(&mut ours);
        assert!(n >= 6, "uffd x2, eventfd x2, pagemap, pidfd, backing file: {:?}", &ours[..n]);
        for &fd in &ours[..n] {
            assert!(fd >= soft - fds::RESERVE && fd < soft, "descriptor {fd} not at the top of {soft}");
            // SAFETY: F_GETFD reads a flag.
            assert_eq!(unsafe { libc::fcntl(fd, libc::F_GETFD) } & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        }

        let len = 48 * MIB;
        let region = rt.create_region(len, 64 << 10).expect("region");
        let base = region.as_ptr() as usize;
        let pages = len / PAGE;
        let threads = 3;
        let done = AtomicBool::new(false);
        let mut closes = 0;
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let done = &done;
                    s.spawn(move || {
                        let mine: Vec<usize> = (t..pages).step_by(threads).collect();
                        let mut version = 1u64;
                        for &p in &mine {
                            fill(base, p, version);
                        }
                        let mut rounds = 0;
                        while !done.load(Relaxed) || rounds < 2 {
                            for &p in &mine {
                                check(base, p, version);
                                fill(base, p, version + 1);
                            }
                            version += 1;
                            rounds += 1;
                        }
                    })
                })
                .collect();
            while workers.iter().any(|w| !w.is_finished()) && closes < 40 {
                std::thread::sleep(std::time::Duration::from_millis(15));
                assert!(close_ours_raw() >= 6);
                closes += 1;
            }
            done.store(true, Relaxed);
        });
        // Every descriptor is back at its number.
        let mut again = [0; fds::SLOTS];
        assert_eq!(fds::ours(&mut again), n);
        for &fd in &again[..n] {
            // SAFETY: F_GETFD reads a flag.
            assert!(unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0, "descriptor {fd} not restored");
        }
        let t = rt.stats().total();
        let s = rt.store().stats();
        assert!(t.zswpin > 0 && s.totals.zswpwb > 0 && s.totals.pswpin > 0, "swap-in and writeback happened: {t:?} {s:?}");
        eprintln!("{path:?}: {closes} raw closes, {t:?}");
        drop(region);
        drop(rt);
        // The runtime's numbers are the program's again.
        let mut none = [0; fds::SLOTS];
        assert_eq!(fds::ours(&mut none), 0);
    }
}
