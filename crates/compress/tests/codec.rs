//! Round trips, ranges, configuration and corruption tests of the public API.

use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use std::sync::OnceLock;
use uzswap_compress::*;

const K: usize = 1024;
const GRANULARITIES: [Granularity; 5] = [
    Granularity::Bytes(4 * K),
    Granularity::Bytes(16 * K),
    Granularity::Bytes(64 * K),
    Granularity::Bytes(256 * K),
    Granularity::Folio,
];
const SAME_WORD: u64 = 0xdead_beef_0bad_f00d;

fn config(algorithm: Algorithm, granularity: Granularity) -> CodecConfig {
    let level = match algorithm {
        Algorithm::Lz4 => 1,
        Algorithm::Zstd => 1,
        Algorithm::Deflate => 6,
    };
    CodecConfig {
        algorithm,
        level,
        granularity,
        ..CodecConfig::default()
    }
}

fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    SmallRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

fn same_filled(len: usize, word: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_same(&mut v, word);
    v
}

/// Real-file data that is not one repeated word (the corpus has zero runs, and a
/// short sample can fall entirely inside one).
fn realistic(len: usize, seed: u64) -> Vec<u8> {
    (seed..)
        .map(|s| uzswap_corpus::realistic(len, s))
        .find(|d| d.chunks_exact(8).any(|w| w != &d[..8]))
        .unwrap()
}

/// Cycles 4 KiB pages through real-file data, zero, a non-zero word and random
/// bytes, so every granularity sees units of every kind (or a blend of them).
fn mixed(len: usize, seed: u64) -> Vec<u8> {
    let real = realistic(len, seed);
    let noise = random(len, seed ^ 0x5555);
    let mut v = vec![0u8; len];
    for (i, page) in v.chunks_exact_mut(4 * K).enumerate() {
        let at = i * 4 * K..(i + 1) * 4 * K;
        match i % 4 {
            0 => page.copy_from_slice(&real[at]),
            1 => {}
            2 => fill_same(page, SAME_WORD),
            _ => page.copy_from_slice(&noise[at]),
        }
    }
    v
}

fn encode(codec: &mut FolioCodec, folio: &[u8]) -> (Vec<u8>, Encoded) {
    let mut out = vec![0u8; codec.max_encoded_len(folio.len())];
    let encoded = codec.encode(folio, &mut out).unwrap();
    if let Encoded::Stored { len, .. } = encoded {
        assert!(len <= out.len());
        out.truncate(len);
    }
    (out, encoded)
}

fn decode(codec: &mut FolioCodec, encoding: &[u8], len: usize) -> Result<Vec<u8>, Error> {
    let mut back = vec![0x5au8; len];
    codec.decode(encoding, &mut back)?;
    Ok(back)
}

/// Encode, decode with this codec and with a codec of another algorithm, and
/// check counts that follow from the data; returns the encoding.
fn round_trip(codec: &mut FolioCodec, folio: &[u8], what: &str) -> (Vec<u8>, Encoded) {
    let cfg = codec.config().clone();
    let ctx = format!(
        "{what} {}/{} folio {}",
        cfg.algorithm,
        cfg.granularity,
        folio.len()
    );
    let mut out = vec![0xa5u8; codec.max_encoded_len(folio.len())];
    let result = codec.encode(folio, &mut out).unwrap();
    match result {
        Encoded::SameFilled { word } => {
            assert_eq!(same_filled(folio.len(), word), folio, "{ctx}");
            assert!(
                out.iter().all(|&b| b == 0xa5),
                "{ctx}: a same-filled folio must write nothing"
            );
        }
        Encoded::Stored {
            len,
            units,
            raw_units,
            same_filled_units,
        } => {
            let unit_len = cfg.granularity.unit_len(folio.len());
            assert_eq!(units as usize, folio.len() / unit_len, "{ctx}");
            assert!(raw_units + same_filled_units <= units, "{ctx}");
            assert!(len <= codec.max_encoded_len(folio.len()), "{ctx}");
            out.truncate(len);
            assert_eq!(decode(codec, &out, folio.len()).unwrap(), folio, "{ctx}");
            let other = match cfg.algorithm {
                Algorithm::Lz4 => Algorithm::Zstd,
                _ => Algorithm::Lz4,
            };
            let mut stranger = FolioCodec::new(&config(other, Granularity::Bytes(4 * K))).unwrap();
            assert_eq!(
                decode(&mut stranger, &out, folio.len()).unwrap(),
                folio,
                "{ctx}: decoded by {other}"
            );
        }
    }
    (out, result)
}

