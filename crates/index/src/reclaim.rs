//! Deferred destruction of unlinked nodes and values.
//!
//! Normally a thin wrapper over crossbeam-epoch's global collector (its pin is
//! a thread-local handle plus a fence). Under loom, crossbeam-epoch's own
//! atomics are invisible to the model checker and its thread-locals would be
//! shared by all model threads, so a stand-in with the same guarantee takes its
//! place: an object retired while any guard is alive is destroyed only once no
//! guard is alive. The stand-in also checks the index's side of the contract —
//! nothing is retired twice and nothing is dereferenced after its grace period
//! ended — by keeping "freed" objects allocated (poisoned) until the index is
//! dropped, so their addresses cannot be reused and mistaken for new objects.

pub(crate) use imp::{Guard, Reclaim};

#[cfg(not(loom))]
mod imp {
    use std::marker::PhantomData;

    use crossbeam_epoch::Shared;

    pub(crate) struct Reclaim;

    pub(crate) struct Guard<'r> {
        epoch: crossbeam_epoch::Guard,
        _reclaim: PhantomData<&'r Reclaim>,
    }

    impl Reclaim {
        pub(crate) fn new() -> Self {
            Reclaim
        }

        #[inline]
        pub(crate) fn pin(&self) -> Guard<'_> {
            Guard { epoch: crossbeam_epoch::pin(), _reclaim: PhantomData }
        }
    }

    impl Guard<'_> {
        /// # Safety
        /// `ptr` came from `Box::into_raw`, was loaded while this guard was alive
        /// and is still valid.
        #[inline]
        pub(crate) unsafe fn deref<T>(&self, ptr: *mut T) -> &T {
            &*ptr
        }

        /// Destroys `ptr`'s box once every guard alive now has been dropped.
        ///
        /// # Safety
        /// `ptr` came from `Box::into_raw`, is no longer reachable by a thread
        /// that pins from now on, and is retired exactly once.
        #[inline]
        pub(crate) unsafe fn retire<T: Send + 'static>(&self, ptr: *mut T) {
            self.epoch.defer_destroy(Shared::from(ptr as *const T));
        }
    }
}

#[cfg(loom)]
mod imp {
    use loom::sync::Mutex;

    pub(crate) struct Reclaim {
        state: Mutex<State>,
        /// Past their grace period; any dereference now is a use after free.
        /// A std mutex: this is the checker's bookkeeping, not part of the model.
        poisoned: std::sync::Mutex<Vec<Retired>>,
    }

    struct State {
        pinned: usize,
        retired: Vec<Retired>,
    }

    struct Retired {
        addr: usize,
        destroy: unsafe fn(usize),
    }

    unsafe fn destroy_box<T>(addr: usize) {
        drop(Box::from_raw(addr as *mut T));
    }

    pub(crate) struct Guard<'r> {
        reclaim: &'r Reclaim,
    }

    impl Reclaim {
        pub(crate) fn new() -> Self {
            Reclaim {
                state: Mutex::new(State { pinned: 0, retired: Vec::new() }),
                poisoned: std::sync::Mutex::new(Vec::new()),
            }
        }

        pub(crate) fn pin(&self) -> Guard<'_> {
            self.state.lock().unwrap().pinned += 1;
            Guard { reclaim: self }
        }

        fn is_poisoned(&self, addr: usize) -> bool {
            self.poisoned.lock().unwrap().iter().any(|r| r.addr == addr)
        }
    }

    impl Guard<'_> {
        pub(crate) unsafe fn deref<T>(&self, ptr: *mut T) -> &T {
            assert!(!self.reclaim.is_poisoned(ptr as usize), "use after free of {ptr:p}");
            &*ptr
        }

        pub(crate) unsafe fn retire<T: Send + 'static>(&self, ptr: *mut T) {
            let addr = ptr as usize;
            assert!(!self.reclaim.is_poisoned(addr), "retired after free: {ptr:p}");
            let mut state = self.reclaim.state.lock().unwrap();
            assert!(state.retired.iter().all(|r| r.addr != addr), "retired twice: {ptr:p}");
            state.retired.push(Retired { addr, destroy: destroy_box::<T> });
        }
    }

    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            let mut state = self.reclaim.state.lock().unwrap();
            state.pinned -= 1;
            if state.pinned == 0 {
                let expired = std::mem::take(&mut state.retired);
                self.reclaim.poisoned.lock().unwrap().extend(expired);
            }
        }
    }

    impl Drop for Reclaim {
        fn drop(&mut self) {
            let state = self.state.get_mut().unwrap();
            let poisoned = self.poisoned.get_mut().unwrap();
            for r in state.retired.drain(..).chain(poisoned.drain(..)) {
                // SAFETY: retired once, from Box::into_raw, never destroyed yet.
                unsafe { (r.destroy)(r.addr) };
            }
        }
    }
}
