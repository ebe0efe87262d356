//! Shared by the integration tests: content that depends on a seed, so every read
//! can be checked.

#![allow(dead_code)]

/// `len` bytes derived from `seed` (xorshift), different for every seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    fill(seed, &mut out);
    out
}

pub fn fill(seed: u64, out: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

pub fn matches(seed: u64, bytes: &[u8]) -> bool {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    bytes.chunks(8).all(|chunk| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk == &x.to_le_bytes()[..chunk.len()]
    })
}