#[test]
fn every_algorithm_granularity_and_folio_size_round_trips() {
    for algorithm in [Algorithm::Lz4, Algorithm::Zstd, Algorithm::Deflate] {
        for granularity in GRANULARITIES {
            let mut codec = FolioCodec::new(&config(algorithm, granularity)).unwrap();
            for folio_len in [4 * K, 16 * K, 64 * K] {
                let unit_len = granularity.unit_len(folio_len);
                let units = (folio_len / unit_len) as u32;

                let zero = vec![0u8; folio_len];
                assert_eq!(
                    round_trip(&mut codec, &zero, "zero").1,
                    Encoded::SameFilled { word: 0 }
                );
                let same = same_filled(folio_len, SAME_WORD);
                assert_eq!(
                    round_trip(&mut codec, &same, "same").1,
                    Encoded::SameFilled { word: SAME_WORD }
                );

                let noise = random(folio_len, folio_len as u64);
                let (enc, result) = round_trip(&mut codec, &noise, "random");
                assert_eq!(
                    result,
                    Encoded::Stored {
                        len: HEADER_LEN + units as usize * UNIT_ENTRY_LEN + folio_len,
                        units,
                        raw_units: units,
                        same_filled_units: 0
                    }
                );
                assert_eq!(enc.len(), codec.max_encoded_len(folio_len));

                let mix = mixed(folio_len, 7);
                let (_, result) = round_trip(&mut codec, &mix, "mixed");
                if folio_len > 4 * K {
                    let Encoded::Stored {
                        same_filled_units,
                        raw_units,
                        ..
                    } = result
                    else {
                        panic!("mixed is not same-filled")
                    };
                    if unit_len == 4 * K {
                        // Two pages in four are same-filled; the real one may be zero too.
                        assert!(
                            (units / 2..=units * 3 / 4).contains(&same_filled_units),
                            "{same_filled_units}"
                        );
                        assert!(raw_units >= units / 4, "random pages must stay raw");
                    } else {
                        assert_eq!(same_filled_units, 0, "every unit holds a random page");
                    }
                }

                let real = realistic(folio_len, 11);
                round_trip(&mut codec, &real, "realistic");
            }
        }
    }
}

#[test]
fn two_mib_folios_round_trip() {
    let folio_len = 2048 * K;
    let real = realistic(folio_len, 3);
    let mix = mixed(folio_len, 5);
    for (algorithm, granularity) in [
        (Algorithm::Lz4, Granularity::Bytes(4 * K)),
        (Algorithm::Lz4, Granularity::Bytes(64 * K)),
        (Algorithm::Lz4, Granularity::Folio),
        (Algorithm::Zstd, Granularity::Bytes(16 * K)),
        (Algorithm::Zstd, Granularity::Bytes(256 * K)),
        (Algorithm::Deflate, Granularity::Bytes(64 * K)),
    ] {
        let mut codec = FolioCodec::new(&config(algorithm, granularity)).unwrap();
        let (_, result) = round_trip(&mut codec, &real, "realistic");
        let Encoded::Stored { len, .. } = result else {
            panic!("realistic data is not same-filled")
        };
        assert!(
            len < folio_len * 3 / 4,
            "{algorithm}/{granularity}: realistic data barely shrank ({len})"
        );
        round_trip(&mut codec, &mix, "mixed");
        round_trip(&mut codec, &random(folio_len, 1), "random");
        assert!(matches!(
            round_trip(&mut codec, &vec![0u8; folio_len], "zero").1,
            Encoded::SameFilled { word: 0 }
        ));
    }
}

