//! `decode`: whatever bytes a codec is handed, `decode` and `decode_range` return
//! `Ok` or `Err(Corrupt)`; they never panic, never read or write out of bounds
//! (AddressSanitizer watches), and all codecs agree.
//!
//! Two kinds of input, chosen by the first byte:
//! - *verbatim*: the rest is the encoding as it is. Nearly all of it dies at the
//!   header, table or crc checks, which is what those checks are for.
//! - *sealed*: the harness writes a correct header, table and crcs around unit
//!   payloads the input chooses, so lz4, zstd and deflate themselves get arbitrary
//!   compressed input behind a valid crc (what a damaged payload whose crc happens
//!   to match, or a buggy compressor, would hand them). A payload is either bytes
//!   from the input or a real stream from the compressor with up to three bytes
//!   changed, the near-valid input that goes deepest into a decompressor. Here the
//!   decoded bytes are checked too: raw and same-filled units come out as stored,
//!   an unchanged real stream as its content (even when other units are bad), and
//!   every `decode_range` equals the same bytes of the whole `decode`.
//!
//! Each input goes through three long-lived codecs, one configured per algorithm
//! (decoding follows the encoding's header, so each of them decodes all three):
//! reused contexts must not carry state from one input to the next, and the three
//! must return the same result.

#![no_main]

use std::cell::RefCell;

