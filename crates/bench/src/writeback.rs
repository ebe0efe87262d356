//! bench writeback (being written)
