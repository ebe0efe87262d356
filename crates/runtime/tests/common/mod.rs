//! What the runtime's integration tests share.

use uzswap_runtime::{Error, Runtime};

/// The runtime `made`, or `None` after printing `SKIP: <why>` where userfaultfd is
/// unavailable here; any other error fails the test.
pub fn or_skip(made: Result<Runtime, Error>) -> Option<Runtime> {
    match made {
        Ok(rt) => Some(rt),
        Err(Error::Unavailable(why)) => {
            eprintln!("SKIP: {why}");
            None
        }
        Err(e) => panic!("runtime: {e}"),
    }
}

/// The runtime's counters, summed over folio sizes, as one consistent snapshot. Each
/// counter is an atomic of its own and a transition moves two or more, so a sum read
/// while the reclaimer (or the reader, settling a drop) is mid-transition can be off by
/// one: the reclaimer is held, and the counters read until three readings in a row
/// agree, before it is let go again.
#[allow(dead_code)] // not every test binary checks counters
pub fn quiet_totals(rt: &Runtime) -> uzswap_runtime::SizeStats {
    rt.pause_reclaimer(true);
    let mut t = rt.stats().total();
    let mut same = 0;
    while same < 3 {
        std::thread::yield_now();
        let u = rt.stats().total();
        same = if u == t { same + 1 } else { 0 };
        t = u;
    }
    rt.pause_reclaimer(false);
    t
}

/// Forks with `hold` taken, after the program unmapped part of a carried region
/// behind the runtime's back (and maybe mapped something else there), or moved it.
/// The child, with a runtime of its own made from `cfg`, must take over no region
/// (the range is not whole) and find what it maps right (`intact`: every page of the
/// region it still has, and the hole). Returns once the parent has resumed and
/// reaped the child.
#[allow(dead_code)] // the fork tests only
pub fn fork_past_a_hole(hold: uzswap_runtime::fork::ForkHold, cfg: uzswap_runtime::RuntimeConfig, intact: impl Fn() -> bool) {
    // SAFETY: the child runs only this test's code and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = (|| {
            let inherited = hold.into_child();
            let Ok(own) = Runtime::new(cfg) else { return 3 };
            if !inherited.take_over(Some(&own)).is_empty() {
                return 4;
            }
            if !intact() {
                return 1;
            }
            0
        })();
        // SAFETY: leaves the child at once.
        unsafe { libc::_exit(code) };
    }
    hold.resume();
    let mut status = 0;
    // SAFETY: our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child died: status {status:#x}");
    assert_eq!(libc::WEXITSTATUS(status), 0, "the child: 1 wrong bytes (or the hole), 3 no runtime, 4 a region taken over");
}

/// Whether nothing is mapped at `[addr, addr + len)`: maps it, as the program would.
#[allow(dead_code)] // the fork tests only
pub fn free_at(addr: usize, len: usize) -> bool {
    // SAFETY: a fresh mapping where nothing is (NOREPLACE), left for the process' end.
    let p = unsafe { libc::mmap(addr as *mut _, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE, -1, 0) };
    p as usize == addr
}
