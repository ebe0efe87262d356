//! Encryption at rest ([`crate::BackingConfig::encrypt`]): every record is sealed
//! with ChaCha20-Poly1305 (RustCrypto) under a key drawn from the OS when the file
//! is made. The key lives only in this process's memory, in the cipher: it is never
//! written, logged or shown by `Debug`, so the file is unreadable once the process
//! is gone, and a page of the file read while it lives shows no memory contents.
//!
//! Nonces never repeat under a key: a nonce is a 64-bit counter taken once per record
//! written (never reused, even when the write fails), so 2^64 records per file.
//! The nonce and the 16-byte tag are kept in memory by offset, next to the live
//! record (`Seal`, about 40 bytes per record with the map's own overhead); the
//! record on disk stays exactly its length, so a 2 MiB folio still fits one cluster.
//! The associated data is the caller's key and the length: a record moved to another
//! slot, replayed from an older write, or changed by one bit fails to open and reads
//! as [`crate::BackingError::Corrupt`]. The crc32c of the plaintext stays in the
//! [`crate::Slot`] and is still checked, so a stale slot is refused as before.

use chacha20poly1305::aead::{AeadInPlace, KeyInit, OsRng};
use chacha20poly1305::{ChaCha20Poly1305, Nonce, Tag};
use std::sync::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What opening a record needs besides the key: its nonce and tag.
#[derive(Clone, Copy)]
pub(crate) struct Seal {
    nonce: u64,
    tag: [u8; 16],
}

pub(crate) struct Sealer {
    cipher: ChaCha20Poly1305,
    next_nonce: AtomicU64,
    /// The seal of each live record, by offset.
    /// A std mutex (futex-based): `open` runs on a signal handler's read path, where
    /// parking_lot's first park on a thread would allocate.
    seals: Mutex<HashMap<u64, Seal>>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer { key: <not shown> }")
    }
}

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    n.into()
}

fn aad(key: u64, len: usize) -> [u8; 12] {
    let mut a = [0u8; 12];
    a[..8].copy_from_slice(&key.to_le_bytes());
    a[8..].copy_from_slice(&(len as u32).to_le_bytes());
    a
}

impl Sealer {
    /// A sealer with a fresh random key (getrandom).
    pub(crate) fn new() -> Self {
        let key = ChaCha20Poly1305::generate_key(&mut OsRng);
        Sealer {
            cipher: ChaCha20Poly1305::new(&key),
            next_nonce: AtomicU64::new(0),
            seals: Mutex::new(HashMap::new()),
        }
    }

    /// Encrypts `data` in place; the returned seal opens it.
    pub(crate) fn seal(&self, key: u64, data: &mut [u8]) -> Seal {
        let counter = self.next_nonce.fetch_add(1, Relaxed);
        assert!(counter != u64::MAX, "nonce space of the backing file exhausted");
        let tag = self
            .cipher
            .encrypt_in_place_detached(&nonce(counter), &aad(key, data.len()), data)
            .expect("records are far below the cipher's length limit");
        Seal {
            nonce: counter,
            tag: tag.into(),
        }
    }

    /// Decrypts the record at `offset` in place; false if it has no seal or fails
    /// authentication (then `data` is left encrypted, and the caller zeroes it).
    pub(crate) fn open(&self, offset: u64, key: u64, data: &mut [u8]) -> bool {
        let Some(seal) = lock(&self.seals).get(&offset).copied() else {
            return false;
        };
        self.cipher
            .decrypt_in_place_detached(
                &nonce(seal.nonce),
                &aad(key, data.len()),
                data,
                Tag::from_slice(&seal.tag),
            )
            .is_ok()
    }

    /// Adds seals. The table grows outside its lock: `open` takes that lock on a
    /// signal handler's path, whose thread may hold the malloc lock, so no one may
    /// allocate while holding it.
    pub(crate) fn remember(&self, offsets_and_seals: impl ExactSizeIterator<Item = (u64, Seal)>) {
        let n = offsets_and_seals.len();
        loop {
            let want = {
                let mut seals = lock(&self.seals);
                if seals.capacity() - seals.len() >= n {
                    seals.extend(offsets_and_seals);
                    return;
                }
                (seals.len() + n).max(64) * 2
            };
            let mut bigger = HashMap::with_capacity(want);
            let old = {
                let mut seals = lock(&self.seals);
                if bigger.capacity() - seals.len() < n {
                    continue;
                }
                bigger.extend(seals.drain());
                std::mem::replace(&mut *seals, bigger)
            };
            drop(old);
        }
    }

    pub(crate) fn forget(&self, offset: u64) -> Option<Seal> {
        lock(&self.seals).remove(&offset)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
