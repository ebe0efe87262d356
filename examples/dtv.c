/* Where a new thread's DTV (glibc's dynamic thread vector: every access to a
 * thread-local of a shared library, uzswap's included, reads it) lives once the
 * program's brk heap is adopted: never in adopted memory. Faulting on it inside
 * uzswap's code, holding a lock the fault's reader needs, hung a JVM.
 *
 * It fills N MiB of its brk heap with small mallocs (the first argument), waits until
 * the heap is adopted (its smaps show a userfaultfd-registered part: VmFlags "um"; at
 * most 20 s), frees all but the last chunk (so the free space, inside the adopted part,
 * is where glibc serves the next small calloc from: the DTV's), then makes threads,
 * each of which finds its DTV (x86-64: the TCB's second word, %fs:8) and checks the
 * mapping holding it.
 *
 *   cc -O2 -pthread -o dtv examples/dtv.c
 *   uzswap run --budget 16M -- ./dtv 32
 *
 * Prints "dtv: ok" and exits 0 when no DTV is in adopted memory; "dtv: adopted" and
 * exits 1 when one is; "dtv: heap not adopted" and exits 2 when the heap never was
 * (without uzswap, or with adoption off).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHUNK 4000 /* far below uzswap's threshold: from glibc's main arena, the brk heap */

/* A mapping's first line in smaps ("start-end perms ..."), with its bounds; the other
 * lines start with a capitalised key ("Rss:", "VmFlags:"). */
static int header(const char *line, unsigned long *a, unsigned long *b) {
    return (line[0] >= '0' && line[0] <= '9') || (line[0] >= 'a' && line[0] <= 'f') ? sscanf(line, "%lx-%lx ", a, b) == 2 : 0;
}

/* The VmFlags of the mapping holding `addr` (smaps), or "" if none. */
static void flags_at(uintptr_t addr, char *out, size_t cap) {
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    int inside = 0;
    out[0] = 0;
    while (f && fgets(line, sizeof line, f)) {
        unsigned long a, b;
        if (header(line, &a, &b)) {
            inside = addr >= a && addr < b;
        } else if (inside && strncmp(line, "VmFlags:", 8) == 0) {
            snprintf(out, cap, "%s", line + 8);
            break;
        }
    }
    if (f)
        fclose(f);
}

/* Whether any part of [heap] is registered with a userfaultfd (adopted). The heap
 * splits into several mappings once adopted: the brk area's bounds are taken from
 * sbrk, and every mapping inside them looked at. */
static int heap_adopted(uintptr_t lo, uintptr_t hi) {
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    int inside = 0, found = 0;
    while (f && fgets(line, sizeof line, f)) {
        unsigned long a, b;
        if (header(line, &a, &b)) {
            inside = a < hi && b > lo;
        } else if (inside && strncmp(line, "VmFlags:", 8) == 0 && strstr(line, " um")) {
            found = 1;
        }
    }
    if (f)
        fclose(f);
    return found;
}

static int bad;

static void *check(void *arg) {
    (void)arg;
    uintptr_t dtv;
    __asm__ volatile("mov %%fs:8, %0" : "=r"(dtv));
    char flags[512];
    flags_at(dtv, flags, sizeof flags);
    if (strstr(flags, " um") && !__atomic_exchange_n(&bad, 1, __ATOMIC_SEQ_CST))
        fprintf(stderr, "dtv: the DTV at %#lx is in adopted memory (VmFlags:%s)", (unsigned long)dtv, flags);
    return NULL;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 0) : 32;
    size_t n = (mib << 20) / CHUNK;
    uintptr_t lo = (uintptr_t)sbrk(0);
    char **chunks = malloc(n * sizeof *chunks);
    for (size_t i = 0; i < n; i++) {
        chunks[i] = malloc(CHUNK);
        memset(chunks[i], (int)(i & 0x7f) | 1, CHUNK);
    }
    uintptr_t hi = (uintptr_t)sbrk(0);
    int adopted = 0;
    for (int t = 0; t < 200 && !(adopted = heap_adopted(lo, hi)); t++) {
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (!adopted) {
        printf("dtv: heap not adopted\n");
        return 2;
    }
    for (size_t i = 0; i + 1 < n; i++)
        free(chunks[i]);
    for (int round = 0; round < 8; round++) {
        pthread_t t[4];
        for (int i = 0; i < 4; i++)
            pthread_create(&t[i], NULL, check, NULL);
        for (int i = 0; i < 4; i++)
            pthread_join(t[i], NULL);
    }
    if (__atomic_load_n(&bad, __ATOMIC_SEQ_CST)) {
        printf("dtv: adopted\n");
        return 1;
    }
    printf("dtv: ok\n");
    return 0;
}
