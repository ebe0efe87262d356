/* A program written to check `uzswap run` end to end: it uses managed memory through
 * mmap, mremap, munmap, madvise, read/write system calls, threads, fork and the malloc
 * family, and checks every byte it reads. Exits 0 and prints "mapper: ok" when all is
 * correct; prints what went wrong and exits 1 otherwise.
 *
 *   cc -O2 -pthread -o mapper examples/mapper.c
 *   uzswap run --budget 64M -- ./mapper 256      # MiB of memory to use
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static size_t MiB = 1 << 20;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (!(cond)) {                                                    \
            fprintf(stderr, "mapper: %s:%d: ", __FILE__, __LINE__);       \
            fprintf(stderr, __VA_ARGS__);                                 \
            fprintf(stderr, " (errno %d: %s)\n", errno, strerror(errno)); \
            exit(1);                                                      \
        }                                                                 \
    } while (0)

/* Compressible and position-dependent: a wrong folio or a zeroed page shows. */
static inline uint64_t word(uint64_t seed, size_t i) {
    return (i % 64 == 63) ? (seed * 0x9e3779b97f4a7c15ULL) ^ (i * 0xff51afd7ed558ccdULL) : (seed << 32) | (i / 512);
}

static void fill(void *p, size_t len, uint64_t seed) {
    uint64_t *w = p;
    for (size_t i = 0; i < len / 8; i++) w[i] = word(seed, i);
}

/* Returns the first wrong byte offset, or -1. */
static long bad(const void *p, size_t len, uint64_t seed, size_t first_word) {
    const uint64_t *w = p;
    for (size_t i = 0; i < len / 8; i++)
        if (w[i] != word(seed, first_word + i)) return (long)(i * 8);
    return -1;
}

static int zero(const void *p, size_t len) {
    const uint64_t *w = p;
    for (size_t i = 0; i < len / 8; i++)
        if (w[i]) return 0;
    return 1;
}

struct slice { char *base; size_t len; uint64_t seed; int rounds; long result; };

static void *worker(void *arg) {
    struct slice *s = arg;
    s->result = -1;
    for (int r = 0; r < s->rounds && s->result < 0; r++) {
        fill(s->base, s->len, s->seed + r);
        s->result = bad(s->base, s->len, s->seed + r, 0);
    }
    return NULL;
}

