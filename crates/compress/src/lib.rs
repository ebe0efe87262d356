//! uzswap-compress: turns one folio (4 KiB .. 2 MiB) into a compact, self-describing
//! encoding and back. SKELETON: the public API below is fixed; bodies are to be written.
//!
//! What it is for: lz4, zstd (any level, negative too) and deflate behind one
//! interface that compresses into a caller's buffer and never allocates on the hot
//! path; a granularity (4K, 16K, 64K, 256K or the whole folio) that splits a folio
//! into independently decompressible units (seed 004); same-filled units (zero or any
//! repeated 8-byte word) stored as a marker; units that do not shrink enough stored
//! raw (seed 001); optional verify-after-compress (seed 000).
//! What it is not: it knows nothing of pools, indexes or memory mappings.

use std::fmt;
use std::str::FromStr;

/// Compression backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    Lz4,
    Zstd,
    Deflate,
}

/// Size of the independently decompressible unit a folio is cut into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Granularity {
    /// A fixed unit size in bytes: 4K, 16K, 64K or 256K (power of two).
    Bytes(usize),
    /// The whole folio is one unit (up to 2 MiB).
    Folio,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CodecConfig {
    pub algorithm: Algorithm,
    /// lz4: acceleration (<=0 default fast mode) ; zstd: level (negative = fast modes);
    /// deflate: 1..=12.
    pub level: i32,
    pub granularity: Granularity,
    /// A unit whose compressed size is above this percentage of its size is kept raw.
    pub raw_threshold_percent: u8,
    /// Decompress every unit right after compressing it and compare (IAA-style).
    pub verify: bool,
}

/// Result of encoding one folio.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoded {
    /// Every byte of the folio is this repeated 8-byte word: nothing needs storing.
    SameFilled { word: u64 },
    /// `len` bytes of `out` hold the encoding.
    Stored { len: usize, units: u32, raw_units: u32, same_filled_units: u32 },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("corrupt encoding: {0}")]
    Corrupt(&'static str),
    #[error("verify-after-compress mismatch in unit {0}")]
    VerifyMismatch(u32),
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("buffer too small: need {need} bytes")]
    BufferTooSmall { need: usize },
}

/// One thread's compressor: contexts and scratch buffers, reused on every call.
pub struct FolioCodec {
    _cfg: CodecConfig,
}

impl FolioCodec {
    pub fn new(cfg: &CodecConfig) -> Result<Self, Error> { let _ = cfg; todo!() }
    pub fn config(&self) -> &CodecConfig { todo!() }
    /// Upper bound of `encode`'s output for a folio of `folio_len` bytes.
    pub fn max_encoded_len(&self, folio_len: usize) -> usize { let _ = folio_len; todo!() }
    pub fn encode(&mut self, folio: &[u8], out: &mut [u8]) -> Result<Encoded, Error> { let _ = (folio, out); todo!() }
    /// Decode a whole folio; `folio.len()` must be the original length.
    pub fn decode(&mut self, encoded: &[u8], folio: &mut [u8]) -> Result<(), Error> { let _ = (encoded, folio); todo!() }
    /// Decode only the units overlapping `[offset, offset + out.len())` of the folio.
    pub fn decode_range(&mut self, encoded: &[u8], offset: usize, out: &mut [u8]) -> Result<(), Error> { let _ = (encoded, offset, out); todo!() }
}

/// Fill `out` with a repeated 8-byte word (the inverse of a same-filled marker).
pub fn fill_same(out: &mut [u8], word: u64) { let _ = (out, word); todo!() }

impl FromStr for Algorithm { type Err = Error; fn from_str(s: &str) -> Result<Self, Error> { let _ = s; todo!() } }
impl fmt::Display for Algorithm { fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { let _ = f; todo!() } }
impl FromStr for Granularity { type Err = Error; fn from_str(s: &str) -> Result<Self, Error> { let _ = s; todo!() } }
impl fmt::Display for Granularity { fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { let _ = f; todo!() } }
