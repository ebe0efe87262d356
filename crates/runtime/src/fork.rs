//! fork(2) of a process with a runtime: the parent's regions are handed to the child
//! with their data; with `fork_carry`, swapped-out folios stay swapped out in both.
//!
//! Regions are MADV_DONTFORK, so a fork that does not go through here (a raw clone,
//! `_Fork`) gives the child none of them: it faults rather than read zeros. Around a
//! libc fork the preload shim calls [`Runtime::hold_for_fork`] (atfork prepare), and
//! [`ForkHold::resume`] in the parent or [`ForkHold::into_child`] in the child.
//!
//! # The hold (parent, before fork)
//! Every folio of every region is locked (the reclaimer skips locked folios, faults
//! wait) and the regions made MADV_DOFORK. What the child gets of each folio:
//! - in place (RESIDENT, CLEAN): the pages themselves, copy-on-write (a CLEAN one made
//!   writable first, see `writable`);
//! - SWAPPED, with the setting `fork_carry` (on by default: see the cost below), in
//!   a region the caller lets a child take over (its whole range reaches
//!   the child: no part unmapped or marked DONTFORK by the program) and on a tier a
//!   child can read: nothing is brought back. The store is frozen (uzswap-store's
//!   `carry`: nothing moves, is freed or written back), its pool mappings made
//!   DOFORK, and the folio's record noted ([`uzswap_store::Carried`]);
//! - everything else (PARTIAL, PROBATION, SWAPPED with drops pending or on a remote
//!   tier, or in a region not taken over) is brought back in place first, as every
//!   folio was before, and the child gets the pages; so is what the caller names as
//!   touched in the child before its runtime is up (`touched_first`: libc's own
//!   resets, for adopted memory: the shim's proc.rs `glibc_touches_in_child`).
//!
//! Adopted regions (the program's own mappings: its brk heap, glibc's arenas, an
//! allocator's or runtime's memory) are carried too: fork copies them as the program
//! left them (not MADV_DONTFORK), so a carried folio is a hole in the child until its
//! runtime takes the range over, adopting it in turn. Anything else that touches such
//! a hole first reads zeros or writes over them: the child finds the page there and
//! lays its bytes that are not zero over the record (counted `fork_touched`, said),
//! the best it can do then; the parent names what it knows of beforehand.
//!
//! # The child
//! It starts a runtime of its own (the shim does, inside fork, before any program
//! code runs), and [`Inheritance::take_over`] registers each region taken over in
//! place with that runtime, every folio SWAPPED (`Carried`) that has data:
//! - a carried one: borrowed (uzswap-store carry.rs "Loans"): the child's entry
//!   names the record where it is, in the child's copy of the parent's pool (kept
//!   mapped, DONTFORK, until no entry names it) or in the parent's backing file (read
//!   through the inherited descriptor, which the child's keeper holds); a same-filled
//!   one, or one the store will not take, is imported (copied) instead;
//! - one with pages present (resident in the parent at fork, now shared copy-on-
//!   write): left in place, write-protected, SHARED (folio.rs): charged to the
//!   parent alone, as a memory cgroup charges a shared page once. The child's first
//!   touch makes the folio its own (charged; the kernel copies a page it writes).
//!   Shared pages cannot be moved out by either process (UFFDIO_MOVE takes only a
//!   page mapped once), so when the group needs room the child's reclaimer makes
//!   them its own and takes them out first, copying each page it still shares
//!   (reclaim.rs `release_shared`); the parent's are then its alone, movable again.
//!   A child that execs or exits soon (most do) pays nothing for them. Compressing
//!   them all in the child before its code ran, as it once did, cost a fork+wait
//!   of 384 MiB under 128 MiB (`bench kernel --workload fork`) 540 ms against 30 ms
//!   for a plain fork.
//!
//! Where anything fails (no runtime, a region that cannot be registered, a store that
//! refuses) the child decodes the folio into place instead, as before; a record that
//! cannot be read (an I/O error, a corrupt record) is poisoned, never read as zeros.
//!
//! # The parent, after fork
//! It makes the pool mappings DONTFORK again, thaws the store and unlocks every
//! folio, without waiting for the child. If the child borrows from its backing file,
//! it lends its store the read end of a pipe whose write end the child holds until
//! it exits or execs: until that reads EOF the store frees no slot (frees queue up;
//! the file grows meanwhile by what the parent writes back anew). Pool objects it
//! frees or moves meanwhile are copied on write, as all of its memory is after a
//! fork: the child keeps the pages it names.
//!
//! Fork thus costs the parent time in proportion to what is resident (page tables),
//! and the child a walk of its folios (a borrow per carried one, a write protection
//! per run of shared ones), not a decode and a mapping of every swapped-out folio
//! in the parent, nor a copy of its records, nor a compression; no page is
//! charged twice (the child is charged for the parent's pool pages it keeps as the
//! kernel charges shared pages: PSS, the runtime's unmanaged memory). Copying the
//! records instead cost a child seconds (its pool, a small share of the group's
//! budget, full at once: a write to its own file per record), while the parent
//! waited for the file's. vfork and posix_spawn, which most runtimes use to start
//! programs, run no fork handlers and cost nothing either way.

