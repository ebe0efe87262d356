/* A program that brings its own allocator, as one linked with jemalloc or tcmalloc
 * does: it defines malloc and friends itself, and maps its big chunks with mmap while
 * holding its allocator's lock (jemalloc's extent hooks do). Whatever uzswap does
 * inside that mmap must not call the program's malloc: here that would take the lock
 * again. The lock is an error-checking mutex, so instead of hanging as jemalloc does,
 * the program says so and aborts.
 *
 *   cc -O2 -pthread -o ownmalloc examples/ownmalloc.c
 *   uzswap run --budget 32M -- ./ownmalloc 128
 *
 * It allocates N MiB in 1 MiB blocks (each its own mmap, under the lock), writes a
 * pattern, lets a thread allocate small blocks meanwhile, forks (the child checks a
 * block), frees half the blocks (munmap under the lock), and checks every byte left,
 * then says "ok" and writes and checks them again, so that stdout's buffer, which this
 * allocator placed in memory uzswap manages, is swapped out when exit flushes it.
 * After main starts, only its own two threads may call its malloc; and at no time may
 * uzswap's own code call it (glibc may, for the threads it makes: their DTVs): every
 * caller's address is kept and looked up at the end.
 * Prints "ownmalloc: ok" and exits 0 when all is well.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- The program's allocator: a bump heap for small blocks, mmap for big ones. ---- */

static pthread_mutex_t lock = PTHREAD_ERRORCHECK_MUTEX_INITIALIZER_NP;
static char *arena, *arena_end;
#define BIG (256 << 10)
#define HDR 16

static void die(const char *msg) {
    write(2, msg, strlen(msg));
    abort();
}

static void take(void) {
    int e = pthread_mutex_lock(&lock);
    if (e == EDEADLK)
        die("ownmalloc: my malloc was called while this thread holds my allocator's lock "
            "(from inside my own mmap or munmap)\n");
    if (e)
        die("ownmalloc: pthread_mutex_lock failed\n");
}

static void give(void) {
    pthread_mutex_unlock(&lock);
}

/* After main starts, only main and the thread it makes may call malloc: any other
 * caller is uzswap's (its threads must never use the program's allocator). */
static _Atomic int main_tid, chatter_tid, foreign;

/* The code that called an entry point of this allocator (its return address), kept
 * once each: at the end, none may be in uzswap's library. A program that defines malloc
 * is handed every malloc call that is not bound elsewhere, uzswap's included unless its
 * library binds them to its own; rustc (jemalloc) hung when std's thread handles of
 * uzswap's threads landed in memory uzswap then swapped out. */
#define CALLERS 512
static _Atomic uintptr_t callers[CALLERS];
static void note_caller(void *ra) {
    uintptr_t a = (uintptr_t)ra;
    for (int i = 0; i < CALLERS; i++) {
        uintptr_t seen = callers[i];
        if (seen == a)
            return;
        if (!seen && __atomic_compare_exchange_n(&callers[i], &seen, a, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return;
        if (seen == a)
            return;
    }
}
#define CALLED() note_caller(__builtin_return_address(0))

/* The first caller in uzswap's library, or NULL. */
static const char *uzswap_caller(void) {
    for (int i = 0; i < CALLERS && callers[i]; i++) {
        Dl_info info;
        if (dladdr((void *)callers[i], &info) && info.dli_fname && strstr(info.dli_fname, "libuzswap"))
            return info.dli_sname ? info.dli_sname : info.dli_fname;
    }
    return NULL;
}

static void *alloc(size_t n, size_t align) {
    int tid = main_tid ? gettid() : 0;
    if (tid && tid != main_tid && tid != chatter_tid)
        foreign++;
    if (align < HDR)
        align = HDR;
    if (n > SIZE_MAX / 2)
        return NULL;
    take();
    char *p;
    if (n >= BIG) {
        size_t len = (n + HDR + align + 4095) & ~(size_t)4095;
        char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            give();
            return NULL;
        }
        p = (char *)(((uintptr_t)m + HDR + align - 1) & ~(uintptr_t)(align - 1));
        ((size_t *)p)[-2] = n;
        ((size_t *)p)[-1] = (size_t)(p - m) | ((size_t)1 << 63);
    } else {
        for (;;) {
            p = (char *)(((uintptr_t)arena + HDR + align - 1) & ~(uintptr_t)(align - 1));
            if (arena && p + n <= arena_end)
                break;
            size_t len = 4 << 20;
            arena = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (arena == MAP_FAILED)
                die("ownmalloc: mmap of an arena failed\n");
            arena_end = arena + len;
        }
        arena = p + n;
        ((size_t *)p)[-2] = n;
        ((size_t *)p)[-1] = 0;
    }
    give();
    return p;
}

static size_t size_of(void *p) {
    return ((size_t *)p)[-2];
}

void *malloc(size_t n) {
    CALLED();
    return alloc(n, 16);
}

void free(void *p) {
    if (!p)
        return;
    size_t tag = ((size_t *)p)[-1];
    if (!(tag >> 63))
        return; /* small blocks are never reused: a bump heap */
    char *m = (char *)p - (tag & ~((size_t)1 << 63));
    size_t len = ((size_t)((char *)p - m) + size_of(p) + 4095) & ~(size_t)4095;
    take();
    if (munmap(m, len))
        die("ownmalloc: munmap failed\n");
    give();
}

void *calloc(size_t n, size_t size) {
    CALLED();
    if (size && n > SIZE_MAX / size)
        return NULL;
    void *p = malloc(n * size);
    if (p)
        memset(p, 0, n * size);
    return p;
}

void *realloc(void *p, size_t n) {
    CALLED();
    if (!p)
        return malloc(n);
    void *q = malloc(n);
    if (q) {
        size_t old = size_of(p);
        memcpy(q, p, old < n ? old : n);
        free(p);
    }
    return q;
}

int posix_memalign(void **out, size_t align, size_t n) {
    CALLED();
    void *p = alloc(n, align);
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}
void *aligned_alloc(size_t align, size_t n) { CALLED(); return alloc(n, align); }
void *memalign(size_t align, size_t n) { CALLED(); return alloc(n, align); }
void *valloc(size_t n) { CALLED(); return alloc(n, 4096); }
void *pvalloc(size_t n) { CALLED(); return alloc((n + 4095) & ~(size_t)4095, 4096); }
size_t malloc_usable_size(void *p) { return p ? size_of(p) : 0; }

/* ---- The workload. ---- */

static uint64_t word(size_t i, uint64_t seed) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 29;
    return x * 0xBF58476D1CE4E5B9ull;
}

