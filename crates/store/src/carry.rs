//! Fork without swap-in: what a forked child takes over from its parent's store.
//!
//! The kernel shares a swapped-out page between parent and child with a counted swap
//! entry. Our store lives in one process, so the child's store *borrows* the
//! parent's records where they are (below, "Loans"), still encoded: no decode, no
//! folio brought back, no copy, and the parent's charge does not grow.
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
//! 3. Child: its store borrows each record ([`Store::borrow`]); one it cannot is read
//!    from its copy of the parent's store ([`Store::carried_bytes`]) and kept in its
//!    own ([`Store::import`]), or put back in place ([`decode_carried`]) when the
//!    child has no store.
//! 4. Parent: [`Store::thaw`], and [`Store::lend`] if the child may read its file.
//!
//! A record on a tier a child cannot read (a remote object: its reader thread is
//! not in the child) is not carried ([`Tier::survives_fork`]); the caller brings
//! such a folio back before fork, as it did every folio before.
//!
//! # Loans
//! Copying a record costs the child a read and, its pool being full at once (a
//! member just joined has a small share of the group's budget), a write to its own
//! file: seconds for a child that then exits. So a child *borrows* them instead
//! ([`Store::start_borrowing`], [`Store::borrow`], [`Store::end_borrowing`]):
//! - a pool record: the entry (`Location::LentPool`) names the object in the
//!   child's copy of the parent's pool, copy-on-write memory that nothing changes.
//!   A mapping of it stays until no lent entry names it; the child is charged for
//!   what it keeps as the kernel charges shared pages (its PSS: the runtime counts
//!   it as unmanaged memory), not for a copy;
//! - a backing file record: the entry (`Location::Lent`) names the slot in the
//!   parent's file, read through the child's copy of the parent's store and the
//!   inherited descriptor. The parent keeps every slot a child may read: after the
//!   fork it lends ([`Store::lend`]) the read end of a pipe whose write end the
//!   child holds until it exits or execs, even once it has loaded every loan (its
//!   runtime's keeper holds a copy: fds.rs); until that end reads EOF no queued free
//!   of a slot written before the loan is carried out ([`Store::reap`]: those frees
//!   wait, nothing is punched or reused). Slots written after it are freed as ever
//!   (the tier's loan marks, `Tier::mark_lend`), so a parent whose child lives long
//!   does not see its file grow by all it writes back meanwhile, as swap slots
//!   shared with a child are kept, and no others.
//!
//! A lent pool record cannot be written back: the child's copy of the parent's pool
//! is not the child's pool. While the parent maps the same pages that costs the group
//! nothing, but once the parent writes to or frees a span of its own, copy-on-write
//! leaves the child's copy to the child alone. [`Store::rehome`] then moves a record
//! into the child's own pool (under its folio lock), from where writeback can take it,
//! and the lent mapping goes with its last record (the runtime decides when: its
//! fork.rs `rehome_lent`).
//!
//! A lent entry is never carried again: a child that forks brings it back first.

