//! Fork without swap-in: what a forked child takes over from its parent's store.
//!
//! The kernel shares a swapped-out page between parent and child with a counted swap
//! entry. Our store lives in one process, so the child gets its own copy of each
//! record instead, still encoded: no decode, no folio brought back, and the parent's
//! charge does not grow.
//!
//! 1. Parent, before fork, every folio of the caller's locked: [`Store::freeze`]
//!    stops every change to where stored bytes are (stores, writeback, reaping,
//!    compaction wait: no pool object moves or is freed, no span is mapped or
//!    unmapped, no backing slot is freed or reused); loads and invalidations still
//!    run (they free nothing: they bury and defer). [`Store::carry`] then says where
//!    each record is, and [`Store::pool_mappings`] which mappings the child must
//!    inherit (the caller makes them MADV_DOFORK for the fork).
//! 2. fork: the child's copy of the pool mappings holds every carried pool record,
//!    and it has the backing file's descriptor.
//! 3. Child: [`Store::carried_bytes`] reads a record from its copy of the parent's
//!    store (the pool's bytes, or the tier through the inherited descriptor) and
//!    [`Store::import`] keeps it in the child's own store, under its own key (or
//!    [`decode_carried`] puts it back in place when the child has no store).
//! 4. Parent: [`Store::thaw`], once no child may still read a carried backing slot
//!    (the caller waits for that); pool records need no wait, the child has a copy.
//!
//! A record on a tier a child cannot read (a remote object: its reader thread is
//! not in the child) is not carried ([`Tier::survives_fork`]); the caller brings
//! such a folio back before fork, as it did every folio before.

use crate::*;

/// A record as a forked child takes it over: the entry's shape, and where its bytes
/// are (in the parent while it is frozen; in the child, in its copy of the parent).
#[derive(Clone, Copy, Debug)]
pub struct Carried {
    entry: Entry,
    at: At,
}

#[derive(Clone, Copy, Debug)]
enum At {
    /// A same-filled marker: no bytes.
    Nowhere,
    /// A pool object, `len` bytes at `addr`.
    Pool { addr: usize, len: usize },
    /// A record in the backing tier.
    Tier(Slot),
}

impl Carried {
    /// Whether the record is in the parent's backing tier, which the parent must keep
    /// as it is until the child has read it.
    pub fn in_tier(&self) -> bool {
        matches!(self.at, At::Tier(_))
    }

    pub fn folio_len(&self) -> usize {
        self.entry.folio_len()
    }

    /// Where the record is in the parent's backing tier, if it is there: records read
    /// in this order are read in file order (read-around serves the neighbours).
    pub fn tier_offset(&self) -> Option<u64> {
        match self.at {
            At::Tier(slot) => Some(slot.offset()),
            _ => None,
        }
    }
}

impl Store {
    /// Stops every change to where stored bytes are, until [`Store::thaw`] (module
    /// comment, step 1). Waits for a store, writeback or reap under way to finish;
    /// call it with nothing else of the store's held.
    pub fn freeze(&self) {
        std::mem::forget(self.moves.write());
    }

    /// Undoes [`Store::freeze`].
    ///
    /// # Safety
    /// Once per `freeze`, in the process that froze (a forked child never thaws: it
    /// does not use its copy of the parent's store again).
    pub unsafe fn thaw(&self) {
        // SAFETY: `freeze` took the write lock and forgot its guard (the caller's contract).
        unsafe { self.moves.force_unlock_write() };
    }

    /// Where the record under `key` is, for a child forked while the store is frozen
    /// (the caller holds the key's folio, so no load or invalidation of it runs);
    /// `None` if there is none, or it is on a tier a child cannot read.
    pub fn carry(&self, key: u64) -> Option<Carried> {
        let entry = self.index.get(key)?;
        let at = match entry.location {
            Location::SameFilled { .. } => At::Nowhere,
            Location::Pool { handle, .. } => {
                let (addr, len) = self.pool.object_addr(handle).ok()?;
                At::Pool { addr, len }
            }
            Location::File { .. } => {
                let slot = entry.slot(key)?;
                if !self.backing.as_ref()?.survives_fork(&slot) {
                    return None;
                }
                At::Tier(slot)
            }
        };
        Some(Carried { entry, at })
    }