#[test]
fn zstd_fast_and_strong_levels_and_lz4_acceleration_round_trip() {
    let real = realistic(64 * K, 21);
    for (algorithm, level) in [
        (Algorithm::Zstd, -5),
        (Algorithm::Zstd, 0),
        (Algorithm::Zstd, 9),
        (Algorithm::Lz4, -3),
        (Algorithm::Lz4, 8),
        (Algorithm::Deflate, 1),
        (Algorithm::Deflate, 12),
    ] {
        let cfg = CodecConfig {
            level,
            ..config(algorithm, Granularity::Bytes(16 * K))
        };
        let mut codec = FolioCodec::new(&cfg).unwrap();
        round_trip(&mut codec, &real, "realistic");
        round_trip(&mut codec, &mixed(64 * K, 2), "mixed");
    }
}

#[test]
fn verify_mode_round_trips() {
    for algorithm in [Algorithm::Lz4, Algorithm::Zstd, Algorithm::Deflate] {
        let cfg = CodecConfig {
            verify: true,
            ..config(algorithm, Granularity::Bytes(16 * K))
        };
        let mut codec = FolioCodec::new(&cfg).unwrap();
        round_trip(&mut codec, &realistic(256 * K, 4), "realistic");
        round_trip(&mut codec, &mixed(256 * K, 4), "mixed");
    }
}

#[test]
fn raw_threshold_decides_what_stays_raw() {
    let real = realistic(256 * K, 8);
    let mut raw_counts = Vec::new();
    for threshold in [0u8, 50, 90, 100] {
        let cfg = CodecConfig {
            raw_threshold_percent: threshold,
            ..config(Algorithm::Lz4, Granularity::Bytes(4 * K))
        };
        let mut codec = FolioCodec::new(&cfg).unwrap();
        let (_, result) = round_trip(&mut codec, &real, "realistic");
        let Encoded::Stored {
            units,
            raw_units,
            same_filled_units,
            ..
        } = result
        else {
            panic!()
        };
        if threshold == 0 {
            assert_eq!(
                raw_units + same_filled_units,
                units,
                "threshold 0 stores everything raw"
            );
        }
        // Check every compressed unit against the threshold by re-encoding it alone.
        let mut one = FolioCodec::new(&CodecConfig {
            granularity: Granularity::Folio,
            ..cfg.clone()
        })
        .unwrap();
        for page in real.chunks_exact(4 * K) {
            let (_, r) = encode(&mut one, page);
            if let Encoded::Stored {
                len, raw_units: 0, ..
            } = r
            {
                assert!((len - HEADER_LEN - UNIT_ENTRY_LEN) * 100 <= 4 * K * threshold as usize);
            }
        }
        raw_counts.push(raw_units);
    }
    assert!(
        raw_counts.windows(2).all(|w| w[0] >= w[1]),
        "raw units must fall as the threshold rises: {raw_counts:?}"
    );
    assert!(raw_counts[0] > raw_counts[3], "{raw_counts:?}");
}

#[test]
fn decode_range_matches_the_original() {
    let mut rng = SmallRng::seed_from_u64(99);
    for algorithm in [Algorithm::Lz4, Algorithm::Zstd, Algorithm::Deflate] {
        for granularity in GRANULARITIES {
            let folio_len = 256 * K;
            let folio = mixed(folio_len, 13);
            let mut codec = FolioCodec::new(&config(algorithm, granularity)).unwrap();
            let (enc, _) = encode(&mut codec, &folio);
            let unit_len = granularity.unit_len(folio_len);
            let mut ranges: Vec<(usize, usize)> =
                vec![(0, folio_len), (0, 1), (folio_len - 1, 1), (0, 0)];
            // Exactly one unit, a unit and a byte, and ranges straddling unit edges.
            ranges.push((unit_len, unit_len.min(folio_len - unit_len)));
            ranges.push((unit_len / 2, unit_len.min(folio_len - unit_len / 2)));
            for _ in 0..40 {
                let start = rng.gen_range(0..folio_len);
                let len = rng.gen_range(0..=(folio_len - start).min(3 * unit_len));
                ranges.push((start, len));
            }
            for (start, len) in ranges {
                let mut out = vec![0x77u8; len];
                codec.decode_range(&enc, start, &mut out).unwrap();
                assert_eq!(
                    out,
                    folio[start..start + len],
                    "{algorithm}/{granularity} {start}+{len}"
                );
            }
            // Out of the folio: a clear error.
            let mut out = vec![0u8; 2];
            assert!(matches!(
                codec.decode_range(&enc, folio_len - 1, &mut out),
                Err(Error::Config(_))
            ));
            assert!(matches!(
                codec.decode_range(&enc, usize::MAX, &mut out),
                Err(Error::Config(_))
            ));
        }
    }
}

