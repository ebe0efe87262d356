//! bench store (being written)
