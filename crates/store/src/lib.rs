//! uzswap-store: our zswap. SKELETON: the public API below is fixed; bodies are being written.
//!
//! Keeps whole folios compressed: codec (uzswap-compress) + pool (uzswap-pool) +
//! index (uzswap-index) + LRU + stats with the kernel's names.
//! Caller contract (as zswap relies on the folio lock): store/load/invalidate of the
//! same key never overlap; different keys may be used from any number of threads.

pub use uzswap_compress::{Algorithm, CodecConfig, Granularity};

#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub codec: CodecConfig,
    /// Keep units that do not compress, raw (seed 001). If false such folios are rejected.
    pub store_incompressible: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Codec(#[from] uzswap_compress::Error),
    #[error(transparent)]
    Pool(#[from] uzswap_pool::PoolError),
    #[error("folio of {0} bytes: must be a power of two from 4 KiB to 2 MiB")]
    FolioSize(usize),
    #[error("folio does not compress and store_incompressible is off")]
    Incompressible,
}

pub struct Store {}

impl Store {
    pub fn new(cfg: StoreConfig) -> Result<Self, StoreError> { let _ = cfg; todo!() }
    /// Compress `folio` and keep it under `key` (replacing any older entry).
    pub fn store(&self, key: u64, folio: &[u8]) -> Result<(), StoreError> { let _ = (key, folio); todo!() }
    /// Exclusive load: decompress into `folio` and free the entry. Ok(false) if absent.
    pub fn load(&self, key: u64, folio: &mut [u8]) -> Result<bool, StoreError> { let _ = (key, folio); todo!() }
    /// Drop the entry if present.
    pub fn invalidate(&self, key: u64) -> bool { let _ = key; todo!() }
    /// pool_total_size: bytes of memory the store holds (pool + entry metadata).
    pub fn pool_total_size(&self) -> u64 { todo!() }
}