#[test]
fn decode_range_reads_only_the_units_it_needs() {
    // Damage the last unit's payload: the first unit must still decode, the last not.
    let folio_len = 64 * K;
    let folio = realistic(folio_len, 17);
    let mut codec = FolioCodec::new(&config(Algorithm::Lz4, Granularity::Bytes(16 * K))).unwrap();
    let (mut enc, _) = encode(&mut codec, &folio);
    let last = enc.len() - 1;
    enc[last] ^= 0x40;
    let mut out = vec![0u8; 16 * K];
    codec.decode_range(&enc, 0, &mut out).unwrap();
    assert_eq!(out, folio[..16 * K]);
    assert!(matches!(
        codec.decode_range(&enc, folio_len - 100, &mut out[..100]),
        Err(Error::Corrupt(_))
    ));
    let mut whole = vec![0u8; folio_len];
    assert!(matches!(
        codec.decode(&enc, &mut whole),
        Err(Error::Corrupt(_))
    ));
}

#[test]
fn bad_folios_and_buffers_are_clear_errors() {
    let mut codec = FolioCodec::new(&CodecConfig::default()).unwrap();
    let mut out = vec![0u8; 8 * 1024 * K];
    for len in [0usize, 8, 4095, 4097, 3 * 4 * K, 4096 * K] {
        let folio = vec![1u8; len];
        assert!(
            matches!(codec.encode(&folio, &mut out), Err(Error::Config(_))),
            "folio of {len} bytes"
        );
        assert!(codec.max_encoded_len(len) >= len);
    }
    let folio = random(16 * K, 0);
    let need = codec.max_encoded_len(16 * K);
    assert_eq!(
        codec.encode(&folio, &mut out[..need - 1]),
        Err(Error::BufferTooSmall { need })
    );
    let (enc, _) = encode(&mut codec, &folio);
    let mut wrong = vec![0u8; 8 * K];
    assert!(matches!(
        codec.decode(&enc, &mut wrong),
        Err(Error::Corrupt(_))
    ));
}

#[test]
fn invalid_configs_are_rejected() {
    let base = CodecConfig::default();
    let bad = [
        CodecConfig {
            algorithm: Algorithm::Lz4,
            level: LZ4_MAX_ACCELERATION + 1,
            ..base.clone()
        },
        CodecConfig {
            algorithm: Algorithm::Zstd,
            level: 23,
            ..base.clone()
        },
        CodecConfig {
            algorithm: Algorithm::Zstd,
            level: -1_000_000,
            ..base.clone()
        },
        CodecConfig {
            algorithm: Algorithm::Deflate,
            level: 0,
            ..base.clone()
        },
        CodecConfig {
            algorithm: Algorithm::Deflate,
            level: 13,
            ..base.clone()
        },
        CodecConfig {
            granularity: Granularity::Bytes(3000),
            ..base.clone()
        },
        CodecConfig {
            granularity: Granularity::Bytes(2 * K),
            ..base.clone()
        },
        CodecConfig {
            granularity: Granularity::Bytes(4096 * K),
            ..base.clone()
        },
        CodecConfig {
            granularity: Granularity::Bytes(0),
            ..base.clone()
        },
        CodecConfig {
            raw_threshold_percent: 101,
            ..base.clone()
        },
    ];
    for cfg in bad {
        assert!(
            matches!(FolioCodec::new(&cfg), Err(Error::Config(_))),
            "{cfg:?}"
        );
        assert!(cfg.validate().is_err());
    }
    for (algorithm, level) in [
        (Algorithm::Lz4, -7),
        (Algorithm::Lz4, 0),
        (Algorithm::Zstd, -7),
        (Algorithm::Zstd, 22),
    ] {
        FolioCodec::new(&CodecConfig {
            algorithm,
            level,
            ..base.clone()
        })
        .unwrap();
    }
}