use crate::fault::{put_in_place, PAGE};
use crate::stats::bump;
use crate::uffd::IoctlError;
use crate::region::*;
use crate::{os, Error, Region, Runtime, Shared, MAX_FOLIO};
use std::os::fd::RawFd;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use uzswap_store::{carry_buffer, decode_carried, Carried, CodecConfig, Store};

/// Every folio of every region of a runtime locked, regions MADV_DOFORK, swapped-out
/// folios carried or brought in (module comment).
pub struct ForkHold {
    runtime: Runtime,
    /// Per region, its folios' states to unlock with.
    held: Vec<(Arc<RegionInner>, Vec<u8>)>,
    carried: Vec<CarriedRegion>,
    /// The store's pool mappings, made DOFORK for this fork (the store is frozen).
    pool_maps: Vec<(usize, usize)>,
    frozen: bool,
    /// A pipe (read end, write end) whose write end the child holds while it may read
    /// the backing file (until it exits or execs: the loan, uzswap-store carry.rs).
    done: Option<[RawFd; 2]>,
}

impl Drop for ForkHold {
    fn drop(&mut self) {
        self.release();
    }
}

/// Children borrowing from the backing file at once, at most (`ForkHold::carry`); a
/// fork past it brings the folios whose records are in the file back first.
const MAX_LOANS: usize = 16;

/// A region a child takes over: its swapped-out folios, and the pages present at fork.
struct CarriedRegion {
    /// The parent's region id: the child's region keeps it, so that its keys are the
    /// parent's (a borrowed record's slot is checked under its key).
    id: u64,
    base: usize,
    len: usize,
    folio_size: usize,
    /// Adopted (the program's own mapping, which fork copies as it is): the child
    /// adopts it in turn, and leaves its fork inheritance as the program set it.
    adopted: Option<crate::MemoryKind>,
    folios: Vec<(usize, Carried)>,
    /// The parent's region, read in the child as the fork copied it: its marks say
    /// which pages the program unmapped after the hold (see [`CarriedRegion::ours`]).
    parent: Arc<RegionInner>,
}

impl CarriedRegion {
    /// In the child: whether every page of `[addr, addr + len)` (inside the region
    /// where it is at the fork, [`CarriedRegion::at_fork`]) is still the region's.
    /// Mapped is not enough: another thread may unmap part of it between the hold
    /// and the fork and map something else there, which the child must leave alone.
    /// Its munmap returned once the parent's reader had read the event, which marks
    /// the pages at once; a fork after the new mapping copies those marks (the
    /// child's copy of memory keeps the order of the parent's stores).
    fn ours(&self, addr: usize, len: usize) -> bool {
        all_mapped(addr, len) && !(addr..addr + len).step_by(PAGE).any(|p| self.parent.gone_at(p))
    }

    /// In the child: where the region was at the fork. Another thread may have moved
    /// it whole (mremap) since the hold; the reader follows such a move at once, as
    /// it marks an unmap.
    fn at_fork(&self) -> usize {
        self.parent.base.load(Acquire)
    }
}

