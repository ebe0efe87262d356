//! Size classes: which slot size an object gets, and how many pages a span of that
//! class covers.
//!
//! Steps are 16 B up to 4 KiB (rounding costs 8 B on average), then 64 steps per
//! doubling (1/64 spacing: 64 B steps between 4 and 8 KiB, ..., 1 KiB steps between 64
//! and 128 KiB), which keeps rounding under 0.8% of the object. Objects above
//! [`LARGE_THRESHOLD`] get a dedicated mapping instead (page rounding, at most 4 KiB,
//! is then under 3% of the object and shrinks with it).
//!
//! For each step the span length is the one, among up to 128 KiB (or 8 objects for
//! big steps), that wastes the smallest fraction of the span on its tail: objects
//! straddle pages, so only the tail after the last whole object is lost. Consecutive
//! steps that end up with the same (span length, objects per span) are merged into one
//! class of the larger size, as zsmalloc does: the smaller objects then cost nothing
//! more, since the span's bytes are the same either way.

use crate::word::MAX_POS;
use std::sync::OnceLock;

/// Step between small classes.
pub(crate) const SMALL_STEP: usize = 16;
/// Largest object with a fine (16 B) step.
pub(crate) const SMALL_LIMIT: usize = 4096;
/// log2 of the number of steps per doubling above [`SMALL_LIMIT`].
const STEPS_PER_DOUBLING_LOG2: u32 = 6;
/// Objects larger than this get a dedicated page-rounded mapping.
pub(crate) const LARGE_THRESHOLD: usize = 128 * 1024;
/// A span may cover this many bytes whatever its class ...
const SPAN_BYTES_MIN_CHOICE: usize = 128 * 1024;
/// ... or this many objects of its class, if that is more.
const SPAN_OBJECTS_MIN_CHOICE: usize = 8;

const SMALL_STEPS: usize = SMALL_LIMIT / SMALL_STEP;
const COARSE_STEPS: usize =
    ((LARGE_THRESHOLD / SMALL_LIMIT).trailing_zeros() as usize) << STEPS_PER_DOUBLING_LOG2;
const STEPS: usize = SMALL_STEPS + COARSE_STEPS;

/// One size class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClassInfo {
    /// Slot size: objects of up to this many bytes.
    pub size: u32,
    /// Bytes of one span (a whole number of pages).
    pub span_bytes: u32,
    /// Objects that fit in a span.
    pub objs_per_span: u32,
}

impl ClassInfo {
    /// Bytes of memory one object of this class costs when spans are full.
    #[cfg(test)]
    pub fn bytes_per_object(&self) -> f64 {
        self.span_bytes as f64 / self.objs_per_span as f64
    }
}

pub(crate) struct ClassTable {
    pub classes: Vec<ClassInfo>,
    /// Step index -> class index.
    class_of_step: Vec<u16>,
}

impl ClassTable {
    /// The table for this system's page size, built once per process.
    pub fn get() -> &'static ClassTable {
        static TABLE: OnceLock<ClassTable> = OnceLock::new();
        TABLE.get_or_init(|| ClassTable::build(crate::sys::page_size()))
    }

    pub fn build(page: usize) -> ClassTable {
        let mut classes: Vec<ClassInfo> = Vec::new();
        let mut class_of_step = Vec::with_capacity(STEPS);
        for step in 0..STEPS {
            let size = step_size(step);
            let (span_bytes, objs) = best_span(size, page);
            let info = ClassInfo {
                size: size as u32,
                span_bytes: span_bytes as u32,
                objs_per_span: objs as u32,
            };
            match classes.last_mut() {
                Some(last)
                    if last.span_bytes == info.span_bytes
                        && last.objs_per_span == info.objs_per_span =>
                {
                    last.size = info.size
                }
                _ => classes.push(info),
            }
            class_of_step.push((classes.len() - 1) as u16);
        }
        ClassTable {
            classes,
            class_of_step,
        }
    }

    /// The class for an object of `size` bytes; `None` for empty and large objects.
    pub fn class_of(&self, size: usize) -> Option<usize> {
        if size == 0 || size > LARGE_THRESHOLD {
            return None;
        }
        Some(self.class_of_step[step_index(size)] as usize)
    }
}

/// Index of the smallest step that holds `size` (1..=LARGE_THRESHOLD) bytes.
fn step_index(size: usize) -> usize {
    debug_assert!((1..=LARGE_THRESHOLD).contains(&size));
    if size <= SMALL_LIMIT {
        return (size - 1) / SMALL_STEP;
    }
    let last = size - 1;
    let order = usize::BITS - 1 - last.leading_zeros(); // 2^order <= last < 2^(order+1)
    let shift = order - STEPS_PER_DOUBLING_LOG2;
    let doublings = (order - SMALL_LIMIT.trailing_zeros()) as usize;
    SMALL_STEPS + (doublings << STEPS_PER_DOUBLING_LOG2) + (last >> shift)
        - (1 << STEPS_PER_DOUBLING_LOG2)
}