#[test]
fn names_parse_and_print() {
    for (s, a) in [
        ("lz4", Algorithm::Lz4),
        ("ZSTD", Algorithm::Zstd),
        (" deflate", Algorithm::Deflate),
    ] {
        assert_eq!(s.parse::<Algorithm>().unwrap(), a);
        assert_eq!(a.to_string().parse::<Algorithm>().unwrap(), a);
    }
    assert_eq!(Algorithm::Lz4.to_string(), "lz4");
    assert!(matches!("lzo".parse::<Algorithm>(), Err(Error::Config(_))));

    for (s, g) in [
        ("4k", Granularity::Bytes(4 * K)),
        ("4K", Granularity::Bytes(4 * K)),
        ("4096", Granularity::Bytes(4 * K)),
        ("16k", Granularity::Bytes(16 * K)),
        ("64KiB", Granularity::Bytes(64 * K)),
        ("256k", Granularity::Bytes(256 * K)),
        ("2m", Granularity::Bytes(2048 * K)),
        ("Folio", Granularity::Folio),
    ] {
        assert_eq!(s.parse::<Granularity>().unwrap(), g, "{s}");
        assert_eq!(g.to_string().parse::<Granularity>().unwrap(), g);
    }
    let shown: Vec<String> = GRANULARITIES.iter().map(|g| g.to_string()).collect();
    assert_eq!(shown, ["4k", "16k", "64k", "256k", "folio"]);
    for s in [
        "",
        "k",
        "3k",
        "4x",
        "1g",
        "-4k",
        "4096k",
        "99999999999999999999k",
        "2k",
    ] {
        assert!(
            matches!(s.parse::<Granularity>(), Err(Error::Config(_))),
            "{s:?}"
        );
    }
}

#[test]
fn codec_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<FolioCodec>();
}

