//! Tests of the pieces the public API cannot reach: the same-filled scan, the
//! phased fill, the layout's overhead and the verify-after-compress failure path.

use super::*;

fn naive_fill(len: usize, bytes: [u8; 8], phase: usize) -> Vec<u8> {
    (0..len).map(|i| bytes[(phase + i) % 8]).collect()
}

#[test]
fn same_filled_scan_finds_the_first_differing_word() {
    let word = 0x0123_4567_89ab_cdefu64;
    let mut data = vec![0u8; 4096];
    fill_same(&mut data, word);
    assert_eq!(same_filled_word(&data), Some(word));
    assert_eq!(same_prefix_len(&data, word), 4096);
    for at in [0usize, 7, 8, 63, 64, 1000, 4088, 4095] {
        let mut d = data.clone();
        d[at] ^= 1;
        assert_eq!(same_filled_word(&d), None, "flip at {at}");
        let prefix = same_prefix_len(&d, word);
        assert!(
            prefix <= at && at - prefix < 64,
            "flip at {at}: prefix {prefix}"
        );
    }
    // Zero is a word like any other.
    assert_eq!(same_filled_word(&[0u8; 64]), Some(0));
    // Remainder shorter than a 64-byte block.
    let mut short = vec![0u8; 64 + 16];
    assert_eq!(same_prefix_len(&short, 0), 80);
    short[72] = 9;
    assert_eq!(same_prefix_len(&short, 0), 72);
}

#[test]
fn fill_same_matches_a_naive_fill_at_every_phase_and_length() {
    for bytes in [
        [0u8; 8],
        [0xff; 8],
        [1, 2, 3, 4, 5, 6, 7, 8],
        [0, 0, 0, 0, 0, 0, 0, 1],
    ] {
        for len in [0usize, 1, 7, 8, 9, 63, 64, 100] {
            let mut out = vec![0xaau8; len];
            fill_same(&mut out, u64::from_ne_bytes(bytes));
            assert_eq!(out, naive_fill(len, bytes, 0));
            for phase in 0..16 {
                let mut out = vec![0xaau8; len];
                fill_same_from(&mut out, bytes, phase);
                assert_eq!(
                    out,
                    naive_fill(len, bytes, phase),
                    "phase {phase} len {len}"
                );
            }
        }
    }
}

#[test]
fn single_unit_overhead_is_twelve_bytes() {
    let text: Vec<u8> = b"the quick brown fox jumps over the lazy dog; "
        .iter()
        .copied()
        .cycle()
        .take(4096)
        .collect();
    let cfg = CodecConfig {
        granularity: Granularity::Folio,
        ..CodecConfig::default()
    };
    let mut codec = FolioCodec::new(&cfg).unwrap();
    let mut out = vec![0u8; codec.max_encoded_len(4096)];
    assert_eq!(out.len(), 4096 + 12);
    let Encoded::Stored {
        len,
        units: 1,
        raw_units: 0,
        same_filled_units: 0,
    } = codec.encode(&text, &mut out).unwrap()
    else {
        panic!("text should compress");
    };
    let mut lz4_alone = vec![0u8; 4096];
    let n = Compressor::new(Algorithm::Lz4, 1)
        .unwrap()
        .compress(&text, &mut lz4_alone)
        .unwrap();
    assert_eq!(len, n + HEADER_LEN + UNIT_ENTRY_LEN);
}

#[test]
fn verify_catches_a_compressor_that_returns_wrong_bytes() {
    let text: Vec<u8> = (0..65536u32)
        .map(|i| (i % 251) as u8 ^ (i / 4096) as u8)
        .collect();
    for algorithm in [Algorithm::Lz4, Algorithm::Zstd, Algorithm::Deflate] {
        let level = if algorithm == Algorithm::Deflate {
            6
        } else {
            1
        };
        let cfg = CodecConfig {
            algorithm,
            level,
            granularity: Granularity::Bytes(16 << 10),
            verify: true,
            ..CodecConfig::default()
        };
        let mut codec = FolioCodec::new(&cfg).unwrap();
        let mut out = vec![0u8; codec.max_encoded_len(text.len())];
        codec.damage_next_compressed = true;
        assert_eq!(
            codec.encode(&text, &mut out),
            Err(Error::VerifyMismatch(0)),
            "{algorithm}"
        );
        // Without damage the same codec verifies and round-trips.
        let Encoded::Stored { len, .. } = codec.encode(&text, &mut out).unwrap() else {
            panic!()
        };
        let mut back = vec![0u8; text.len()];
        codec.decode(&out[..len], &mut back).unwrap();
        assert_eq!(back, text);
    }
}
