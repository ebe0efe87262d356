//! bench index (being written)