#[test]
fn codecs_on_several_threads_do_not_interfere() {
    // One codec per thread, as the store uses them; every thread also decodes the
    // other threads' encodings, so hidden shared state in a library would show.
    let folios: Vec<Vec<u8>> = (0..4).map(|t| mixed(64 * K, 40 + t)).collect();
    let algorithms = [
        Algorithm::Lz4,
        Algorithm::Zstd,
        Algorithm::Deflate,
        Algorithm::Lz4,
    ];
    let encodings: Vec<Vec<u8>> = std::thread::scope(|s| {
        let handles: Vec<_> = folios
            .iter()
            .zip(algorithms)
            .map(|(folio, algorithm)| {
                s.spawn(move || {
                    let mut codec =
                        FolioCodec::new(&config(algorithm, Granularity::Bytes(16 * K))).unwrap();
                    let mut last = Vec::new();
                    for _ in 0..30 {
                        let (enc, _) = encode(&mut codec, folio);
                        assert_eq!(decode(&mut codec, &enc, folio.len()).unwrap(), *folio);
                        last = enc;
                    }
                    last
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    std::thread::scope(|s| {
        for (t, algorithm) in algorithms.into_iter().enumerate() {
            let (folios, encodings) = (&folios, &encodings);
            s.spawn(move || {
                let mut codec = FolioCodec::new(&config(algorithm, Granularity::Folio)).unwrap();
                for round in 0..30 {
                    let i = (t + round) % 4;
                    assert_eq!(
                        decode(&mut codec, &encodings[i], 64 * K).unwrap(),
                        folios[i]
                    );
                }
            });
        }
    });
}

/// Encodings of every unit kind and algorithm, made once for the corruption tests.
fn samples() -> &'static [(Vec<u8>, Vec<u8>)] {
    static SAMPLES: OnceLock<Vec<(Vec<u8>, Vec<u8>)>> = OnceLock::new();
    SAMPLES.get_or_init(|| {
        let mut v = Vec::new();
        for (algorithm, granularity, folio) in [
            (Algorithm::Lz4, Granularity::Bytes(4 * K), mixed(16 * K, 1)),
            (Algorithm::Lz4, Granularity::Folio, realistic(4 * K, 2)),
            (
                Algorithm::Zstd,
                Granularity::Bytes(16 * K),
                mixed(64 * K, 3),
            ),
            (Algorithm::Zstd, Granularity::Folio, realistic(16 * K, 4)),
            (
                Algorithm::Deflate,
                Granularity::Bytes(4 * K),
                mixed(32 * K, 5),
            ),
            (Algorithm::Deflate, Granularity::Folio, realistic(8 * K, 6)),
        ] {
            let mut codec = FolioCodec::new(&config(algorithm, granularity)).unwrap();
            let (enc, result) = encode(&mut codec, &folio);
            assert!(matches!(result, Encoded::Stored { .. }));
            v.push((folio, enc));
        }
        v
    })
}

fn codec_for_corruption() -> FolioCodec {
    FolioCodec::new(&config(Algorithm::Lz4, Granularity::Bytes(4 * K))).unwrap()
}

/// Decoding damaged input must fail; and if a range decode succeeds (it may, when the
/// damage is outside the range), its bytes must be the original ones.
fn assert_rejected(codec: &mut FolioCodec, folio: &[u8], damaged: &[u8], range: (usize, usize)) {
    let mut out = vec![0u8; folio.len()];
    let whole = codec.decode(damaged, &mut out);
    assert!(
        matches!(whole, Err(Error::Corrupt(_))),
        "decode accepted damaged input: {whole:?}"
    );
    let (start, len) = range;
    let len = len.min(folio.len() - start);
    let mut part = vec![0u8; len];
    if codec.decode_range(damaged, start, &mut part).is_ok() {
        assert_eq!(
            part,
            folio[start..start + len],
            "decode_range returned wrong bytes"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn flipped_bytes_are_detected(
        which in 0usize..6,
        flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..4),
        range in (0usize..64 * K, 0usize..20 * K),
    ) {
        let (folio, enc) = &samples()[which];
        let mut damaged = enc.clone();
        let mut changed = false;
        for (at, mask) in flips {
            damaged[at.index(enc.len())] ^= mask;
            changed = true;
        }
        prop_assume!(changed && damaged != *enc);
        let mut codec = codec_for_corruption();
        assert_rejected(&mut codec, folio, &damaged, (range.0 % folio.len(), range.1));
    }

    #[test]
    fn truncated_or_extended_input_is_detected(
        which in 0usize..6,
        cut in any::<prop::sample::Index>(),
        extra in prop::collection::vec(any::<u8>(), 1..16),
    ) {
        let (folio, enc) = &samples()[which];
        let mut codec = codec_for_corruption();
        let cut = cut.index(enc.len());
        assert_rejected(&mut codec, folio, &enc[..cut], (0, folio.len()));
        let mut longer = enc.clone();
        longer.extend_from_slice(&extra);
        assert_rejected(&mut codec, folio, &longer, (0, folio.len()));
    }

    #[test]
    fn garbage_is_rejected(
        garbage in prop::collection::vec(any::<u8>(), 0..2000),
        header in prop::sample::select(vec![[0xc5u8, 0x10, 0, 0], [0xc5, 0x11, 2, 0], [0xc5, 0x12, 2, 2], [0xc5, 0x10, 9, 9]]),
        keep_header in any::<bool>(),
    ) {
        // Random bytes, and random bytes behind a plausible header so the table and
        // payload checks are reached, not just the magic.
        let mut input = garbage;
        if keep_header && input.len() >= 4 {
            input[..4].copy_from_slice(&header);
        }
        let mut codec = codec_for_corruption();
        for folio_len in [4 * K, 16 * K, 2048 * K] {
            let mut out = vec![0u8; folio_len];
            prop_assert!(matches!(codec.decode(&input, &mut out), Err(Error::Corrupt(_))));
        }
        let mut part = vec![0u8; 100];
        prop_assert!(codec.decode_range(&input, 0, &mut part).is_err());
    }
}

/// Rough single-thread speed of lz4 at 64K on realistic data; not a benchmark,
/// a sanity check: `cargo test -p uzswap-compress --release -- --ignored --nocapture`.
#[test]
#[ignore]
fn speed_self_check() {
    use std::time::Instant;
    let folio_len = 64 * K;
    let data = realistic(64 * 1024 * K, 1);
    for (algorithm, level, granularity) in [
        (Algorithm::Lz4, 1, Granularity::Bytes(64 * K)),
        (Algorithm::Lz4, 1, Granularity::Bytes(16 * K)),
        (Algorithm::Lz4, 1, Granularity::Bytes(4 * K)),
        (Algorithm::Zstd, 1, Granularity::Bytes(64 * K)),
        (Algorithm::Zstd, -1, Granularity::Bytes(64 * K)),
        (Algorithm::Deflate, 1, Granularity::Bytes(64 * K)),
    ] {
        let mut codec = FolioCodec::new(&CodecConfig {
            algorithm,
            level,
            granularity,
            ..CodecConfig::default()
        })
        .unwrap();
        let bound = codec.max_encoded_len(folio_len);
        let mut store = vec![0u8; data.len() / folio_len * bound];
        let mut lens = Vec::with_capacity(data.len() / folio_len);
        let t = Instant::now();
        for (i, folio) in data.chunks_exact(folio_len).enumerate() {
            let len = match codec
                .encode(folio, &mut store[i * bound..(i + 1) * bound])
                .unwrap()
            {
                Encoded::SameFilled { .. } => 0,
                Encoded::Stored { len, .. } => len,
            };
            lens.push(len);
        }
        let store_s = t.elapsed().as_secs_f64();
        let mut back = vec![0u8; folio_len];
        let t = Instant::now();
        for (i, &len) in lens.iter().enumerate() {
            if len > 0 {
                codec
                    .decode(&store[i * bound..i * bound + len], &mut back)
                    .unwrap();
            }
        }
        let load_s = t.elapsed().as_secs_f64();
        let stored: usize = lens.iter().sum();
        let mb = data.len() as f64 / 1e6;
        println!(
            "{algorithm} level {level} {granularity}: ratio {:.2}, store {:.0} MB/s, load {:.0} MB/s",
            data.len() as f64 / stored as f64,
            mb / store_s,
            mb / load_s
        );
    }
}

/// A cut asked per folio (`encode_cut`) overrides the configured one, is recorded in
/// the encoding, and decodes with a codec of any configured cut, whole or in ranges.
#[test]
fn a_cut_per_folio_decodes_without_the_setting() {
    let folio = mixed(64 * K, 11);
    for algorithm in [Algorithm::Lz4, Algorithm::Zstd, Algorithm::Deflate] {
        let mut coder = FolioCodec::new(&config(algorithm, Granularity::Folio)).unwrap();
        let mut reader = FolioCodec::new(&config(algorithm, Granularity::Bytes(16 * K))).unwrap();
        for cut in GRANULARITIES {
            let mut out = vec![0u8; max_encoded_len(folio.len(), SMALLEST)];
            let Encoded::Stored { len, units, .. } = coder.encode_cut(&folio, &mut out, cut).unwrap() else { panic!("mixed data is not same-filled") };
            assert_eq!(units as usize, 64 * K / cut.unit_len(64 * K), "{algorithm} {cut:?}");
            let mut back = vec![0u8; folio.len()];
            reader.decode(&out[..len], &mut back).unwrap();
            assert!(back == folio, "{algorithm} {cut:?}");
            let mut page = vec![0u8; 4 * K];
            reader.decode_range(&out[..len], 36 * K, &mut page).unwrap();
            assert!(page[..] == folio[36 * K..40 * K], "{algorithm} {cut:?}");
        }
        // Any cut fits the bound of the smallest; a smaller buffer is refused.
        let mut short = vec![0u8; max_encoded_len(folio.len(), Granularity::Folio) - 1];
        assert!(matches!(coder.encode_cut(&folio, &mut short, SMALLEST), Err(Error::BufferTooSmall { .. })));
        assert!(matches!(coder.encode_cut(&folio, &mut short, Granularity::Bytes(3 * K)), Err(Error::Config(_))));
    }
}

const SMALLEST: Granularity = Granularity::Bytes(4 * K);
