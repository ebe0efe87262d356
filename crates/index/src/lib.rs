//! uzswap-index: our xarray (seed 002). SKELETON: the public API below is fixed; bodies are to be written.
//!
//! Maps a u64 key (swap slot or folio number) to a value. Lookups take no lock
//! (epoch-based reclamation via crossbeam-epoch); writers are sharded/lock-free so that
//! stores to different folios do not contend.

pub struct Index<V> { _v: std::marker::PhantomData<V> }

impl<V: Clone + Send + Sync + 'static> Index<V> {
    pub fn new() -> Self { todo!() }
    /// Lock-free lookup; returns a clone of the value.
    pub fn get(&self, key: u64) -> Option<V> { let _ = key; todo!() }
    /// Lock-free lookup that runs `f` on the value in place.
    pub fn with<R>(&self, key: u64, f: impl FnOnce(&V) -> R) -> Option<R> { let _ = (key, f); todo!() }
    /// Insert or replace; returns the previous value.
    pub fn insert(&self, key: u64, value: V) -> Option<V> { let _ = (key, value); todo!() }
    pub fn remove(&self, key: u64) -> Option<V> { let _ = key; todo!() }
    /// Remove only if `pred` holds for the current value (writeback's `entry == xa_load()` re-check).
    pub fn remove_if(&self, key: u64, pred: impl FnOnce(&V) -> bool) -> Option<V> { let _ = (key, pred); todo!() }
    pub fn len(&self) -> usize { todo!() }
    pub fn is_empty(&self) -> bool { self.len() == 0 }
    /// Bytes of memory the index itself holds (nodes and value boxes).
    pub fn memory_bytes(&self) -> usize { todo!() }
}

impl<V: Clone + Send + Sync + 'static> Default for Index<V> { fn default() -> Self { Self::new() } }
