//! The store's LRU: entries in the order they were stored, oldest first, so that
//! writeback takes the coldest (zswap's list_lru). Raw entries are on it too (seed
//! 001): an incompressible folio must still leave in LRU order.
//!
//! Nodes live in a slab indexed by `u32` so an entry needs 4 bytes to find its node
//! and a node costs 16 bytes, with no allocation per entry once the slab has grown.
//! The list is not thread-safe by itself: the store keeps it under one mutex, taken
//! once per store and once per load, as zswap takes its list_lru lock.

const NIL: u32 = u32::MAX;

struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

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
        let node = Node { key, prev: self.tail.unwrap_or(NIL), next: NIL };
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
        match self.tail {
            Some(t) => self.nodes[t as usize].next = id,
            None => self.head = Some(id),
        }
        self.tail = Some(id);
        self.len += 1;
        id
    }

    /// Unlinks node `id` and returns its key.
    pub(crate) fn remove(&mut self, id: u32) -> u64 {
        let Node { key, prev, next } = self.nodes[id as usize];
        debug_assert!(prev != id && next != id);
        match prev {
            NIL => self.head = (next != NIL).then_some(next),
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = (prev != NIL).then_some(prev),
            n => self.nodes[n as usize].prev = prev,
        }
        self.free.push(id);
        self.len -= 1;
        key
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
                assert_eq!(lru.remove(id), k);
            }
            assert_eq!(lru.len(), model.len());
            assert_eq!(lru.coldest(), model.front().copied());
        }
        while let Some((id, k)) = lru.coldest() {
            assert_eq!(model.pop_front(), Some((id, k)));
            lru.remove(id);
        }
        assert!(model.is_empty());
    }
}
