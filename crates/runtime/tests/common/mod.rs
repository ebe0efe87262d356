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
