//! The store's LRU: entries in the order they were stored, oldest first, so that
//! writeback takes the coldest (zswap's list_lru). Raw entries are on it too (seed
//! 001): an incompressible folio must still leave in LRU order.
//!
//! Nodes live in a slab indexed by `u32` so an entry needs 4 bytes to find its node
//! and a node costs 16 bytes, with no allocation per entry once the slab has grown.
//! Free nodes are chained through their `next`, so freeing one never allocates, and
//! the slab grows only through `Lru::grow` with a vector the caller allocated
//! outside the lock: no operation under the lock calls the allocator, because a
//! signal handler may wait for this lock while its thread holds the malloc lock.
//! The list is not thread-safe by itself: the store keeps it under one mutex, taken
//! once per store and once per load, as zswap takes its list_lru lock.
//!
//! A node can be *taken*: off the list but still allocated, so its id is not reused.
//! Writeback takes the coldest nodes while it writes their entries out, and a load
//! takes its entry's node while it decodes. A taken node records who holds it
//! (`Holder`, kept in its `next` link, unused while off the list), and that holder
//! owns the entry's pool object; a load that finds its node held by writeback joins
//! it instead of waiting (see the store's design comment for the hand-over).
//!
//! A node can also be *buried*: its pool object is to be freed, but the one who
//! finished with it may not free (a load on a signal handler's path). Buried nodes
//! are chained through `next`, their `key` holds the pool handle, and the store's
//! `reap` frees both later. Burying allocates nothing; freeing a node may (the free
//! list grows), so only `reap` and writeback free nodes.

const NIL: u32 = u32::MAX;

pub(crate) struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

/// `prev` of a taken node: not on the list; `next` holds its [`Holder`].
const TAKEN: u32 = u32::MAX - 1;
/// `prev` of a buried node: `next` links the buried list, `key` is the pool handle.
const BURIED: u32 = u32::MAX - 2;
/// `prev` of a free node: `next` links the free list.
const FREE: u32 = u32::MAX - 3;

/// Who holds a taken node, and so its entry's pool object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Holder {
    /// A load (or invalidate), alone.
    Loader = 0,
    /// Writeback, writing the object out.
    Writeback = 1,
    /// Writeback, with a load reading the object alongside: writeback leaves the
    /// object to the load.
    WritebackPinned = 2,
    /// Writeback, after a load alongside erased the entry: writeback frees the object
    /// and the slot it wrote, and does not publish the file entry.
    WritebackErased = 3,
    /// A load, whose entry writeback moved to the file meanwhile: the object is the
    /// load's to bury when it is done with it.
    Orphan = 4,
}

impl Holder {
    fn from_link(link: u32) -> Holder {
        match link {
            0 => Holder::Loader,
            1 => Holder::Writeback,
            2 => Holder::WritebackPinned,
            3 => Holder::WritebackErased,
            4 => Holder::Orphan,
            _ => unreachable!("not a holder: {link}"),
        }
    }
}

pub(crate) struct Lru {
    nodes: Vec<Node>,
    /// Free nodes, chained through `next` (NIL: none).
    free: u32,
    /// Coldest node.
    head: Option<u32>,
    /// Newest node.
    tail: Option<u32>,
    len: usize,
    /// Buried nodes, chained through `next` (NIL: none).
    buried: u32,
}

impl Default for Lru {
    fn default() -> Self {
        Lru { nodes: Vec::new(), free: NIL, head: None, tail: None, len: 0, buried: NIL }
    }
}

impl Lru {
    /// Adds `key` as the newest entry; returns its node id. Grows the slab if it must
    /// (tests; the store makes room first with `grow`, outside the lock).
    #[cfg(test)]
    pub(crate) fn push(&mut self, key: u64) -> u32 {
        if let Some(more) = self.wants_room() {
            self.grow(Vec::with_capacity(more));
        }
        let id = self.push_taken(key).expect("room was made");
        self.put_back(id, true);
        id
    }

    /// A node for `key`, taken (by a loader: the store publishing it), not on the
    /// list yet; `None` if the slab is full (see `wants_room`). Never allocates.
    pub(crate) fn push_taken(&mut self, key: u64) -> Option<u32> {
        let node = Node { key, prev: TAKEN, next: Holder::Loader as u32 };
        if self.free != NIL {
            let id = self.free;
            self.free = self.nodes[id as usize].next;
            self.nodes[id as usize] = node;
            return Some(id);
        }
        if self.nodes.len() == self.nodes.capacity() {
            return None;
        }
        self.nodes.push(node);
        Some(u32::try_from(self.nodes.len() - 1).expect("fewer than 2^32 LRU entries"))
    }

