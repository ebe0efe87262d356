//! Sealed records: [`Aead`], the one authenticated cipher of uzswap's tiers (this
//! file's encryption at rest and the remote tier's objects), and the file's table of
//! seals ([`Sealer`], [`crate::BackingConfig::encrypt`]).
//!
//! [`Aead`] is AES-256-GCM (ring: AES-NI and carry-less multiply, about 8.6 GB/s on
//! these machines against 1.4 for RustCrypto's ChaCha20-Poly1305, which it replaced)
//! under a key drawn from the OS when the tier is made. The key lives only in this
//! process's memory: it is never written, logged or shown by `Debug`, so what was
//! written is unreadable once the process is gone. Nonces never repeat under a key:
//! a 64-bit counter taken once per record sealed (never reused, even when the write
//! fails). Sealing and opening allocate nothing (a signal handler's read path opens).
//!
//! In the file, the nonce and the 16-byte tag are kept in memory by offset, next to
//! the live record (`Seal`, about 40 bytes per record with the map's own overhead);
//! the record on disk stays exactly its length, so a 2 MiB folio still fits one
//! cluster. The associated data is the caller's key and the length: a record moved to
//! another slot, replayed from an older write, or changed by one bit fails to open
//! and reads as [`crate::BackingError::Corrupt`]. The crc32c of the plaintext stays
//! in the [`crate::Slot`] and is still checked, so a stale slot is refused as before.

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use uzswap_sync::Mutex;

/// AES-256-GCM under a random key of this process's, with counter nonces.
pub struct Aead {
    key: LessSafeKey,
    next_nonce: AtomicU64,
}

impl std::fmt::Debug for Aead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Aead { key: <not shown> }")
    }
}

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

impl Aead {
    /// A cipher with a fresh random key (getrandom); an error if the OS gives none.
    pub fn new() -> std::io::Result<Aead> {
        let mut key = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut key)
            .map_err(|_| std::io::Error::other("no random key from the OS (getrandom failed)"))?;
        let key = UnboundKey::new(&AES_256_GCM, &key).map_err(|_| std::io::Error::other("AES-256-GCM refused a 32-byte key"))?;
        Ok(Aead { key: LessSafeKey::new(key), next_nonce: AtomicU64::new(0) })
    }

    /// Encrypts `data` in place, bound to `aad`; returns the nonce and the tag that open it.
    pub fn seal(&self, aad: &[u8], data: &mut [u8]) -> (u64, [u8; 16]) {
        let counter = self.next_nonce.fetch_add(1, Relaxed);
        assert!(counter != u64::MAX, "nonce space of a sealing key exhausted");
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce(counter), Aad::from(aad), data)
            .expect("records are far below AES-GCM's length limit");
        let mut t = [0u8; 16];
        t.copy_from_slice(tag.as_ref());
        (counter, t)
    }

    /// Decrypts `data` in place; false if it fails authentication (then `data` holds
    /// no plaintext the caller may use). Allocation-free.
    pub fn open(&self, counter: u64, aad: &[u8], tag: &[u8; 16], data: &mut [u8]) -> bool {
        self.key.open_in_place_separate_tag(nonce(counter), Aad::from(aad), Tag::from(*tag), data, 0..).is_ok()
    }
}

/// What opening a record needs besides the key: its nonce and tag.
#[derive(Clone, Copy)]
pub(crate) struct Seal {
    nonce: u64,
    tag: [u8; 16],
}

/// The file's sealing: the cipher and the seal of each live record.
pub(crate) struct Sealer {
    aead: Aead,
    /// The seal of each live record, by offset.
    /// `open` runs on a signal handler's read path: held briefly, nothing allocated.
    seals: Mutex<HashMap<u64, Seal>>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.aead.fmt(f)
    }
}

fn aad(key: u64, len: usize) -> [u8; 12] {
    let mut a = [0u8; 12];
    a[..8].copy_from_slice(&key.to_le_bytes());
    a[8..].copy_from_slice(&(len as u32).to_le_bytes());
    a
}

impl Sealer {
    /// A sealer with a fresh random key.
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Sealer { aead: Aead::new()?, seals: Mutex::new(HashMap::new()) })
    }

    /// Encrypts `data` in place; the returned seal opens it.
    pub(crate) fn seal(&self, key: u64, data: &mut [u8]) -> Seal {
        let (nonce, tag) = self.aead.seal(&aad(key, data.len()), data);
        Seal { nonce, tag }
    }

    /// Decrypts the record at `offset` in place; false if it has no seal or fails
    /// authentication (then `data` is left encrypted, and the caller zeroes it).
    pub(crate) fn open(&self, offset: u64, key: u64, data: &mut [u8]) -> bool {
        let Some(seal) = self.seals.lock().get(&offset).copied() else {
            return false;
        };
        self.aead.open(seal.nonce, &aad(key, data.len()), &seal.tag, data)
    }

    /// Adds seals. The table grows outside its lock: `open` takes that lock on a
    /// signal handler's path, whose thread may hold the malloc lock, so no one may
    /// allocate while holding it.
    pub(crate) fn remember(&self, offsets_and_seals: impl ExactSizeIterator<Item = (u64, Seal)>) {
        let n = offsets_and_seals.len();
        loop {
            let want = {
                let mut seals = self.seals.lock();
                if seals.capacity() - seals.len() >= n {
                    seals.extend(offsets_and_seals);
                    return;
                }
                (seals.len() + n).max(64) * 2
            };
            let mut bigger = HashMap::with_capacity(want);
            let old = {
                let mut seals = self.seals.lock();
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
        self.seals.lock().remove(&offset)
    }
}

