//! uzswap-backing
