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
