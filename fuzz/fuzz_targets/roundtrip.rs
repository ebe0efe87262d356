//! `roundtrip`: any folio, under any configuration taken from the input, encodes
//! and decodes back bit for bit, and any single damaged byte of the encoding is
//! detected.
//!
//! The input picks the algorithm, level, granularity, raw threshold, verify flag
//! and folio size (4 KiB .. 2 MiB, mostly up to 64 KiB to keep runs fast); its data
//! is repeated (or padded with zeros or a word) up to the folio size, which gives
//! compressible, incompressible and same-filled units. An out-of-range level,
//! threshold or granularity must be refused by `FolioCodec::new` exactly when
//! `CodecConfig::validate` refuses it; the harness then folds it into range.
//!
//! Checked for every folio: the encoding fits `max_encoded_len`; a buffer one byte
//! smaller is refused with the right `need`; `decode` (by the encoding codec and by
//! a codec of another algorithm) and `decode_range` give back the input; the
//! encoding cut short or with a byte appended is refused; and one byte changed
//! anywhere (header, table, crc or payload) makes `decode` fail — the crc32c over
//! header, entry, index and payload catches every single-byte change.

#![no_main]

use std::cell::RefCell;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use uzswap_compress::{
    Algorithm, CodecConfig, Encoded, Error, FolioCodec, Granularity, MIN_FOLIO_LEN,
};

#[derive(Arbitrary, Debug)]
enum Padding {
    /// The data over and over (zeros if there is none).
    Repeat,
    Zeros,
    Word(u64),
}

#[derive(Arbitrary, Debug)]
struct Input {
    algorithm: u8,
    level: i32,
    granularity: u8,
    raw_threshold_percent: u8,
    verify: bool,
    folio_size: u8,
    padding: Padding,
    range: (u32, u32),
    damage_at: u32,
    damage_xor: u8,
    data: Vec<u8>,
}

thread_local! {
    /// A long-lived lz4 codec: decodes whatever algorithm the encoding names.
    static OTHER: RefCell<FolioCodec> =
        RefCell::new(FolioCodec::new(&CodecConfig::default()).expect("default configuration"));
}

fn config(input: &Input) -> CodecConfig {
    let algorithm =
        [Algorithm::Lz4, Algorithm::Zstd, Algorithm::Deflate][input.algorithm as usize % 3];
    let granularity = match input.granularity % 12 {
        10 => Granularity::Folio,
        11 => Granularity::Bytes(3 * MIN_FOLIO_LEN), // not a power of two
        shift => Granularity::Bytes(MIN_FOLIO_LEN << shift),
    };
    CodecConfig {
        algorithm,
        level: input.level,
        granularity,
        raw_threshold_percent: input.raw_threshold_percent,
        verify: input.verify,
    }
}

/// The same configuration with every setting folded into its valid range (levels
/// kept to the fast ones: this is about correctness, not ratio).
fn fold_into_range(mut cfg: CodecConfig) -> CodecConfig {
    cfg.level = match cfg.algorithm {
        Algorithm::Lz4 => cfg.level.rem_euclid(20) - 2,
        Algorithm::Zstd => cfg.level.rem_euclid(13) - 5,
        Algorithm::Deflate => cfg.level.rem_euclid(12) + 1,
    };
    if let Granularity::Bytes(n) = cfg.granularity {
        if !n.is_power_of_two() {
            cfg.granularity = Granularity::Bytes(16 << 10);
        }
    }
    cfg.raw_threshold_percent %= 101;
    cfg
}

fn folio(input: &Input) -> Vec<u8> {
    // Mostly 4..64 KiB; 1 in 8 inputs may go up to 2 MiB.
    let shift = if input.folio_size < 224 {
        input.folio_size % 5
    } else {
        input.folio_size % 10
    };
    let len = MIN_FOLIO_LEN << shift;
    let mut folio = Vec::with_capacity(len);
    folio.extend_from_slice(&input.data[..input.data.len().min(len)]);
    match input.padding {
        Padding::Repeat if !input.data.is_empty() => {
            while folio.len() < len {
                let n = (len - folio.len()).min(folio.len());
                folio.extend_from_within(..n);
            }
        }
        Padding::Repeat | Padding::Zeros => folio.resize(len, 0),
        Padding::Word(word) => {
            let word = word.to_ne_bytes();
            // Keep the word aligned to the folio so a padded unit is same-filled.
            let filled = folio.len();
            folio.extend_from_slice(&word.repeat(len / 8)[filled..]);
        }
    }
    folio
}

