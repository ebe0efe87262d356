//! The functions we interpose, as the next library (libc) defines them, found with
//! dlsym(RTLD_NEXT) on first use; and the bootstrap allocator that serves whatever
//! dlsym itself allocates while we are still looking malloc up.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering::*};

thread_local! {
    /// Set while this thread runs dlsym for us: its allocations come from BOOT.
    static RESOLVING: Cell<bool> = const { Cell::new(false) };
}

const BOOT_LEN: usize = 256 << 10;
#[repr(align(64))]
struct Boot([u8; BOOT_LEN]);
static mut BOOT: Boot = Boot([0; BOOT_LEN]);
static BOOT_USED: AtomicUsize = AtomicUsize::new(0);

pub fn resolving() -> bool {
    RESOLVING.try_with(|r| r.get()).unwrap_or(false)
}

/// Bump allocation from the static buffer (never freed, always zeroed).
pub fn boot_alloc(size: usize) -> *mut c_void {
    let size = size.max(1).div_ceil(16) * 16;
    let at = BOOT_USED.fetch_add(size, Relaxed);
    if at + size > BOOT_LEN {
        return std::ptr::null_mut();
    }
    // SAFETY: `at + size <= BOOT_LEN`, so the pointer is inside BOOT; fetch_add hands
    // each byte range out once, and BOOT is only ever reached through such pointers
    // (raw, no reference), so no two users alias.
    unsafe { (&raw mut BOOT.0).cast::<u8>().add(at).cast() }
}

pub fn is_boot(p: *const c_void) -> bool {
    let start = (&raw const BOOT).cast::<u8>() as usize;
    (start..start + BOOT_LEN).contains(&(p as usize))
}

/// Bytes from `p` to the end of the bootstrap buffer (the most a boot block can hold).
pub fn boot_room(p: *const c_void) -> usize {
    (&raw const BOOT).cast::<u8>() as usize + BOOT_LEN - p as usize
}

fn lookup(cache: &AtomicUsize, name: &CStr) -> usize {
    let p = cache.load(Relaxed);
    if p != 0 {
        return p;
    }
    let was = RESOLVING.with(|r| r.replace(true));
    // SAFETY: `name` is a NUL-terminated C string that outlives the call; RTLD_NEXT is
    // a valid pseudo-handle from inside a shared object.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    RESOLVING.with(|r| r.set(was));
    if p == 0 {
        let msg = b"uzswap shim: a libc function is missing (dlsym RTLD_NEXT failed)\n";
        // SAFETY: write reads `msg.len()` bytes of a live static; abort never returns.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::abort();
        }
    }
    cache.store(p, Relaxed);
    p
}

macro_rules! real {
    ($($name:ident: $ty:ty;)*) => {
        /// Looks every function up now (a signal handler may need one later, and dlsym
        /// is not async-signal-safe).
        pub fn resolve_all() {
            $( let _ = $name(); )*
        }
        $(
            #[allow(non_upper_case_globals)]
            pub fn $name() -> $ty {
                static CACHE: AtomicUsize = AtomicUsize::new(0);
                let name = concat!(stringify!($name), "\0");
                let p = lookup(&CACHE, CStr::from_bytes_with_nul(name.as_bytes()).expect("nul-terminated"));
                // SAFETY: `p` is non-null (lookup aborts otherwise) and is the next
                // library's function of this name, whose C prototype is this type.
                unsafe { std::mem::transmute::<usize, $ty>(p) }
            }
        )*
    };
}