impl Runtime {
    /// Prepares the regions for fork(2) (module comment). `may_carry(base, len)` says
    /// whether a child may take over the swapped-out folios of the region at `base`:
    /// whether the whole range reaches it as it is. `touched_first(pin)` names, by
    /// calling `pin(addr, len)`, the memory the child touches before its runtime
    /// starts (libc's own resets in the child, for an adopted range): each folio of it
    /// is put in place, not carried, and is readable once `pin` returns.
    pub fn hold_for_fork(&self, may_carry: impl Fn(usize, usize) -> bool, touched_first: impl FnOnce(&mut dyn FnMut(usize, usize))) -> ForkHold {
        let sh = &self.inner.shared;
        let regions: Vec<Arc<RegionInner>> = sh.regions.lock().clone();
        let mut buf = vec![0u8; MAX_FOLIO];
        let mut held = Vec::with_capacity(regions.len());
        // Every region a child may take over, even with nothing swapped out: it takes
        // over what is present too (module comment). Left out, such a region stayed
        // plain memory in the child, shared with the parent, which could move none of
        // it out (a Python parent's fully resident 1 MiB buffers, 25 MiB of them).
        let mut carried = Vec::new();
        // (index in `held`, index in `carried`, folio) of the SWAPPED folios left out.
        // Sized once: growing it by copies faulted in fresh pages again and again.
        let mut swapped: Vec<(usize, usize, usize)> = Vec::with_capacity(regions.iter().map(|r| r.folios()).sum());
        for r in regions {
            let inherited = set_inherited(sh, &r, true);
            let base = r.base.load(Acquire);
            // Not one the program unmapped part of: the child would take over its whole
            // range, and the part unmapped may be another mapping's by now (region.rs).
            let whole = !(0..r.folios()).any(|idx| r.torn(idx));
            let carry = sh.cfg.fork_carry && inherited && whole && may_carry(base, r.len);
            if carry {
                carried.push(CarriedRegion { id: r.id, base, len: r.len, folio_size: r.folio_size, adopted: r.adopted, folios: Vec::new(), parent: r.clone() });
            }
            let mut states = Vec::with_capacity(r.folios());
            for idx in 0..r.folios() {
                let now = r.lock(idx);
                if carry && now == SWAPPED && !r.has_drop_pending(idx) {
                    swapped.push((held.len(), carried.len() - 1, idx));
                    states.push(now);
                } else {
                    states.push(held_in_place(&r, idx, now, &mut buf));
                }
            }
            held.push((r, states));
        }
        // What the child touches before its runtime is up reads zeros there if carried
        // (a hole in memory no userfaultfd serves yet): put in place, as if not carried.
        touched_first(&mut |addr, len| {
            for (h, (r, states)) in held.iter_mut().enumerate() {
                let (base, fs) = (r.base.load(Acquire), r.folio_size);
                if addr + len <= base || addr >= base + r.len {
                    continue;
                }
                let (first, last) = ((addr.max(base) - base) / fs, ((addr + len).min(base + r.len) - 1 - base) / fs);
                for (idx, state) in states.iter_mut().enumerate().take(last + 1).skip(first) {
                    // `swapped` is in (region, folio) order, as listed above.
                    if let Ok(at) = swapped.binary_search_by_key(&(h, idx), |&(hh, _, i)| (hh, i)) {
                        swapped.remove(at);
                        *state = held_in_place(r, idx, SWAPPED, &mut buf);
                    }
                }
            }
        });
        let mut hold = ForkHold { runtime: self.clone(), held, carried, pool_maps: Vec::new(), frozen: false, done: None };
        if !swapped.is_empty() {
            hold.carry(swapped, &mut buf);
        }
        hold
    }
}

/// A held folio (locked in `state`) put in place (`put_in_place`), and made writable
/// if it is then CLEAN (its kept copy freed, as by a first write) or SHARED: the forking thread
/// writes memory of ours after the hold is taken
/// (an allocator's fork handlers lock its arenas' mutexes; jemalloc's run after ours),
/// and a write into a write-protected page would fault on a folio the hold keeps
/// locked, a fault nobody could serve until the hold ends (redis' BGSAVE hung so).
fn held_in_place(r: &RegionInner, idx: usize, state: u8, buf: &mut [u8]) -> u8 {
    let state = put_in_place(r, idx, state, buf);
    // So is a SHARED one, made ours (`Unshared`, charged) for the same reason.
    let t = match state {
        CLEAN => Transition::Dirtied,
        SHARED => Transition::Unshared,
        _ => return state,
    };
    let now = r.book().record(idx, state, t, None);
    match r.unprotect_folio(idx, true) {
        Ok(()) | Err(IoctlError::Gone) => now,
        Err(IoctlError::Unexpected(e)) => crate::fault::ioctl_fatal(b"UFFDIO_WRITEPROTECT (a folio held for fork)", e),
        // Waiting, it is never asked to give up.
        Err(IoctlError::Again) => crate::fault::ioctl_fatal(b"UFFDIO_WRITEPROTECT (a folio held for fork)", libc::EAGAIN),
    }
}

