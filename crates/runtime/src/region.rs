//! A managed region: the program's mapping, its shadow, and one state word per folio.

use crate::Shared;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use std::sync::Arc;

pub(crate) use crate::folio::*;

pub(crate) struct RegionInner {
    pub id: u64,
    /// Start of the mapping; changes when the program mremaps the whole region.
    pub base: AtomicUsize,
    pub len: usize,
    pub folio_size: usize,
    pub folio_shift: u32,
    /// Same length as the region, registered with the staging context: a folio's pages
    /// are moved to the same offset here while it is on probation or being compressed.
    pub shadow: usize,
    /// States and kept flags (folio.rs owns their rules).
    pub folios: Folios,
    /// Fault-in order (a global sequence): smaller is older, i.e. colder.
    pub stamps: Box<[AtomicU64]>,
    /// Folios the reclaimer passes over for now, another process mapping their pages
    /// too (reclaim.rs `pass_over`).
    pub passed_over: Box<[AtomicU8]>,
    /// One bit per page: the program dropped the page (MADV_DONTNEED/FREE) while it was
    /// mapped, and it may still be mapped with its old bytes. See [`RegionInner::settle_drops`].
    pub drop_pending: PageBits,
    /// One bit per page: the program unmapped it (see "Pages unmapped" below).
    pub gone: PageBits,
    /// How the region is read back (pattern.rs): sizes swap-ins, picks the cut.
    pub pattern: crate::pattern::Pattern,
    /// Its index in the region table (fault.rs), which names it in the fault queue.
    pub slot: AtomicUsize,
    /// Memory the program had before uzswap took it over (`Runtime::adopt_region`),
    /// and of what kind: never unmapped by us, inherited by fork as it was.
    pub adopted: Option<crate::MemoryKind>,
    /// Taken over from the parent at fork, its pages shared copy-on-write: the
    /// reclaimer copies a page it shares to take it out (reclaim.rs `take_out_run`).
    pub inherited: bool,
    /// The reader's read count (`Shared::reads`) when the region went into the fault
    /// table, between two reads: a drop or unmap read by then, and still pending,
    /// was the program's for what was mapped there before, never this region's.
    pub born: AtomicU64,
    pub shared: Arc<Shared>,
}

/// The store key of folio `idx` of region `id`: the id above bit 40 (a region holds
/// at most 2^40 folios).
pub(crate) fn folio_key(id: u64, idx: usize) -> u64 {
    (id << 40) | idx as u64
}

impl RegionInner {
    pub fn folios(&self) -> usize {
        self.folios.len()
    }

