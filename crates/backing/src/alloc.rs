//! The slot allocator: 4 KiB blocks grouped into clusters, as the kernel's swap
//! allocator groups page slots (mm/swapfile.c, "swap cluster order" since 6.12).
//!
//! A cluster is Free (on `free`, punched, owned by nobody), Nonfull or Full while it
//! holds extents, or Discarding between its last extent going away and the hole
//! punch that returns its disk space (the kernel's CLUSTER_FLAG_DISCARD): a
//! Discarding cluster is on no list, so nobody can write into it while the punch
//! runs outside the lock.
//!
//! A cluster takes the order (ceil log2 of the size in blocks) of the first extent
//! put into it and then serves only extents of that order, so small, short-lived
//! records do not pepper the clusters that whole 2 MiB folios need. An extent
//! goes, in order of preference, into a Nonfull cluster of its own order, into a
//! Free cluster, or (a counted *fallback*) into a hole of a cluster of another
//! order. Extents larger than a cluster take consecutive Free clusters.
//!
//! Two bitmaps describe the blocks: `used` (allocated) and `start` (first block of
//! an extent). Together they let `release` reject a slot that was never handed out
//! or is freed twice, instead of corrupting a neighbour's space.

use std::collections::BTreeSet;

/// The allocation unit: also the O_DIRECT alignment.
pub(crate) const BLOCK: u64 = 4096;

/// A run of blocks, in block numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Extent {
    pub start: u64,
    pub blocks: u64,
}

impl Extent {
    pub fn end(&self) -> u64 {
        self.start + self.blocks
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Nonfull,
    Full,
    Discarding,
}

#[derive(Clone, Copy, Debug)]
struct Cluster {
    used: u32,
    order: u8,
    state: State,
    /// Where the last allocation ended: the next first-fit search starts there, so a
    /// cluster being filled hands out consecutive blocks (one sequential write).
    hint: u32,
}

/// Cluster occupancy, for the stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterCounts {
    pub free: u64,
    pub nonfull: u64,
    pub full: u64,
    pub discarding: u64,
}

pub(crate) struct ClusterAllocator {
    cluster_blocks: u64,
    max_order: u8,
    clusters: Vec<Cluster>,
    used: Vec<u64>,
    start: Vec<u64>,
    free: BTreeSet<u32>,
    nonfull: Vec<BTreeSet<u32>>,
    used_blocks: u64,
}

/// The order of an extent of `blocks` blocks: ceil(log2), capped at the cluster's.
fn order_of(blocks: u64, max_order: u8) -> u8 {
    let order = 64 - (blocks.max(1) - 1).leading_zeros() as u8;
    order.min(max_order)
}

impl ClusterAllocator {
    /// `cluster_blocks` must be a power of two.
    pub fn new(clusters: u32, cluster_blocks: u64) -> Self {
        debug_assert!(cluster_blocks.is_power_of_two());
        let max_order = cluster_blocks.trailing_zeros() as u8;
        let words = (clusters as u64 * cluster_blocks).div_ceil(64) as usize;
        ClusterAllocator {
            cluster_blocks,
            max_order,
            clusters: vec![
                Cluster {
                    used: 0,
                    order: 0,
                    state: State::Free,
                    hint: 0
                };
                clusters as usize
            ],
            used: vec![0; words],
            start: vec![0; words],
            free: (0..clusters).collect(),
            nonfull: vec![BTreeSet::new(); max_order as usize + 1],
            used_blocks: 0,
        }
    }

    pub fn total_blocks(&self) -> u64 {
        self.clusters.len() as u64 * self.cluster_blocks
    }

    pub fn used_blocks(&self) -> u64 {
        self.used_blocks
    }

    pub fn counts(&self) -> ClusterCounts {
        let mut c = ClusterCounts::default();
        for cl in &self.clusters {
            match cl.state {
                State::Free => c.free += 1,
                State::Nonfull => c.nonfull += 1,
                State::Full => c.full += 1,
                State::Discarding => c.discarding += 1,
            }
        }
        c
    }

    fn is_used(&self, block: u64) -> bool {
        self.used[(block / 64) as usize] & (1 << (block % 64)) != 0
    }

    fn is_start(&self, block: u64) -> bool {
        self.start[(block / 64) as usize] & (1 << (block % 64)) != 0
    }