impl ForkHold {
    /// Freezes the store and notes where each of `swapped` is; a folio that cannot be
    /// carried is brought in.
    fn carry(&mut self, swapped: Vec<(usize, usize, usize)>, buf: &mut [u8]) {
        let sh = self.runtime.inner.shared.clone();
        sh.store.freeze();
        self.frozen = true;
        // SAFETY: the store is frozen until `resume` (or for good, in the child).
        self.pool_maps = unsafe { sh.store.pool_mappings() };
        // SAFETY: madvise of the pool's own mappings changes only what fork copies.
        let inheritable = self.pool_maps.iter().all(|&(a, l)| unsafe { libc::madvise(a as *mut _, l, libc::MADV_DOFORK) } == 0);
        let mut counts = vec![0usize; self.carried.len()];
        for &(_, ci, _) in &swapped {
            counts[ci] += 1;
        }
        for (cr, n) in self.carried.iter_mut().zip(counts) {
            cr.folios.reserve_exact(n);
        }
        for (h, ci, idx) in swapped {
            let (r, states) = &mut self.held[h];
            match sh.store.carry(r.key(idx)).filter(|_| inheritable) {
                Some(c) => self.carried[ci].folios.push((idx, c)),
                None => states[idx] = held_in_place(r, idx, SWAPPED, buf),
            }
        }
        if self.carried.iter().any(|cr| cr.folios.iter().any(|(_, c)| c.in_tier())) {
            let mut fds = [-1; 2];
            // At most MAX_LOANS children borrow from the file at once: each holds a
            // descriptor of ours in both processes, in the few numbers set aside for
            // them (fds.rs).
            // SAFETY: pipe2 writes two descriptors into `fds`.
            if sh.store.loans_out() < MAX_LOANS && unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0 {
                // Out of the program's reach (fds.rs), in both processes: a program
                // closing either end early would end the loan while the child reads.
                self.done = Some(fds.map(crate::fds::place_raw));
            } else {
                // No way to know when a child is done with the file: those come in.
                for cr in &mut self.carried {
                    let (r, states) = self.held.iter_mut().find(|(r, _)| r.base.load(Acquire) == cr.base).expect("a held region");
                    cr.folios.retain(|&(idx, c)| {
                        if c.in_tier() {
                            states[idx] = held_in_place(r, idx, SWAPPED, buf);
                        }
                        !c.in_tier()
                    });
                }
            }
        }
    }

    /// Folios a child takes over swapped out.
    pub fn carried(&self) -> usize {
        self.carried.iter().map(|cr| cr.folios.len()).sum()
    }

    /// In the parent after fork (module comment): waits for the child if it reads the
    /// backing file, then thaws the store, makes the regions DONTFORK again, unlocks
    /// every folio and kicks reclaim.
    pub fn resume(self) {
        drop(self);
    }

    /// What [`ForkHold::resume`] does, once: a hold dropped unresumed (a panic between
    /// the hold and the fork) lets go as well, rather than leave every folio locked
    /// and the store frozen (a test's failed assertion once hung there, unwinding).
    fn release(&mut self) {
        let sh = &self.runtime.inner.shared;
        if let Some([rd, wr]) = self.done.take() {
            crate::fds::unregister(wr);
            // SAFETY: our own pipe's write end: the child has its copy.
            unsafe { libc::close(wr) };
            // The child borrows the records of our backing file it carries: the store
            // keeps every slot until this reads EOF (uzswap-store carry.rs, "Loans").
            crate::fds::unregister(rd);
            crate::fds::register_unkept(rd);
            sh.store.lend(rd, |fd| {
                crate::fds::unregister(fd);
                // SAFETY: the loan pipe's read end, at EOF, closed once by the store.
                unsafe { libc::close(fd) };
            });
        }
        for &(a, l) in &std::mem::take(&mut self.pool_maps) {
            // SAFETY: the pool's own mappings, still as they were (the store is frozen).
            unsafe { libc::madvise(a as *mut _, l, libc::MADV_DONTFORK) };
        }
        if std::mem::take(&mut self.frozen) {
            sh.store.thaw();
        }
        for (r, states) in &std::mem::take(&mut self.held) {
            set_inherited(sh, r, false);
            for (idx, &s) in states.iter().enumerate() {
                unlock_held(r, idx, s);
            }
        }
        sh.kick_reclaimer();
    }

    /// In the child, first thing, on its only thread: what it takes over. Nothing of
    /// the parent's runtime is released or used but the records the child reads (its
    /// threads are not here): its descriptors are closed but those (`fds.rs`
    /// `drop_in_child`), and the process-wide traces of it forgotten
    /// ([`forget_parent_in_child`]).
    pub fn into_child(self) -> Inheritance {
        // Taken apart without its drop, which would resume the parent's hold here.
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: each field is read out once, and `this` is neither used nor dropped
        // again.
        let (runtime, held, carried, pool_maps, done) =
            unsafe { (std::ptr::read(&this.runtime), std::ptr::read(&this.held), std::ptr::read(&this.carried), std::ptr::read(&this.pool_maps), this.done) };
        std::mem::forget(held);
        // The loan pipe exists exactly when a record in the backing file is carried
        // (`carry` brings the others back): then the file is read from.
        let parent_fd = done.and_then(|_| runtime.inner.shared.store.backing_fd());
        let done_wr = done.map(|[rd, wr]| {
            crate::fds::unregister(rd);
            // SAFETY: the read end is the parent's to read; the child's copy is closed.
            unsafe { libc::close(rd) };
            wr
        });
        // What the child's runtime keeps from its start (its keeper's table: fds.rs),
        // so that no close of the program's ends a loan early (`Store::borrow`).
        for (slot, fd) in BORROWED_FDS.iter().zip([parent_fd, done_wr]) {
            slot.store(fd.unwrap_or(-1), Relaxed);
        }
        crate::fds::drop_in_child(&[parent_fd.unwrap_or(-1), done_wr.unwrap_or(-1)]);
        forget_parent_in_child();
        Inheritance { parent: std::mem::ManuallyDrop::new(runtime), carried, pool_maps, done_wr, parent_fd }
    }
}

