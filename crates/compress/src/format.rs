//! The byte layout of an encoded folio (described in the crate comment) and its
//! validation. Everything that reads an encoding goes through `Layout::parse`,
//! which checks the header and the whole unit table before any output is touched.

use crate::{Algorithm, Error, Granularity};

/// Bytes before the unit table.
pub const HEADER_LEN: usize = 4;
/// Bytes per unit in the table: a `kind | length` word and a crc32c.
pub const UNIT_ENTRY_LEN: usize = 8;
/// Smallest and largest folio, as powers of two.
pub const MIN_FOLIO_SHIFT: u32 = 12;
pub const MAX_FOLIO_SHIFT: u32 = 21;
pub const MIN_FOLIO_LEN: usize = 1 << MIN_FOLIO_SHIFT;
pub const MAX_FOLIO_LEN: usize = 1 << MAX_FOLIO_SHIFT;

const MAGIC: u8 = 0xc5;
const VERSION: u8 = 1;
/// Payload of a same-filled unit: the repeated word, as it was in memory.
pub const SAME_FILLED_PAYLOAD_LEN: usize = 8;

const KIND_SHIFT: u32 = 30;
const LEN_MASK: u32 = (1 << KIND_SHIFT) - 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitKind {
    Compressed = 0,
    Raw = 1,
    SameFilled = 2,
}

/// How a folio is cut: both lengths are powers of two, unit <= folio.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    folio_shift: u32,
    unit_shift: u32,
}

impl Geometry {
    /// The cut `granularity` gives a folio of `folio_len` bytes (a unit larger than
    /// the folio becomes the folio).
    pub fn new(folio_len: usize, granularity: Granularity) -> Result<Self, Error> {
        if !folio_len.is_power_of_two() || !(MIN_FOLIO_LEN..=MAX_FOLIO_LEN).contains(&folio_len) {
            return Err(Error::Config(format!(
                "folio length {folio_len} is not a power of two between 4 KiB and 2 MiB"
            )));
        }
        granularity.validate()?;
        let unit_len = match granularity {
            Granularity::Folio => folio_len,
            Granularity::Bytes(n) => n.min(folio_len),
        };
        Ok(Geometry {
            folio_shift: folio_len.trailing_zeros(),
            unit_shift: unit_len.trailing_zeros(),
        })
    }

    pub fn folio_len(self) -> usize {
        1 << self.folio_shift
    }
    pub fn unit_len(self) -> usize {
        1 << self.unit_shift
    }
    pub fn units(self) -> usize {
        1 << (self.folio_shift - self.unit_shift)
    }
    pub fn table_len(self) -> usize {
        self.units() * UNIT_ENTRY_LEN
    }
    /// Every unit stored raw is the worst case: payloads never exceed the folio.
    pub fn max_encoded_len(self) -> usize {
        HEADER_LEN + self.table_len() + self.folio_len()
    }
}

pub fn write_header(out: &mut [u8], algorithm: Algorithm, geometry: Geometry) {
    out[0] = MAGIC;
    out[1] = (VERSION << 4) | algorithm_code(algorithm);
    out[2] = (geometry.folio_shift - MIN_FOLIO_SHIFT) as u8;
    out[3] = (geometry.unit_shift - MIN_FOLIO_SHIFT) as u8;
}

fn algorithm_code(algorithm: Algorithm) -> u8 {
    match algorithm {
        Algorithm::Lz4 => 0,
        Algorithm::Zstd => 1,
        Algorithm::Deflate => 2,
    }
}

pub fn pack_entry(kind: UnitKind, len: usize) -> u32 {
    debug_assert!(len <= LEN_MASK as usize);
    ((kind as u32) << KIND_SHIFT) | len as u32
}

/// crc32c of a unit: the header, the unit's table word and index, then its payload.
/// Covering the header and the index means a damaged header or table cannot make a
/// payload be decoded with the wrong algorithm or into the wrong place.
pub fn unit_crc(header_crc: u32, index: usize, entry: u32, payload: &[u8]) -> u32 {
    let mut tag = [0u8; 8];
    tag[..4].copy_from_slice(&entry.to_le_bytes());
    tag[4..].copy_from_slice(&(index as u32).to_le_bytes());
    crc32c::crc32c_append(crc32c::crc32c_append(header_crc, &tag), payload)
}

