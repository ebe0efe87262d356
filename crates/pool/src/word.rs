//! The handle table's words, and the public handle value.
//!
//! A handle names a slot of the handle table; the slot holds one 64-bit word:
//!
//! ```text
//! live:  1 | gen:4 | size:22 | pos:12 | span:25
//! free:  0 | gen:4 | 0...              | next free handle + 1 (0: end of chain):32
//! ```
//!
//! `size` is the object's exact length (its class follows from it), `span` and `pos`
//! say where it is. Putting the size here instead of in an object header costs the
//! objects nothing. `gen` counts the slot's reuses (mod 16), and the handle carries the
//! generation it was issued with, so most uses of a stale handle are caught.

use crate::Handle;

const LIVE: u64 = 1 << 63;
const GEN_SHIFT: u32 = 59;
const GEN_MASK: u64 = 0xf;
const SIZE_SHIFT: u32 = 37;
const SIZE_MASK: u64 = (1 << 22) - 1;
const POS_SHIFT: u32 = 25;
const POS_MASK: u64 = (1 << 12) - 1;
const SPAN_MASK: u64 = (1 << 25) - 1;

/// Largest object position in a span.
pub(crate) const MAX_POS: usize = POS_MASK as usize;
/// Number of span ids.
pub(crate) const SPAN_IDS: usize = SPAN_MASK as usize + 1;
/// Largest size a word can hold.
pub(crate) const MAX_SIZE: usize = SIZE_MASK as usize;
const _: () = assert!(crate::Pool::MAX_OBJECT_SIZE <= MAX_SIZE);

/// A live word, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Location {
    pub gen: u8,
    pub size: usize,
    pub span: u32,
    pub pos: u32,
}

impl Location {
    pub fn encode(self) -> u64 {
        debug_assert!(self.size <= MAX_SIZE && self.pos as usize <= MAX_POS);
        debug_assert!((self.span as usize) < SPAN_IDS && u64::from(self.gen) <= GEN_MASK);
        LIVE | u64::from(self.gen) << GEN_SHIFT
            | (self.size as u64) << SIZE_SHIFT
            | u64::from(self.pos) << POS_SHIFT
            | u64::from(self.span)
    }

    /// `None` for a free slot.
    pub fn decode(word: u64) -> Option<Location> {
        (word & LIVE != 0).then_some(Location {
            gen: ((word >> GEN_SHIFT) & GEN_MASK) as u8,
            size: ((word >> SIZE_SHIFT) & SIZE_MASK) as usize,
            pos: ((word >> POS_SHIFT) & POS_MASK) as u32,
            span: (word & SPAN_MASK) as u32,
        })
    }
}

/// A free word: the generation the slot's next owner gets, and the next free handle
/// in whatever chain the slot is on.
pub(crate) fn free_word(gen: u8, next: Option<u32>) -> u64 {
    (u64::from(gen) & GEN_MASK) << GEN_SHIFT | next.map_or(0, |n| u64::from(n) + 1)
}

/// (generation, next) of a free word.
pub(crate) fn decode_free(word: u64) -> (u8, Option<u32>) {
    debug_assert!(word & LIVE == 0);
    let link = word as u32;
    (((word >> GEN_SHIFT) & GEN_MASK) as u8, link.checked_sub(1))
}

pub(crate) fn next_gen(gen: u8) -> u8 {
    (gen + 1) & GEN_MASK as u8
}

impl Handle {
    pub(crate) fn new(index: u32, gen: u8) -> Handle {
        Handle(u64::from(gen) << 32 | (u64::from(index) + 1))
    }

    /// (slot index, generation), or `None` if no handle could look like this.
    pub(crate) fn parts(self) -> Option<(u32, u8)> {
        let index = (self.0 as u32).checked_sub(1)?;
        let gen = self.0 >> 32;
        (gen <= GEN_MASK).then_some((index, gen as u8))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        let loc = Location {
            gen: 15,
            size: MAX_SIZE,
            span: SPAN_IDS as u32 - 1,
            pos: MAX_POS as u32,
        };
        assert_eq!(Location::decode(loc.encode()), Some(loc));
        let loc = Location {
            gen: 0,
            size: 0,
            span: 0,
            pos: 0,
        };
        assert_eq!(Location::decode(loc.encode()), Some(loc));
        for (gen, next) in [(0, None), (7, Some(0)), (15, Some(u32::MAX - 1))] {
            let w = free_word(gen, next);
            assert_eq!(Location::decode(w), None);
            assert_eq!(decode_free(w), (gen, next));
        }
        assert_eq!(Location::decode(0), None);
        assert_eq!(next_gen(15), 0);
    }

    #[test]
    fn handles_round_trip() {
        assert_eq!(Handle::new(0, 0).parts(), Some((0, 0)));
        assert_eq!(Handle::new(12345, 9).parts(), Some((12345, 9)));
        assert_eq!(Handle(0).parts(), None);
        assert_eq!(Handle(16 << 32 | 1).parts(), None);
        assert_eq!(Handle(u64::MAX).parts(), None);
    }
}