int main(int argc, char **argv) {
    size_t total = (argc > 1 ? strtoul(argv[1], 0, 10) : 256) * MiB;
    const size_t page = 4096;

    /* 1. A big mapping, written then read back (most of it comes back from uzswap). */
    char *m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED, "mmap %zu", total);
    CHECK(zero(m, 8 * MiB), "fresh mmap not zero");
    fill(m, total, 1);
    long b = bad(m, total, 1, 0);
    CHECK(b < 0, "mmap readback wrong at %ld", b);

    /* 2. madvise(DONTNEED) of a middle part reads as zeros; the rest is intact. */
    size_t lo = total / 4, hi = total / 2;
    CHECK(madvise(m + lo, hi - lo, MADV_DONTNEED) == 0, "madvise");
    CHECK(zero(m + lo, hi - lo), "DONTNEED range not zero");
    CHECK(bad(m, lo, 1, 0) < 0 && bad(m + hi, total - hi, 1, hi / 8) < 0, "data around DONTNEED changed");
    fill(m + lo, hi - lo, 2);
    CHECK(bad(m + lo, hi - lo, 2, 0) < 0, "refill after DONTNEED");
    fill(m + lo, hi - lo, 1);
    for (size_t off = lo; off < hi; off += MiB) {  /* and a DONTNEED of single pages */
        CHECK(madvise(m + off + page, page, MADV_DONTNEED) == 0, "madvise page");
        CHECK(zero(m + off + page, page), "DONTNEED page not zero");
        fill(m + off + page, page, 1);
        /* fill() numbers words from the start of its range: redo the whole MiB */
        fill(m + off, MiB, 1);
    }
    fill(m, total, 1);

    /* 3. system calls on managed memory: write(2) from it, read(2) into it. */
    char path[] = "/tmp/uzswap-mapper-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    unlink(path);
    size_t io = total / 4;
    for (size_t off = 0; off < io;) {
        ssize_t n = write(fd, m + off, io - off);
        CHECK(n > 0, "write from managed memory");
        off += n;
    }
    char *r = mmap(NULL, io, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(r != MAP_FAILED, "mmap read buffer");
    fill(r, io, 9); /* so that read(2) lands on swapped-out pages */
    fill(m + io, total - io, 1);
    CHECK(lseek(fd, 0, SEEK_SET) == 0, "lseek");
    for (size_t off = 0; off < io;) {
        ssize_t n = read(fd, r + off, io - off);
        CHECK(n > 0, "read into managed memory");
        off += n;
    }
    b = bad(r, io, 1, 0);
    CHECK(b < 0, "read(2) data wrong at %ld", b);
    for (size_t off = 0; off < io; off += 16 * MiB) { /* pread/pwrite too */
        CHECK(pwrite(fd, r + off, MiB, off) == (ssize_t)MiB, "pwrite");
        CHECK(pread(fd, r + off + MiB, MiB, off) == (ssize_t)MiB, "pread");
        CHECK(memcmp(r + off, r + off + MiB, MiB) == 0, "pread data wrong");
        fill(r + off, 2 * MiB, 1);
        /* word numbering restarts at off: fix up by refilling the whole buffer below */
    }
    fill(r, io, 1);
    int pipefd[2];
    CHECK(pipe(pipefd) == 0, "pipe");
    CHECK(write(pipefd[1], m + total - 64 * 1024, 64 * 1024) == 64 * 1024, "write to pipe");
    CHECK(read(pipefd[0], r, 64 * 1024) == 64 * 1024, "read from pipe");
    CHECK(memcmp(r, m + total - 64 * 1024, 64 * 1024) == 0, "pipe data wrong");
    close(pipefd[0]);
    close(pipefd[1]);
    close(fd);
    CHECK(munmap(r, io) == 0, "munmap read buffer");

    /* 4. threads filling and checking their own slices, several rounds. */
    enum { T = 4 };
    pthread_t th[T];
    struct slice sl[T];
    for (int i = 0; i < T; i++) {
        sl[i] = (struct slice){m + i * (total / T), total / T, 100 + i * 10, 3, -1};
        CHECK(pthread_create(&th[i], NULL, worker, &sl[i]) == 0, "pthread_create");
    }
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        CHECK(sl[i].result < 0, "thread %d saw a wrong byte at %ld", i, sl[i].result);
    }
    fill(m, total, 1);

    /* 5. fork: the child sees all of the memory, swapped-out parts included. */
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        long cb = bad(m, total, 1, 0);
        if (cb >= 0) {
            fprintf(stderr, "mapper: child saw a wrong byte at %ld\n", cb);
            _exit(1);
        }
        fill(m, 16 * MiB, 77); /* the child's writes stay in the child */
        _exit(bad(m, 16 * MiB, 77, 0) < 0 ? 0 : 1);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child failed (status %d)", st);
    b = bad(m, total, 1, 0);
    CHECK(b < 0, "parent memory wrong after fork at %ld", b);

    /* 6. mremap: grow (moving), check, shrink in place; munmap part, then all. */
    size_t grown = total + total / 2;
    char *g = mremap(m, total, grown, MREMAP_MAYMOVE);
    CHECK(g != MAP_FAILED, "mremap grow");
    b = bad(g, total, 1, 0);
    CHECK(b < 0, "mremap lost data at %ld", b);
    CHECK(zero(g + total, grown - total), "mremap grown part not zero");
    fill(g + total, grown - total, 3);
    char *s = mremap(g, grown, total / 2, 0);
    CHECK(s == g, "mremap shrink in place");
    CHECK(bad(s, total / 2, 1, 0) < 0, "data lost by shrink");
    CHECK(munmap(s + total / 8, total / 8) == 0, "munmap middle");
    CHECK(bad(s, total / 8, 1, 0) < 0 && bad(s + total / 4, total / 4, 1, total / 32) < 0,
          "data around a munmap changed");
    CHECK(munmap(s, total / 2) == 0, "munmap rest");

    /* 7. malloc family: big blocks, realloc growth keeps data, calloc is zero. */
    enum { B = 8 };
    char *blk[B];
    size_t bl = total / B;
    for (int i = 0; i < B; i++) {
        blk[i] = malloc(bl);
        CHECK(blk[i], "malloc");
        fill(blk[i], bl, 200 + i);
    }
    for (int i = 0; i < B; i++) CHECK(bad(blk[i], bl, 200 + i, 0) < 0, "malloc block %d wrong", i);
    blk[0] = realloc(blk[0], 2 * bl);
    CHECK(blk[0] && bad(blk[0], bl, 200, 0) < 0, "realloc lost data");
    char *z = calloc(bl / 8, 8);
    CHECK(z && zero(z, bl), "calloc not zero");
    void *al = NULL;
    CHECK(posix_memalign(&al, 65536, 4 * MiB) == 0 && ((uintptr_t)al % 65536) == 0, "posix_memalign");
    fill(al, 4 * MiB, 5);
    CHECK(bad(al, 4 * MiB, 5, 0) < 0, "aligned block wrong");
    free(al);
    free(z);
    for (int i = 0; i < B; i++) free(blk[i]);

    printf("mapper: ok (%zu MiB)\n", total / MiB);
    return 0;
}
