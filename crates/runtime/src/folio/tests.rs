//! The folio life cycle against a model, without userfaultfd: random sequences of
//! transitions (the mechanism stood in for by the store calls the real paths make),
//! then the budget sums, the kept flags and the store's contents checked after every
//! step, each against an independent model of a folio; the same from several threads
//! with drops and fork holds among them, the books checked whenever a checker holds
//! every folio; and the table in the module comment checked against `edge`.

use super::*;
use proptest::prelude::*;
use std::sync::Arc;
use uzswap_store::StoreConfig;

const FOLIO: usize = 16 << 10;
const ALL: [Transition; 24] = [
    Transition::ZeroFilled,
    Transition::FilledAhead,
    Transition::Adopted,
    Transition::Carried,
    Transition::Shared,
    Transition::Unshared,
    Transition::Touched,
    Transition::Dirtied,
    Transition::SwappedIn,
    Transition::SwappedInClean,
    Transition::InAhead,
    Transition::PartIn,
    Transition::PartFilled,
    Transition::Refaulted,
    Transition::RefaultedClean,
    Transition::Poisoned,
    Transition::ToProbation,
    Transition::Stored,
    Transition::CleanEvicted,
    Transition::Refused,
    Transition::Dropped { unmap: false },
    Transition::Dropped { unmap: true },
    Transition::PartDropped,
    Transition::ForkIn,
];

struct World {
    folios: Folios,
    charges: Charges,
    stats: SizeCounters,
    store: Store,
}

