//! Links the preloaded library so that its own calls to the functions it defines bind
//! to its own definitions (-Bsymbolic-functions), not to the first definition in the
//! process. A program that defines malloc itself (rustc and other programs linked
//! with jemalloc unprefixed, examples/ownmalloc.c) would otherwise be handed every
//! malloc made inside this library: std's `System` allocator (which std uses for
//! every thread's handle, whose parker uzswap's threads write), zstd's and
//! libdeflate's contexts. That memory is the program's, adopted and swapped out with
//! the rest; rustc hung when the reclaimer woke its compressing thread through a
//! handle in a folio it was taking out. Bound here, those calls reach our malloc,
//! which serves uzswap's code from uzswap's own heap (own.rs).
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic-functions");
}
