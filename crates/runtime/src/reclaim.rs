//! The reclaimer: our kswapd. One thread per runtime.
//!
//! Woken when usage (resident + pool) passes the high watermark, it works until usage is
//! under the low one. Candidates are resident folios in fault-in order (oldest first,
//! from a per-folio stamp). Two policies:
//! - `Fifo`: compress the oldest folio at once.
//! - `Probation` (default; the kernel's active/inactive lists in small): move the oldest
//!   folio's pages to the shadow (UFFDIO_MOVE, out of the program's view but still
//!   uncompressed) and append it to a probation queue; compress from the head of that
//!   queue once it holds `probation_percent` of the budget. A touch on a folio in
//!   probation faults it back with one MOVE (no decompression) and gives it a fresh
//!   stamp, so a hot set that is resident but never faults is still seen to be hot.
//!
//! The evict race (a write landing between copy and discard) cannot happen: the pages
//! are moved, not copied, so a concurrent access faults and waits on the folio lock.

use crate::fault::move_back;
use crate::region::*;
use crate::stats::bump;
use crate::uffd::Partial;
use crate::{ReclaimPolicy, Shared};
use std::collections::VecDeque;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Candidates gathered per scan of the regions.
const BATCH: usize = 4096;

struct Candidate {
    region: Arc<RegionInner>,
    idx: usize,
    stamp: u64,
}

pub(crate) fn reclaim_loop(sh: Arc<Shared>) {
    let mut candidates: VecDeque<Candidate> = VecDeque::new();
    let mut probation: VecDeque<Candidate> = VecDeque::new();
    let mut last_stats = Instant::now() - Duration::from_secs(10);
    let mut fds = [libc::pollfd { fd: sh.reclaim_fd, events: libc::POLLIN, revents: 0 }, libc::pollfd {
        fd: sh.stop_fd,
        events: libc::POLLIN,
        revents: 0,
    }];
    while !sh.stopping() {
        // SAFETY: valid pollfds; the eventfd is drained so it can be kicked again.
        unsafe {
            libc::poll(fds.as_mut_ptr(), 2, 5);
            let mut v = 0u64;
            libc::read(sh.reclaim_fd, (&mut v as *mut u64).cast(), 8);
        }
        if sh.stopping() {
            break;
        }
        if last_stats.elapsed() >= Duration::from_secs(1) {
            sh.publish_stats();
            last_stats = Instant::now();
        }
        if sh.refresh_usage() <= sh.high_watermark() {
            continue;
        }
        while sh.refresh_usage() > sh.low_watermark() && !sh.stopping() {
            let progressed = match sh.cfg.policy {
                ReclaimPolicy::Fifo => match next(&sh, &mut candidates) {
                    Some(c) => {
                        evict_resident(&sh, &c);
                        true
                    }
                    None => false,
                },
                ReclaimPolicy::Probation => {
                    let want_more = sh.probation.load(Relaxed) < sh.probation_target();
                    match (want_more, probation.is_empty()) {
                        (true, _) | (false, true) => match next(&sh, &mut candidates) {
                            Some(c) => {
                                if let Some(p) = to_probation(&sh, c) {
                                    probation.push_back(p);
                                }
                                true
                            }
                            None => match probation.pop_front() {
                                Some(p) => {
                                    evict_probation(&sh, &p);
                                    true
                                }
                                None => false,
                            },
                        },
                        (false, false) => {
                            let p = probation.pop_front().expect("checked non-empty");
                            evict_probation(&sh, &p);
                            true
                        }
                    }
                }
            };
            if !progressed {
                break;
            }
        }
        // Entries whose region is gone would keep it alive; drop them.
        probation.retain(|p| p.region.states[p.idx].load(Relaxed) != UNMAPPED);
    }
}

/// The next-oldest resident folio, rescanning the regions when the batch runs out.
fn next(sh: &Shared, candidates: &mut VecDeque<Candidate>) -> Option<Candidate> {
    loop {
        while let Some(c) = candidates.pop_front() {
            let s = c.region.states[c.idx].load(Relaxed);
            if s == RESIDENT && c.region.stamps[c.idx].load(Relaxed) == c.stamp {
                return Some(c);
            }
        }
        let regions: Vec<Arc<RegionInner>> = sh.regions.lock().clone();
        let mut all: Vec<Candidate> = Vec::new();
        for r in &regions {
            for idx in 0..r.folios() {
                if r.states[idx].load(Relaxed) == RESIDENT {
                    all.push(Candidate { region: r.clone(), idx, stamp: r.stamps[idx].load(Relaxed) });
                }
            }
        }
        if all.is_empty() {
            return None;
        }
        if all.len() > BATCH {
            all.select_nth_unstable_by_key(BATCH, |c| c.stamp);
            all.truncate(BATCH);
        }
        all.sort_unstable_by_key(|c| c.stamp);
        candidates.extend(all);
    }
}

