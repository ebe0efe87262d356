//! A flight recorder of folio life cycles, for explaining a rare failure after the
//! fact (a stress test that reads a page back wrong asks for the history of its
//! folio): the last `SLOTS` events of every region of the process, each naming the
//! folio by its store key. Off unless turned on ([`enable`]): then every transition
//! recorded (folio.rs), every drop marked on a folio (region.rs), every bring-in
//! put off half-way and every fault taken up (fault.rs) leaves an event.
//!
//! Not for production diagnosis (it keeps no more than the last few thousand events,
//! and an entry written while [`history`] reads may come out torn); it is cheap off (one
//! relaxed load at each site), and lock- and allocation-free on, so the fault path
//! may record.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};

const SLOTS: usize = 1 << 15;

static ON: AtomicBool = AtomicBool::new(false);
static NEXT: AtomicU64 = AtomicU64::new(1);
/// Per slot: sequence number (0: empty), store key, packed event.
static RING: [[AtomicU64; 3]; SLOTS] = [const { [const { AtomicU64::new(0) }; 3] }; SLOTS];

/// Starts recording, for the rest of the process.
pub fn enable() {
    ON.store(true, SeqCst);
}

/// What happened to a folio.
#[derive(Clone, Copy)]
pub(crate) enum Event {
    /// A transition (folio.rs): from state, to state, and the transition's name
    /// (an index into `crate::folio::TRANSITION_NAMES`).
    Moved { from: u8, to: u8, t: u8 },
    /// Pages `first..first + count` of the folio marked dropped (or gone, `unmap`).
    Marked { first: u16, count: u16, unmap: bool },
    /// A bring-in stopped half-way and put off, with `present` pages found there.
    PutOff { from: u8, present: u16, copied: bool },
    /// Pending marks of the folio cleared by `why` (1 `filled`, 2 `settle_drops`, 3
    /// `discard_drop_pending`): a mask of its first 56 pages.
    Settled { why: u8, mask: u64 },
    /// A fault on page `page` of the folio (`write`: a write access) was taken up by
    /// the reader or a SIGBUS handler, with `outcome` 0 served, 1 put off, 2 not ours.
    Fault { page: u16, write: bool, outcome: u8 },
}

/// Whether the recorder is on (for a caller that would loop to record).
#[inline]
pub(crate) fn on() -> bool {
    ON.load(Relaxed)
}

/// Records `event` of the folio under store key `key`. Async-signal-safe.
#[inline]
pub(crate) fn note(key: u64, event: Event) {
    if on() {
        put(key, event);
    }
}

#[cold]
fn put(key: u64, event: Event) {
    let (kind, a, b, c, d) = match event {
        Event::Moved { from, to, t } => (1u64, u64::from(from), u64::from(to), u64::from(t), 0),
        Event::Marked { first, count, unmap } => (2, u64::from(first), u64::from(count), u64::from(unmap), 0),
        Event::PutOff { from, present, copied } => (3, u64::from(from), u64::from(present), u64::from(copied), 0),
        Event::Settled { why, mask } => (4, u64::from(why), 0, 0, mask),
        Event::Fault { page, write, outcome } => (5, u64::from(page), u64::from(write), u64::from(outcome), 0),
    };
    // SAFETY: gettid takes no arguments and is async-signal-safe.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u64 & 0xffff;
    let seq = NEXT.fetch_add(1, Relaxed);
    let slot = &RING[seq as usize % SLOTS];
    slot[1].store(key, Relaxed);
    // Settled carries its mask in place of the small fields.
    let packed = if kind == 4 { d << 8 | a << 4 | kind } else { kind | a << 8 | b << 24 | c << 40 | tid << 48 };
    slot[2].store(packed, Relaxed);
    slot[0].store(seq, Release);
}

/// The recorded events of the folio under store key `key`, oldest first, one line each.
pub fn history(key: u64) -> Vec<String> {
    let mut found: Vec<(u64, u64)> = RING
        .iter()
        .filter_map(|s| {
            let seq = s[0].load(Acquire);
            (seq != 0 && s[1].load(Relaxed) == key).then(|| (seq, s[2].load(Relaxed)))
        })
        .collect();
    found.sort_unstable();
    let state = |s: u64| crate::folio::state_name(s as u8);
    found
        .into_iter()
        .map(|(seq, p)| {
            let (kind, a, b, c, tid) = (p & 0xff, p >> 8 & 0xffff, p >> 24 & 0xffff, p >> 40 & 0xff, p >> 48);
            match kind & 0xf {
                1 => format!("#{seq} t{tid} {} -> {} ({})", state(a), state(b), crate::folio::transition_name(c as u8)),
                2 => format!("#{seq} t{tid} marked pages {a}..{} {}", a + b, if c != 0 { "gone" } else { "dropped" }),
                3 => format!("#{seq} t{tid} bring-in of {} put off, {b} pages found present, {}", state(a), if c != 0 { "copied" } else { "moved" }),
                5 => format!(
                    "#{seq} t{tid} {} fault on page {a} {}",
                    if b != 0 { "write" } else { "read" },
                    ["served", "put off", "not ours"][(c as usize).min(2)]
                ),
                _ => format!("#{seq} marks settled by {} (mask {:#x})", ["?", "filled", "settle_drops", "discard"][(p >> 4 & 0xf).min(3) as usize], p >> 8),
            }
        })
        .collect()
}
