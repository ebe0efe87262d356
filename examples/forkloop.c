/* fork in a loop while other threads fault and rewrite memory that is mostly swapped
 * out (the reclaimer evicting all along): every child checks that what it got is
 * whole (each page one version, as some thread last wrote it) and writes memory of
 * its own beyond the budget; the parent checks every page after all. Prints
 * "forkloop: ok" and exits 0 when all was right.
 *
 *   cc -O2 -pthread -o forkloop examples/forkloop.c
 *   uzswap run --budget 32M -- ./forkloop 64 20
 *
 * A page is written under a read lock of `pages_lock`; fork happens under its write
 * lock, so no page is half written at fork (as a program that forks with a lock it
 * needs consistent would do).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define PAGE 4096
#define THREADS 3
static uint64_t *mem;
static size_t pages;
static volatile int stop;
static pthread_rwlock_t pages_lock;

static uint64_t word(size_t page, size_t i, uint64_t v) {
    uint64_t x = (page * 0x9E3779B97F4A7C15ull) ^ (v << 20) ^ i;
    x ^= x >> 31;
    return x * 0xBF58476D1CE4E5B9ull | 1;
}

static void write_page(size_t p, uint64_t v) {
    uint64_t *w = mem + p * (PAGE / 8);
    w[0] = v;
    for (size_t i = 1; i < PAGE / 8; i++)
        w[i] = word(p, i, v);
}

/* The page's version, or (uint64_t)-1 if it is torn or wrong. */
static uint64_t page_version(size_t p) {
    uint64_t *w = mem + p * (PAGE / 8);
    uint64_t v = w[0];
    for (size_t i = 1; i < PAGE / 8; i++)
        if (w[i] != word(p, i, v))
            return (uint64_t)-1;
    return v;
}

static uint64_t *versions;

static void *worker(void *arg) {
    size_t t = (size_t)arg;
    uint64_t x = t + 1;
    while (!stop) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t p = (x % (pages / THREADS)) * THREADS + t;
        pthread_rwlock_rdlock(&pages_lock);
        if (page_version(p) != versions[p]) {
            fprintf(stderr, "forkloop: page %zu wrong in the parent\n", p);
            exit(1);
        }
        write_page(p, ++versions[p]);
        pthread_rwlock_unlock(&pages_lock);
    }
    return NULL;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 64;
    int forks = argc > 2 ? atoi(argv[2]) : 20;
    /* Writers first: readers come all the time, and fork must get its turn. */
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&pages_lock, &attr);
    pages = mib * (1 << 20) / PAGE;
    mem = malloc(pages * PAGE);
    versions = calloc(pages, sizeof *versions);
    for (size_t p = 0; p < pages; p++)
        write_page(p, versions[p] = 1);
    pthread_t th[THREADS];
    for (size_t t = 0; t < THREADS; t++)
        pthread_create(&th[t], NULL, worker, (void *)t);
    for (int f = 0; f < forks; f++) {
        pthread_rwlock_wrlock(&pages_lock);
        pid_t pid = fork();
        if (pid == 0) {
            /* The child: every page whole, at the version the parent had at fork. */
            for (size_t p = 0; p < pages; p++)
                if (page_version(p) != versions[p]) {
                    fprintf(stderr, "forkloop: page %zu wrong in child %d\n", p, f);
                    _exit(1);
                }
            /* Memory of its own beyond the budget, read back. */
            size_t n = 48 << 20;
            uint8_t *own = malloc(n);
            for (size_t i = 0; i < n; i += PAGE)
                own[i] = (uint8_t)(i / PAGE + f);
            for (size_t i = 0; i < n; i += PAGE)
                if (own[i] != (uint8_t)(i / PAGE + f)) {
                    fprintf(stderr, "forkloop: child %d: own memory wrong\n", f);
                    _exit(1);
                }
            _exit(0);
        }
        pthread_rwlock_unlock(&pages_lock);
        if (pid < 0) {
            perror("forkloop: fork");
            return 1;
        }
        int st;
        if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "forkloop: child %d failed\n", f);
            return 1;
        }
    }
    stop = 1;
    for (size_t t = 0; t < THREADS; t++)
        pthread_join(th[t], NULL);
    for (size_t p = 0; p < pages; p++)
        if (page_version(p) != versions[p]) {
            fprintf(stderr, "forkloop: page %zu wrong at the end\n", p);
            return 1;
        }
    printf("forkloop: ok\n");
    return 0;
}