/// What a forked child takes over from its parent ([`ForkHold::into_child`]).
pub struct Inheritance {
    /// The child's copy of the parent's runtime: read (its store), never dropped.
    parent: std::mem::ManuallyDrop<Runtime>,
    carried: Vec<CarriedRegion>,
    pool_maps: Vec<(usize, usize)>,
    done_wr: Option<RawFd>,
    parent_fd: Option<RawFd>,
}

impl Inheritance {
    /// Takes the carried regions over into `rt`, the child's runtime (`None`: the
    /// child has none, and every carried folio is decoded into place). Returns the
    /// new regions by base, for the caller to put where the parent's were (adopted
    /// ones, `Region::adopted`, among its adopted regions).
    pub fn take_over(self, rt: Option<&Runtime>) -> Vec<(usize, Region)> {
        // Kept for good: borrowed records are read through it for the child's life.
        let lender: &'static Runtime = Box::leak(Box::new(std::mem::ManuallyDrop::into_inner(self.parent)));
        let parent = &lender.inner.shared.store;
        let cfg = parent.config().codec.clone();
        let mut buf = carry_buffer(&cfg)
            .unwrap_or_else(|_| crate::fault::fatal(b"uzswap: fork: no codec for the parent's records; the child cannot have its memory\n"));
        // The child's store borrows the records (uzswap-store carry.rs "Loans") and owns
        // the copies of the pool mappings from here on; without one, they go below.
        let borrowing = rt.is_some_and(|rt| rt.inner.shared.store.start_borrowing(parent, &self.pool_maps).is_ok());
        if borrowing {
            for &(a, l) in &self.pool_maps {
                // SAFETY: madvise of the child's copies of the parent's pool mappings
                // changes only what its own forks copy: nothing of them (a lent entry
                // is brought back before a fork, never carried again).
                unsafe { libc::madvise(a as *mut _, l, libc::MADV_DONTFORK) };
            }
        }
        let mut regions = Vec::new();
        for cr in &self.carried {
            // A range the program marked MADV_DONTFORK (all or part: an adopted one),
            // or unmapped part of behind the parent's back (another thread's munmap
            // between the hold's look and the fork, or a raw system call the shim did
            // not see), is not the child's, or not all of it: what is not there is
            // left out, and the rest placed as plain memory, not taken over. Registered
            // whole, the region would claim the hole, and whatever the child maps
            // there next (registration says nothing of holes), or another mapping
            // made there since. Looked at here, where no other thread runs: one system
            // call a region.
            let whole = cr.at_fork() == cr.base && cr.ours(cr.base, cr.len);
            let taken = if whole { rt.map(|rt| rt.inherit_region(cr, parent, borrowing, &mut buf)) } else { None };
            match taken {
                Some(Ok(region)) => regions.push((cr.base, region)),
                _ => {
                    // Moved since the hold, its folios go where it is now (they once
                    // went nowhere: the child read zeros there).
                    let base = cr.at_fork();
                    for &(idx, c) in &cr.folios {
                        let (folio, len) = (base + idx * cr.folio_size, cr.folio_size);
                        // A folio the child has in part: its pages that are there.
                        let torn = !whole && !cr.ours(folio, len);
                        if torn && !(0..len).step_by(PAGE).any(|o| cr.ours(folio + o, PAGE)) {
                            continue;
                        }
                        let placed = parent.carried_bytes(&c, &mut buf).is_ok_and(|b| place(&cfg, &c, b, folio, len, torn.then_some(cr)));
                        if !placed {
                            for o in (0..len).step_by(if torn { PAGE } else { len }) {
                                if !torn || cr.ours(folio + o, PAGE) {
                                    lose_plain(folio + o, if torn { PAGE } else { len });
                                }
                            }
                        }
                    }
                }
            }
        }
        match rt.filter(|_| borrowing) {
            Some(rt) => rt.inner.shared.store.end_borrowing(),
            None => {
                for &(a, l) in &self.pool_maps {
                    // SAFETY: the child's copies of the parent's pool mappings, which
                    // nothing in the child uses once the records are taken over.
                    unsafe { libc::munmap(a as *mut _, l) };
                }
            }
        }
        // Borrowing from the file, the child keeps both until it exits or execs
        // (close-on-exec), which ends its loans. Else these copies go now: without a
        // runtime that ends the loan; with one, its keeper still holds a copy of each
        // (`borrowed_fds`) until the child exits or execs.
        if rt.is_none_or(|rt| rt.inner.shared.store.borrowed_from_file() == 0) {
            for fd in [self.parent_fd, self.done_wr].into_iter().flatten() {
                crate::fds::unregister(fd);
                // SAFETY: the parent's backing file (kept open for this) and our pipe's end.
                unsafe { libc::close(fd) };
            }
        }
        regions
    }
}

