//! uzswap-corpus
