//! uzswap-compress: turns one folio (4 KiB .. 2 MiB) into a compact, self-describing
//! encoding and back.
//!
//! What it is for: lz4, zstd (any level, negative too) and deflate behind one
//! interface that compresses into a caller's buffer and never allocates on the hot
//! path; a granularity (4K, 16K, 64K, 256K or the whole folio) that splits a folio
//! into independently decompressible units (as zram's multi-page compression); same-filled units (zero or any
//! repeated 8-byte word) stored as a marker; units that do not shrink enough stored
//! raw (as zswap stores incompressible pages raw); optional verify-after-compress
//! (from zswap's mTHP swap-out work).
//! What it is not: it knows nothing of pools, indexes or memory mappings, keeps no
//! statistics beyond what one `encode` returns, and does not choose a granularity
//! (the store does, adaptively).
//!
//! # Structures, locking, life cycle
//!
//! A [`FolioCodec`] is one thread's tool, like the per-CPU `acomp_ctx` of zswap:
//! it owns the compression context of its configured algorithm, the decompression
//! contexts, and one 2 MiB scratch buffer, all made in [`FolioCodec::new`] and reused
//! by every call. Every method takes `&mut self`, so there is no locking inside; a
//! store keeps one codec per worker thread (or behind its own mutex). The scratch
//! buffer is used for verify-after-compress and for units a [`FolioCodec::decode_range`]
//! only partly needs; it is allocated zeroed and so costs no memory until touched.
//! Decoding follows the encoding's header, not the codec's configuration: a codec
//! made for lz4 decodes zstd, creating the zstd context once on first need.
//!
//! # Encoding
//!
//! `encode` first looks for a same-filled folio (every 8-byte word equal to the
//! first; the last word is compared first so ordinary data is rejected after two
//! loads). That returns [`Encoded::SameFilled`] and writes nothing: the caller keeps
//! the word, as zswap keeps `zswap_entry->value`. Otherwise each unit is, in order of
//! preference:
//! - same-filled: stored as its 8-byte word;
//! - compressed: if the result is at most `raw_threshold_percent` of the unit and
//!   strictly smaller than it. The compressor is given an output slice of exactly
//!   that size, so an incompressible unit fails fast instead of being compressed in
//!   full and then thrown away;
//! - raw: a copy of the unit (decoded with a memcpy).
//!
//! Layout (all integers little endian):
//!
//! ```text
//! offset      size  field
//! 0           1     magic 0xc5
//! 1           1     version (high nibble, 1) | algorithm (low nibble: 0 lz4, 1 zstd, 2 deflate)
//! 2           1     log2(folio length) - 12    (0..=9: 4 KiB .. 2 MiB)
//! 3           1     log2(unit length) - 12     (<= the folio's)
//! 4           8*n   unit table, n = folio / unit, one entry per unit in folio order:
//!                     u32  kind << 30 | stored length
//!                          kind 0 compressed (0 < length < unit),
//!                          kind 1 raw (length = unit), kind 2 same-filled (length = 8)
//!                     u32  crc32c(header ++ entry word ++ u32 unit index ++ payload)
//! 4+8n        ...   payloads, back to back in unit order; their lengths add up to
//!                   exactly the rest of the encoding
//! ```
//!
//! So a single-unit folio costs 12 bytes of overhead, and every further unit 8.
//! The same-filled payload is the word's 8 bytes as they were in memory.
//!
//! # Integrity
//!
//! Decoding never trusts the input: the header and the whole table are validated
//! against the encoding's length before any output is written, each unit's crc is
//! checked before it is decompressed or copied, and a decompressed unit must be
//! exactly one unit long. Any failure is [`Error::Corrupt`]; nothing panics. Since the
//! crc covers the header, the entry and its index too, a damaged header cannot make a
//! payload decode with another algorithm or land in another unit. On error the
//! output buffer holds unspecified bytes and must not be used.

mod backend;
mod format;

use std::fmt;
use std::str::FromStr;

use backend::{Compressor, Decompressors};
use format::{Geometry, Layout, UnitKind, UnitRef, SAME_FILLED_PAYLOAD_LEN};