static void fill(uint64_t *b, size_t words, uint64_t seed) {
    for (size_t i = 0; i < words; i++)
        b[i] = i % 8 ? (i & 0xff) : word(i, seed); /* compresses, but not to nothing */
}

static int check(const uint64_t *b, size_t words, uint64_t seed) {
    for (size_t i = 0; i < words; i++)
        if (b[i] != (i % 8 ? (i & 0xff) : word(i, seed)))
            return 0;
    return 1;
}

static void *chatter(void *arg) {
    (void)arg;
    chatter_tid = gettid();
    for (int i = 0; i < 20000; i++) {
        char *p = malloc(64 + i % 512);
        memset(p, i, 64);
        free(p);
    }
    return NULL;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 128;
    size_t block = 1 << 20, words = block / 8;
    main_tid = gettid();
    uint64_t **b = malloc(mib * sizeof *b);
    pthread_t t;
    chatter_tid = -1;
    if (pthread_create(&t, NULL, chatter, NULL))
        die("ownmalloc: pthread_create failed\n");
    for (size_t i = 0; i < mib; i++) {
        b[i] = malloc(block);
        if (!b[i])
            die("ownmalloc: malloc of a block failed\n");
        fill(b[i], words, i);
    }
    pthread_join(t, NULL);
    pid_t pid = fork();
    if (pid == 0)
        _exit(check(b[0], words, 0) && check(b[mib / 2], words, mib / 2) ? 0 : 3);
    int st;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) {
        fprintf(stderr, "ownmalloc: the forked child saw wrong bytes\n");
        return 1;
    }
    for (size_t i = 0; i < mib; i += 2)
        free(b[i]);
    for (size_t i = 1; i < mib; i += 2) {
        if (!check(b[i], words, i)) {
            fprintf(stderr, "ownmalloc: block %zu differs\n", i);
            return 1;
        }
    }
    if (foreign) {
        fprintf(stderr, "ownmalloc: a thread I did not make called my malloc %d times\n", (int)foreign);
        return 1;
    }
    const char *who = uzswap_caller();
    if (who) {
        fprintf(stderr, "ownmalloc: uzswap's own code called my malloc (from %s)\n", who);
        return 1;
    }
    /* Said before the rest is written and checked once more: the line waits in stdout's
     * buffer (a pipe's: fully buffered), which this allocator placed in memory uzswap
     * manages, and goes out cold; exit's flush must still write it. */
    printf("ownmalloc: ok\n");
    for (int round = 0; round < 2; round++)
        for (size_t i = 1; i < mib; i += 2)
            fill(b[i], words, i); /* dirty: written out again, after the buffer */
    for (size_t i = 1; i < mib; i += 2) {
        if (!check(b[i], words, i)) {
            fprintf(stderr, "ownmalloc: block %zu differs after it was written again\n", i);
            return 1;
        }
    }
    return 0;
}
