//! `pool_ops`: a sequence of pool operations, each checked against a model
//! (`HashMap<Handle, Vec<u8>>`) of what the pool must hold.
//!
//! Objects span every kind the pool has: empty, small and big size classes (up
//! to 128 KiB, where spans hold several objects and compaction moves them) and
//! large mappings (up to `MAX_OBJECT_SIZE`). Every object's bytes are unique to it,
//! so an object that was moved onto another's place, copied short or read from a
//! stale position shows. After every operation `stats()` must count exactly the
//! model's objects and bytes, and `total_size` must cover the bytes; after a
//! compaction every object is read back. Handles that name no live object (freed
//! ones, freed ones whose slot was reused, and arbitrary words) must be refused
//! by `try_read` and `try_free` — unless the word equals a live handle: handles
//! carry a 4-bit generation, so after 16 reuses a freed handle is a live one again,
//! and the model follows that rule exactly.

#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use uzswap_pool::{Handle, Pool, PoolError};

/// Sizes of the objects a `Store` makes.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Size {
    Empty,
    /// 1..=4096 bytes: the 16-byte classes.
    Small(u16),
    /// up to 128 KiB: the big classes, several objects per span.
    Big(u32),
    /// above 128 KiB, up to `Pool::MAX_OBJECT_SIZE`: mappings of their own.
    Large(u32),
    /// One byte past the maximum: refused.
    TooLarge,
}

impl Size {
    fn bytes(self) -> usize {
        match self {
            Size::Empty => 0,
            Size::Small(n) => 1 + n as usize % 4096,
            Size::Big(n) => 4097 + n as usize % (128 * 1024 - 4096),
            Size::Large(n) => 128 * 1024 + 1 + n as usize % (Pool::MAX_OBJECT_SIZE - 128 * 1024),
            Size::TooLarge => Pool::MAX_OBJECT_SIZE + 1,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// Several objects of one size, each with its own bytes.
    Store {
        size: Size,
        count: u8,
        seed: u32,
    },
    Read {
        pick: u16,
    },
    Free {
        pick: u16,
    },
    /// Free and read again a handle freed earlier.
    UseFreed {
        pick: u16,
    },
    /// Any 64-bit word as a handle.
    UseWord {
        handle: u64,
    },
    Compact,
}

/// At most this many bytes live at once, so no input runs the machine out of memory.
const MAX_LIVE_BYTES: usize = 96 << 20;

/// Bytes unique to an object and to each place in it: a 1 KiB xorshift pattern
/// from the seed, repeated, with the seed and offset stamped every 256 bytes (built
/// in blocks: a loop per byte would spend the run in coverage hooks).
fn object_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut pattern = Vec::with_capacity(1024);
    for _ in 0..1024 / 8 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        pattern.extend_from_slice(&x.to_le_bytes());
    }
    let mut bytes = pattern.repeat(len.div_ceil(1024));
    bytes.truncate(len);
    for (i, block) in bytes.chunks_mut(256).enumerate() {
        let stamp = (seed ^ (i as u64) << 40).to_le_bytes();
        let n = block.len().min(8);
        block[..n].copy_from_slice(&stamp[..n]);
    }
    bytes
}

struct Model {
    live: HashMap<Handle, Vec<u8>>,
    /// Live handles in a stable order, for picking.
    order: Vec<Handle>,
    freed: Vec<Handle>,
    live_bytes: usize,
}

impl Model {
    fn pick(&self, pick: u16) -> Option<Handle> {
        (!self.order.is_empty()).then(|| self.order[pick as usize % self.order.len()])
    }

    fn remove(&mut self, handle: Handle) -> Vec<u8> {
        let bytes = self
            .live
            .remove(&handle)
            .expect("handle is live in the model");
        self.order.retain(|&h| h != handle);
        self.live_bytes -= bytes.len();
        bytes
    }
}

