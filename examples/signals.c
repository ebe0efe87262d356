/* A program with its own SIGSEGV and SIGBUS handlers, to check that under `uzswap run`
 * it still gets its own signals while uzswap manages (and swaps) its memory.
 *
 *   cc -O2 -o signals examples/signals.c
 *   uzswap run --budget 32M --fault-path sigbus -- ./signals 128
 *
 * It touches a PROT_NONE page (SIGSEGV) and a mapped file page past the end of the
 * file (SIGBUS), catching both with sigsetjmp/siglongjmp, between passes over a big
 * buffer that does not fit the budget. Prints "signals: ok" and exits 0 when every
 * signal arrived at its handler with the right address and every byte was right.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static sigjmp_buf jump;
static volatile void *fault_addr;
static volatile int segv_count, bus_count;

static void on_segv(int sig, siginfo_t *info, void *ctx) {
    (void)sig, (void)ctx;
    segv_count++;
    fault_addr = info->si_addr;
    siglongjmp(jump, 1);
}

static void on_bus(int sig) {
    (void)sig;
    bus_count++;
    siglongjmp(jump, 2);
}

static int pass(uint64_t *w, size_t words, uint64_t seed, int write) {
    for (size_t i = 0; i < words; i++) {
        uint64_t want = (i % 8 == 0) ? seed ^ (i * 0x9e3779b97f4a7c15ULL) : seed + i / 1024;
        if (write)
            w[i] = want;
        else if (w[i] != want)
            return 0;
    }
    return 1;
}

int main(int argc, char **argv) {
    size_t total = (argc > 1 ? strtoul(argv[1], 0, 10) : 128) << 20;
    struct sigaction sa = {0};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, NULL) != 0) return perror("sigaction"), 1;
    if (signal(SIGBUS, on_bus) == SIG_ERR) return perror("signal"), 1;

    uint64_t *big = malloc(total);
    char *guard = mmap(NULL, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    FILE *f = tmpfile();
    if (!big || guard == MAP_FAILED || !f) return perror("setup"), 1;
    /* A one-page mapping of an empty file: touching it is SIGBUS (beyond EOF). */
    char *past_eof = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fileno(f), 0);
    if (past_eof == MAP_FAILED) return perror("mmap file"), 1;

    for (int round = 0; round < 3; round++) {
        if (!pass(big, total / 8, round, 1)) return 1;
        int j = sigsetjmp(jump, 1);
        if (j == 0) {
            *(volatile char *)(guard + 100) = 1;
            fprintf(stderr, "signals: no SIGSEGV\n");
            return 1;
        }
        if (j != 1 || fault_addr != guard + 100) {
            fprintf(stderr, "signals: SIGSEGV handler saw %p, expected %p\n", (void *)fault_addr, guard + 100);
            return 1;
        }
        if (!pass(big, total / 8, round, 0)) {
            fprintf(stderr, "signals: wrong data in round %d\n", round);
            return 1;
        }
        j = sigsetjmp(jump, 1);
        if (j == 0) {
            (void)*(volatile char *)past_eof;
            fprintf(stderr, "signals: no SIGBUS\n");
            return 1;
        }
        if (j != 2) return 1;
    }
    if (segv_count != 3 || bus_count != 3) {
        fprintf(stderr, "signals: %d SIGSEGV and %d SIGBUS, expected 3 each\n", segv_count, bus_count);
        return 1;
    }
    free(big);
    printf("signals: ok\n");
    return 0;
}