impl World {
    fn new(n: usize) -> World {
        World { folios: Folios::new(n), charges: Charges::default(), stats: SizeCounters::default(), store: Store::new(StoreConfig::default()).unwrap() }
    }
    fn book(&self) -> Book<'_> {
        Book { folios: &self.folios, charges: &self.charges, stats: &self.stats, store: &self.store, key_base: 7 << 40, folio_bytes: FOLIO as u64 }
    }

    /// Locks `idx` (waiting), does what the real path does around transition `t` if the
    /// table allows it from the folio's state, and unlocks. True if it happened.
    fn step(&self, idx: usize, t: Transition, fill: u8) -> bool {
        let b = self.book();
        let prev = self.folios.lock(idx);
        let kept = self.folios.kept(idx);
        if edge(prev, kept, t).is_none() {
            self.folios.unlock(idx, prev);
            return false;
        }
        let key = b.key(idx);
        let mut buf = vec![0u8; FOLIO];
        // The mechanism's store calls, as fault.rs / reclaim.rs / fork make them.
        let pages = (FOLIO / crate::fault::PAGE) as u16;
        let res = match t {
            Transition::ZeroFilled
            | Transition::FilledAhead
            | Transition::SwappedIn
            | Transition::SwappedInClean
            | Transition::InAhead
            | Transition::Unshared
            | Transition::ForkIn => Some(b.reserve(idx, prev)),
            // A unit of 1 to 3 pages more, as a partial swap-in charges ahead.
            Transition::PartIn => Some(b.reserve_bytes(u64::from(fill % 3 + 1) * crate::fault::PAGE as u64)),
            _ => None,
        };
        match (t, prev) {
            (Transition::SwappedIn | Transition::ForkIn, SWAPPED | PARTIAL) => {
                assert!(self.store.load(key, &mut buf).unwrap(), "a SWAPPED folio has its entry");
            }
            (Transition::SwappedInClean | Transition::InAhead | Transition::PartIn | Transition::PartFilled, _) => {
                assert!(self.store.read_range(key, 0, &mut buf).unwrap())
            }
            // A child's import keeps an encoded record, as a store does.
            (Transition::Stored | Transition::Carried, _) => self.store.store(key, &vec![fill; FOLIO]).unwrap(),
            _ => {}
        }
        let next = if t == Transition::PartIn {
            // Some pages more, never all (the last unit is PartFilled).
            let had = if prev == PARTIAL { self.folios.placed(idx) } else { 0 };
            b.record_part(idx, prev, (had + u16::from(fill % 3 + 1)).min(pages - 1), res)
        } else {
            b.record(idx, prev, t, res)
        };
        self.folios.unlock(idx, next);
        true
    }

    /// Takes the `choice`-th of the transitions the table allows from folio `idx`'s
    /// state (so every step is a transition, not a refusal).
    fn step_any(&self, idx: usize, choice: usize, fill: u8) {
        let (s, kept) = (self.folios.peek(idx), self.folios.kept(idx));
        // Not munmap: UNMAPPED is terminal, and would soon be all there is.
        let legal: Vec<Transition> =
            ALL.iter().copied().filter(|&t| t != (Transition::Dropped { unmap: true }) && edge(s, kept, t).is_some()).collect();
        if !legal.is_empty() {
            self.step(idx, legal[choice % legal.len()], fill);
        }
    }

    /// The invariants, with no folio locked and no reservation outstanding.
    fn check(&self) {
        let states: Vec<u8> = (0..self.folios.len()).map(|idx| self.folios.peek(idx)).collect();
        self.check_states(&states);
    }

    /// The invariants while this thread holds every folio's lock (`states`: what each
    /// was in when locked): no transition is half done then.
    fn check_states(&self, states: &[u8]) {
        let (mut charged_n, mut probation_n, mut kept_n, mut placed_n) = (0u64, 0u64, 0u64, 0u64);
        for (idx, &s) in states.iter().enumerate() {
            assert_ne!(s, BUSY, "folio {idx} left locked");
            let kept = self.folios.kept(idx);
            assert!(kept_allowed(s) || !kept, "folio {idx}: a kept copy in state {s}");
            assert!(!matches!(s, SWAPPED | CLEAN | PARTIAL) || kept, "folio {idx}: state {s} without its copy");
            let placed = u64::from(self.folios.placed(idx));
            assert!(s == PARTIAL || placed == 0, "folio {idx}: state {s} with {placed} pages placed");
            assert!(placed < (FOLIO / crate::fault::PAGE) as u64, "folio {idx}: all pages placed, still PARTIAL");
            placed_n += placed;
            assert_eq!(self.store.contains(self.book().key(idx)), kept, "folio {idx} (state {s}): store entry vs kept flag");
            charged_n += charged(s) as u64;
            probation_n += (s == PROBATION) as u64;
            kept_n += kept as u64;
        }
        assert_eq!(self.charges.resident.load(Relaxed), charged_n * FOLIO as u64 + placed_n * crate::fault::PAGE as u64, "resident charge");
        assert_eq!(self.charges.probation.load(Relaxed), probation_n * FOLIO as u64, "probation charge");
        let shared_n = states.iter().filter(|&&s| s == SHARED).count() as u64;
        assert_eq!(self.charges.shared.load(Relaxed), shared_n * FOLIO as u64, "shared bytes");
        assert_eq!(self.stats.stored.load(Relaxed), kept_n, "stored folios");
    }
}

/// A model of one folio, written apart from folio.rs: what its state, its kept copy
/// and its placed pages become on each transition, from the documented table alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Model {
    state: u8,
    kept: bool,
    placed: u16,
}

impl Model {
    const NEW: Model = Model { state: EMPTY, kept: false, placed: 0 };

