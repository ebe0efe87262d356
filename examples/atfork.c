/* Fork handlers registered before uzswap's, touching the program's swapped-out memory
 * (crates/cli/tests/run_group.rs). Built twice: with -DATFORK_LIB as a shared library
 * whose constructor registers pthread_atfork handlers (a shared library's constructor
 * runs before a preloaded one's, as libjemalloc's does under redis-server), and as the
 * program, linked with it. The program fills two buffers of MIB MiB from malloc with
 * data that compresses about 2:1, then MIB MiB more to push the first out,
 * hands the first two to the library and forks. The library's handlers read every
 * byte of both in each phase: prepare and parent in the parent, child in the child.
 * Prints "atfork: ok" if every phase saw every byte right; exits 1 otherwise. A hang
 * or a wrong sum is the failure.
 *
 *   cc -O2 -shared -fPIC -DATFORK_LIB -o libatfork.so examples/atfork.c
 *   cc -O2 -o atfork examples/atfork.c -L. -latfork -Wl,-rpath,'$ORIGIN'
 *   uzswap run --budget 32M -- ./atfork 48
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define PHASES 3

#ifdef ATFORK_LIB

static const unsigned char *bufs[2];
static size_t lens[2];
static uint64_t seen[PHASES];

static uint64_t sum(void) {
    uint64_t s = 0;
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < lens[b]; i++)
            s = s * 31 + bufs[b][i];
    return s;
}

static void prepare(void) { seen[0] = sum(); }
static void parent(void) { seen[1] = sum(); }
static void child(void) { seen[2] = sum(); }

__attribute__((constructor)) static void init(void) { pthread_atfork(prepare, parent, child); }

void atfork_watch(const unsigned char *a, size_t alen, const unsigned char *b, size_t blen) {
    bufs[0] = a, lens[0] = alen;
    bufs[1] = b, lens[1] = blen;
}

uint64_t atfork_seen(int phase) { return seen[phase]; }

uint64_t atfork_sum(void) { return sum(); }

#else

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

void atfork_watch(const unsigned char *a, size_t alen, const unsigned char *b, size_t blen);
uint64_t atfork_seen(int phase);
uint64_t atfork_sum(void);

/* Random in the first half of each page, zero after: about 2:1. */
static void fill(unsigned char *p, size_t len, uint64_t seed) {
    uint64_t x = seed;
    for (size_t i = 0; i < len; i++) {
        if ((i % 4096) >= 2048) {
            p[i] = 0;
            continue;
        }
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (unsigned char)(x >> 56);
    }
}

int main(int argc, char **argv) {
    size_t len = (size_t)(argc > 1 ? atoi(argv[1]) : 48) << 20;
    unsigned char *a = malloc(len);
    unsigned char *b = malloc(len);
    unsigned char *c = malloc(len);
    if (!a || !b || !c) {
        perror("atfork: memory");
        return 1;
    }
    fill(a, len, 1);
    fill(b, len, 2);
    fill(c, len, 3);
    atfork_watch(a, len, b, len);
    uint64_t want = atfork_sum();
    fill(c, len, 4); /* the sum read a and b back in: push them out again */
    pid_t pid = fork();
    if (pid < 0) {
        perror("atfork: fork");
        return 1;
    }
    if (pid == 0)
        _exit(atfork_seen(2) == want && atfork_sum() == want ? 0 : 3);
    int st = 0;
    if (waitpid(pid, &st, 0) != pid) {
        perror("atfork: waitpid");
        return 1;
    }
    int ok = 1;
    const char *names[] = {"prepare", "parent"};
    for (int p = 0; p < 2; p++)
        if (atfork_seen(p) != want) {
            printf("atfork: the %s handler read a wrong byte\n", names[p]);
            ok = 0;
        }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        printf("atfork: the child's handler or the child read a wrong byte (status %d)\n", st);
        ok = 0;
    }
    if (atfork_sum() != want) {
        printf("atfork: the parent reads a wrong byte after fork\n");
        ok = 0;
    }
    if (!ok)
        return 1;
    printf("atfork: ok\n");
    return 0;
}

#endif
