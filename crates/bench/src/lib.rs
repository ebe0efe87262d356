//! uzswap-bench