    /// The folio after `t`, or None where the table has no such transition.
    fn after(self, t: Transition, fill: u8) -> Option<Model> {
        use Transition as T;
        let pages = (FOLIO / crate::fault::PAGE) as u16;
        let Model { state: s, kept, placed } = self;
        let to = |state, kept| Some(Model { state, kept, placed: 0 });
        match t {
            T::ZeroFilled | T::FilledAhead | T::Adopted if s == EMPTY => to(RESIDENT, false),
            T::Shared if s == EMPTY => to(SHARED, false),
            T::Unshared if s == SHARED => to(RESIDENT, false),
            T::Carried if s == EMPTY => to(SWAPPED, true),
            T::Touched if matches!(s, RESIDENT | CLEAN | PARTIAL | POISONED) => Some(self),
            T::Dirtied if s == CLEAN => to(RESIDENT, false),
            T::SwappedIn if matches!(s, SWAPPED | PARTIAL) => to(RESIDENT, false),
            T::SwappedInClean | T::InAhead if s == SWAPPED => to(CLEAN, true),
            T::PartIn if matches!(s, SWAPPED | PARTIAL) => {
                Some(Model { state: PARTIAL, kept: true, placed: (placed + u16::from(fill % 3 + 1)).min(pages - 1) })
            }
            T::PartFilled if s == PARTIAL => to(CLEAN, true),
            T::Refaulted if s == PROBATION => to(RESIDENT, false),
            T::RefaultedClean if s == PROBATION && kept => to(CLEAN, true),
            T::Poisoned if matches!(s, EMPTY | SWAPPED | PARTIAL | PROBATION) => to(POISONED, false),
            T::ToProbation if matches!(s, RESIDENT | CLEAN) => to(PROBATION, s == CLEAN),
            T::Stored if s == RESIDENT || (s == PROBATION && !kept) => to(SWAPPED, true),
            T::CleanEvicted if matches!(s, CLEAN | PARTIAL) || (s == PROBATION && kept) => to(SWAPPED, true),
            T::Refused if matches!(s, RESIDENT | CLEAN | PROBATION) => to(RESIDENT, false),
            T::Refused if s == PARTIAL => Some(self),
            T::Dropped { unmap } if s != UNMAPPED => to(if unmap { UNMAPPED } else { EMPTY }, false),
            T::PartDropped => match s {
                RESIDENT | CLEAN => to(RESIDENT, false),
                PROBATION => to(PROBATION, false),
                _ => Some(self),
            },
            T::ForkIn if matches!(s, SWAPPED | PARTIAL | PROBATION) => to(RESIDENT, false),
            _ => None,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// Random legal transitions (munmap now and then, which ends a folio) on four
    /// folios: after every step each folio is what the model says, the code allows
    /// exactly the transitions the model does, and the charges and counters are the
    /// model's sums.
    #[test]
    fn random_transitions_keep_the_books(ops in prop::collection::vec((0usize..4, 0usize..64, any::<u8>()), 1..200)) {
        const PAGE: u64 = crate::fault::PAGE as u64;
        let w = World::new(4);
        let mut model = [Model::NEW; 4];
        for (idx, choice, fill) in ops {
            let m = model[idx];
            // Munmap one time in sixteen: UNMAPPED is terminal.
            let legal: Vec<Transition> = ALL
                .iter()
                .copied()
                .filter(|&t| m.after(t, fill).is_some() && (t != (Transition::Dropped { unmap: true }) || choice % 16 == 0))
                .collect();
            for t in ALL {
                prop_assert_eq!(edge(m.state, m.kept, t).is_some(), m.after(t, fill).is_some(), "{:?} from {:?}", t, m);
            }
            if legal.is_empty() {
                continue;
            }
            let t = legal[choice % legal.len()];
            prop_assert!(w.step(idx, t, fill), "{:?} from {:?} refused", t, m);
            model[idx] = m.after(t, fill).unwrap();
            for (i, m) in model.iter().enumerate() {
                let got = Model { state: w.folios.peek(i), kept: w.folios.kept(i), placed: w.folios.placed(i) };
                prop_assert_eq!(got, *m, "folio {} after {:?} on folio {}", i, t, idx);
                prop_assert_eq!(w.store.contains(w.book().key(i)), m.kept, "folio {}: store entry", i);
            }
            let full = |f: fn(&Model) -> bool| model.iter().filter(|m| f(m)).count() as u64 * FOLIO as u64;
            let placed: u64 = model.iter().map(|m| u64::from(m.placed)).sum();
            prop_assert_eq!(w.charges.resident.load(Relaxed), full(|m| matches!(m.state, RESIDENT | CLEAN | PROBATION)) + placed * PAGE);
            prop_assert_eq!(w.charges.probation.load(Relaxed), full(|m| m.state == PROBATION));
            prop_assert_eq!(w.charges.shared.load(Relaxed), full(|m| m.state == SHARED));
            prop_assert_eq!(w.stats.stored.load(Relaxed), model.iter().filter(|m| m.kept).count() as u64);
            w.check();
        }
    }
}

/// Several threads record transitions on the same folios, with whole and partial
/// drops and fork holds (every folio locked in turn, brought in, unlocked) among
/// them, while another locks all the folios again and again (in order, as a fork
/// hold does) and checks the books each time it holds them all; and once at the end.
#[test]
fn concurrent_transitions_drops_and_fork_holds_keep_the_books() {
    use rand::{Rng, SeedableRng};
    let w = Arc::new(World::new(32));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let checker = {
        let (w, done) = (w.clone(), done.clone());
        std::thread::spawn(move || {
            let mut checks = 0;
            while !done.load(Relaxed) || checks == 0 {
                let states: Vec<u8> = (0..w.folios.len()).map(|idx| w.folios.lock(idx)).collect();
                w.check_states(&states);
                for (idx, &s) in states.iter().enumerate() {
                    w.folios.unlock(idx, s);
                }
                checks += 1;
            }
            checks
        })
    };
    let threads: Vec<_> = (0..4u64)
        .map(|seed| {
            let w = w.clone();
            std::thread::spawn(move || {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
                for _ in 0..3000 {
                    match (seed, rng.gen_range(0..10)) {
                        // A fork hold: every folio in address order, as hold_for_fork.
                        (0, 0) => {
                            for idx in 0..w.folios.len() {
                                w.step(idx, Transition::ForkIn, 0);
                            }
                        }
                        // MADV_DONTNEED of a range, whole folios or parts; now and
                        // then a munmap of one folio.
                        (1, 0..=2) => {
                            let start = rng.gen_range(0..w.folios.len());
                            for idx in start..(start + 4).min(w.folios.len()) {
                                let t = match rng.gen_range(0..100) {
                                    0 => Transition::Dropped { unmap: true },
                                    1..50 => Transition::Dropped { unmap: false },
                                    _ => Transition::PartDropped,
                                };
                                w.step(idx, t, 0);
                            }
                        }
                        // Anything else the table allows (a folio another thread holds
                        // may have moved on by the time we lock it: then it is skipped).
                        _ => w.step_any(rng.gen_range(0..w.folios.len()), rng.gen(), rng.gen()),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    done.store(true, Relaxed);
    let checks = checker.join().unwrap();
    eprintln!("{checks} checks with every folio held");
    assert!(checks > 0);
    w.check();
}

/// The table in the module comment is the code: every row's edges are what `edge`
/// says, and `edge` has no edge the table lacks.
#[test]
fn the_documented_table_is_the_code() {
    let state = |s: &str| -> u8 {
        match s {
            "EMPTY" => EMPTY,
            "RESIDENT" => RESIDENT,
            "CLEAN" => CLEAN,
            "PARTIAL" => PARTIAL,
            "PROBATION" => PROBATION,
            "SWAPPED" => SWAPPED,
            "POISONED" => POISONED,
            "UNMAPPED" => UNMAPPED,
            "SHARED" => SHARED,
            _ => panic!("unknown state {s:?} in the table"),
        }
    };
    let states = [EMPTY, RESIDENT, CLEAN, PARTIAL, PROBATION, SWAPPED, POISONED, UNMAPPED, SHARED];
    let lines: Vec<&str> = include_str!("../folio.rs").lines().map(|l| l.strip_prefix("//! ").unwrap_or("")).collect();
    let header = lines.iter().position(|l| l.starts_with("transition ")).expect("the table's header");
    let col = |name: &str| lines[header].find(name).unwrap();
    let (from_at, to_at, copy_at) = (col("from"), col("to "), col("kept copy"));
    let mut documented = std::collections::BTreeSet::new();
    let mut current: Vec<Transition> = Vec::new();
    for line in lines[header + 2..].iter().take_while(|l| !l.starts_with("```")) {
        let head = line[..from_at].trim();
        if !head.is_empty() {
            current = ALL.iter().copied().filter(|t| format!("{t:?}").replace(' ', "").replace(":true", "").replace(":false", "") == head).collect();
            assert!(!current.is_empty(), "unknown transition {head:?}");
        }
        let (from, to) = (line[from_at..to_at].trim(), line[to_at..copy_at].trim());
        let froms: Vec<(u8, bool)> = if from == "all but UNMAPPED" {
            states.iter().filter(|&&s| s != UNMAPPED).map(|&s| (s, kept_allowed(s))).collect()
        } else {
            let kept = from.contains("(kept)");
            from.split_whitespace().filter(|w| *w != "(kept)").map(state).map(|s| (s, kept || matches!(s, SWAPPED | CLEAN | PARTIAL))).collect()
        };
        for &t in &current {
            for &(s, kept) in &froms {
                let expect = match (to, t) {
                    ("(same)", _) => s,
                    ("EMPTY / UNMAPPED", Transition::Dropped { unmap }) => if unmap { UNMAPPED } else { EMPTY },
                    (other, _) => state(other),
                };
                let got = edge(s, kept, t).unwrap_or_else(|| panic!("{t:?} from {s} is in the table, not in the code"));
                assert_eq!(got.next, expect, "{t:?} from {s}");
                documented.insert((format!("{t:?}"), s));
            }
        }
    }
    for t in ALL {
        for s in states {
            for kept in [false, true] {
                if edge(s, kept, t).is_some() {
                    assert!(documented.contains(&(format!("{t:?}"), s)), "{t:?} from state {s} is in the code, not in the table");
                }
            }
        }
    }
}

#[test]
fn a_clean_folio_through_probation_and_back() {
    let w = World::new(1);
    for t in [Transition::ZeroFilled, Transition::Stored, Transition::SwappedInClean, Transition::ToProbation, Transition::Refaulted] {
        assert!(w.step(0, t, 3), "{t:?} from {}", w.folios.peek(0));
        w.check();
    }
    assert_eq!(w.folios.peek(0), RESIDENT);
}


/// Faults past the limit sleep on the charges' futex; each folio's charge given back
/// wakes one, which takes the room (as a fault charges its folio). All get in long
/// before their timeout: no wake is lost, none waits for the clock.
#[test]
fn freed_charges_wake_the_faults_sleeping_for_room() {
    use std::time::{Duration, Instant};
    const LIMIT: u64 = 8 * FOLIO as u64;
    const FAULTS: usize = 6;
    let charges = Arc::new(Charges::default());
    charges.resident.store(LIMIT + FOLIO as u64, Relaxed);
    let start = Instant::now();
    let faults: Vec<_> = (0..FAULTS)
        .map(|_| {
            let c = charges.clone();
            std::thread::spawn(move || {
                let full = || c.resident.load(Relaxed) > LIMIT;
                loop {
                    while full() {
                        c.sleep_for_room(Duration::from_secs(60), full);
                    }
                    // Take the room, unless another took it first.
                    let had = c.resident.fetch_add(FOLIO as u64, Relaxed);
                    if had <= LIMIT {
                        return;
                    }
                    c.resident.fetch_sub(FOLIO as u64, Relaxed);
                }
            })
        })
        .collect();
    let mut freed = 0;
    while freed < FAULTS {
        // Free a folio once the last was taken (usage back past the limit).
        if charges.resident.load(Relaxed) > LIMIT {
            charges.uncharge(FOLIO as u64);
            freed += 1;
        } else {
            std::thread::yield_now();
        }
    }
    for f in faults {
        f.join().unwrap();
    }
    assert!(start.elapsed() < Duration::from_secs(20), "a fault waited for its timeout: {:?}", start.elapsed());
    assert_eq!(charges.resident.load(Relaxed), LIMIT + FOLIO as u64);
}
