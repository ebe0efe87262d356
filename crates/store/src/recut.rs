//! Recut: when the pool is full, its coldest records that were cut into small units
//! (to be read a page at a time: [`Store::store_cut`]) are cut again into one unit
//! each before anything is written back, as zram recompresses idle pages before its
//! writeback. Small units decode alone, so a fault at random pays for one page, but
//! they compress worse (sixteen 4 KiB units of a 64 KiB folio take about twice the
//! room of one unit on text-like data); a record that went cold is read, if ever, as
//! a whole, so at the pool's limit it is worth the one re-encode.
//!
//! A recut is a writeback whose destination is the pool itself, and follows the same
//! hand-over (the store's design comment): the records' LRU nodes are taken as
//! writeback takes them, so a load that comes meanwhile joins (`WritebackPinned`)
//! instead of waiting; the new records go into new pool objects with new nodes, and
//! are published only if the old entry is still there. For each record, under the LRU
//! lock:
//! - held by us alone (`Writeback`): the index entry now names the new object; the old
//!   object and node are freed;
//! - a load reads the old object alongside (`WritebackPinned`): published as well; the
//!   old node goes to the load (`Orphan`), which buries the old object when done (and,
//!   if it was erasing the entry, erases the new record: [`Store::erase`]);
//! - a load erased the entry meanwhile (`WritebackErased`): both objects and nodes are
//!   freed, nothing is published;
//! - not recut (it did not shrink, did not decode, or the pool refused the new object):
//!   as a failed writeback, the node goes back where it was, or to the load alongside.
//!
//! Nothing is lost at any step: the old record stays the entry until the new one is
//! published, and a record that does not decode is left for its load to report.

use crate::*;

/// Nodes looked at from the cold end in one recut, past records already whole.
const RECUT_SCAN: usize = 4096;
/// Records recut in one batch.
const RECUT_BATCH: usize = 256;

impl Entry {
    /// A pool record cut into several units (whole records and records kept raw are
    /// not).
    fn recuttable(&self) -> bool {
        matches!(self.location, Location::Pool { .. }) && !self.is_kept_raw() && self.unit_order < self.order
    }
}

/// A record recut, not yet published: its entry (with its new node) and index box.
struct Recut {
    entry: Entry,
    prepared: Prepared<Entry>,
}

impl Store {
    /// Cuts up to `max_bytes` of the coldest pool records that are cut into several
    /// units (among the `RECUT_SCAN` coldest) into one unit each. Recut records go
    /// back to the cold end, where writeback finds them first. Returns how many bytes
    /// the records shrank by (0: nothing to recut, or nothing shrank).
    pub fn recut_coldest(&self, max_bytes: usize) -> u64 {
        self.reap();
        let _moves = self.moves.hold();
        let batch = self.recut_take(max_bytes);
        if batch.is_empty() {
            return 0;
        }
        let mut folio = vec![0u8; MAX_FOLIO];
        let recut: Vec<Option<Recut>> = batch.iter().map(|(key, entry)| self.recut_one(*key, entry, &mut folio)).collect();
        self.recut_publish(&batch, recut)
    }

    /// Step 1: takes the nodes of up to `max_bytes` of recuttable records among the
    /// `RECUT_SCAN` coldest, as writeback takes its batch (allocation-free under the
    /// lock: the batch's room is made first). Under `moves`, shared.
    fn recut_take(&self, max_bytes: usize) -> Vec<(u64, Entry)> {
        let mut batch: Vec<(u64, Entry)> = Vec::with_capacity(RECUT_BATCH);
        let mut lru = self.lru.lock();
        let (mut cur, mut seen, mut bytes) = (lru.coldest().map(|c| c.0), 0, 0);
        while let Some(node) = cur {
            if seen == RECUT_SCAN || bytes >= max_bytes || batch.len() == batch.capacity() {
                break;
            }
            seen += 1;
            cur = lru.newer(node);
            let key = lru.key(node);
            let entry = self.index.get(key).expect("an LRU node's entry is in the index");
            if let (true, Location::Pool { len, .. }) = (entry.recuttable(), entry.location) {
                lru.take_for_writeback(node);
                bytes += len as usize;
                batch.push((key, entry));
            }
        }
        batch
    }