    /// What a transition of one of this region's folios touches (folio.rs).
    pub fn book(&self) -> Book<'_> {
        let sh = &*self.shared;
        Book {
            folios: &self.folios,
            charges: &sh.charges,
            stats: &sh.stats.sizes[self.order()],
            store: &sh.store,
            key_base: folio_key(self.id, 0),
            folio_bytes: self.folio_size as u64,
        }
    }

    pub fn key(&self, idx: usize) -> u64 {
        folio_key(self.id, idx)
    }

    pub fn order(&self) -> usize {
        (self.folio_shift - 12) as usize
    }

    pub fn try_lock(&self, idx: usize) -> Option<u8> {
        self.folios.try_lock(idx)
    }

    pub fn lock(&self, idx: usize) -> u8 {
        self.folios.lock(idx)
    }

    pub fn unlock(&self, idx: usize, state: u8) {
        self.folios.unlock(idx, state)
    }

    /// Records transition `t` of folio `idx` (locked, in `prev`) and unlocks it in its
    /// new state; a folio a fault brought in gets a fresh stamp and a fault-queue entry.
    pub fn finish(&self, idx: usize, prev: u8, t: Transition, res: Option<Reservation>) -> u8 {
        let next = self.book().record(idx, prev, t, res);
        let fault_in = matches!(
            t,
            Transition::ZeroFilled
                | Transition::FilledAhead
                | Transition::Adopted
                | Transition::Touched
                | Transition::SwappedIn
                | Transition::SwappedInClean
                | Transition::InAhead
                | Transition::PartIn
                | Transition::PartFilled
                | Transition::Refaulted
                | Transition::RefaultedClean
                | Transition::ForkIn
        );
        if fault_in {
            self.unlock_in(idx, next);
        } else {
            self.unlock(idx, next);
        }
        next
    }

    /// Unlocks a folio just brought in, in `state`: a fresh stamp and a fault-queue
    /// entry if it has pages mapped now (RESIDENT, CLEAN, PARTIAL), else a plain unlock.
    pub fn unlock_in(&self, idx: usize, state: u8) {
        if mapped(state) {
            self.unlock_faulted_in(idx, state);
        } else {
            self.unlock(idx, state);
        }
    }

    /// Leaves folio `idx` (locked, in `prev`) as it was, to be retried: gives back the
    /// charge taken for it, if any, and unlocks it.
    pub fn put_back(&self, idx: usize, prev: u8, res: Option<Reservation>) {
        if let Some(res) = res {
            self.book().release(res);
        }
        self.unlock(idx, prev);
    }

    // ---- Drops the kernel has not carried out yet. ----
    //
    // On MADV_DONTNEED/FREE of a mapped folio the kernel sends REMOVE and blocks the
    // caller until the reader has *read* it; only then does the caller zap the pages,
    // whenever it next runs. Until the zap, the dropped pages are still mapped with
    // their old bytes, and a folio taken out then would keep them (the zap would find
    // holes). No kernel event says the zap is done, so the reader marks each dropped
    // page *pending*, and a pending page is settled only by facts that order it after
    // the zap, never by time:
    // - it is absent (pagemap: neither present nor swapped): the zap has passed it, and
    //   any later access faults to us. The reclaimer checks this under the folio lock,
    //   where nothing of ours can map it meanwhile (`settle_drops`), and so does a
    //   drop of a folio on probation, which discards the page from the shadow
    //   (`discard_drop_pending`);
    // - a fault of ours filled it (`filled`): it was absent, so zapped, and what it
    //   holds now is the program's; or a bring-in mapped zeros there (a folio that
    //   was out when the event was read: `zero_drop_pending`).
    //   A folio that is out (SWAPPED, PARTIAL) keeps its marks until it comes in: they
    //   say which of its stored pages now read as zeros (folio.rs, `PartDropped`).
    // The reader marks the pages as soon as it has read the event, before it takes
    // any folio lock, so a fault or fork hold that brings a folio in before the reader
    // has applied the drop maps zeros there, not the old bytes. A folio with a pending
    // page is never taken out. A page MADV_FREE left mapped and the program never
    // touched again keeps its folio resident until it is dropped again (counted
    // `drop_pinned`): the price of never saving dropped bytes. (Knowing when the
    // program's madvise call returned would settle those too, but only together with
    // the reader's own progress on the event: not done.)

    fn folio_bits(&self, idx: usize) -> std::ops::Range<usize> {
        let per = self.folio_size / crate::fault::PAGE;
        idx * per..(idx + 1) * per
    }

    /// Marks the pages of `[start, end)` in this region (any part of it) as dropped:
    /// the reader, as soon as it has read the event, before any folio lock.
    pub fn mark_drop_range(&self, start: usize, end: usize) {
        let bits = self.bits_within(start, end);
        for bit in bits.clone() {
            self.set_pending(bit);
        }
        self.trace_marks(bits, false);
    }

    /// Records marks on the pages `bits` in the flight recorder (trace.rs), folio by folio.
    fn trace_marks(&self, bits: std::ops::Range<usize>, unmap: bool) {
        if !crate::trace::on() {
            return;
        }
        let per = self.folio_size / crate::fault::PAGE;
        let mut bit = bits.start;
        while bit < bits.end {
            let idx = bit / per;
            let end = bits.end.min((idx + 1) * per);
            let (first, count) = ((bit - idx * per) as u16, (end - bit) as u16);
            crate::trace::note(self.key(idx), crate::trace::Event::Marked { first, count, unmap });
            bit = end;
        }
    }

    /// Records in the flight recorder that the pending marks `mask` (`page_bit`) of
    /// folio `idx` were cleared by `why` (see `trace::Event::Settled`).
    fn trace_settled(&self, idx: usize, why: u8, mask: u64) {
        if mask != 0 {
            crate::trace::note(self.key(idx), crate::trace::Event::Settled { why, mask });
        }
    }

    /// The page bits of the part of `[start, end)` inside this region.
    fn bits_within(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        let base = self.base.load(Acquire);
        let (lo, hi) = (start.max(base), end.min(base + self.len));
        (lo.saturating_sub(base)) / crate::fault::PAGE..(hi.saturating_sub(base)).div_ceil(crate::fault::PAGE)
    }

    /// Zeroes, in `buf` (folio `idx`'s bytes, about to be mapped), the pages dropped.
    pub fn zero_drop_pending(&self, idx: usize, buf: &mut [u8]) {
        for (i, bit) in self.folio_bits(idx).enumerate() {
            if self.is_pending(bit) {
                buf[i * crate::fault::PAGE..(i + 1) * crate::fault::PAGE].fill(0);
            }
        }
    }

    /// Discards from the shadow the pages of folio `idx` (locked, on probation) that
    /// were dropped, and settles those absent from the region. One still mapped there
    /// (a copy a swap-in that stopped half-way left, or a page its move brought back)
    /// has its zap to come: it stays marked, so nothing takes it out with its old
    /// bytes before then (which would bring them back after the drop). If the pagemap
    /// cannot be read, every page is taken as still mapped.
    pub fn discard_drop_pending(&self, idx: usize) {
        let shadow = self.shadow_addr(idx);
        self.settle_absent(idx, 3, |i| discard_shadow(shadow + i * crate::fault::PAGE, crate::fault::PAGE));
    }

    /// Settles the marks of folio `idx`'s pages that the region no longer maps
    /// (pagemap: neither present nor swapped out by the kernel, so zapped), after
    /// calling `each(i)` for every marked page (page `i` of the folio), and records
    /// them as settled by `why`. Returns whether a marked page is still mapped, or
    /// `None` if the pagemap could not be read (nothing is settled then).
    fn settle_absent(&self, idx: usize, why: u8, mut each: impl FnMut(usize)) -> Option<bool> {
        let bits = self.folio_bits(idx);
        let mut entries = [0u64; crate::MAX_FOLIO / crate::fault::PAGE];
        let entries = &mut entries[..bits.len()];
        let read = self.shared.pagemap(self.folio_addr(idx), entries);
        let (mut left, mut settled) = (false, 0u64);
        for (i, bit) in bits.enumerate() {
            if !self.is_pending(bit) {
                continue;
            }
            each(i);
            if read && !crate::holds_data(entries[i]) {
                self.clear_pending(bit);
                settled |= page_bit(i);
            } else {
                left = true;
            }
        }
        self.trace_settled(idx, why, settled);
        read.then_some(left)
    }

    fn set_pending(&self, bit: usize) {
        self.drop_pending.set(bit);
    }

    fn clear_pending(&self, bit: usize) {
        self.drop_pending.clear(bit);
    }

    fn is_pending(&self, bit: usize) -> bool {
        self.drop_pending.is_set(bit)
    }

    /// Whether every page of folio `idx` is marked dropped: the program gave all of it
    /// back, in pieces (its drop then frees the folio whole).
    pub fn all_drop_pending(&self, idx: usize) -> bool {
        self.drop_pending.all(self.folio_bits(idx))
    }

    /// Whether folio `idx` has pages dropped but maybe still mapped. Cheap.
    pub fn has_drop_pending(&self, idx: usize) -> bool {
        self.drop_pending.any(self.folio_bits(idx))
    }

    // ---- Pages unmapped. ----
    //
    // A munmap (or brk shrinking, or MAP_FIXED over it) of part of a folio leaves the
    // folio *torn*: its other pages are still the program's, but the addresses of the
    // unmapped ones are not ours any more. The program may map anything there again
    // (glibc regrows its brk heap right there), and that new mapping is not registered
    // with us: UFFDIO_MOVE takes pages from any anonymous mapping it is pointed at,
    // so a take-out of the folio would carry the program's fresh bytes off to the store
    // (brktrim.c read zeros at the top of its regrown heap; cc1 died of a corrupted
    // heap). So the reader marks the pages *gone* as soon as it reads the UNMAP, before
    // any folio lock, with take-outs held off meanwhile (moves.rs); then:
    // - a folio whose every page is gone, in however many pieces, is dropped whole
    //   (UNMAPPED), as one unmapped at once;
    // - a torn folio is never taken out again (it stays where it is, charged);
    // - whatever brings a torn folio's data in, or protects or poisons it, acts on its
    //   other pages only ([`RegionInner::live_runs`]); one on probation is copied back
    //   from the shadow rather than moved (a move covers the folio's whole range).
    // The marks stay: the addresses never become ours again while the region lives.

    /// Marks the pages of `[start, end)` in this region (any part of it) as unmapped:
    /// the reader, as soon as it has read the event.
    pub fn mark_gone_range(&self, start: usize, end: usize) {
        let bits = self.bits_within(start, end);
        for bit in bits.clone() {
            self.gone.set(bit);
        }
        self.trace_marks(bits, true);
    }

    /// Whether the program unmapped part of folio `idx` (it is torn). Cheap.
    pub fn torn(&self, idx: usize) -> bool {
        self.gone.any(self.folio_bits(idx))
    }

    /// Calls `op(start, len)` on each run of the region's pages that the program has
    /// not unmapped (all of it, if it unmapped nothing): what a release may unregister
    /// or unmap. The rest may be another mapping's by now, even another region's.
    pub fn live_spans(&self, mut op: impl FnMut(usize, usize)) {
        let base = self.base.load(Acquire);
        let _ = self.gone.clear_runs(base, base, base + self.len, |start, len| {
            op(start, len);
            Ok::<(), ()>(())
        });
    }

    /// The page bit of `addr`, if it is inside the region.
    fn page_at(&self, addr: usize) -> Option<usize> {
        let page = addr.checked_sub(self.base.load(Acquire)).map(|off| off / crate::fault::PAGE);
        page.filter(|&p| p < self.len / crate::fault::PAGE)
    }

    /// Whether the program unmapped the page at `addr` (inside the region).
    pub fn gone_at(&self, addr: usize) -> bool {
        self.page_at(addr).is_some_and(|p| self.gone.is_set(p))
    }

    /// Whether the page at `addr` (inside the region) is marked dropped and not settled.
    pub fn drop_pending_at(&self, addr: usize) -> bool {
        self.page_at(addr).is_some_and(|p| self.is_pending(p))
    }

    /// Whether the program unmapped every page of folio `idx`, in pieces or at once.
    pub fn all_gone(&self, idx: usize) -> bool {
        self.gone.all(self.folio_bits(idx))
    }

    /// Calls `op(start, len)` on each run of pages of `[lo, hi)` (inside folio `idx`)
    /// that are still the program's, in order, until one fails: the whole range at
    /// once unless the folio is torn. Async-signal-safe.
    pub fn live_runs<E>(&self, idx: usize, lo: usize, hi: usize, mut op: impl FnMut(usize, usize) -> Result<(), E>) -> Result<(), E> {
        if !self.torn(idx) {
            return op(lo, hi - lo);
        }
        self.gone.clear_runs(self.base.load(Acquire), lo, hi, op)
    }

    /// Lifts the write protection of folio `idx` (locked) from the pages still the
    /// program's. Async-signal-safe.
    pub fn unprotect_folio(&self, idx: usize, wait: bool) -> Result<(), crate::uffd::IoctlError> {
        let folio = self.folio_addr(idx);
        self.live_runs(idx, folio, folio + self.folio_size, |at, n| crate::fault::unprotect_range(&self.shared, at, n, wait))
    }

    /// Settles the pending pages of folio `idx` (locked, in `state`) that are absent
    /// now; true if none is left pending, so the folio may be taken out. The
    /// reclaimer's check.
    ///
    /// A folio in `state` CLEAN or PARTIAL is never settled: its kept copy still holds
    /// the dropped bytes until the reader applies the drop (which frees the copy).
    /// Evicting it now would keep that copy, and the drop, applied then to a SWAPPED
    /// folio with nothing left pending, would bring the old bytes back.
    pub fn settle_drops(&self, idx: usize, state: u8) -> bool {
        if !self.has_drop_pending(idx) {
            return true;
        }
        if state != RESIDENT {
            crate::stats::bump(&self.shared.stats.sizes[self.order()].drop_pinned);
            return false;
        }
        let Some(left) = self.settle_absent(idx, 2, |_| {}) else { return false };
        left.then(|| crate::stats::bump(&self.shared.stats.sizes[self.order()].drop_pinned));
        !left
    }

    /// A fill of ours placed the pages `placed` of folio `idx` (locked): they were
    /// absent, so any drop of theirs is done, and what they hold now is zeros or the
    /// program's. Only once nothing of the folio's data is left anywhere else (see
    /// `bring_back`).
    pub fn filled(&self, idx: usize, placed: &PageSet) {
        if !self.has_drop_pending(idx) {
            return;
        }
        let folio = self.folio_addr(idx);
        let mut settled = 0u64;
        for (i, bit) in self.folio_bits(idx).enumerate() {
            if placed.has(folio + i * crate::fault::PAGE) && self.is_pending(bit) {
                self.clear_pending(bit);
                settled |= page_bit(i);
            }
        }
        self.trace_settled(idx, 1, settled);
    }

    /// Unlocks a folio just faulted in as `state` (RESIDENT, CLEAN, PARTIAL): a fresh stamp,
    /// and an entry in the fault queue for the reclaimer, queued once the folio is
    /// unlocked so the reclaimer never finds it still locked. Async-signal-safe.
    pub fn unlock_faulted_in(&self, idx: usize, state: u8) {
        let sh = &*self.shared;
        let stamp = sh.next_stamp();
        self.stamps[idx].store(stamp, Relaxed);
        self.unlock(idx, state);
        sh.fault_queue.push(self.slot.load(Relaxed), idx, stamp);
    }

    /// How much of folio `idx` (out: SWAPPED or PARTIAL, and locked, so its record
    /// stays as it is) a partial swap-in maps: its record's unit, the only part
    /// decoded. A folio stored whole has none smaller: the whole folio comes in, as it
    /// was decoded anyway (mapping one page of it only saved charge, and a write after
    /// the read decoded it twice: redis filling 500k keys under 64M took 27 s so
    /// against 19 s). Lock-free, for the fault path.
    pub fn swapin_unit(&self, idx: usize) -> usize {
        if !self.shared.cfg.partial_swapin {
            return self.folio_size;
        }
        self.shared.store.unit_len(self.key(idx)).map_or(self.folio_size, |u| u.clamp(crate::fault::PAGE, self.folio_size))
    }

    /// The cut a folio of this region stored now gets (pattern.rs).
    pub fn cut(&self) -> uzswap_store::Granularity {
        let cfg = &self.shared.cfg;
        self.pattern.cut(cfg.store.codec.granularity, cfg.adaptive_cut)
    }

    /// Whether a folio of this region that is not gone with its mapping lies in
    /// `[start, end)`: not UNMAPPED, nor unmapped whole by an event the reader has
    /// marked and has yet to process.
    pub fn live_within(&self, start: usize, end: usize) -> bool {
        let (base, stop) = (self.base.load(Acquire), self.base.load(Acquire) + self.len);
        if end <= base || start >= stop {
            return false;
        }
        let first = (start.max(base) - base) >> self.folio_shift;
        let last = (end.min(stop) - 1 - base) >> self.folio_shift;
        (first..=last).any(|idx| self.folios.peek(idx) != crate::folio::UNMAPPED && !self.all_gone(idx))
    }

    pub fn folio_addr(&self, idx: usize) -> usize {
        self.base.load(Acquire) + (idx << self.folio_shift)
    }

    pub fn shadow_addr(&self, idx: usize) -> usize {
        self.shadow + (idx << self.folio_shift)
    }
}