fuzz_target!(|input: Input| {
    let cfg = config(&input);
    let valid = cfg.validate();
    let cfg = match FolioCodec::new(&cfg) {
        Ok(_) => {
            assert_eq!(
                valid,
                Ok(()),
                "FolioCodec::new accepted what validate refuses"
            );
            cfg
        }
        Err(e) => {
            assert!(matches!(e, Error::Config(_)), "new: unexpected error {e:?}");
            assert!(
                valid.is_err(),
                "FolioCodec::new refused a valid configuration: {e}"
            );
            fold_into_range(cfg)
        }
    };
    let mut codec = FolioCodec::new(&cfg).unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
    let folio = folio(&input);
    let max = codec.max_encoded_len(folio.len());

    let mut small = vec![0u8; max - 1];
    assert_eq!(
        codec.encode(&folio, &mut small),
        Err(Error::BufferTooSmall { need: max })
    );

    let mut out = vec![0u8; max];
    let encoded = codec
        .encode(&folio, &mut out)
        .unwrap_or_else(|e| panic!("encode: {e}"));
    let len = match encoded {
        Encoded::SameFilled { word } => {
            let word = word.to_ne_bytes();
            assert!(
                folio == word.repeat(folio.len() / 8),
                "not same-filled: {encoded:?}"
            );
            return;
        }
        Encoded::Stored {
            len,
            units,
            raw_units,
            same_filled_units,
        } => {
            let unit_len = cfg.granularity.unit_len(folio.len());
            assert!(len <= max, "{len} > max_encoded_len {max}");
            assert_eq!(units as usize, folio.len() / unit_len);
            assert!(raw_units + same_filled_units <= units);
            if cfg.raw_threshold_percent == 0 {
                assert_eq!(
                    raw_units + same_filled_units,
                    units,
                    "threshold 0 compressed a unit"
                );
            }
            len
        }
    };
    let encoding = &out[..len];

    let mut back = vec![0u8; folio.len()];
    codec
        .decode(encoding, &mut back)
        .unwrap_or_else(|e| panic!("decode: {e}"));
    assert!(back == folio, "decode did not give the folio back");
    back.fill(0);
    OTHER
        .with(|other| other.borrow_mut().decode(encoding, &mut back))
        .unwrap_or_else(|e| panic!("decode by another codec: {e}"));
    assert!(
        back == folio,
        "decode by another codec did not give the folio back"
    );

    let start = input.range.0 as usize % (folio.len() + 1);
    let range_len = input.range.1 as usize % (folio.len() - start + 1);
    let mut part = vec![0u8; range_len];
    codec
        .decode_range(encoding, start, &mut part)
        .unwrap_or_else(|e| panic!("decode_range: {e}"));
    assert!(
        part == folio[start..start + range_len],
        "decode_range {start}+{range_len} differs"
    );

    assert!(
        codec.decode(&encoding[..len - 1], &mut back).is_err(),
        "a cut encoding decoded"
    );
    let mut longer = encoding.to_vec();
    longer.push(0);
    assert!(
        codec.decode(&longer, &mut back).is_err(),
        "an encoding with a byte appended decoded"
    );

    let mut damaged = encoding.to_vec();
    let at = input.damage_at as usize % len;
    damaged[at] ^= input.damage_xor.max(1);
    match codec.decode(&damaged, &mut back) {
        Err(Error::Corrupt(_)) => {}
        other => panic!(
            "byte {at} of {len} xor {:#x} went undetected: {other:?}, folio {}",
            input.damage_xor.max(1),
            if other.is_ok() && back == folio {
                "intact"
            } else {
                "changed"
            }
        ),
    }
});