/// Decodes a carried record into the plain memory at `folio` (not registered with any
/// userfaultfd); false if it does not decode. A folio `torn` from its region is
/// placed on the pages still the region's.
fn place(cfg: &CodecConfig, c: &Carried, bytes: &[u8], folio: usize, len: usize, torn: Option<&CarriedRegion>) -> bool {
    if let Some(cr) = torn {
        // Decoded aside, and copied to the pages that are the region's.
        let mut data = vec![0u8; len];
        if decode_carried(cfg, c, bytes, &mut data).is_err() {
            return false;
        }
        for (o, page) in data.chunks(PAGE).enumerate() {
            let at = folio + o * PAGE;
            if cr.ours(at, PAGE) {
                // SAFETY: a page of the child's own writable mapping of a region it
                // inherited, mapped (just asked), which no userfaultfd serves and
                // nothing else uses while the child takes it over.
                unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), at as *mut u8, PAGE) };
            }
        }
        return true;
    }
    // SAFETY: the child's own writable mapping of a region it inherited, which no
    // userfaultfd serves and nothing else uses while the child takes it over.
    let out = unsafe { std::slice::from_raw_parts_mut(folio as *mut u8, len) };
    decode_carried(cfg, c, bytes, out).is_ok()
}

/// Whether every page of `[addr, addr + len)` is mapped.
fn all_mapped(addr: usize, len: usize) -> bool {
    // SAFETY: msync(MS_ASYNC) touches nothing; ENOMEM says a page is unmapped.
    unsafe { libc::msync(addr as *mut _, len, libc::MS_ASYNC) == 0 }
}

/// A carried folio the child touched before its runtime started (`inherit_region`):
/// the record decoded, and every byte the child's pages hold that is not zero laid
/// over it (a page it only read holds zeros; one it wrote, its writes over zeros),
/// written in place; false if the record does not decode. A write of zeros over the
/// parent's data cannot be told from no write: it is lost, which is why the parent
/// puts in place what it knows the child touches first.
fn merge_touched(cfg: &CodecConfig, c: &Carried, bytes: &[u8], folio: usize, len: usize) -> bool {
    let mut data = vec![0u8; len];
    if decode_carried(cfg, c, bytes, &mut data).is_err() {
        return false;
    }
    // SAFETY: the child's own mapping of a folio it inherited, not registered yet:
    // plain memory nothing else uses while the child takes it over.
    let now = unsafe { std::slice::from_raw_parts_mut(folio as *mut u8, len) };
    for (d, n) in data.iter_mut().zip(now.iter()) {
        if *n != 0 {
            *d = *n;
        }
    }
    now.copy_from_slice(&data);
    true
}

/// A folio whose record could not be read, in memory no userfaultfd serves: made
/// inaccessible (an access faults, never reads zeros) and said.
fn lose_plain(folio: usize, len: usize) {
    // SAFETY: PROT_NONE on the child's own folio, whose data is lost.
    if unsafe { libc::mprotect(folio as *mut _, len, libc::PROT_NONE) } != 0 {
        // Left readable it would read as whatever is there: never that.
        crate::fault::fatal(b"uzswap: fork: a folio whose record is lost could not be made inaccessible\n");
    }
    crate::fault::say_poisoned();
}

/// How each folio of an inherited region starts (`Runtime::install`).
pub(crate) struct Inheriting {
    pub id: u64,
    first: Vec<First>,
}

#[derive(Clone, Copy, PartialEq)]
enum First {
    /// As the pagemap says (present: RESIDENT, else EMPTY).
    Scan,
    /// Its record is in the store under its key: SWAPPED.
    Carried,
    /// Its record could not be read: POISONED.
    Lost,
}

impl Inheriting {
    /// Records the first state of folio `idx` of `r` (locked, EMPTY) if it is not the
    /// pagemap's to say; true if it did.
    pub(crate) fn first_state(&self, r: &RegionInner, idx: usize) -> bool {
        match self.first[idx] {
            First::Scan => false,
            First::Carried => {
                r.finish(idx, EMPTY, Transition::Carried, None);
                true
            }
            First::Lost => {
                let _ = crate::fault::place_poison(&r.shared, r.folio_addr(idx), r.folio_size, true);
                crate::fault::say_poisoned();
                r.finish(idx, EMPTY, Transition::Poisoned, None);
                true
            }
        }
    }
}

