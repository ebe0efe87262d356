//! uzswap-bench: the benchmark programs behind `uzswap bench ...`.
//!
//! A benchmark here is a program, not a timed test: each compares both sides in one
//! run on the same machine and prints a table, or JSON Lines with `--json`.

pub mod index;
pub mod kernel;
pub mod programs;
pub mod region;
pub mod report;
pub mod soak;
pub mod store;
pub mod writeback;

/// A progress bar on stderr for people; hidden in JSON mode or when stderr is not a terminal.
pub fn progress(json: bool, len: u64) -> indicatif::ProgressBar {
    if json {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {elapsed}")
            .expect("valid template"),
    );
    bar
}
