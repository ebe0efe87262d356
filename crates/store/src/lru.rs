//! The store's LRU: entries in the order they were stored, oldest first, so that
//! writeback takes the coldest (zswap's list_lru). Raw entries are on it too (seed
//! 001): an incompressible folio must still leave in LRU order.
//!
//! Nodes live in a slab indexed by `u32` so an entry needs 4 bytes to find its node
//! and a node costs 16 bytes, with no allocation per entry once the slab has grown.
//! The list is not thread-safe by itself: the store keeps it under one mutex, taken
//! once per store and once per load, as zswap takes its list_lru lock.
//!
//! A node can be *taken*: off the list but still allocated, so its id is not reused.
//! Writeback takes the coldest nodes while it writes their entries out, and a load
//! takes its entry's node while it decodes; either then frees the node, or puts it
//! back when it failed. Whoever took a node owns its entry's pool object meanwhile.

const NIL: u32 = u32::MAX;

struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

/// `prev` of a taken node: not on the list.
const TAKEN: u32 = u32::MAX - 1;

#[derive(Default)]
pub(crate) struct Lru {
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Coldest node.
    head: Option<u32>,
    /// Newest node.
    tail: Option<u32>,
    len: usize,
}

impl Lru {
    /// Adds `key` as the newest entry; returns its node id.
    pub(crate) fn push(&mut self, key: u64) -> u32 {
        let node = Node { key, prev: TAKEN, next: NIL };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                u32::try_from(self.nodes.len() - 1).expect("fewer than 2^32 LRU entries")
            }
        };
        self.put_back(id, true);
        id
    }

    /// Takes node `id` off the list, keeping it allocated; returns its key.
    pub(crate) fn take(&mut self, id: u32) -> u64 {
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
        self.len -= 1;
        key
    }

    pub(crate) fn is_taken(&self, id: u32) -> bool {
        self.nodes[id as usize].prev == TAKEN
    }

    /// Takes the coldest node, if any: (node id, key).
    pub(crate) fn take_coldest(&mut self) -> Option<(u32, u64)> {
        let id = self.head?;
        Some((id, self.take(id)))
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

    /// Frees a taken node.
    pub(crate) fn free(&mut self, id: u32) {
        debug_assert!(self.is_taken(id));
        self.free.push(id);
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
        self.nodes.capacity() * std::mem::size_of::<Node>() + self.free.capacity() * 4
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
}