    /// First run of `n` free blocks in `[from, to)`, skipping whole words at a time.
    fn find_free_run(&self, from: u64, to: u64, n: u64) -> Option<u64> {
        let (mut b, mut run_start, mut run) = (from, from, 0u64);
        while b < to {
            if b % 64 == 0 && b + 64 <= to {
                let word = self.used[(b / 64) as usize];
                if word == u64::MAX {
                    b += 64;
                    run = 0;
                    run_start = b;
                    continue;
                }
                if word == 0 {
                    if run == 0 {
                        run_start = b;
                    }
                    run += 64;
                    b += 64;
                    if run >= n {
                        return Some(run_start);
                    }
                    continue;
                }
            }
            if self.is_used(b) {
                run = 0;
                run_start = b + 1;
            } else {
                if run == 0 {
                    run_start = b;
                }
                run += 1;
                if run >= n {
                    return Some(run_start);
                }
            }
            b += 1;
        }
        None
    }

    fn find_in_cluster(&self, c: u32, n: u64) -> Option<u64> {
        let base = c as u64 * self.cluster_blocks;
        let end = base + self.cluster_blocks;
        let hint = base + self.clusters[c as usize].hint as u64;
        self.find_free_run(hint, end, n)
            .or_else(|| self.find_free_run(base, end, n))
    }

    /// Allocates `n` contiguous blocks. Returns the extent and whether it was a
    /// fallback (placed in a cluster of another order), or None if no run of `n`
    /// free blocks exists.
    pub fn alloc(&mut self, n: u64) -> Option<(Extent, bool)> {
        if n == 0 || n > self.total_blocks() {
            return None;
        }
        if n > self.cluster_blocks {
            return self.alloc_span(n).map(|e| (e, false));
        }
        let order = order_of(n, self.max_order);
        let own = self.nonfull[order as usize]
            .iter()
            .find_map(|&c| self.find_in_cluster(c, n));
        if let Some(start) = own {
            return Some((self.take(start, n, order), false));
        }
        if let Some(&c) = self.free.iter().next() {
            let start = c as u64 * self.cluster_blocks;
            return Some((self.take(start, n, order), false));
        }
        // Fragmented: borrow a hole from clusters of other orders, largest first
        // (their holes are the likeliest to fit).
        for other in (0..=self.max_order).rev().filter(|&o| o != order) {
            let found = self.nonfull[other as usize]
                .iter()
                .find_map(|&c| self.find_in_cluster(c, n));
            if let Some(start) = found {
                return Some((self.take(start, n, other), true));
            }
        }
        None
    }

    /// An extent larger than a cluster: consecutive Free clusters.
    fn alloc_span(&mut self, n: u64) -> Option<Extent> {
        let want = n.div_ceil(self.cluster_blocks) as u32;
        let (mut first, mut len) = (0u32, 0u32);
        for &c in &self.free {
            if len > 0 && c == first + len {
                len += 1;
            } else {
                first = c;
                len = 1;
            }
            if len == want {
                let start = first as u64 * self.cluster_blocks;
                let ext = self.take(start, n, self.max_order);
                // The last cluster's free tail serves the largest order that fits it.
                let last = first + want - 1;
                let cl = self.clusters[last as usize];
                if cl.state == State::Nonfull {
                    let tail = self.cluster_blocks - cl.used as u64;
                    let order = (63 - tail.leading_zeros()) as u8;
                    self.nonfull[cl.order as usize].remove(&last);
                    self.nonfull[order as usize].insert(last);
                    self.clusters[last as usize].order = order;
                }
                return Some(ext);
            }
        }
        None
    }

    /// Marks `[start, start+n)` used; `order` is given to clusters that were Free.
    fn take(&mut self, start: u64, n: u64, order: u8) -> Extent {
        let ext = Extent { start, blocks: n };
        for b in start..ext.end() {
            self.used[(b / 64) as usize] |= 1 << (b % 64);
        }
        self.start[(start / 64) as usize] |= 1 << (start % 64);
        self.used_blocks += n;
        self.for_each_cluster(ext, |this, c, overlap, last_block| {
            let cl = &mut this.clusters[c as usize];
            if cl.state == State::Free {
                this.free.remove(&c);
                cl.order = order;
                cl.state = State::Nonfull;
                this.nonfull[order as usize].insert(c);
            }
            debug_assert!(cl.state != State::Discarding);
            cl.used += overlap as u32;
            cl.hint = (last_block % this.cluster_blocks) as u32;
            if cl.used as u64 == this.cluster_blocks {
                cl.state = State::Full;
                this.nonfull[cl.order as usize].remove(&c);
            }
        });
        ext
    }