type SizeT = usize;
real! {
    malloc: unsafe extern "C" fn(SizeT) -> *mut c_void;
    calloc: unsafe extern "C" fn(SizeT, SizeT) -> *mut c_void;
    realloc: unsafe extern "C" fn(*mut c_void, SizeT) -> *mut c_void;
    free: unsafe extern "C" fn(*mut c_void);
    posix_memalign: unsafe extern "C" fn(*mut *mut c_void, SizeT, SizeT) -> c_int;
    aligned_alloc: unsafe extern "C" fn(SizeT, SizeT) -> *mut c_void;
    memalign: unsafe extern "C" fn(SizeT, SizeT) -> *mut c_void;
    valloc: unsafe extern "C" fn(SizeT) -> *mut c_void;
    pvalloc: unsafe extern "C" fn(SizeT) -> *mut c_void;
    malloc_usable_size: unsafe extern "C" fn(*mut c_void) -> SizeT;
    mmap: unsafe extern "C" fn(*mut c_void, SizeT, c_int, c_int, c_int, libc::off_t) -> *mut c_void;
    munmap: unsafe extern "C" fn(*mut c_void, SizeT) -> c_int;
    mremap: unsafe extern "C" fn(*mut c_void, SizeT, SizeT, c_int, *mut c_void) -> *mut c_void;
    madvise: unsafe extern "C" fn(*mut c_void, SizeT, c_int) -> c_int;
    mprotect: unsafe extern "C" fn(*mut c_void, SizeT, c_int) -> c_int;
    close: unsafe extern "C" fn(c_int) -> c_int;
    opendir: unsafe extern "C" fn(*const std::ffi::c_char) -> *mut libc::DIR;
    fdopendir: unsafe extern "C" fn(c_int) -> *mut libc::DIR;
    closedir: unsafe extern "C" fn(*mut libc::DIR) -> c_int;
    readdir64: unsafe extern "C" fn(*mut libc::DIR) -> *mut libc::dirent64;
    dup2: unsafe extern "C" fn(c_int, c_int) -> c_int;
    setgroups: unsafe extern "C" fn(SizeT, *const libc::gid_t) -> c_int;
    setuid: unsafe extern "C" fn(libc::uid_t) -> c_int;
    seteuid: unsafe extern "C" fn(libc::uid_t) -> c_int;
    setreuid: unsafe extern "C" fn(libc::uid_t, libc::uid_t) -> c_int;
    setresuid: unsafe extern "C" fn(libc::uid_t, libc::uid_t, libc::uid_t) -> c_int;
    setgid: unsafe extern "C" fn(libc::gid_t) -> c_int;
    setegid: unsafe extern "C" fn(libc::gid_t) -> c_int;
    setregid: unsafe extern "C" fn(libc::gid_t, libc::gid_t) -> c_int;
    setresgid: unsafe extern "C" fn(libc::gid_t, libc::gid_t, libc::gid_t) -> c_int;
    dup3: unsafe extern "C" fn(c_int, c_int, c_int) -> c_int;
    pthread_create: unsafe extern "C" fn(
        *mut libc::pthread_t,
        *const libc::pthread_attr_t,
        extern "C" fn(*mut c_void) -> *mut c_void,
        *mut c_void,
    ) -> c_int;
    sigaction: unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;
    read: unsafe extern "C" fn(c_int, *mut c_void, SizeT) -> isize;
    write: unsafe extern "C" fn(c_int, *const c_void, SizeT) -> isize;
    pread64: unsafe extern "C" fn(c_int, *mut c_void, SizeT, libc::off64_t) -> isize;
    pwrite64: unsafe extern "C" fn(c_int, *const c_void, SizeT, libc::off64_t) -> isize;
    readv: unsafe extern "C" fn(c_int, *const libc::iovec, c_int) -> isize;
    writev: unsafe extern "C" fn(c_int, *const libc::iovec, c_int) -> isize;
    preadv64: unsafe extern "C" fn(c_int, *const libc::iovec, c_int, libc::off64_t) -> isize;
    pwritev64: unsafe extern "C" fn(c_int, *const libc::iovec, c_int, libc::off64_t) -> isize;
    recv: unsafe extern "C" fn(c_int, *mut c_void, SizeT, c_int) -> isize;
    process_vm_readv: unsafe extern "C" fn(libc::pid_t, *const libc::iovec, libc::c_ulong, *const libc::iovec, libc::c_ulong, libc::c_ulong) -> isize;
    process_vm_writev: unsafe extern "C" fn(libc::pid_t, *const libc::iovec, libc::c_ulong, *const libc::iovec, libc::c_ulong, libc::c_ulong) -> isize;
    getxattr: unsafe extern "C" fn(*const c_char, *const c_char, *mut c_void, SizeT) -> isize;
    lgetxattr: unsafe extern "C" fn(*const c_char, *const c_char, *mut c_void, SizeT) -> isize;
    fgetxattr: unsafe extern "C" fn(c_int, *const c_char, *mut c_void, SizeT) -> isize;
    listxattr: unsafe extern "C" fn(*const c_char, *mut c_char, SizeT) -> isize;
    llistxattr: unsafe extern "C" fn(*const c_char, *mut c_char, SizeT) -> isize;
    flistxattr: unsafe extern "C" fn(c_int, *mut c_char, SizeT) -> isize;
    setxattr: unsafe extern "C" fn(*const c_char, *const c_char, *const c_void, SizeT, c_int) -> c_int;
    lsetxattr: unsafe extern "C" fn(*const c_char, *const c_char, *const c_void, SizeT, c_int) -> c_int;
    fsetxattr: unsafe extern "C" fn(c_int, *const c_char, *const c_void, SizeT, c_int) -> c_int;
    send: unsafe extern "C" fn(c_int, *const c_void, SizeT, c_int) -> isize;
    recvfrom: unsafe extern "C" fn(c_int, *mut c_void, SizeT, c_int, *mut libc::sockaddr, *mut libc::socklen_t) -> isize;
    sendto: unsafe extern "C" fn(c_int, *const c_void, SizeT, c_int, *const libc::sockaddr, libc::socklen_t) -> isize;
    sendmsg: unsafe extern "C" fn(c_int, *const libc::msghdr, c_int) -> isize;
    recvmsg: unsafe extern "C" fn(c_int, *mut libc::msghdr, c_int) -> isize;
    fread: unsafe extern "C" fn(*mut c_void, SizeT, SizeT, *mut libc::FILE) -> SizeT;
    fread_unlocked: unsafe extern "C" fn(*mut c_void, SizeT, SizeT, *mut libc::FILE) -> SizeT;
    fwrite: unsafe extern "C" fn(*const c_void, SizeT, SizeT, *mut libc::FILE) -> SizeT;
    fwrite_unlocked: unsafe extern "C" fn(*const c_void, SizeT, SizeT, *mut libc::FILE) -> SizeT;
    __fread_chk: unsafe extern "C" fn(*mut c_void, SizeT, SizeT, SizeT, *mut libc::FILE) -> SizeT;
    __fread_unlocked_chk: unsafe extern "C" fn(*mut c_void, SizeT, SizeT, SizeT, *mut libc::FILE) -> SizeT;
    fputs: unsafe extern "C" fn(*const c_char, *mut libc::FILE) -> c_int;
    fputs_unlocked: unsafe extern "C" fn(*const c_char, *mut libc::FILE) -> c_int;
    fflush: unsafe extern "C" fn(*mut libc::FILE) -> c_int;
    fflush_unlocked: unsafe extern "C" fn(*mut libc::FILE) -> c_int;
    fclose: unsafe extern "C" fn(*mut libc::FILE) -> c_int;
    fopen: unsafe extern "C" fn(*const c_char, *const c_char) -> *mut libc::FILE;
    fopen64: unsafe extern "C" fn(*const c_char, *const c_char) -> *mut libc::FILE;
    fdopen: unsafe extern "C" fn(c_int, *const c_char) -> *mut libc::FILE;
    freopen: unsafe extern "C" fn(*const c_char, *const c_char, *mut libc::FILE) -> *mut libc::FILE;
    freopen64: unsafe extern "C" fn(*const c_char, *const c_char, *mut libc::FILE) -> *mut libc::FILE;
    tmpfile: unsafe extern "C" fn() -> *mut libc::FILE;
    tmpfile64: unsafe extern "C" fn() -> *mut libc::FILE;
    popen: unsafe extern "C" fn(*const c_char, *const c_char) -> *mut libc::FILE;
    pclose: unsafe extern "C" fn(*mut libc::FILE) -> c_int;
    setvbuf: unsafe extern "C" fn(*mut libc::FILE, *mut c_char, c_int, SizeT) -> c_int;
    setbuf: unsafe extern "C" fn(*mut libc::FILE, *mut c_char);
    setbuffer: unsafe extern "C" fn(*mut libc::FILE, *mut c_char, SizeT);
    setlinebuf: unsafe extern "C" fn(*mut libc::FILE);
    __cxa_thread_atexit_impl: unsafe extern "C" fn(unsafe extern "C" fn(*mut c_void), *mut c_void, *mut c_void) -> c_int;
    __register_atfork: unsafe extern "C" fn(Option<extern "C" fn()>, Option<extern "C" fn()>, Option<extern "C" fn()>, *mut c_void) -> c_int;
}