pub use backend::LZ4_MAX_ACCELERATION;
pub use format::{HEADER_LEN, MAX_FOLIO_LEN, MIN_FOLIO_LEN, UNIT_ENTRY_LEN};

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
    /// A fixed unit size in bytes: 4K, 16K, 64K or 256K (any power of two from
    /// 4 KiB to 2 MiB is accepted).
    Bytes(usize),
    /// The whole folio is one unit (up to 2 MiB).
    Folio,
}

impl Granularity {
    /// Length of one unit of a folio of `folio_len` bytes: a unit larger than the
    /// folio is the folio.
    pub fn unit_len(self, folio_len: usize) -> usize {
        match self {
            Granularity::Folio => folio_len,
            Granularity::Bytes(n) => n.min(folio_len),
        }
    }

    pub fn validate(self) -> Result<(), Error> {
        match self {
            Granularity::Folio => Ok(()),
            Granularity::Bytes(n)
                if n.is_power_of_two() && (MIN_FOLIO_LEN..=MAX_FOLIO_LEN).contains(&n) =>
            {
                Ok(())
            }
            Granularity::Bytes(n) => Err(Error::Config(format!(
                "granularity {n} is not a power of two between 4 KiB and 2 MiB"
            ))),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct CodecConfig {
    pub algorithm: Algorithm,
    /// lz4: acceleration (<=1 default fast mode, at most 65537); zstd: level (negative
    /// = fast modes, 0 = zstd's default); deflate: 1..=12.
    pub level: i32,
    pub granularity: Granularity,
    /// A unit whose compressed size is above this percentage of its size is kept raw
    /// (0..=100; 0 stores everything raw).
    pub raw_threshold_percent: u8,
    /// Decompress every unit right after compressing it and compare (IAA-style).
    pub verify: bool,
}

impl CodecConfig {
    pub const DEFAULT_RAW_THRESHOLD_PERCENT: u8 = 90;

    /// Check everything `FolioCodec::new` would, without making contexts.
    pub fn validate(&self) -> Result<(), Error> {
        self.granularity.validate()?;
        if self.raw_threshold_percent > 100 {
            return Err(Error::Config(format!(
                "raw threshold {}% is above 100%",
                self.raw_threshold_percent
            )));
        }
        match self.algorithm {
            Algorithm::Lz4 if self.level > LZ4_MAX_ACCELERATION => Err(Error::Config(format!(
                "lz4 acceleration {} is above {LZ4_MAX_ACCELERATION}",
                self.level
            ))),
            Algorithm::Zstd
                if !(zstd::zstd_safe::min_c_level()..=zstd::zstd_safe::max_c_level())
                    .contains(&self.level) =>
            {
                Err(Error::Config(format!(
                    "zstd level {} is out of range",
                    self.level
                )))
            }
            Algorithm::Deflate if !(1..=12).contains(&self.level) => Err(Error::Config(format!(
                "deflate level {} is outside 1..=12",
                self.level
            ))),
            _ => Ok(()),
        }
    }
}

impl Default for CodecConfig {
    /// lz4 at its default speed, 64K units, raw above 90%, no verify.
    fn default() -> Self {
        CodecConfig {
            algorithm: Algorithm::Lz4,
            level: 1,
            granularity: Granularity::Bytes(64 << 10),
            raw_threshold_percent: Self::DEFAULT_RAW_THRESHOLD_PERCENT,
            verify: false,
        }
    }
}

/// Result of encoding one folio.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoded {
    /// Every byte of the folio is this repeated 8-byte word: nothing needs storing.
    SameFilled { word: u64 },
    /// `len` bytes of `out` hold the encoding.
    Stored {
        len: usize,
        units: u32,
        raw_units: u32,
        same_filled_units: u32,
    },
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
    cfg: CodecConfig,
    compressor: Compressor,
    decompressors: Decompressors,
    /// One unit of the largest size: verify target and partial-unit decode target.
    scratch: Box<[u8]>,
    /// Test hook: damage the next compressed payload before it is verified.
    #[cfg(test)]
    damage_next_compressed: bool,
}

impl FolioCodec {
    pub fn new(cfg: &CodecConfig) -> Result<Self, Error> {
        cfg.validate()?;
        let compressor = Compressor::new(cfg.algorithm, cfg.level)?;
        let mut decompressors = Decompressors::default();
        // Our own algorithm's context now: verify and the common decode need it.
        decompressors.prepare(cfg.algorithm)?;
        Ok(FolioCodec {
            cfg: cfg.clone(),
            compressor,
            decompressors,
            scratch: vec![0u8; MAX_FOLIO_LEN].into_boxed_slice(),
            #[cfg(test)]
            damage_next_compressed: false,
        })
    }

    pub fn config(&self) -> &CodecConfig {
        &self.cfg
    }

    /// Upper bound of `encode`'s output for a folio of `folio_len` bytes.
    pub fn max_encoded_len(&self, folio_len: usize) -> usize {
        max_encoded_len(folio_len, self.cfg.granularity)
    }

    /// Encodes `folio` cut as the configuration says.
    pub fn encode(&mut self, folio: &[u8], out: &mut [u8]) -> Result<Encoded, Error> {
        self.encode_cut(folio, out, self.cfg.granularity)
    }

    /// Encodes `folio` cut into units of `granularity`, whatever the configuration
    /// says: a caller that knows how the folio will be read back (at random: small
    /// units; as a whole: one) picks the cut per folio. The encoding records its cut,
    /// so decoding needs no setting.
    pub fn encode_cut(&mut self, folio: &[u8], out: &mut [u8], granularity: Granularity) -> Result<Encoded, Error> {
        granularity.validate()?;
        let geometry = Geometry::new(folio.len(), granularity)?;
        let need = geometry.max_encoded_len();
        if out.len() < need {
            return Err(Error::BufferTooSmall { need });
        }

        let first = word_at(folio, 0);
        // Bytes known to repeat `first`: units inside need no second look.
        let same_prefix = if word_at(folio, folio.len() - 8) == first {
            same_prefix_len(folio, first)
        } else {
            0
        };
        if same_prefix == folio.len() {
            return Ok(Encoded::SameFilled { word: first });
        }

        let unit_len = geometry.unit_len();
        // Largest compressed size worth keeping; anything bigger is stored raw.
        let keep_limit =
            (unit_len * usize::from(self.cfg.raw_threshold_percent) / 100).min(unit_len - 1);

        let (header, rest) = out.split_at_mut(HEADER_LEN);
        format::write_header(header, self.cfg.algorithm, geometry);
        let header_crc = crc32c::crc32c(header);
        let (table, payloads) = rest.split_at_mut(geometry.table_len());

        let (mut pos, mut raw_units, mut same_filled_units) = (0usize, 0u32, 0u32);
        for (index, unit) in folio.chunks_exact(unit_len).enumerate() {
            let same = (index + 1) * unit_len <= same_prefix || same_filled_word(unit).is_some();
            let (kind, len) = if same {
                payloads[pos..pos + SAME_FILLED_PAYLOAD_LEN]
                    .copy_from_slice(&unit[..SAME_FILLED_PAYLOAD_LEN]);
                same_filled_units += 1;
                (UnitKind::SameFilled, SAME_FILLED_PAYLOAD_LEN)
            } else if let Some(n) = self
                .compressor
                .compress(unit, &mut payloads[pos..pos + keep_limit])
            {
                let compressed = &mut payloads[pos..pos + n];
                #[cfg(test)]
                if std::mem::take(&mut self.damage_next_compressed) {
                    compressed[n / 2] ^= 0x10;
                }
                if self.cfg.verify {
                    let check = &mut self.scratch[..unit_len];
                    let ok = self
                        .decompressors
                        .decompress(self.cfg.algorithm, compressed, check)
                        == Some(unit_len)
                        && check == unit;
                    if !ok {
                        return Err(Error::VerifyMismatch(index as u32));
                    }
                }
                (UnitKind::Compressed, n)
            } else {
                payloads[pos..pos + unit_len].copy_from_slice(unit);
                raw_units += 1;
                (UnitKind::Raw, unit_len)
            };
            let entry = format::pack_entry(kind, len);
            let crc = format::unit_crc(header_crc, index, entry, &payloads[pos..pos + len]);
            let slot = &mut table[index * UNIT_ENTRY_LEN..][..UNIT_ENTRY_LEN];
            slot[..4].copy_from_slice(&entry.to_le_bytes());
            slot[4..].copy_from_slice(&crc.to_le_bytes());
            pos += len;
        }
        Ok(Encoded::Stored {
            len: HEADER_LEN + geometry.table_len() + pos,
            units: geometry.units() as u32,
            raw_units,
            same_filled_units,
        })
    }

    /// Decode a whole folio; `folio.len()` must be the original length.
    pub fn decode(&mut self, encoded: &[u8], folio: &mut [u8]) -> Result<(), Error> {
        let layout = Layout::parse(encoded)?;
        if folio.len() != layout.geometry.folio_len() {
            return Err(Error::Corrupt("folio length does not match the encoding"));
        }
        self.decode_units(&layout, 0, folio)
    }

    /// Decode only the units overlapping `[offset, offset + out.len())` of the folio.
    pub fn decode_range(
        &mut self,
        encoded: &[u8],
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), Error> {
        let layout = Layout::parse(encoded)?;
        let folio_len = layout.geometry.folio_len();
        match offset.checked_add(out.len()) {
            Some(end) if end <= folio_len => {}
            _ => {
                return Err(Error::Config(format!(
                    "range {offset}+{} is outside the {folio_len}-byte folio",
                    out.len()
                )))
            }
        }
        if out.is_empty() {
            return Ok(());
        }
        self.decode_units(&layout, offset, out)
    }

    fn decode_units(
        &mut self,
        layout: &Layout<'_>,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), Error> {
        let unit_len = layout.geometry.unit_len();
        let end = offset + out.len();
        for unit in layout.units(offset / unit_len, (end - 1) / unit_len) {
            layout.check(&unit)?;
            let unit_start = unit.index * unit_len;
            let lo = offset.max(unit_start);
            let hi = end.min(unit_start + unit_len);
            let dst = &mut out[lo - offset..hi - offset];
            if dst.len() == unit_len {
                decode_unit(&mut self.decompressors, layout.algorithm, &unit, dst)?;
                continue;
            }
            // Only part of this unit is wanted.
            let within = lo - unit_start..hi - unit_start;
            match unit.kind {
                UnitKind::Raw => dst.copy_from_slice(&unit.payload[within]),
                UnitKind::SameFilled => fill_same_from(dst, same_word_bytes(&unit), within.start),
                UnitKind::Compressed => {
                    let whole = &mut self.scratch[..unit_len];
                    decode_unit(&mut self.decompressors, layout.algorithm, &unit, whole)?;
                    dst.copy_from_slice(&whole[within]);
                }
            }
        }
        Ok(())
    }
}

/// Upper bound of an encoding of a folio of `folio_len` bytes cut by `granularity`;
/// the smallest unit (`Granularity::Bytes(MIN_FOLIO_LEN)`) bounds every cut.
pub fn max_encoded_len(folio_len: usize, granularity: Granularity) -> usize {
    match Geometry::new(folio_len, granularity) {
        Ok(geometry) => geometry.max_encoded_len(),
        // encode() will refuse such a folio; still give a bound that holds.
        Err(_) => {
            let unit = granularity.unit_len(folio_len).max(MIN_FOLIO_LEN);
            HEADER_LEN + folio_len.div_ceil(unit).max(1) * UNIT_ENTRY_LEN + folio_len
        }
    }
}

/// Decode one whole, already checked unit into `dst` (exactly one unit long).
fn decode_unit(
    decompressors: &mut Decompressors,
    algorithm: Algorithm,
    unit: &UnitRef<'_>,
    dst: &mut [u8],
) -> Result<(), Error> {
    match unit.kind {
        UnitKind::Raw => dst.copy_from_slice(unit.payload),
        UnitKind::SameFilled => fill_same(dst, u64::from_ne_bytes(same_word_bytes(unit))),
        UnitKind::Compressed => {
            decompressors.prepare(algorithm)?;
            match decompressors.decompress(algorithm, unit.payload, dst) {
                Some(n) if n == dst.len() => {}
                Some(_) => return Err(Error::Corrupt("unit decompressed to the wrong length")),
                None => return Err(Error::Corrupt("unit does not decompress")),
            }
        }
    }
    Ok(())
}

fn same_word_bytes(unit: &UnitRef<'_>) -> [u8; 8] {
    unit.payload[..SAME_FILLED_PAYLOAD_LEN].try_into().unwrap()
}

#[inline(always)]
fn word_at(data: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(data[at..at + 8].try_into().unwrap())
}

/// The repeated word if `data` (a multiple of 8 bytes) is one word over and over.
/// The last word is compared first: most data differs there and costs two loads.
fn same_filled_word(data: &[u8]) -> Option<u64> {
    let first = word_at(data, 0);
    if word_at(data, data.len() - 8) != first {
        return None;
    }
    (same_prefix_len(data, first) == data.len()).then_some(first)
}

/// Length of the prefix of `data` (a multiple of 8 bytes) made only of `word`,
/// rounded down to 64 bytes unless it is all of `data`. Compares 64 bytes per step
/// without branching inside, so the compiler can vectorise it.
fn same_prefix_len(data: &[u8], word: u64) -> usize {
    let mut blocks = data.chunks_exact(64);
    let mut len = 0;
    for block in &mut blocks {
        let diff = block.chunks_exact(8).fold(0, |acc, w| {
            acc | (u64::from_ne_bytes(w.try_into().unwrap()) ^ word)
        });
        if diff != 0 {
            return len;
        }
        len += 64;
    }
    for w in blocks.remainder().chunks_exact(8) {
        if u64::from_ne_bytes(w.try_into().unwrap()) != word {
            return len;
        }
        len += 8;
    }
    len
}

/// Fill `out` with a repeated 8-byte word (the inverse of a same-filled marker).
/// The word is laid down as it was read from memory (native byte order), starting
/// at `out[0]`; a trailing partial word gets the word's first bytes.
pub fn fill_same(out: &mut [u8], word: u64) {
    let bytes = word.to_ne_bytes();
    if bytes.iter().all(|&b| b == bytes[0]) {
        out.fill(bytes[0]); // zero and 0xff.. pages: plain memset
        return;
    }
    let mut chunks = out.chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&bytes);
    }
    let tail = chunks.into_remainder();
    let n = tail.len();
    tail.copy_from_slice(&bytes[..n]);
}