impl Runtime {
    /// Registers an inherited region in place, its carried folios borrowed (or
    /// imported) into this runtime's store (module comment). On error every carried folio is in place (or
    /// lost and inaccessible) and the range is plain memory again.
    fn inherit_region(&self, cr: &CarriedRegion, parent: &Store, borrowing: bool, buf: &mut [u8]) -> Result<Region, Error> {
        let sh = &self.inner.shared;
        let cfg = &sh.cfg.store.codec;
        let (base, fs) = (cr.base, cr.folio_size);
        // The parent's id: its keys, under which borrowed records are checked (the
        // child's own new regions take ids the parent never gave, from its copy of
        // the counter).
        let mut ih = Inheriting { id: cr.id, first: vec![First::Scan; cr.len / fs] };
        // In the order of the parent's backing file (pool records first): read-around
        // then serves a record's neighbours from the window it read.
        // Sorted by a small key (a stable sort of the records themselves was a tenth of
        // a take-over of 65,000 of them).
        let mut order: Vec<(u64, u32)> = cr.folios.iter().enumerate().map(|(i, (_, c))| (c.tier_offset().map_or(0, |o| o + 1), i as u32)).collect();
        order.sort_unstable();
        // Folios with a page present, from one walk of the pagemap (one read per folio
        // made a take-over of 384 MiB in 4 KiB folios 65,000 system calls).
        let mut present = vec![false; cr.len / fs];
        sh.page_runs(base, cr.len, crate::holds_data, |at, bytes| {
            present[(at - base) / fs..(at + bytes - base).div_ceil(fs)].fill(true);
            true
        });
        for &(_, i) in &order {
            let (idx, c) = cr.folios[i as usize];
            let folio = base + idx * fs;
            // A page there: the child touched the folio before its runtime was up (a
            // hole read as zeros, or written over zeros). Only what the parent named
            // (`touched_first`) should be; anything else is laid over the parent's data
            // here, its bytes that are not zero over the record, and said.
            if present[idx] {
                ih.first[idx] = match parent.carried_bytes(&c, buf) {
                    Ok(bytes) if merge_touched(cfg, &c, bytes, folio, fs) => First::Scan,
                    _ => First::Lost,
                };
                bump(&sh.stats.sizes[(fs.trailing_zeros() - 12) as usize].fork_touched);
                static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
                if !SAID.swap(true, Relaxed) {
                    crate::fault::say(b"uzswap: fork: the child touched memory carried to it swapped out before its runtime started; its writes were laid over the parent's data (see fork_touched; said once)\n");
                }
                continue;
            }
            // Borrowed, not copied (uzswap-store carry.rs "Loans"); one that cannot be
            // (a same-filled one: nothing to copy) is copied.
            if borrowing && sh.store.borrow(folio_key(ih.id, idx), &c).is_ok() {
                ih.first[idx] = First::Carried;
                continue;
            }
            ih.first[idx] = match parent.carried_bytes(&c, buf) {
                Err(_) => First::Lost,
                Ok(bytes) => match sh.store.import(folio_key(ih.id, idx), &c, bytes) {
                    Ok(()) => First::Carried,
                    Err(_) if place(cfg, &c, bytes, folio, fs, None) => First::Scan,
                    Err(_) => First::Lost,
                },
            };
        }
        // What the child shares with its parent (pages present at fork, copy-on-write)
        // stays in place: `install` records it `Shared` (module comment).
        // SAFETY: madvise on the child's own inherited mapping changes what its forks
        // copy. An adopted one is the program's, inherited as it chose.
        let kept_out = cr.adopted.is_some() || unsafe { libc::madvise(base as *mut _, cr.len, libc::MADV_DONTFORK) } == 0;
        let adopt = cr.adopted.map(|kind| (kind, || Some(())));
        let installed = if kept_out { self.install(base, cr.len, fs, adopt, Some(&ih)) } else { Err(os("madvise(MADV_DONTFORK)")) };
        installed.inspect_err(|_| {
            // Not registered: bring what was imported back in place.
            for (idx, first) in ih.first.iter().enumerate() {
                let folio = base + idx * fs;
                match first {
                    First::Carried => {
                        // SAFETY: as in `place`: the child's own unregistered mapping.
                        let out = unsafe { std::slice::from_raw_parts_mut(folio as *mut u8, fs) };
                        if !sh.store.load(folio_key(ih.id, idx), out).unwrap_or(false) {
                            lose_plain(folio, fs);
                        }
                    }
                    First::Lost => lose_plain(folio, fs),
                    First::Scan => {}
                }
            }
        })
    }
}