/// Slot size of step `step`.
fn step_size(step: usize) -> usize {
    if step < SMALL_STEPS {
        return (step + 1) * SMALL_STEP;
    }
    let coarse = step - SMALL_STEPS;
    let order = SMALL_LIMIT.trailing_zeros() as usize + (coarse >> STEPS_PER_DOUBLING_LOG2);
    let sub = (coarse & ((1 << STEPS_PER_DOUBLING_LOG2) - 1)) + 1;
    (1 << order) + (sub << (order - STEPS_PER_DOUBLING_LOG2 as usize))
}

/// (span bytes, objects per span) wasting the smallest fraction of the span.
fn best_span(size: usize, page: usize) -> (usize, usize) {
    let max_bytes = SPAN_BYTES_MIN_CHOICE.max(SPAN_OBJECTS_MIN_CHOICE * size);
    let max_pages = max_bytes.div_ceil(page);
    let mut best: Option<(usize, usize, usize)> = None; // (span bytes, objects, waste)
    for pages in 1..=max_pages {
        let span = pages * page;
        let objs = (span / size).min(MAX_POS + 1);
        if objs == 0 {
            continue;
        }
        let waste = span - objs * size;
        // waste / span < best_waste / best_span, in integers.
        let better = match best {
            None => true,
            Some((b_span, _, b_waste)) => waste * b_span < b_waste * span,
        };
        if better {
            best = Some((span, objs, waste));
        }
    }
    let (span, objs, _) = best.expect("a span of max_pages holds at least one object");
    (span, objs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_round_trip() {
        for step in 0..STEPS {
            let size = step_size(step);
            assert_eq!(step_index(size), step, "size {size}");
            if step > 0 {
                assert_eq!(step_index(step_size(step - 1) + 1), step);
                assert!(step_size(step - 1) < size);
            }
        }
        assert_eq!(step_size(STEPS - 1), LARGE_THRESHOLD);
    }

    #[test]
    fn every_size_gets_the_smallest_fitting_class() {
        let table = ClassTable::build(4096);
        assert_eq!(table.class_of(0), None);
        assert_eq!(table.class_of(LARGE_THRESHOLD + 1), None);
        for size in 1..=LARGE_THRESHOLD {
            let c = table.class_of(size).unwrap();
            let info = table.classes[c];
            assert!(info.size as usize >= size);
            if c > 0 {
                assert!((table.classes[c - 1].size as usize) < size);
            }
            assert!(info.objs_per_span >= 1 && info.objs_per_span as usize <= MAX_POS + 1);
            assert!(info.objs_per_span * info.size <= info.span_bytes);
            assert_eq!(info.span_bytes % 4096, 0);
        }
    }

    #[test]
    fn class_rounding_and_tail_waste_are_small() {
        let table = ClassTable::build(4096);
        // Memory per object (rounding + span tail) against the object's own size, for
        // every size in the ranges compressed 4 KiB and 64 KiB units fall in.
        let cost = |size: usize| {
            let info = table.classes[table.class_of(size).unwrap()];
            info.bytes_per_object() - size as f64
        };
        let mean = |r: std::ops::RangeInclusive<usize>| {
            let n = r.clone().count() as f64;
            r.map(cost).sum::<f64>() / n
        };
        let small = mean(800..=3600);
        assert!(
            small < 16.0,
            "mean waste per 800..3600 B object: {small:.1} B"
        );
        let big_per_4k = mean(10 * 1024..=40 * 1024) / 16.0;
        assert!(
            big_per_4k < 20.0,
            "mean waste per 4 KiB for 10..40 KiB objects: {big_per_4k:.1} B"
        );
        let worst = (1..=LARGE_THRESHOLD)
            .map(|size| (cost(size) / size.max(512) as f64, size))
            .fold((0.0, 0), |a, b| if b.0 > a.0 { b } else { a });
        assert!(
            worst.0 < 0.04,
            "size {}: {:.1}% of the object wasted",
            worst.1,
            worst.0 * 100.0
        );
    }

    #[test]
    fn merged_classes_keep_distinct_geometry() {
        let table = ClassTable::build(4096);
        for pair in table.classes.windows(2) {
            assert!(pair[0].size < pair[1].size);
            assert!(
                (pair[0].span_bytes, pair[0].objs_per_span)
                    != (pair[1].span_bytes, pair[1].objs_per_span)
            );
        }
        assert!(table.classes.len() < STEPS);
    }

    #[test]
    fn other_page_sizes_build() {
        for page in [16384, 65536] {
            let table = ClassTable::build(page);
            for c in &table.classes {
                assert_eq!(c.span_bytes as usize % page, 0);
                assert!(c.objs_per_span as usize <= MAX_POS + 1);
            }
        }
    }
}