/// Fill `out` with the part of a same-filled unit that starts `phase` bytes into it.
fn fill_same_from(out: &mut [u8], bytes: [u8; 8], phase: usize) {
    let mut rotated = bytes;
    rotated.rotate_left(phase % 8);
    fill_same(out, u64::from_ne_bytes(rotated));
}

impl FromStr for Algorithm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "lz4" => Ok(Algorithm::Lz4),
            "zstd" => Ok(Algorithm::Zstd),
            "deflate" => Ok(Algorithm::Deflate),
            _ => Err(Error::Config(format!(
                "unknown algorithm {s:?} (expected lz4, zstd or deflate)"
            ))),
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Algorithm::Lz4 => "lz4",
            Algorithm::Zstd => "zstd",
            Algorithm::Deflate => "deflate",
        })
    }
}

impl FromStr for Granularity {
    type Err = Error;
    /// "folio", or a size: "4k", "16K", "64KiB", "2m", "4096".
    fn from_str(s: &str) -> Result<Self, Error> {
        let lower = s.trim().to_ascii_lowercase();
        if lower == "folio" {
            return Ok(Granularity::Folio);
        }
        let bad = || {
            Error::Config(format!(
                "bad granularity {s:?} (expected 4k, 16k, 64k, 256k, folio or a size in bytes)"
            ))
        };
        let digits_end = lower
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(lower.len());
        let (number, suffix) = lower.split_at(digits_end);
        let scale: usize = match suffix.trim() {
            "" | "b" => 1,
            "k" | "kb" | "kib" => 1 << 10,
            "m" | "mb" | "mib" => 1 << 20,
            _ => return Err(bad()),
        };
        let bytes = number
            .parse::<usize>()
            .ok()
            .and_then(|n| n.checked_mul(scale))
            .ok_or_else(bad)?;
        let granularity = Granularity::Bytes(bytes);
        granularity.validate()?;
        Ok(granularity)
    }
}

impl fmt::Display for Granularity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Granularity::Folio => f.write_str("folio"),
            Granularity::Bytes(n) if n % 1024 == 0 => write!(f, "{}k", n / 1024),
            Granularity::Bytes(n) => write!(f, "{n}"),
        }
    }
}

#[cfg(test)]
mod tests;