    /// Calls `f(self, cluster, blocks of ext in it, end of ext in it)` per cluster.
    fn for_each_cluster(&mut self, ext: Extent, mut f: impl FnMut(&mut Self, u32, u64, u64)) {
        let mut b = ext.start;
        while b < ext.end() {
            let c = b / self.cluster_blocks;
            let cluster_end = (c + 1) * self.cluster_blocks;
            let end = cluster_end.min(ext.end());
            f(self, c as u32, end - b, end);
            b = end;
        }
    }

    /// Whether `ext` is exactly one live extent as handed out by `alloc`.
    pub fn check(&self, ext: Extent) -> Result<(), &'static str> {
        if ext.blocks == 0 || ext.end() > self.total_blocks() {
            return Err("outside the backing file");
        }
        if !self.is_start(ext.start) {
            return Err("no record starts there (never written, or already freed)");
        }
        for b in ext.start..ext.end() {
            if !self.is_used(b) {
                return Err("part of it is free (already freed?)");
            }
            if b != ext.start && self.is_start(b) {
                return Err("it overlaps the next record (wrong length)");
            }
        }
        if ext.end() < self.total_blocks() && self.is_used(ext.end()) && !self.is_start(ext.end()) {
            return Err("the record continues past it (wrong length)");
        }
        Ok(())
    }

    /// Clusters that releasing `ext` would certainly empty now (for callers that
    /// punch the rest of a large extent before releasing it).
    pub fn clusters_emptied_by(&mut self, ext: Extent) -> Vec<u32> {
        let mut out = Vec::new();
        self.for_each_cluster(ext, |this, c, overlap, _| {
            if this.clusters[c as usize].used as u64 == overlap {
                out.push(c);
            }
        });
        out
    }

    /// Frees a live extent. Returns the clusters it left empty: they are now
    /// Discarding, and the caller hands each back with `discarded` once punched.
    pub fn release(&mut self, ext: Extent) -> Result<Vec<u32>, &'static str> {
        self.check(ext)?;
        for b in ext.start..ext.end() {
            self.used[(b / 64) as usize] &= !(1 << (b % 64));
        }
        self.start[(ext.start / 64) as usize] &= !(1 << (ext.start % 64));
        self.used_blocks -= ext.blocks;
        let mut emptied = Vec::new();
        self.for_each_cluster(ext, |this, c, overlap, _| {
            let cl = &mut this.clusters[c as usize];
            cl.used -= overlap as u32;
            if cl.used == 0 {
                this.nonfull[cl.order as usize].remove(&c);
                cl.state = State::Discarding;
                emptied.push(c);
            } else if cl.state == State::Full {
                cl.state = State::Nonfull;
                this.nonfull[cl.order as usize].insert(c);
            }
        });
        Ok(emptied)
    }

    /// A Discarding cluster's space has been given back: it is Free again.
    pub fn discarded(&mut self, c: u32) {
        let cl = &mut self.clusters[c as usize];
        debug_assert_eq!(cl.state, State::Discarding);
        if cl.state == State::Discarding {
            cl.state = State::Free;
            cl.hint = 0;
            self.free.insert(c);
        }
    }

    /// Recomputes everything from the bitmaps; panics on any disagreement (tests).
    #[cfg(test)]
    pub fn assert_consistent(&self) {
        let mut total = 0;
        for (i, cl) in self.clusters.iter().enumerate() {
            let base = i as u64 * self.cluster_blocks;
            let used = (base..base + self.cluster_blocks)
                .filter(|&b| self.is_used(b))
                .count();
            assert_eq!(used as u32, cl.used, "cluster {i} used count");
            total += used as u64;
            let c = i as u32;
            match cl.state {
                State::Free => {
                    assert_eq!(cl.used, 0);
                    assert!(self.free.contains(&c));
                }
                State::Discarding => assert_eq!(cl.used, 0),
                State::Nonfull => {
                    assert!(cl.used > 0 && (cl.used as u64) < self.cluster_blocks);
                    assert!(self.nonfull[cl.order as usize].contains(&c));
                }
                State::Full => assert_eq!(cl.used as u64, self.cluster_blocks),
            }
            if cl.state != State::Free {
                assert!(!self.free.contains(&c));
            }
            for (o, list) in self.nonfull.iter().enumerate() {
                if list.contains(&c) {
                    assert_eq!((cl.state, cl.order as usize), (State::Nonfull, o));
                }
            }
        }
        assert_eq!(total, self.used_blocks);
        for b in 0..self.total_blocks() {
            if self.is_start(b) {
                assert!(self.is_used(b), "start bit on a free block {b}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders() {
        assert_eq!(order_of(1, 9), 0);
        assert_eq!(order_of(2, 9), 1);
        assert_eq!(order_of(3, 9), 2);
        assert_eq!(order_of(512, 9), 9);
        assert_eq!(order_of(4000, 9), 9);
    }

    #[test]
    fn consecutive_allocations_are_contiguous() {
        let mut a = ClusterAllocator::new(4, 512);
        let (e1, _) = a.alloc(16).unwrap();
        let (e2, _) = a.alloc(16).unwrap();
        assert_eq!(e1.end(), e2.start);
        // Another order gets its own cluster.
        let (e3, fb) = a.alloc(1).unwrap();
        assert!(!fb);
        assert_eq!(e3.start, 512);
        a.assert_consistent();
    }

    #[test]
    fn spans_take_consecutive_free_clusters() {
        let mut a = ClusterAllocator::new(6, 512);
        let (small, _) = a.alloc(1).unwrap(); // cluster 0
        let (big, _) = a.alloc(1300).unwrap(); // clusters 1..=3
        assert_eq!(big.start, 512);
        a.assert_consistent();
        // The 236-block tail of cluster 3 serves order 7 (up to 128 blocks).
        let (tail, fb) = a.alloc(100).unwrap();
        assert!(!fb);
        assert_eq!(tail.start, big.end());
        assert!(a.alloc(1100).is_none(), "only clusters 4..=5 are free");
        assert_eq!(a.release(big).unwrap(), vec![1, 2]);
        a.discarded(1);
        a.discarded(2);
        a.release(small).unwrap();
        a.assert_consistent();
    }

    #[test]
    fn release_rejects_bad_extents() {
        let mut a = ClusterAllocator::new(2, 512);
        let (e, _) = a.alloc(8).unwrap();
        let (f, _) = a.alloc(8).unwrap();
        assert!(a
            .release(Extent {
                start: e.start + 1,
                blocks: 7
            })
            .is_err());
        assert!(a
            .release(Extent {
                start: e.start,
                blocks: 9
            })
            .is_err());
        assert!(a
            .release(Extent {
                start: e.start,
                blocks: 7
            })
            .is_err());
        assert!(a
            .release(Extent {
                start: 2000,
                blocks: 1
            })
            .is_err());
        assert!(a.release(e).unwrap().is_empty());
        assert!(a.release(e).is_err(), "double free");
        assert_eq!(a.release(f).unwrap(), vec![0]);
        a.discarded(0);
        a.assert_consistent();
        assert_eq!(a.used_blocks(), 0);
    }

    #[test]
    fn fragmentation_falls_back_then_fails() {
        let mut a = ClusterAllocator::new(2, 64);
        // Fill cluster 0 with order-0 blocks and cluster 1 with order-2 extents.
        let singles: Vec<_> = (0..64).map(|_| a.alloc(1).unwrap().0).collect();
        let quads: Vec<_> = (0..16).map(|_| a.alloc(4).unwrap().0).collect();
        assert_eq!(a.counts().full, 2);
        // Free every other single: holes of one block in an order-0 cluster.
        for e in singles.iter().step_by(2) {
            a.release(*e).unwrap();
        }
        a.release(quads[3]).unwrap();
        // An order-0 extent finds its own cluster; a 2-block one borrows the quad hole.
        assert!(!a.alloc(1).unwrap().1);
        let (e, fb) = a.alloc(2).unwrap();
        assert!(fb);
        assert_eq!(e.start, quads[3].start);
        assert!(a.alloc(4).is_none(), "free space exists but no run of four");
        a.assert_consistent();
    }
}