/// Whether a child forked now gets a copy of region `r` (MADV_DOFORK for a fork
/// hold, MADV_DONTFORK again after it); true if it is as asked. Adopted regions are
/// the program's own mappings and keep whatever the program chose. A failure is
/// counted and said once: nothing is lost, but a child then misses the memory, or
/// later children copy it.
fn set_inherited(sh: &Shared, r: &RegionInner, inherit: bool) -> bool {
    if r.adopted.is_some() {
        return true;
    }
    let advice = if inherit { libc::MADV_DOFORK } else { libc::MADV_DONTFORK };
    // On what the program still maps: a torn region's holes may be anything's now.
    let mut errno = 0;
    r.live_spans(|start, len| {
        // SAFETY: madvise on the region's own mapping changes only what fork copies.
        if unsafe { libc::madvise(start as *mut _, len, advice) } != 0 && errno == 0 {
            errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        }
    });
    if errno == 0 {
        return true;
    }
    if inherit {
        let then = b": a child forked now does not get that memory (said once; see ioctl_errors)\n";
        crate::fault::unexpected_once!(sh, r.order(), b"MADV_DOFORK (a region held for fork)", errno, then);
    } else {
        let then = b": later children get a copy of that region (said once; see ioctl_errors)\n";
        crate::fault::unexpected_once!(sh, r.order(), b"MADV_DONTFORK (a region after fork)", errno, then);
    }
    false
}

/// In a child that borrows its parent's pool records: moves into its own store the
/// lent records in mappings it keeps alone, at most `max_bytes` of them, and says how
/// many bytes moved. A lent pool record is in the child's copy of one of the parent's
/// pool mappings (a span); while the parent maps the same pages the two share them (the
/// child is charged half, by its PSS), but once the parent writes to or frees its span
/// (copy-on-write), the child's copy of those pages is the child's alone, charged in
/// full, and a lent record can never be written back: a child living on beside a
/// parent that rewrote its memory held the group at 2.4 times its budget, and the
/// group, seeing memory the child could not reclaim, squeezed the parent instead.
/// Moved (`Store::rehome`), the records go out to the file as any of the child's own,
/// and the mapping goes with the last of them. Every record of a mapping with a page
/// of the child's alone moves (the mapping goes only once all have); a mapping still
/// wholly shared stays lent: copies would cost the group more.
pub(crate) fn rehome_lent(sh: &Shared, max_bytes: usize) -> usize {
    if sh.store.borrowed() == sh.store.borrowed_from_file() {
        return 0;
    }
    use crate::{PM_EXCLUSIVE, PM_PRESENT};
    // Looked at once per mapping in a pass (many records share one).
    let mut looked: std::collections::HashMap<usize, bool> = std::collections::HashMap::new();
    let mut alone = |(base, len): (usize, usize)| {
        *looked.entry(base).or_insert_with(|| sh.any_page(base, len, |e| e & PM_PRESENT != 0 && e & PM_EXCLUSIVE != 0))
    };
    let regions = sh.regions.lock().clone();
    let mut moved = 0;
    for r in &regions {
        for idx in 0..r.folios() {
            let key = r.key(idx);
            let Some(mapping) = sh.store.lent_mapping_of(key) else { continue };
            if !alone(mapping) {
                continue;
            }
            let Some(state) = r.try_lock(idx) else { continue };
            // Looked at again under the folio lock: the entry may have gone meanwhile.
            let rehomed = sh.store.rehome(key);
            r.unlock(idx, state);
            match rehomed {
                Ok(Some(len)) => moved += len,
                Ok(None) => {}
                // No room (the pool full and no writeback): the loan stays as it was.
                Err(_) => return moved,
            }
            if moved >= max_bytes {
                return moved;
            }
        }
    }
    moved
}

/// Unlocks a folio a hold kept locked. A resident one goes back on the reclaimer's
/// lists: the reclaimer drops what it finds locked, and the access just used it.
pub(crate) fn unlock_held(r: &RegionInner, idx: usize, state: u8) {
    if mapped(state) {
        r.unlock_faulted_in(idx, state);
    } else {
        r.unlock(idx, state);
    }
}

/// In a forked child, before it starts a runtime of its own: forgets every trace of
/// the parent's runtime in the process-wide state (the region table, which the new
/// runtime's lookups and the SIGBUS handler read; the table's reader count, which a
/// thread of the parent may have held at fork; the stats file name; the descriptor
/// limit lowered below the parent's descriptors, which the new ones take). Nothing of
/// the parent's is freed or dropped: its threads are not here, and its memory is the
/// child's now. [`ForkHold::into_child`] calls it, after `fds::drop_in_child`.
fn forget_parent_in_child() {
    crate::fault::forget_regions_in_child();
    crate::forget_stats_file_in_child();
    crate::fds::unseal_in_child();
}

/// In a forked child between [`ForkHold::into_child`] and its runtime's start: the
/// parent's backing file and the loan pipe's write end, which the runtime's keeper
/// keeps (`Shared::own_fds`); -1 for none.
static BORROWED_FDS: [std::sync::atomic::AtomicI32; 2] = [const { std::sync::atomic::AtomicI32::new(-1) }; 2];

/// The descriptors a child borrowing records from its parent keeps (see
/// [`BORROWED_FDS`]).
pub(crate) fn borrowed_fds() -> impl Iterator<Item = RawFd> {
    BORROWED_FDS.iter().map(|f| f.load(Relaxed)).filter(|&fd| fd >= 0)
}