use arbitrary::{Arbitrary, Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use uzswap_compress::{
    Algorithm, CodecConfig, Encoded, Error, FolioCodec, Granularity, HEADER_LEN, MIN_FOLIO_LEN,
    UNIT_ENTRY_LEN,
};

const ALGORITHMS: [Algorithm; 3] = [Algorithm::Lz4, Algorithm::Zstd, Algorithm::Deflate];
/// Largest folio the harness builds (4 KiB << 9 = 2 MiB, the format's maximum).
const MAX_FOLIO_SHIFT: u8 = 9;

thread_local! {
    static CODECS: RefCell<Vec<FolioCodec>> = RefCell::new(
        ALGORITHMS
            .iter()
            .map(|&algorithm| {
                let level = if algorithm == Algorithm::Deflate { 6 } else { 1 };
                let cfg = CodecConfig { algorithm, level, ..CodecConfig::default() };
                FolioCodec::new(&cfg).expect("a valid configuration")
            })
            .collect(),
    );
    /// Encoders that make real streams: one unit per folio, never raw.
    static ENCODERS: RefCell<Vec<FolioCodec>> = RefCell::new(
        ALGORITHMS
            .iter()
            .map(|&algorithm| {
                let level = if algorithm == Algorithm::Deflate { 6 } else { 1 };
                let cfg = CodecConfig {
                    algorithm,
                    level,
                    granularity: Granularity::Folio,
                    raw_threshold_percent: 100,
                    verify: false,
                };
                FolioCodec::new(&cfg).expect("a valid configuration")
            })
            .collect(),
    );
}

/// One unit of a sealed encoding.
#[derive(Debug)]
struct UnitSpec {
    /// 0 compressed, 1 raw, 2 same-filled, 3 (reserved: must be refused).
    kind: u32,
    payload: Vec<u8>,
    /// For an undamaged stream from the real compressor: what it must decode to.
    expect: Option<Vec<u8>>,
}

/// A stream from the real compressor for `unit_len` bytes repeating `pattern`: the
/// start from which the decompressors get near-valid input, the most searching kind.
fn compressed_stream(algorithm: u8, unit_len: usize, pattern: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    if pattern.is_empty() {
        return None;
    }
    let content = pattern.repeat(unit_len.div_ceil(pattern.len()))[..unit_len].to_vec();
    ENCODERS.with(|encoders| {
        let codec = &mut encoders.borrow_mut()[algorithm as usize];
        let mut out = vec![0u8; codec.max_encoded_len(unit_len)];
        match codec.encode(&content, &mut out) {
            // One unit, compressed: its payload follows the header and the table entry.
            Ok(Encoded::Stored {
                len,
                raw_units: 0,
                same_filled_units: 0,
                ..
            }) => Some((out[HEADER_LEN + UNIT_ENTRY_LEN..len].to_vec(), content)),
            _ => None,
        }
    })
}

/// Builds a sealed encoding: valid header, table and crcs around payloads the
/// input chooses. Returns the encoding, its folio length and its units.
fn sealed(u: &mut Unstructured<'_>) -> Result<(Vec<u8>, usize, Vec<UnitSpec>)> {
    let algorithm = u.int_in_range(0..=2u8)?;
    let folio_shift = u.int_in_range(0..=MAX_FOLIO_SHIFT)?;
    let unit_shift = u.int_in_range(0..=folio_shift)?;
    let (folio_len, unit_len) = (MIN_FOLIO_LEN << folio_shift, MIN_FOLIO_LEN << unit_shift);
    let units = folio_len / unit_len;
    let mut specs = Vec::with_capacity(units);
    for _ in 0..units {
        let choice = u.int_in_range(0..=15u8)?;
        let spec = match choice {
            // Raw and same-filled, of the right length when the input has enough.
            0 => UnitSpec {
                kind: 1,
                payload: u.bytes(unit_len.min(u.len()))?.to_vec(),
                expect: None,
            },
            1 => UnitSpec {
                kind: 2,
                payload: u.bytes(8.min(u.len()))?.to_vec(),
                expect: None,
            },
            2 => {
                let len = u.arbitrary_len::<u8>()?;
                UnitSpec {
                    kind: 3,
                    payload: u.bytes(len)?.to_vec(),
                    expect: None,
                }
            }
            3..=9 => {
                // A real stream, then maybe a few bytes changed behind the crc's back.
                let pattern_len = u.int_in_range(1..=64)?;
                let pattern = u.bytes(pattern_len.min(u.len()))?;
                let Some((mut payload, content)) = compressed_stream(algorithm, unit_len, pattern)
                else {
                    // Same-filled content: no stream to start from.
                    specs.push(UnitSpec {
                        kind: 0,
                        payload: pattern.to_vec(),
                        expect: None,
                    });
                    continue;
                };
                let changes = u.int_in_range(0..=3u8)?;
                for _ in 0..changes {
                    let at = u.choose_index(payload.len())?;
                    payload[at] ^= u8::arbitrary(u)?.max(1);
                }
                UnitSpec {
                    kind: 0,
                    payload,
                    expect: (changes == 0).then_some(content),
                }
            }
            _ => {
                let len = u.arbitrary_len::<u8>()?.min(unit_len);
                UnitSpec {
                    kind: 0,
                    payload: u.bytes(len)?.to_vec(),
                    expect: None,
                }
            }
        };
        specs.push(spec);
    }
    let header = [0xc5, 0x10 | algorithm, folio_shift, unit_shift];
    let header_crc = crc32c::crc32c(&header);
    let mut encoding = header.to_vec();
    for (index, spec) in specs.iter().enumerate() {
        let entry = spec.kind << 30 | spec.payload.len() as u32;
        let mut tag = [0u8; 8];
        tag[..4].copy_from_slice(&entry.to_le_bytes());
        tag[4..].copy_from_slice(&(index as u32).to_le_bytes());
        let crc = crc32c::crc32c_append(crc32c::crc32c_append(header_crc, &tag), &spec.payload);
        encoding.extend_from_slice(&tag[..4]);
        encoding.extend_from_slice(&crc.to_le_bytes());
    }
    for spec in &specs {
        encoding.extend_from_slice(&spec.payload);
    }
    Ok((encoding, folio_len, specs))
}

/// Folio length the header of a verbatim encoding claims, if it is a possible one.
fn claimed_folio_len(encoding: &[u8]) -> Option<usize> {
    let shift = *encoding.get(2)?;
    (shift <= MAX_FOLIO_SHIFT).then(|| MIN_FOLIO_LEN << shift)
}

fn check_error(what: &str, err: &Error) {
    assert!(
        matches!(err, Error::Corrupt(_)),
        "{what}: unexpected error kind {err:?}"
    );
}

fn run(data: &[u8]) -> Result<()> {
    let mut u = Unstructured::new(data);
    let is_sealed = bool::arbitrary(&mut u)?;
    let range_start = u32::arbitrary(&mut u)? as usize;
    let range_len = u32::arbitrary(&mut u)? as usize;
    let (encoding, folio_len, specs) = if is_sealed {
        sealed(&mut u)?
    } else {
        let encoding = u.take_rest().to_vec();
        let folio_len = claimed_folio_len(&encoding).unwrap_or(MIN_FOLIO_LEN);
        (encoding, folio_len, Vec::new())
    };

    CODECS.with(|codecs| {
        let mut codecs = codecs.borrow_mut();
        let mut first: Option<std::result::Result<Vec<u8>, Error>> = None;
        for codec in codecs.iter_mut() {
            let mut folio = vec![0u8; folio_len];
            let result = codec.decode(&encoding, &mut folio).map(|()| folio);
            if let Err(e) = &result {
                check_error("decode", e);
            }
            match &first {
                None => first = Some(result),
                Some(expected) => assert_eq!(
                    expected.as_ref().map_err(|_| ()),
                    result.as_ref().map_err(|_| ()),
                    "codecs configured for different algorithms disagree"
                ),
            }
        }
        let decoded = first.expect("three codecs").ok();

        // A range of the folio: decode_range must agree with the whole decode.
        let start = range_start % (folio_len + 1);
        let len = range_len % (folio_len - start + 1);
        let codec = &mut codecs[range_start % ALGORITHMS.len()];
        let mut part = vec![0u8; len];
        match codec.decode_range(&encoding, start, &mut part) {
            Ok(()) => {
                if let Some(folio) = &decoded {
                    assert_eq!(
                        part,
                        folio[start..start + len],
                        "decode_range differs from decode"
                    );
                }
            }
            Err(Error::Config(_)) => {
                // Only a verbatim header that claims a smaller folio makes the range
                // fall outside.
                assert!(
                    !is_sealed,
                    "range {start}+{len} refused for a {folio_len}-byte folio"
                );
            }
            Err(e) => {
                check_error("decode_range", &e);
                assert!(
                    decoded.is_none(),
                    "decode_range failed where decode succeeded: {e:?}"
                );
            }
        }
        // A sealed encoding whose table is well formed (every kind known, every
        // length right for its kind) and whose compressed units are all unchanged
        // real streams decodes; an unchanged stream decodes to its content whatever
        // the other units' payloads hold.
        let unit_len = folio_len / specs.len().max(1);
        let table_valid = specs.iter().all(|s| match s.kind {
            0 => !s.payload.is_empty() && s.payload.len() < unit_len,
            1 => s.payload.len() == unit_len,
            2 => s.payload.len() == 8,
            _ => false,
        });
        if is_sealed && table_valid && specs.iter().all(|s| s.kind != 0 || s.expect.is_some()) {
            assert!(decoded.is_some(), "a sound sealed encoding did not decode");
        }
        if is_sealed && decoded.is_some() {
            assert!(table_valid, "an encoding with a malformed table decoded");
        }
        for (index, spec) in specs.iter().enumerate() {
            match &spec.expect {
                Some(content) if table_valid => {
                    let mut unit = vec![0u8; unit_len];
                    codec
                        .decode_range(&encoding, index * unit_len, &mut unit)
                        .unwrap_or_else(|e| panic!("unit {index}, an unchanged stream: {e}"));
                    assert!(
                        unit == *content,
                        "unit {index}: an unchanged stream decoded to other bytes"
                    );
                }
                _ => {}
            }
        }
        // Past the end of the folio is refused, not clamped.
        let mut one = [0u8; 1];
        if let Ok(()) = codec.decode_range(&encoding, folio_len, &mut one) {
            panic!("decode_range accepted a range past the end of the folio");
        }

        if let Some(folio) = decoded {
            for (spec, unit) in specs.iter().zip(folio.chunks(unit_len)) {
                match spec.kind {
                    1 => assert_eq!(unit, spec.payload, "raw unit not decoded as stored"),
                    2 => assert!(
                        unit == spec.payload.repeat(unit_len / 8),
                        "same-filled unit not decoded as its word"
                    ),
                    _ => {}
                }
            }
        }
    });
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(data);
});

// The sealed builder writes the header and table by hand.
const _: () = assert!(HEADER_LEN == 4 && UNIT_ENTRY_LEN == 8);