    /// If the next `push_taken` would find no room: the capacity to allocate.
    pub(crate) fn wants_room(&self) -> Option<usize> {
        (self.free == NIL && self.nodes.len() == self.nodes.capacity()).then(|| (self.nodes.capacity() * 2).max(64))
    }

    /// Moves the slab into `bigger` (allocated by the caller outside the lock) if that
    /// makes room; returns the vector to drop, again outside the lock. Never allocates.
    pub(crate) fn grow(&mut self, mut bigger: Vec<Node>) -> Vec<Node> {
        if bigger.capacity() <= self.nodes.len() || self.wants_room().is_none() {
            return bigger;
        }
        bigger.clear();
        bigger.append(&mut self.nodes);
        std::mem::replace(&mut self.nodes, bigger)
    }

    /// Takes node `id` off the list for a load, keeping it allocated; returns its key.
    pub(crate) fn take(&mut self, id: u32) -> u64 {
        self.take_for(id, Holder::Loader)
    }

    fn take_for(&mut self, id: u32, holder: Holder) -> u64 {
        let Node { key, prev, next } = self.nodes[id as usize];
        debug_assert!(prev != TAKEN, "node {id} taken twice");
        match prev {
            NIL => self.head = (next != NIL).then_some(next),
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = (prev != NIL).then_some(prev),
            n => self.nodes[n as usize].prev = prev,
        }
        self.nodes[id as usize].prev = TAKEN;
        self.nodes[id as usize].next = holder as u32;
        self.len -= 1;
        key
    }

    /// Who holds taken node `id`.
    pub(crate) fn holder(&self, id: u32) -> Holder {
        debug_assert!(self.is_taken(id));
        Holder::from_link(self.nodes[id as usize].next)
    }

    /// Hands taken node `id` to `holder`.
    pub(crate) fn set_holder(&mut self, id: u32, holder: Holder) {
        debug_assert!(self.is_taken(id));
        self.nodes[id as usize].next = holder as u32;
    }

    /// Buries taken node `id`: `handle`'s pool object and the node wait for
    /// `unbury`. Allocates nothing.
    pub(crate) fn bury(&mut self, id: u32, handle: u64) {
        debug_assert!(self.is_taken(id));
        let node = &mut self.nodes[id as usize];
        *node = Node { key: handle, prev: BURIED, next: self.buried };
        self.buried = id;
    }

    /// A buried node and its pool handle, taken off the buried list; the caller frees
    /// the object, then the node (`free`).
    pub(crate) fn unbury(&mut self) -> Option<(u32, u64)> {
        let id = (self.buried != NIL).then_some(self.buried)?;
        let node = &mut self.nodes[id as usize];
        debug_assert_eq!(node.prev, BURIED);
        self.buried = node.next;
        node.prev = TAKEN;
        Some((id, node.key))
    }

    pub(crate) fn is_taken(&self, id: u32) -> bool {
        self.nodes[id as usize].prev == TAKEN
    }

    /// The node after `id` towards the newest, if any (`id` on the list).
    pub(crate) fn newer(&self, id: u32) -> Option<u32> {
        debug_assert!(!matches!(self.nodes[id as usize].prev, TAKEN | BURIED | FREE));
        let next = self.nodes[id as usize].next;
        (next != NIL).then_some(next)
    }

    /// The key of node `id` (on the list).
    pub(crate) fn key(&self, id: u32) -> u64 {
        self.nodes[id as usize].key
    }

    /// Takes node `id` (on the list) for writeback, wherever it is: the store's recut
    /// holds nodes as writeback does.
    pub(crate) fn take_for_writeback(&mut self, id: u32) -> u64 {
        self.take_for(id, Holder::Writeback)
    }

    /// Takes the coldest node for writeback, if any: (node id, key).
    pub(crate) fn take_coldest(&mut self) -> Option<(u32, u64)> {
        let id = self.head?;
        Some((id, self.take_for(id, Holder::Writeback)))
    }

