//! uzswap-pool: our zsmalloc. SKELETON: the public API below is fixed; bodies are to be written.
//!
//! Stores variable-size objects (a few bytes up to the largest encoded folio, ~2 MiB +
//! header) packed into size classes whose spans cover several pages, so objects cross
//! page boundaries instead of wasting the tail. Handles stay valid across compaction.
//! `total_size()` is exactly the bytes of memory the pool holds from the system.

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Handle(pub u64);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("object of {0} bytes is larger than the pool's maximum")]
    TooLarge(usize),
    #[error("out of memory")]
    OutOfMemory,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Live objects.
    pub objects: u64,
    /// Sum of live object sizes as passed to `store`.
    pub object_bytes: u64,
    /// Bytes of memory held from the system (spans, large objects, handle tables, metadata).
    pub total_size: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompactStats {
    pub moved_objects: u64,
    pub freed_bytes: u64,
}

pub struct Pool {}

impl Pool {
    pub fn new() -> Self { todo!() }
    /// Largest object `store` accepts.
    pub const MAX_OBJECT_SIZE: usize = 2 * 1024 * 1024 + 64 * 1024;
    /// Allocate an object and copy `data` into it (zs_malloc + zs_obj_write).
    pub fn store(&self, data: &[u8]) -> Result<Handle, PoolError> { let _ = data; todo!() }
    /// Run `f` on the object's bytes; they may move once `f` returns (zs_obj_read_begin/end).
    pub fn read<R>(&self, handle: Handle, f: impl FnOnce(&[u8]) -> R) -> R { let _ = (handle, f); todo!() }
    pub fn free(&self, handle: Handle) { let _ = handle; todo!() }
    /// Move objects out of sparse spans into fuller ones and give empty spans back.
    pub fn compact(&self) -> CompactStats { todo!() }
    /// pool_total_size: bytes of memory the pool really holds.
    pub fn total_size(&self) -> u64 { todo!() }
    pub fn stats(&self) -> PoolStats { todo!() }
}

impl Default for Pool { fn default() -> Self { Self::new() } }