/// One unit as read from a validated table.
pub struct UnitRef<'a> {
    pub index: usize,
    pub kind: UnitKind,
    entry: u32,
    crc: u32,
    pub payload: &'a [u8],
}

/// A parsed encoding whose header and table are consistent with its length.
pub struct Layout<'a> {
    pub algorithm: Algorithm,
    pub geometry: Geometry,
    header_crc: u32,
    table: &'a [u8],
    payloads: &'a [u8],
}

fn corrupt(what: &'static str) -> Error {
    Error::Corrupt(what)
}

impl<'a> Layout<'a> {
    pub fn parse(encoded: &'a [u8]) -> Result<Self, Error> {
        let header = encoded
            .get(..HEADER_LEN)
            .ok_or(corrupt("shorter than the header"))?;
        if header[0] != MAGIC {
            return Err(corrupt("bad magic"));
        }
        if header[1] >> 4 != VERSION {
            return Err(corrupt("unknown version"));
        }
        let algorithm = match header[1] & 0xf {
            0 => Algorithm::Lz4,
            1 => Algorithm::Zstd,
            2 => Algorithm::Deflate,
            _ => return Err(corrupt("unknown algorithm")),
        };
        let folio_shift = u32::from(header[2]) + MIN_FOLIO_SHIFT;
        let unit_shift = u32::from(header[3]) + MIN_FOLIO_SHIFT;
        if folio_shift > MAX_FOLIO_SHIFT || unit_shift > folio_shift {
            return Err(corrupt("bad folio or unit size"));
        }
        let geometry = Geometry {
            folio_shift,
            unit_shift,
        };
        let rest = &encoded[HEADER_LEN..];
        if rest.len() < geometry.table_len() {
            return Err(corrupt("truncated unit table"));
        }
        let (table, payloads) = rest.split_at(geometry.table_len());
        let layout = Layout {
            algorithm,
            geometry,
            header_crc: crc32c::crc32c(header),
            table,
            payloads,
        };
        // Validate every entry and the total length now, so that decoding a range
        // never starts on an encoding that is truncated or padded further on.
        let mut total = 0usize;
        for index in 0..geometry.units() {
            let (_, len, _) = layout.entry(index)?;
            total += len;
        }
        if total != payloads.len() {
            return Err(corrupt("payload length does not match the unit table"));
        }
        Ok(layout)
    }

    fn entry(&self, index: usize) -> Result<(UnitKind, usize, u32), Error> {
        let raw = &self.table[index * UNIT_ENTRY_LEN..][..UNIT_ENTRY_LEN];
        let word = u32::from_le_bytes(raw[..4].try_into().unwrap());
        let len = (word & LEN_MASK) as usize;
        let unit_len = self.geometry.unit_len();
        let kind = match word >> KIND_SHIFT {
            0 if len > 0 && len < unit_len => UnitKind::Compressed,
            1 if len == unit_len => UnitKind::Raw,
            2 if len == SAME_FILLED_PAYLOAD_LEN => UnitKind::SameFilled,
            _ => return Err(corrupt("bad unit table entry")),
        };
        Ok((kind, len, word))
    }

    /// The units `first..=last`, in order, with their payloads.
    pub fn units(&self, first: usize, last: usize) -> impl Iterator<Item = UnitRef<'a>> + '_ {
        let mut offset = 0usize;
        (0..=last).filter_map(move |index| {
            // parse() validated every entry, so this cannot fail.
            let (kind, len, entry) = self.entry(index).ok()?;
            let payload = &self.payloads[offset..offset + len];
            offset += len;
            let crc_at = index * UNIT_ENTRY_LEN + 4;
            let crc = u32::from_le_bytes(self.table[crc_at..crc_at + 4].try_into().unwrap());
            (index >= first).then_some(UnitRef {
                index,
                kind,
                entry,
                crc,
                payload,
            })
        })
    }

    /// Check a unit's payload against its crc; done before anything is decompressed.
    pub fn check(&self, unit: &UnitRef<'_>) -> Result<(), Error> {
        if unit_crc(self.header_crc, unit.index, unit.entry, unit.payload) != unit.crc {
            return Err(corrupt("unit checksum mismatch"));
        }
        Ok(())
    }
}
