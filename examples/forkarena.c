/* What glibc itself touches in a fork's child, in memory uzswap adopted and swapped
 * out: the brk heap (main arena) and three threads' arenas hold N MiB each of small
 * malloc'd blocks, with FILEs from fopen among them (opened first, so they go cold and
 * out with the rest); then the program forks F times while one thread holds a FILE's
 * lock (flockfile). Between fork and the program's fork handlers glibc locks every
 * arena (parent) and resets every arena's mutex and every FILE's lock (child): where
 * those sit in a folio carried to the child swapped out, the child would find zeros,
 * or the parent a folio held for the fork. Each child checks every block, writes to
 * every FILE (the held one too: its lock must have been reset) and mallocs from a new
 * thread (the arenas' mutexes too), within 60 s (alarm). The parent checks every
 * block after. Prints "forkarena: ok" and exits 0 when all was right.
 *
 *   cc -O2 -pthread -o forkarena examples/forkarena.c
 *   uzswap run --budget 32M -- ./forkarena 24 3
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 1000 /* small: from the brk heap or a thread's arena, never mmap'd */
#define PARTS 4    /* the main thread's heap, three threads' arenas */
#define FILES 16   /* per part */

static size_t per_part;
static unsigned char **blocks[PARTS];
static FILE *files[PARTS][FILES];
static pthread_barrier_t made;
static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;
static int holding, release_it;

static unsigned char byte(int part, size_t b, size_t i) {
    uint64_t x = (part + 1) * 0x9E3779B97F4A7C15ull ^ (b * 0xD1B54A32D192ED03ull) ^ (i / 8 * 0x94D049BB133111EBull);
    x ^= x >> 29;
    /* Half the bytes zero: compresses about 2:1, as real heaps do. */
    return (i & 8) ? 0 : (unsigned char)(x >> ((i % 8) * 8));
}

static void make(int part) {
    for (int f = 0; f < FILES; f++) {
        files[part][f] = fopen("/dev/null", "w");
        if (!files[part][f]) {
            perror("fopen");
            exit(2);
        }
    }
    blocks[part] = malloc(per_part * sizeof(char *));
    for (size_t b = 0; b < per_part; b++) {
        unsigned char *p = malloc(BLOCK);
        for (size_t i = 0; i < BLOCK; i++)
            p[i] = byte(part, b, i);
        blocks[part][b] = p;
    }
}

static int check(const char *who) {
    for (int part = 0; part < PARTS; part++)
        for (size_t b = 0; b < per_part; b++)
            for (size_t i = 0; i < BLOCK; i++)
                if (blocks[part][b][i] != byte(part, b, i)) {
                    printf("forkarena: %s: part %d block %zu byte %zu wrong\n", who, part, b, i);
                    return 0;
                }
    return 1;
}

static void *arena_user(void *arg) {
    int part = (int)(intptr_t)arg;
    make(part);
    pthread_barrier_wait(&made);
    if (part == 1) {
        /* Holds a FILE's lock across every fork, as a thread writing a log would. */
        flockfile(files[1][0]);
        pthread_mutex_lock(&hold_mu);
        holding = 1;
        pthread_cond_broadcast(&hold_cv);
        while (!release_it)
            pthread_cond_wait(&hold_cv, &hold_mu);
        pthread_mutex_unlock(&hold_mu);
        funlockfile(files[1][0]);
    }
    return NULL;
}

static void *churn(void *arg) {
    (void)arg;
    for (int k = 0; k < 1000; k++)
        free(malloc(64 + k % 512));
    return NULL;
}

static size_t rss_anon_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    size_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "RssAnon: %zu", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 24;
    int forks = argc > 2 ? atoi(argv[2]) : 3;
    per_part = (mib << 20) / BLOCK;
    setvbuf(stdout, NULL, _IONBF, 0);
    pthread_barrier_init(&made, NULL, PARTS);
    pthread_t t[PARTS];
    for (int part = 1; part < PARTS; part++)
        pthread_create(&t[part], NULL, arena_user, (void *)(intptr_t)part);
    make(0);
    pthread_barrier_wait(&made);
    /* Until most of it is swapped out (progress, not correctness): at most 20 s. */
    for (int i = 0; i < 400 && rss_anon_kb() > (PARTS * mib << 10) / 3; i++)
        usleep(50000);
    pthread_mutex_lock(&hold_mu);
    while (!holding)
        pthread_cond_wait(&hold_cv, &hold_mu);
    pthread_mutex_unlock(&hold_mu);
    for (int k = 0; k < forks; k++) {
        pid_t pid = fork();
        if (pid == 0) {
            alarm(60);
            int ok = check("child");
            for (int part = 0; part < PARTS; part++)
                for (int f = 0; f < FILES; f++)
                    ok &= fprintf(files[part][f], "child %d\n", k) > 0 && fflush(files[part][f]) == 0;
            pthread_t c;
            ok &= pthread_create(&c, NULL, churn, NULL) == 0 && pthread_join(c, NULL) == 0;
            _exit(ok ? 0 : 1);
        }
        int st;
        if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            printf("forkarena: child %d failed (status %#x)\n", k, pid < 0 ? -1 : st);
            return 1;
        }
    }
    pthread_mutex_lock(&hold_mu);
    release_it = 1;
    pthread_cond_broadcast(&hold_cv);
    pthread_mutex_unlock(&hold_mu);
    for (int part = 1; part < PARTS; part++)
        pthread_join(t[part], NULL);
    if (!check("parent"))
        return 1;
    printf("forkarena: ok (rss_anon_kb=%zu)\n", rss_anon_kb());
    return 0;
}
