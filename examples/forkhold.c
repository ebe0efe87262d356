/* A process that forks once while holding memory, then keeps holding it: after the
 * fork its memory must go back under the budget (crates/cli/tests/run_group.rs).
 * Fills MIB MiB (malloc'd in 4 MiB pieces, so uzswap manages them) with data that
 * compresses about 2:1, forks a child that checks a word of every piece and _exits,
 * waits for it, then waits (up to 20 s, looking every 50 ms) for its own anonymous
 * resident memory to fall to LIMIT MiB, prints "forkhold: rss_anon_kb=N" with what it
 * came to, checks every byte and prints "forkhold: ok". Exits 1 on a wrong byte.
 *
 *   cc -O2 -o forkhold examples/forkhold.c
 *   uzswap run --budget 32M -- ./forkhold 96 64
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PIECE (4u << 20)

/* The word at index i of piece p: random in the first half of each page, zero after. */
static uint64_t word(size_t p, size_t i) {
    if ((i % 512) >= 256)
        return 0;
    uint64_t x = 0x5EEDull ^ (p * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);
    x ^= x >> 31;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 29);
}

static long rss_anon_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "RssAnon:", 8))
            kb = strtol(line + 8, 0, 10);
    if (f)
        fclose(f);
    return kb;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 96;
    long limit_kb = (argc > 2 ? strtol(argv[2], 0, 10) : 64) * 1024;
    size_t pieces = mib * (1u << 20) / PIECE, words = PIECE / 8;
    uint64_t **mem = malloc(pieces * sizeof *mem);
    for (size_t p = 0; p < pieces; p++) {
        mem[p] = malloc(PIECE);
        if (!mem[p]) {
            fprintf(stderr, "forkhold: out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < words; i++)
            mem[p][i] = word(p, i);
    }
    pid_t pid = fork();
    if (pid < 0) {
        perror("forkhold: fork");
        return 1;
    }
    if (pid == 0) {
        for (size_t p = 0; p < pieces; p++)
            if (mem[p][1] != word(p, 1))
                _exit(1);
        _exit(0);
    }
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) {
        fprintf(stderr, "forkhold: the child saw wrong data\n");
        return 1;
    }
    long kb = rss_anon_kb();
    for (int t = 0; t < 400 && kb > limit_kb; t++) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, 0);
        kb = rss_anon_kb();
    }
    printf("forkhold: rss_anon_kb=%ld\n", kb);
    for (size_t p = 0; p < pieces; p++)
        for (size_t i = 0; i < words; i++)
            if (mem[p][i] != word(p, i)) {
                fprintf(stderr, "forkhold: piece %zu word %zu wrong\n", p, i);
                return 1;
            }
    printf("forkhold: ok\n");
    return 0;
}
