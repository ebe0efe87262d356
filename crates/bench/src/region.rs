//! bench region (being written)
