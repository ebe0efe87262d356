//! uzswap-capi: the C API of uzswap's runtime. The header is include/uzswap.h; each
//! function here is documented there. A `uzswap_runtime` is a boxed [`CRuntime`]: the
//! Rust runtime plus the regions the C side created, keyed by address, so that
//! `uzswap_region_destroy(rt, addr)` and `uzswap_runtime_free` can drop them.
//! No function unwinds into C: panics are caught and reported as errors.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use uzswap_runtime::shim_support::Settings;
use uzswap_runtime::{FaultPath, ReclaimPolicy, Region, Runtime, RuntimeConfig};

pub struct CRuntime {
    rt: Runtime,
    regions: uzswap_sync::Mutex<Vec<Region>>,
}

#[repr(C)]
pub struct UzswapConfig {
    pub budget_bytes: u64,
    pub fault_path: c_int,
    pub policy: c_int,
    pub publish_stats: c_int,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: impl std::fmt::Display) {
    let text = CString::new(msg.to_string().replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

/// Runs `f`, turning a panic into an error and `fallback`.
fn guard<T>(fallback: T, f: impl FnOnce() -> Result<T, String>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(msg)) => {
            set_error(msg);
            fallback
        }
        Err(_) => {
            set_error("internal error (panic) in uzswap");
            fallback
        }
    }
}

/// # Safety
/// `cfg` must be NULL or point to a writable `struct uzswap_config`.
#[no_mangle]
pub unsafe extern "C" fn uzswap_config_default(cfg: *mut UzswapConfig, budget_bytes: u64) {
    if let Some(cfg) = cfg.as_mut() {
        *cfg = UzswapConfig { budget_bytes, fault_path: 0, policy: 0, publish_stats: 1 };
    }
}

/// # Safety
/// `cfg` must be NULL or point to a valid `struct uzswap_config`.
#[no_mangle]
pub unsafe extern "C" fn uzswap_runtime_new(cfg: *const UzswapConfig) -> *mut CRuntime {
    let cfg = cfg.as_ref();
    guard(std::ptr::null_mut(), || new_runtime(cfg.ok_or("uzswap_runtime_new: cfg is NULL")?, None))
}

/// # Safety
/// `cfg` must be NULL or point to a valid `struct uzswap_config`; `settings` NULL or
/// a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn uzswap_runtime_new_with(cfg: *const UzswapConfig, settings: *const c_char) -> *mut CRuntime {
    let cfg = cfg.as_ref();
    let text = (!settings.is_null()).then(|| std::ffi::CStr::from_ptr(settings).to_string_lossy().into_owned());
    guard(std::ptr::null_mut(), || new_runtime(cfg.ok_or("uzswap_runtime_new_with: cfg is NULL")?, text.as_deref()))
}

/// A runtime from the C config, and (`settings`) the config file's `key = value`
/// lines, which name every setting as `uzswap run` does and win over the struct.
fn new_runtime(c: &UzswapConfig, settings: Option<&str>) -> Result<*mut CRuntime, String> {
    let fault_path = match c.fault_path {
        0 => FaultPath::Thread,
        1 => FaultPath::Sigbus,
        x => return Err(format!("fault_path {x}: must be UZSWAP_FAULT_THREAD (0) or UZSWAP_FAULT_SIGBUS (1)")),
    };
    let policy = match c.policy {
        0 => ReclaimPolicy::Probation,
        1 => ReclaimPolicy::Fifo,
        x => return Err(format!("policy {x}: must be UZSWAP_POLICY_PROBATION (0) or UZSWAP_POLICY_FIFO (1)")),
    };
    let mut rc = match settings {
        None => {
            let mut rc = RuntimeConfig::new(c.budget_bytes);
            rc.fault_path = fault_path;
            rc.policy = policy;
            rc
        }
        Some(text) => {
            let mut s = Settings { budget: Some(c.budget_bytes), fault_path, policy, ..Settings::default() };
            s.apply_config(text, "uzswap_runtime_new_with")?;
            s.validate()?;
            let mut rc = s.runtime_config();
            if let Some(remote) = &mut rc.remote {
                // A bad URL or an unreachable store is this call's error, not a later one.
                remote.lazy = false;
            }
            rc
        }
    };
    rc.publish_stats = c.publish_stats != 0;
    let rt = Runtime::new(rc).map_err(|e| e.to_string())?;
    Ok(Box::into_raw(Box::new(CRuntime { rt, regions: uzswap_sync::Mutex::new(Vec::new()) })))
}

/// # Safety
/// `rt` must be NULL or a runtime from `uzswap_runtime_new`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn uzswap_runtime_free(rt: *mut CRuntime) {
    if !rt.is_null() {
        guard((), || {
            drop(Box::from_raw(rt));
            Ok(())
        })
    }
}

/// # Safety
/// `rt` must be a live runtime from `uzswap_runtime_new`.
#[no_mangle]
pub unsafe extern "C" fn uzswap_region_create(rt: *mut CRuntime, len: usize, folio_size: usize) -> *mut c_void {
    let rt = rt.as_ref();
    guard(std::ptr::null_mut(), || {
        let rt = rt.ok_or("uzswap_region_create: rt is NULL")?;
        let region = rt.rt.create_region(len, folio_size).map_err(|e| e.to_string())?;
        let p = region.as_ptr().cast();
        rt.regions.lock().push(region);
        Ok(p)
    })
}

/// # Safety
/// `rt` must be a live runtime from `uzswap_runtime_new`.
#[no_mangle]
pub unsafe extern "C" fn uzswap_region_destroy(rt: *mut CRuntime, addr: *mut c_void) -> c_int {
    let rt = rt.as_ref();
    guard(-1, || {
        let rt = rt.ok_or("uzswap_region_destroy: rt is NULL")?;
        let region = {
            let mut regions = rt.regions.lock();
            let i = regions
                .iter()
                .position(|r| r.as_ptr().cast() == addr)
                .ok_or_else(|| format!("uzswap_region_destroy: {addr:p} is not a region of this runtime"))?;
            regions.swap_remove(i)
        };
        drop(region);
        Ok(0)
    })
}

/// # Safety
/// `rt` must be a live runtime from `uzswap_runtime_new`.
#[no_mangle]
pub unsafe extern "C" fn uzswap_usage(rt: *mut CRuntime) -> u64 {
    rt.as_ref().map_or(0, |rt| rt.rt.usage())
}

/// # Safety
/// `rt` must be a live runtime; `buf` must be NULL (with `len` 0) or hold `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn uzswap_stats_json(rt: *mut CRuntime, buf: *mut c_char, len: usize) -> usize {
    let rt = rt.as_ref();
    guard(0, || {
        let rt = rt.ok_or("uzswap_stats_json: rt is NULL")?;
        let text = serde_json::to_string(&rt.rt.stats()).map_err(|e| e.to_string())?;
        if !buf.is_null() && len > 0 {
            let n = text.len().min(len - 1);
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast(), n);
            *buf.add(n) = 0;
        }
        Ok(text.len())
    })
}

#[no_mangle]
pub extern "C" fn uzswap_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
