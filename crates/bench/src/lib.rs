//! uzswap-bench: the benchmark programs behind `uzswap bench ...`.
//!
//! A benchmark here is a program, not a timed test: each compares both sides in one
//! run on the same machine and prints a table, or JSON Lines with `--json`.

pub mod index;
pub mod region;
pub mod report;
pub mod store;
pub mod writeback;