    /// Step 3: publishes what was recut (step 2 is [`Store::recut_one`], outside every
    /// lock but `moves`), coldest last so the batch keeps its order at the cold end,
    /// and gives back what was not. Returns how many bytes the records shrank by.
    fn recut_publish(&self, batch: &[(u64, Entry)], recut: Vec<Option<Recut>>) -> u64 {
        let mut to_free: Vec<Handle> = Vec::with_capacity(2 * batch.len());
        let mut unused: Vec<Prepared<Entry>> = Vec::with_capacity(batch.len());
        let (mut shrank, mut pages) = (0u64, 0u64);
        let mut lru = self.lru.lock();
        for ((key, entry), new) in batch.iter().zip(recut).rev() {
            let Location::Pool { handle, lru: node, len } = entry.location else { unreachable!() };
            let Some(new) = new else {
                give_back_taken(&mut lru, node, handle, &mut to_free);
                continue;
            };
            let Location::Pool { handle: new_handle, lru: new_node, len: new_len } = new.entry.location else { unreachable!() };
            if lru.holder(node) == Holder::WritebackErased {
                lru.free(node);
                lru.free(new_node);
                to_free.extend([handle, new_handle]);
                unused.push(new.prepared);
                continue;
            }
            let replaced = self.index.replace(*key, new.prepared);
            debug_assert!(replaced.as_ref().is_ok_and(|old| old == entry), "{key:#x}: {:?}", replaced.as_ref().ok());
            lru.put_back(new_node, false);
            release_moved(&mut lru, node, handle, &mut to_free);
            self.account(entry, -1);
            self.account(&new.entry, 1);
            shrank += u64::from(len - new_len);
            pages += entry.pages();
        }
        drop(lru);
        drop(unused);
        for handle in to_free {
            self.pool.free(handle);
        }
        LiveStats::add(&self.stats.totals.recut_pages, pages);
        shrank
    }

    /// Decodes the record under `key` (held for recut) whole and encodes it as one
    /// unit into a new pool object with a new (taken) node; `None` if it does not
    /// decode, does not shrink, or the pool refuses it: the record then stays as it is.
    fn recut_one(&self, key: u64, entry: &Entry, folio: &mut [u8]) -> Option<Recut> {
        let Location::Pool { handle, len: old_len, .. } = entry.location else { return None };
        let folio = &mut folio[..entry.folio_len()];
        let made = self.with_context(|ctx| -> Option<(Handle, u32)> {
            self.pool.read(handle, |bytes| ctx.codec.decode(bytes, folio)).ok()?;
            match ctx.codec.encode_cut(folio, &mut ctx.buf[..], Granularity::Folio).ok()? {
                Encoded::Stored { len, raw_units: 0, .. } if len < old_len as usize => {
                    let new = self.pool.store(&ctx.buf[..len]).ok()?;
                    Some((new, len as u32))
                }
                _ => None,
            }
        });
        let (new_handle, new_len) = made.ok().flatten()?;
        let node = self.new_lru_node(key);
        let entry = Entry {
            location: Location::Pool { handle: new_handle, len: new_len, lru: node },
            unit_order: entry.order,
            raw_pages: 0,
            ..*entry
        };
        Some(Recut { entry, prepared: self.index.prepare(entry) })
    }
}

#[cfg(test)]
mod tests {
    //! Each hand-over case of the design comment, played out in order on one thread
    //! (handover.rs races them).
    use super::*;

    const FOLIO: usize = 64 << 10;

    /// Text-like bytes: words of a small vocabulary in a pseudo-random order, which
    /// compress in 4 KiB units and better as a whole.
    fn text(len: usize, seed: u64) -> Vec<u8> {
        const WORDS: [&str; 12] = ["folio ", "swap ", "the ", "zswap ", "page ", "pool ", "of ", "and ", "memory ", "cold ", "unit ", "write "];
        let (mut out, mut x) = (Vec::with_capacity(len + 8), seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        while out.len() < len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            out.extend_from_slice(WORDS[(x % 12) as usize].as_bytes());
            if x % 97 == 0 {
                out.extend_from_slice(format!("{x:x} ").as_bytes());
            }
        }
        out.truncate(len);
        out
    }

    fn store_with(key_data: &[(u64, &[u8])]) -> Store {
        let cfg = StoreConfig {
            codec: CodecConfig { algorithm: Algorithm::Lz4, level: 1, granularity: SMALLEST_CUT, raw_threshold_percent: 90, verify: false },
            ..StoreConfig::default()
        };
        let store = Store::new(cfg).unwrap();
        for (key, data) in key_data {
            store.store(*key, data).unwrap();
            assert_eq!(store.unit_len(*key), Some(PAGE_SIZE));
        }
        store
    }