fn check_read(pool: &Pool, handle: Handle, expected: &[u8]) {
    let same = pool
        .try_read(handle, |bytes| bytes == expected)
        .unwrap_or_else(|e| panic!("read of live {handle:?}: {e}"));
    assert!(
        same,
        "{handle:?}: bytes differ from what was stored ({} bytes)",
        expected.len()
    );
}

/// A handle the model does not hold is refused by `try_read` and `try_free`.
fn check_dead(pool: &Pool, model: &Model, handle: Handle) {
    if model.live.contains_key(&handle) {
        return;
    }
    assert_eq!(
        pool.try_read(handle, |_| ()),
        Err(PoolError::InvalidHandle),
        "read of dead {handle:?}"
    );
    assert_eq!(
        pool.try_free(handle),
        Err(PoolError::InvalidHandle),
        "free of dead {handle:?}"
    );
}

fn check_stats(pool: &Pool, model: &Model) {
    let stats = pool.stats();
    assert_eq!(stats.objects, model.live.len() as u64, "objects");
    assert_eq!(stats.object_bytes, model.live_bytes as u64, "object_bytes");
    assert!(
        stats.total_size >= stats.object_bytes,
        "total_size {} < bytes held {}",
        stats.total_size,
        stats.object_bytes
    );
    assert_eq!(stats.total_size, pool.total_size());
}

fuzz_target!(|ops: Vec<Op>| {
    let pool = Pool::new();
    let mut model = Model {
        live: HashMap::new(),
        order: Vec::new(),
        freed: Vec::new(),
        live_bytes: 0,
    };
    let mut serial = 0u64;
    for op in ops {
        match op {
            Op::Store { size, count, seed } => {
                let len = size.bytes();
                for _ in 0..count % 8 + 1 {
                    if model.live_bytes + len > MAX_LIVE_BYTES && len <= Pool::MAX_OBJECT_SIZE {
                        break;
                    }
                    serial += 1;
                    let bytes = object_bytes(len, u64::from(seed) << 32 | serial);
                    match pool.store(&bytes) {
                        Ok(handle) => {
                            assert!(len <= Pool::MAX_OBJECT_SIZE, "stored {len} bytes");
                            let old = model.live.insert(handle, bytes);
                            assert!(old.is_none(), "{handle:?} handed out while live");
                            model.order.push(handle);
                            model.live_bytes += len;
                            model.freed.retain(|&h| h != handle);
                        }
                        Err(e) => {
                            assert_eq!(e, PoolError::TooLarge(len));
                            break;
                        }
                    }
                }
            }
            Op::Read { pick } => {
                if let Some(handle) = model.pick(pick) {
                    check_read(&pool, handle, &model.live[&handle]);
                }
            }
            Op::Free { pick } => {
                if let Some(handle) = model.pick(pick) {
                    assert_eq!(pool.try_free(handle), Ok(()), "free of live {handle:?}");
                    model.remove(handle);
                    model.freed.push(handle);
                    check_dead(&pool, &model, handle);
                }
            }
            Op::UseFreed { pick } => {
                if !model.freed.is_empty() {
                    let handle = model.freed[pick as usize % model.freed.len()];
                    check_dead(&pool, &model, handle);
                }
            }
            Op::UseWord { handle } => {
                let handle = Handle(handle);
                match model.live.get(&handle) {
                    Some(bytes) => check_read(&pool, handle, bytes),
                    None => check_dead(&pool, &model, handle),
                }
            }
            Op::Compact => {
                pool.compact();
                for (&handle, bytes) in &model.live {
                    check_read(&pool, handle, bytes);
                }
            }
        }
        check_stats(&pool, &model);
    }
    for (&handle, bytes) in &model.live {
        check_read(&pool, handle, bytes);
    }
    // Free half of what is left and drop the pool with the rest still live.
    let order = std::mem::take(&mut model.order);
    for handle in order.iter().step_by(2) {
        assert_eq!(pool.try_free(*handle), Ok(()));
        model.live_bytes -= model.live.remove(handle).map_or(0, |b| b.len());
    }
    check_stats(&pool, &model);
});
