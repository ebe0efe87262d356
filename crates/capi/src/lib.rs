//! uzswap-capi