    /// Takes `key`'s record for recut and encodes it, as `recut_coldest` does up to
    /// publishing; `meanwhile` runs between the take and the publish.
    fn recut_with(store: &Store, meanwhile: impl FnOnce()) -> u64 {
        let _moves = store.moves.hold();
        let batch = store.recut_take(usize::MAX);
        assert_eq!(batch.len(), 1);
        meanwhile();
        let mut folio = vec![0u8; MAX_FOLIO];
        let recut: Vec<_> = batch.iter().map(|(k, e)| store.recut_one(*k, e, &mut folio)).collect();
        assert!(recut[0].is_some(), "text-like data shrinks cut whole");
        store.recut_publish(&batch, recut)
    }

    fn nothing_left(store: &Store) {
        store.reap();
        let st = store.stats();
        assert!(store.is_empty() && store.lru_len() == 0, "{st:?}");
        assert_eq!((st.totals.stored_pages, st.compressed_bytes), (0, 0), "{st:?}");
        assert_eq!(store.pool_objects(), 0, "{st:?}");
    }

    #[test]
    fn recut_shrinks_and_reads_back_whole() {
        let data = text(16 * FOLIO, 3);
        let pairs: Vec<(u64, &[u8])> = data.chunks(FOLIO).enumerate().map(|(i, d)| (i as u64, d)).collect();
        let store = store_with(&pairs);
        let before = store.stats().compressed_bytes;
        let shrank = store.recut_coldest(usize::MAX);
        let st = store.stats();
        assert!(shrank > 0 && st.compressed_bytes == before - shrank, "{shrank} {st:?}");
        assert_eq!(st.totals.recut_pages, 16 * 16);
        assert_eq!(store.recut_coldest(usize::MAX), 0, "nothing left to recut");
        let mut out = vec![0u8; FOLIO];
        for (key, d) in &pairs {
            assert_eq!(store.unit_len(*key), Some(FOLIO));
            assert!(store.load(*key, &mut out).unwrap());
            assert!(out[..] == d[..]);
        }
        nothing_left(&store);
    }

    #[test]
    fn a_load_alongside_that_erases_erases_the_recut_record() {
        let data = text(FOLIO, 4);
        let store = store_with(&[(1, &data)]);
        let mut claimed = None;
        recut_with(&store, || claimed = store.claim(1));
        let claimed = claimed.unwrap();
        // The load reads its own (old) object, then erases: Orphan, with a pool record.
        let mut out = vec![0u8; FOLIO];
        store.decode(1, &claimed, 0, &mut out).unwrap();
        assert!(out == data);
        store.erase(1, &claimed);
        nothing_left(&store);
    }

    #[test]
    fn a_load_alongside_that_only_reads_leaves_the_recut_record() {
        let data = text(FOLIO, 5);
        let store = store_with(&[(1, &data)]);
        let mut claimed = None;
        recut_with(&store, || claimed = store.claim(1));
        store.unclaim(&claimed.unwrap(), true);
        assert_eq!(store.unit_len(1), Some(FOLIO));
        let mut out = vec![0u8; FOLIO];
        assert!(store.load(1, &mut out).unwrap());
        assert!(out == data);
        nothing_left(&store);
    }

    #[test]
    fn a_load_that_erased_first_leaves_nothing_published() {
        let data = text(FOLIO, 6);
        let store = store_with(&[(1, &data)]);
        let shrank = recut_with(&store, || {
            let claimed = store.claim(1).unwrap();
            store.erase(1, &claimed);
        });
        assert_eq!(shrank, 0);
        assert!(!store.contains(1));
        nothing_left(&store);
    }

    #[test]
    fn an_erase_of_a_recut_record_writeback_holds_leaves_it_to_writeback() {
        let data = text(FOLIO, 7);
        let store = store_with(&[(1, &data)]);
        let mut claimed = None;
        recut_with(&store, || claimed = store.claim(1));
        // Writeback takes the new record's node before the load erases.
        let (node, key) = store.lru.lock().take_coldest().unwrap();
        assert_eq!(key, 1);
        let new = store.index.get(1).unwrap();
        store.erase(1, &claimed.unwrap());
        assert_eq!(store.lru.lock().holder(node), Holder::WritebackErased);
        // ... and frees it when it sees that, as writeback_batch does.
        let Location::Pool { handle, .. } = new.location else { unreachable!() };
        store.lru.lock().free(node);
        store.pool.free(handle);
        nothing_left(&store);
    }
}