use crate::*;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Release};

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
        self.moves.freeze();
    }

    /// Undoes [`Store::freeze`], once per freeze, in the process that froze (a forked
    /// child never thaws: it does not use its copy of the parent's store again).
    pub fn thaw(&self) {
        self.moves.thaw();
    }

    /// Where the record under `key` is, for a child forked while the store is frozen
    /// (the caller holds the key's folio, so no load or invalidation of it runs);
    /// `None` if there is none, or it is on a tier a child cannot read, or borrowed.
    pub fn carry(&self, key: u64) -> Option<Carried> {
        let entry = self.index.get(key)?;
        let at = match entry.location {
            Location::Lent { .. } | Location::LentPool { .. } => return None,
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
                    let _moves = self.moves.hold();
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

/// A forked child's side of the loans (module comment, "Loans").
pub(crate) struct Borrowed {
    /// The child's copy of the parent's store, kept for good (`'static`: never
    /// dropped): its tier reads the lent file records through the inherited descriptor.
    lender: &'static Store,
    /// Lent file records not loaded or dropped yet.
    in_file: AtomicU64,
    /// Lent pool records not loaded or dropped yet.
    in_pool: AtomicU64,
    /// The child's copies of the parent's pool mappings, by address: (address,
    /// length, references). A reference per lent record in it, and one for the take-
    /// over while it lends ([`Store::end_borrowing`]); the last one unmaps it.
    maps: Box<[(usize, usize, AtomicU64)]>,
}

impl Borrowed {
    fn map_of(&self, addr: usize) -> Option<&(usize, usize, AtomicU64)> {
        let i = self.maps.partition_point(|m| m.0 <= addr).checked_sub(1)?;
        let m = &self.maps[i];
        (addr < m.0 + m.1).then_some(m)
    }

    /// Drops a reference to a pool mapping: the last one unmaps it.
    fn unref(m: &(usize, usize, AtomicU64)) {
        if m.2.fetch_sub(1, AcqRel) == 1 {
            // SAFETY: the child's copy of a pool mapping of the parent's that no lent
            // entry names any more and the take-over is done with: nothing reads it.
            unsafe { libc::munmap(m.0 as *mut _, m.1) };
        }
    }
}

/// What closes a loan pipe's read end (the caller's, which may have registered it).
type Closer = fn(std::os::fd::RawFd);

/// A parent's side of the loans: the read ends of the pipes its children hold the
/// write ends of (module comment, "Loans").
#[derive(Default)]
pub(crate) struct Lent {
    /// Each read end, with what closes it (the caller's: it may have registered it)
    /// and its tier's loan mark.
    fds: Mutex<Vec<(std::os::fd::RawFd, Closer, u32)>>,
    /// Whether `fds` may be non-empty (lock-free check for `reap`).
    any: AtomicBool,
}

impl Store {
    /// In a forked child, before [`Store::borrow`]: its loans come from `lender`, the
    /// child's copy of the parent's store, and from `pool_maps`, the child's copies of
    /// that store's pool mappings, which this store unmaps from now on (each once no
    /// lent entry names it and [`Store::end_borrowing`] was called).
    pub fn start_borrowing(&self, lender: &'static Store, pool_maps: &[(usize, usize)]) -> Result<(), StoreError> {
        let mut maps: Vec<_> = pool_maps.iter().map(|&(a, l)| (a, l, AtomicU64::new(1))).collect();
        maps.sort_by_key(|m| m.0);
        let b = Borrowed { lender, in_file: AtomicU64::new(0), in_pool: AtomicU64::new(0), maps: maps.into_boxed_slice() };
        self.borrowed.set(b).map_err(|_| StoreError::Carry("a store borrows from one lender"))
    }

    /// The take-over is done borrowing: pool mappings no lent entry names are unmapped
    /// now, the others with their last entry.
    pub fn end_borrowing(&self) {
        if let Some(b) = self.borrowed.get() {
            b.maps.iter().for_each(Borrowed::unref);
        }
    }

    /// In a forked child, after [`Store::start_borrowing`]: keeps the carried record
    /// `c`, in the parent's pool or backing tier, as a loan under `key` (the parent's
    /// key for that folio: a file slot's check is keyed by it) instead of a copy
    /// (module comment, "Loans").
    pub fn borrow(&self, key: u64, c: &Carried) -> Result<(), StoreError> {
        let b = self.borrowed.get().ok_or(StoreError::Carry("no lender"))?;
        let location = match c.at {
            At::Tier(slot) if slot.key() == key => {
                b.in_file.fetch_add(1, Relaxed);
                Location::Lent { offset: slot.offset(), len: slot.data_len() as u32, crc: slot.checksum() }
            }
            At::Tier(_) => return Err(StoreError::Carry("a loan keeps the parent's key")),
            At::Pool { addr, len } => {
                let m = b.map_of(addr).filter(|m| addr + len <= m.0 + m.1).ok_or(StoreError::Carry("a pool record outside the pool's mappings"))?;
                m.2.fetch_add(1, Relaxed);
                b.in_pool.fetch_add(1, Relaxed);
                Location::LentPool { addr: addr as u64, len: len as u32 }
            }
            At::Nowhere => return Err(StoreError::Carry("a same-filled record is copied")),
        };
        self.invalidate(key);
        let entry = Entry { location, ..c.entry };
        self.account(&entry, 1);
        self.publish(key, entry);
        Ok(())
    }

    /// Lent records (pool and file) not yet loaded or dropped.
    pub fn borrowed(&self) -> u64 {
        self.borrowed.get().map_or(0, |b| b.in_file.load(Relaxed) + b.in_pool.load(Relaxed))
    }

    /// Lent file records not yet loaded or dropped: while there are any, the child
    /// keeps the parent's file open and the parent keeps their slots.
    pub fn borrowed_from_file(&self) -> u64 {
        self.borrowed.get().map_or(0, |b| b.in_file.load(Relaxed))
    }

    /// The child's copies of the parent's pool mappings still mapped (a lent entry
    /// names each, or the take-over is not done).
    pub fn lent_mappings(&self) -> usize {
        self.borrowed.get().map_or(0, |b| b.maps.iter().filter(|m| m.2.load(Relaxed) > 0).count())
    }

    /// Bytes of those mappings: memory the child maps with its parent (copy-on-write,
    /// the parent charged for it as its pool), until either changes it.
    pub fn lent_mapped_bytes(&self) -> u64 {
        self.borrowed.get().map_or(0, |b| b.maps.iter().filter(|m| m.2.load(Relaxed) > 0).map(|m| m.1 as u64).sum())
    }

    /// The lent mapping (address and length: the child's copy of one of the parent's
    /// pool mappings) that the entry under `key` names, if it is a lent pool record.
    pub fn lent_mapping_of(&self, key: u64) -> Option<(usize, usize)> {
        let Location::LentPool { addr, .. } = self.index.get(key)?.location else { return None };
        self.borrowed.get()?.map_of(addr as usize).map(|m| (m.0, m.1))
    }

    /// In a forked child: keeps the lent pool record under `key` in this store's own
    /// pool instead (making room by writeback, as [`Store::store`] does), and lets go
    /// of the loan, so that the child's copy of the parent's pool mapping can go with
    /// the last record in it. For mappings that are the child's alone now (the parent
    /// wrote to or freed its own: copy-on-write), which the child is charged for in
    /// full and could never write back while lent (module comment, "Loans"). The caller
    /// holds the key's folio: no load or invalidation of it runs meanwhile. The bytes
    /// moved, `None` if the entry is not a lent pool record; on an error the loan stays
    /// as it was.
    pub fn rehome(&self, key: u64) -> Result<Option<usize>, StoreError> {
        let Some(lent) = self.index.get(key) else { return Ok(None) };
        let Location::LentPool { addr, len } = lent.location else { return Ok(None) };
        // SAFETY: the child's copy of the parent's pool, mapped while any lent entry
        // names it (this one does until the `invalidate` below) and written by nobody.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
        self.reap();
        self.make_room(bytes.len())?;
        let handle = {
            let _moves = self.moves.hold();
            self.pool.store(bytes).inspect_err(|_| LiveStats::add(&self.stats.totals.reject_alloc_fail, 1))?
        };
        // The loan returns here (`erase` -> `loan_returned`), unmapping the lent
        // mapping with its last entry: `bytes` is not read again.
        self.invalidate(key);
        let own = Entry { location: Location::Pool { handle, len, lru: 0 }, ..lent };
        self.account(&own, 1);
        self.publish(key, own);
        Ok(Some(len as usize))
    }

    /// The lender's tier, which lent file entries are read from.
    pub(crate) fn lender_tier(&self) -> Option<&dyn Tier> {
        self.borrowed.get()?.lender.backing.as_deref()
    }

    /// `entry`, erased, is gone from this store: if it was a loan, one fewer.
    /// Allocation-free (a load's path).
    pub(crate) fn loan_returned(&self, entry: &Entry) {
        let Some(b) = self.borrowed.get() else { return };
        match entry.location {
            Location::Lent { .. } => {
                b.in_file.fetch_sub(1, Relaxed);
            }
            Location::LentPool { addr, .. } => {
                b.in_pool.fetch_sub(1, Relaxed);
                match b.map_of(addr as usize) {
                    Some(m) => Borrowed::unref(m),
                    None => debug_assert!(false, "a lent pool record outside the lent mappings"),
                }
            }
            _ => {}
        }
    }

    /// In a parent after fork: `fd` is the read end of a pipe whose write end a child
    /// holds while it may read records of this store's tier; the store holds its
    /// tier's frees until it reads EOF, then calls `close(fd)` (module comment, "Loans").
    pub fn lend(&self, fd: std::os::fd::RawFd, close: fn(std::os::fd::RawFd)) {
        // Marked after the fork: what the tier writes between the two is kept too
        // (it is nobody's to read, and freed once the loan ends), never the reverse.
        let mark = self.backing.as_ref().map_or(1, |b| b.mark_lend());
        self.lent.fds.lock().push((fd, close, mark));
        self.lent.any.store(true, Release);
    }

    /// Children that may still read this store's tier (their pipes not at EOF).
    pub fn loans_out(&self) -> usize {
        self.loans_mark();
        self.lent.fds.lock().len()
    }

    /// The highest loan mark of the children still holding one (0: none); closes the
    /// read ends that reached EOF. One that reads as closed (POLLNVAL: the program
    /// closed it with a raw system call) is never settled: the frees it keeps wait
    /// for good, rather than reuse a slot a child may read.
    pub(crate) fn loans_mark(&self) -> u32 {
        if !self.lent.any.load(Acquire) {
            return 0;
        }
        let mut fds = self.lent.fds.lock();
        fds.retain(|&(fd, close, _)| {
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one pollfd of ours, no wait.
            if unsafe { libc::poll(&mut p, 1, 0) } != 1 || p.revents & libc::POLLNVAL != 0 {
                return true;
            }
            let mut b = [0u8; 1];
            // SAFETY: reads at most one byte into `b` (nothing is ever written to it).
            let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), 1) };
            if n != 0 {
                return true;
            }
            // Our pipe's read end, at EOF: every child holding it is done.
            close(fd);
            false
        });
        self.lent.any.store(!fds.is_empty(), Release);
        fds.iter().map(|l| l.2).max().unwrap_or(0)
    }
}