/// Moves a locked resident folio's pages to the shadow. On failure (a pinned page) puts
/// back whatever moved and returns false.
fn take_out(sh: &Shared, r: &RegionInner, idx: usize) -> bool {
    let (src, dst, fs) = (r.folio_addr(idx), r.shadow_addr(idx), r.folio_size);
    let mut off = 0;
    let mut tries = 0;
    while off < fs {
        match sh.staging.move_pages(dst + off, src + off, fs - off) {
            Partial::Done => return true,
            Partial::Failed { done, .. } if done > 0 => off += done,
            Partial::Failed { errno: libc::EAGAIN, .. } if tries < 100 => {
                tries += 1;
                std::thread::yield_now();
            }
            Partial::Failed { errno, .. } => {
                // The region vma may be gone (munmap under us): then there is nothing to put back.
                if errno != libc::ENOENT && errno != libc::EINVAL {
                    let _ = move_back(sh, src, dst, off, true);
                }
                return false;
            }
        }
    }
    true
}

/// Compresses a folio whose pages sit in the shadow and frees them. On failure moves
/// the pages back. Returns the state to unlock with.
fn compress_out(sh: &Shared, r: &RegionInner, idx: usize) -> u8 {
    let fs = r.folio_size;
    let shadow = r.shadow_addr(idx);
    let st = &sh.stats.sizes[r.order()];
    // SAFETY: the shadow range is ours and holds the folio's pages (holes read as zeros).
    let data = unsafe { std::slice::from_raw_parts(shadow as *const u8, fs) };
    match sh.store.store(r.key(idx), data) {
        Ok(()) => {
            // SAFETY: our shadow range; the staging context has no REMOVE events.
            unsafe { libc::madvise(shadow as *mut _, fs, libc::MADV_DONTNEED) };
            bump(&st.zswpout);
            st.stored.fetch_add(1, Relaxed);
            sh.resident.fetch_sub(fs as u64, Relaxed);
            SWAPPED
        }
        Err(_) => {
            bump(&st.reject_reclaim_fail);
            let _ = move_back(sh, r.folio_addr(idx), shadow, fs, true);
            RESIDENT
        }
    }
}

fn evict_resident(sh: &Shared, c: &Candidate) {
    let r = &*c.region;
    match r.try_lock(c.idx) {
        Some(RESIDENT) => {}
        Some(other) => return r.unlock(c.idx, other),
        None => return,
    }
    let next = if take_out(sh, r, c.idx) {
        compress_out(sh, r, c.idx)
    } else {
        bump(&sh.stats.sizes[r.order()].reject_reclaim_fail);
        RESIDENT
    };
    r.unlock(c.idx, next);
}

fn to_probation(sh: &Shared, c: Candidate) -> Option<Candidate> {
    let r = &*c.region;
    match r.try_lock(c.idx) {
        Some(RESIDENT) => {}
        Some(other) => {
            r.unlock(c.idx, other);
            return None;
        }
        None => return None,
    }
    if !take_out(sh, r, c.idx) {
        bump(&sh.stats.sizes[r.order()].reject_reclaim_fail);
        r.unlock(c.idx, RESIDENT);
        return None;
    }
    bump(&sh.stats.sizes[r.order()].probation_out);
    sh.probation.fetch_add(r.folio_size as u64, Relaxed);
    let stamp = r.stamps[c.idx].load(Relaxed);
    r.unlock(c.idx, PROBATION);
    Some(Candidate { stamp, ..c })
}

fn evict_probation(sh: &Shared, p: &Candidate) {
    let r = &*p.region;
    match r.try_lock(p.idx) {
        // Still on probation since we put it there: nobody touched it.
        Some(PROBATION) if r.stamps[p.idx].load(Relaxed) == p.stamp => {
            sh.probation.fetch_sub(r.folio_size as u64, Relaxed);
            let next = compress_out(sh, r, p.idx);
            r.unlock(p.idx, next);
        }
        Some(s) => r.unlock(p.idx, s),
        None => {}
    }
}