    /// Puts a taken node back on the list, as the coldest entry (a failed writeback
    /// keeps its place) or as the newest (its folio was just used).
    pub(crate) fn put_back(&mut self, id: u32, newest: bool) {
        debug_assert!(self.is_taken(id));
        let first = if newest { self.tail } else { self.head };
        let node = &mut self.nodes[id as usize];
        if newest {
            node.prev = first.unwrap_or(NIL);
            node.next = NIL;
            match first {
                Some(t) => self.nodes[t as usize].next = id,
                None => self.head = Some(id),
            }
            self.tail = Some(id);
        } else {
            node.prev = NIL;
            node.next = first.unwrap_or(NIL);
            match first {
                Some(h) => self.nodes[h as usize].prev = id,
                None => self.tail = Some(id),
            }
            self.head = Some(id);
        }
        self.len += 1;
    }

    /// Frees a taken node. Never allocates.
    pub(crate) fn free(&mut self, id: u32) {
        debug_assert!(self.is_taken(id));
        self.nodes[id as usize] = Node { key: 0, prev: FREE, next: self.free };
        self.free = id;
    }

    /// The coldest entry, if any: (node id, key).
    pub(crate) fn coldest(&self) -> Option<(u32, u64)> {
        self.head.map(|h| (h, self.nodes[h as usize].key))
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes the list holds (its slab).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    #[test]
    fn matches_a_deque_model() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        let mut lru = Lru::default();
        let mut model: VecDeque<(u32, u64)> = VecDeque::new();
        for key in 0..20_000u64 {
            if rng.gen_bool(0.55) || model.is_empty() {
                model.push_back((lru.push(key), key));
            } else {
                let (id, k) = model.remove(rng.gen_range(0..model.len())).unwrap();
                assert_eq!(lru.take(id), k);
                lru.free(id);
            }
            assert_eq!(lru.len(), model.len());
            assert_eq!(lru.coldest(), model.front().copied());
        }
        while let Some((id, k)) = lru.coldest() {
            assert_eq!(model.pop_front(), Some((id, k)));
            lru.take(id);
            lru.free(id);
        }
        assert!(model.is_empty());
    }

    #[test]
    fn taken_nodes_keep_their_ids_until_freed() {
        let mut lru = Lru::default();
        let ids: Vec<u32> = (0..4).map(|k| lru.push(k)).collect();
        assert_eq!(lru.take_coldest(), Some((ids[0], 0)));
        assert_eq!(lru.take(ids[2]), 2);
        assert!(lru.is_taken(ids[0]) && lru.is_taken(ids[2]) && !lru.is_taken(ids[1]));
        assert_eq!(lru.len(), 2);
        let fresh = lru.push(9);
        assert!(!ids.contains(&fresh), "a taken id is not reused");
        lru.put_back(ids[0], false);
        assert_eq!(lru.coldest(), Some((ids[0], 0)));
        lru.free(ids[2]);
        assert_eq!(lru.push(10), ids[2], "a freed id is reused");
        let order: Vec<u64> = std::iter::from_fn(|| lru.take_coldest().map(|(_, k)| k)).collect();
        assert_eq!(order, vec![0, 1, 3, 9, 10]);
    }

    #[test]
    fn buried_nodes_keep_their_ids_until_unburied_and_freed() {
        let mut lru = Lru::default();
        let ids: Vec<u32> = (0..4).map(|k| lru.push(k)).collect();
        let (cold, _) = lru.take_coldest().unwrap();
        assert_eq!(lru.holder(cold), Holder::Writeback);
        lru.set_holder(cold, Holder::WritebackPinned);
        assert_eq!(lru.holder(cold), Holder::WritebackPinned);
        lru.take(ids[2]);
        assert_eq!(lru.holder(ids[2]), Holder::Loader);
        lru.bury(ids[2], 0xAB);
        lru.bury(cold, 0xCD);
        assert_eq!(lru.len(), 2);
        let fresh = lru.push(9);
        assert!(!ids.contains(&fresh), "a buried id is not reused");
        let mut unburied = Vec::new();
        while let Some((id, handle)) = lru.unbury() {
            unburied.push((id, handle));
            lru.free(id);
        }
        unburied.sort();
        assert_eq!(unburied, vec![(cold, 0xCD), (ids[2], 0xAB)]);
        assert_eq!(lru.unbury(), None);
        let order: Vec<u64> = std::iter::from_fn(|| lru.take_coldest().map(|(_, k)| k)).collect();
        assert_eq!(order, vec![1, 3, 9]);
    }
}
