/* Memory that never comes through a malloc or mmap request a preload can serve, made
 * the ways allocators and runtimes make it:
 *   raw      mmap by system call (Go)
 *   brk      the brk heap grown with sbrk (glibc's main arena grows so, inside libc)
 *   arena    small mallocs from a second thread (glibc makes that thread an arena of
 *            its own with an internal mmap)
 *   commit   a PROT_NONE reservation committed with mprotect, and another part with
 *            mmap MAP_FIXED (the JVM and V8)
 * N MiB of each (the first argument), filled with a pattern; then it waits until its
 * resident anonymous memory falls under a third of what it wrote (uzswap swapped most
 * of it out: progress, not correctness; at most 20 s), rewrites a part, gives a part back (MADV_DONTNEED
 * and munmap), forks a child that checks a sample, and checks every byte it kept.
 *
 *   cc -O2 -pthread -o rawmem examples/rawmem.c
 *   uzswap run --budget 64M -- ./rawmem 48
 *
 * Prints "rawmem: ok" and exits 0 when all is well.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1UL << 20)
#define CHUNK (64 << 10) /* arena mallocs: below uzswap's threshold */

static uint64_t word(size_t i, uint64_t seed) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    return x * 0xBF58476D1CE4E5B9ull;
}

static void fill(void *p, size_t len, uint64_t seed) {
    uint64_t *w = p;
    for (size_t i = 0; i < len / 8; i++)
        w[i] = i % 16 ? seed : word(i, seed);
}

/* Whether [p + off, p + off + len) holds what fill(p, ..., seed) wrote there. */
static int check_part(const void *p, size_t off, size_t len, uint64_t seed) {
    const uint64_t *w = p;
    for (size_t i = off / 8; i < (off + len) / 8; i++)
        if (w[i] != (i % 16 ? seed : word(i, seed)))
            return 0;
    return 1;
}

static int check(const void *p, size_t len, uint64_t seed) {
    return check_part(p, 0, len, seed);
}

static size_t mib;
static char **chunks;
static size_t nchunks;

static void *arena_thread(void *arg) {
    (void)arg;
    for (size_t i = 0; i < nchunks; i++) {
        chunks[i] = malloc(CHUNK);
        if (!chunks[i])
            return (void *)1;
        fill(chunks[i], CHUNK, 400 + i);
    }
    return NULL;
}

static long rss_anon_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "RssAnon: %ld kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb;
}

static void fail(const char *what) {
    fprintf(stderr, "rawmem: %s\n", what);
    exit(1);
}

int main(int argc, char **argv) {
    mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 48;
    size_t len = mib * MIB;

    /* raw: the mmap system call itself */
    char *raw = (char *)syscall(SYS_mmap, NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        fail("raw mmap failed");
    fill(raw, len, 100);

    /* brk: grow the heap by hand */
    char *brk0 = sbrk(0);
    char *heap = (char *)(((uintptr_t)brk0 + 4095) & ~(uintptr_t)4095);
    if (sbrk(heap - brk0 + len) == (void *)-1)
        fail("sbrk failed");
    fill(heap, len, 200);

    /* commit: reserve, then commit half by mprotect and half by mmap MAP_FIXED */
    char *res = mmap(NULL, 2 * len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (res == MAP_FAILED || mprotect(res, len / 2, PROT_READ | PROT_WRITE))
        fail("reserve or mprotect failed");
    if (mmap(res + len / 2, len / 2, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != res + len / 2)
        fail("mmap MAP_FIXED failed");
    fill(res, len, 300);

    /* arena: small mallocs from another thread */
    nchunks = len / CHUNK;
    chunks = calloc(nchunks, sizeof *chunks);
    pthread_t t;
    void *bad;
    if (pthread_create(&t, NULL, arena_thread, NULL) || pthread_join(t, &bad) || bad)
        fail("arena thread failed");

    /* Wait for uzswap to take most of it out (at most 20 s): all four kinds must be
     * managed for that. */
    long written_kb = 4 * len / 1024;
    for (int i = 0; i < 400 && rss_anon_kb() > written_kb / 3; i++) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    printf("rawmem: resident anonymous %ld kB of %ld written\n", rss_anon_kb(), written_kb);

    if (!check(raw, len, 100) || !check(heap, len, 200) || !check(res, len, 300))
        fail("a byte differs after swapping");
    for (size_t i = 0; i < nchunks; i++)
        if (!check(chunks[i], CHUNK, 400 + i))
            fail("an arena chunk differs after swapping");

    /* Rewrite a quarter, drop 1 MiB, unmap 1 MiB. */
    fill(raw, len / 4, 101);
    madvise(heap + MIB, MIB, MADV_DONTNEED);
    munmap(res + len - MIB, MIB);

    pid_t pid = fork();
    if (pid == 0)
        _exit(check(raw, len / 4, 101) && check_part(raw, len / 4, len - len / 4, 100) ? 0 : 3);
    int st;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st))
        fail("the forked child saw wrong bytes");

    /* Every byte kept. */
    if (!check(raw, len / 4, 101) || !check_part(raw, len / 4, len - len / 4, 100))
        fail("raw memory differs");
    static char zeros[1 << 20];
    if (!check(heap, MIB, 200) || memcmp(heap + MIB, zeros, MIB) || !check_part(heap, 2 * MIB, len - 2 * MIB, 200))
        fail("brk memory differs");
    if (!check(res, len - MIB, 300))
        fail("committed memory differs");
    for (size_t i = 0; i < nchunks; i++)
        if (!check(chunks[i], CHUNK, 400 + i))
            fail("an arena chunk differs");
    printf("rawmem: ok\n");
    return 0;
}