impl Drop for RegionInner {
    fn drop(&mut self) {
        // SAFETY: the shadow is ours, and with the last reference gone nobody uses it.
        unsafe { libc::munmap(self.shadow as *mut _, self.len) };
    }
}

/// Page `i` of a folio in the recorder's masks (trace.rs: its first 64 pages).
fn page_bit(i: usize) -> u64 {
    1u64.checked_shl(i as u32).unwrap_or(0)
}

/// One bit per page of a folio, by address: the pages a fill placed, or found present.
/// (A folio spans at most `MAX_FOLIO` of consecutive pages, so no two of its pages
/// share a bit.)
#[derive(Default)]
pub(crate) struct PageSet([u64; crate::MAX_FOLIO / crate::fault::PAGE / 64]);

impl PageSet {
    fn bit(addr: usize) -> usize {
        (addr / crate::fault::PAGE) % (crate::MAX_FOLIO / crate::fault::PAGE)
    }
    pub fn add(&mut self, addr: usize) {
        let b = Self::bit(addr);
        self.0[b / 64] |= 1 << (b % 64);
    }
    /// Adds the pages of `[addr, addr + len)` (inside one folio).
    pub fn add_range(&mut self, addr: usize, len: usize) {
        for page in (addr..addr + len).step_by(crate::fault::PAGE) {
            self.add(page);
        }
    }
    pub fn has(&self, addr: usize) -> bool {
        let b = Self::bit(addr);
        self.0[b / 64] & (1 << (b % 64)) != 0
    }
    /// How many pages are in the set.
    pub fn count(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
}

/// One atomic bit per page of a region.
pub(crate) struct PageBits(Box<[AtomicU64]>);

impl PageBits {
    pub fn new(pages: usize) -> PageBits {
        PageBits((0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
    }
    fn set(&self, bit: usize) {
        self.0[bit / 64].fetch_or(1 << (bit % 64), Relaxed);
    }
    fn clear(&self, bit: usize) {
        self.0[bit / 64].fetch_and(!(1 << (bit % 64)), Relaxed);
    }
    fn is_set(&self, bit: usize) -> bool {
        self.0[bit / 64].load(Relaxed) & (1 << (bit % 64)) != 0
    }
    fn all(&self, bits: std::ops::Range<usize>) -> bool {
        bits.into_iter().all(|bit| self.is_set(bit))
    }
    /// Calls `op(start, len)` on each run of pages of `[lo, hi)` whose bits are clear,
    /// in order, until one fails; page 0 is at `base`. Async-signal-safe.
    pub fn clear_runs<E>(&self, base: usize, lo: usize, hi: usize, mut op: impl FnMut(usize, usize) -> Result<(), E>) -> Result<(), E> {
        let page = crate::fault::PAGE;
        let mut at = lo;
        while at < hi {
            if self.is_set((at - base) / page) {
                at += page;
                continue;
            }
            let start = at;
            while at < hi && !self.is_set((at - base) / page) {
                at += page;
            }
            op(start, at - start)?;
        }
        Ok(())
    }

    /// Whether a bit of `bits` (one folio's: a power of two, aligned) is set. Cheap.
    fn any(&self, bits: std::ops::Range<usize>) -> bool {
        if bits.len() >= 64 {
            return self.0[bits.start / 64..bits.end / 64].iter().any(|w| w.load(Relaxed) != 0);
        }
        let mask = ((1u64 << bits.len()) - 1) << (bits.start % 64);
        self.0[bits.start / 64].load(Relaxed) & mask != 0
    }
}

/// Frees `[addr, addr + len)` of a shadow (MADV_DONTNEED; the staging context has no
/// REMOVE events, so this cannot block on the reader). If the kernel refuses, the old
/// bytes would stay where a later move back, or a take-out, expects none: the program
/// stops with the errno rather than ever read them.
pub(crate) fn discard_shadow(addr: usize, len: usize) {
    // SAFETY: the caller's shadow range, of a live region: no one else maps there.
    if unsafe { libc::madvise(addr as *mut _, len, libc::MADV_DONTNEED) } != 0 {
        // SAFETY: errno of this thread, just set by madvise.
        crate::fault::ioctl_fatal(b"MADV_DONTNEED (of a shadow)", unsafe { *libc::__errno_location() });
    }
}

#[cfg(test)]
mod tests {
    use super::PageBits;
    const P: usize = crate::fault::PAGE;

    /// A drop of a folio on probation settles the marks of the pages the region no
    /// longer maps, and only those: a page still mapped there (a copy a put-off
    /// swap-in left) has its zap to come, and stays marked so that no take-out carries
    /// its old bytes off before then (they came back after the drop).
    #[test]
    fn a_drop_settles_only_pages_the_region_no_longer_maps() {
        let rt = match crate::Runtime::new(crate::RuntimeConfig::new(64 << 20)) {
            Ok(rt) => rt,
            Err(crate::Error::Unavailable(why)) => return eprintln!("SKIP: {why}"),
            Err(e) => panic!("runtime: {e}"),
        };
        let region = rt.create_region(1 << 20, 8 * P).unwrap();
        let r = region.r();
        let base = r.base.load(std::sync::atomic::Ordering::Acquire);
        // SAFETY: the first folio of our region, filled whole by this write's fault;
        // then its second page dropped (zapped once the madvise returns).
        unsafe {
            (base as *mut u8).write_volatile(1);
            assert_eq!(libc::madvise((base + P) as *mut _, P, libc::MADV_DONTNEED), 0);
        }
        let state = r.lock(0);
        // Pages 0 and 1 marked dropped, as the reader marks them when it reads the
        // event (it may not have yet): page 1 is zapped, page 0 has its zap to come.
        r.mark_drop_range(base, base + 2 * P);
        r.discard_drop_pending(0);
        let (kept, settled) = (r.drop_pending_at(base), !r.drop_pending_at(base + P));
        r.unlock(0, state);
        assert!(kept, "page 0 is still mapped: its mark stays");
        assert!(settled, "page 1 is not: settled");
    }

    fn runs(bits: &PageBits, base: usize, lo: usize, hi: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let _ = bits.clear_runs(base, lo, hi, |s, n| {
            out.push(((s - base) / P, n / P));
            Ok::<(), ()>(())
        });
        out
    }

    /// The runs of pages still the program's: every clear stretch once, in order,
    /// within the range asked; none when all are set; a failure stops the walk.
    #[test]
    fn clear_runs_are_the_live_stretches() {
        let base = 0x10_0000;
        let bits = PageBits::new(128);
        assert_eq!(runs(&bits, base, base, base + 128 * P), [(0, 128)]);
        for b in [0, 5, 6, 63, 64, 100, 127] {
            bits.set(b);
        }
        assert_eq!(runs(&bits, base, base, base + 128 * P), [(1, 4), (7, 56), (65, 35), (101, 26)]);
        assert_eq!(runs(&bits, base, base + 16 * P, base + 32 * P), [(16, 16)]);
        assert_eq!(runs(&bits, base, base + 60 * P, base + 68 * P), [(60, 3), (65, 3)]);
        assert!(bits.any(64..80) && !bits.any(80..96) && bits.any(0..128));
        assert!(!bits.all(0..16) && bits.all(5..7));
        for b in 0..16 {
            bits.set(b);
        }
        assert!(bits.all(0..16));
        assert_eq!(runs(&bits, base, base, base + 16 * P), []);
        let mut calls = 0;
        let r = bits.clear_runs(base, base, base + 128 * P, |_, _| {
            calls += 1;
            Err("stop")
        });
        assert_eq!((r, calls), (Err("stop"), 1));
    }

    /// Bits set and cleared from several threads at once, each its own: none lost.
    #[test]
    fn bits_from_several_threads() {
        let bits = std::sync::Arc::new(PageBits::new(4096));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let bits = bits.clone();
                std::thread::spawn(move || {
                    for round in 0..200 {
                        for b in (t..4096).step_by(4) {
                            if round % 2 == 0 { bits.set(b) } else { bits.clear(b) }
                        }
                        for b in (t..4096).step_by(4) {
                            assert_eq!(bits.is_set(b), round % 2 == 0, "bit {b} round {round}");
                        }
                    }
                    for b in (t..4096).step_by(4) {
                        if t % 2 == 0 { bits.set(b) }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!((0..4096).all(|b| bits.is_set(b) == (b % 4 % 2 == 0)));
    }
}
