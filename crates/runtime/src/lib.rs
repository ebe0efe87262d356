//! uzswap-runtime