    /// The pool's mappings (address, length), which a child needs to read carried
    /// pool records.
    ///
    /// # Safety
    /// The store is frozen, and stays so while the list is used.
    pub unsafe fn pool_mappings(&self) -> Vec<(usize, usize)> {
        // SAFETY: frozen: nothing stores, frees or compacts.
        unsafe { self.pool.mappings() }
    }

    /// In a forked child, on its copy of the parent's store: the encoded bytes of a
    /// carried record, read into `buf` (block-aligned, a largest record long: see
    /// [`carry_buffer`]). A record that fails its checksum or does not open is an
    /// error, never bytes.
    pub fn carried_bytes<'b>(&self, c: &Carried, buf: &'b mut [u8]) -> Result<&'b [u8], StoreError> {
        match c.at {
            At::Nowhere => Ok(&buf[..0]),
            At::Pool { addr, len } => {
                // SAFETY: the child's copy of the parent's pool mapping, inherited as it
                // was when the parent froze (the caller made it DOFORK): the object's
                // `len` bytes are there, and no thread of the parent's is here to move them.
                buf[..len].copy_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
                Ok(&buf[..len])
            }
            At::Tier(slot) => {
                let tier = self.backing.as_ref().expect("a tier record comes from a store with a tier");
                tier.read_in_place(&slot, buf)?;
                Ok(&buf[..slot.data_len()])
            }
        }
    }

    /// Keeps a carried record (its bytes from [`Store::carried_bytes`]) under `key`, as
    /// [`Store::store`] keeps what it encodes: in the pool, making room by writeback.
    pub fn import(&self, key: u64, c: &Carried, bytes: &[u8]) -> Result<(), StoreError> {
        self.reap();
        self.invalidate(key);
        let entry = match c.entry.location {
            Location::SameFilled { .. } => c.entry,
            _ => {
                self.make_room(bytes.len())?;
                let handle = {
                    let _moves = self.moves.read();
                    self.pool.store(bytes).inspect_err(|_| LiveStats::add(&self.stats.totals.reject_alloc_fail, 1))?
                };
                Entry { location: Location::Pool { handle, len: bytes.len() as u32, lru: 0 }, ..c.entry }
            }
        };
        self.account(&entry, 1);
        self.publish(key, entry);
        Ok(())
    }
}

/// A buffer for [`Store::carried_bytes`]: block-aligned, room for a largest record.
pub fn carry_buffer(cfg: &CodecConfig) -> Result<AlignedBuf, StoreError> {
    FolioCodec::new(cfg)?;
    Ok(AlignedBuf::zeroed(max_encoded_len(MAX_FOLIO, SMALLEST_CUT).max(MAX_FOLIO).next_multiple_of(BLOCK_SIZE)))
}

/// Decodes a carried record into `out` (its whole folio) with a codec of `cfg` (the
/// store's): for a child that cannot keep it in a store of its own and puts the
/// folio back in place instead.
pub fn decode_carried(cfg: &CodecConfig, c: &Carried, bytes: &[u8], out: &mut [u8]) -> Result<(), StoreError> {
    if out.len() != c.folio_len() {
        return Err(StoreError::SizeMismatch { key: 0, stored: c.folio_len(), asked: out.len() });
    }
    if let Location::SameFilled { word } = c.entry.location {
        uzswap_compress::fill_same(out, word);
        return Ok(());
    }
    let mut codec = FolioCodec::new(cfg)?;
    Ok(decode_into(&mut codec, bytes, &c.entry, 0, out)?)
}
