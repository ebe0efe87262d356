/* Holds memory and re-reads it: one process of a group test (crates/cli/tests/
 * run_group.rs). Fills MIB MiB (malloc'd in 4 MiB pieces, so uzswap manages them)
 * with data that compresses about 2:1, reads every byte back PASSES times, and prints
 * "hold: ok" if all of it was right. Exits 1 on the first wrong byte. With FORKS, it
 * first forks that many children (no exec), which do the same, and waits for them.
 * With a fourth argument "_exit", every process ends with _exit (no exit handlers).
 *
 *   cc -O2 -o hold examples/hold.c
 *   uzswap run --budget 64M -- sh -c './hold 48 3 & ./hold 48 3 & wait'
 *   uzswap run --budget 64M -- ./hold 48 3 2
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define PIECE (4u << 20)

/* The word at index i of piece p: random in the first half of each page, zero after. */
static uint64_t word(uint64_t seed, size_t p, size_t i) {
    if ((i % 512) >= 256)
        return 0;
    uint64_t x = seed ^ (p * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);
    x ^= x >> 31;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 29);
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 64;
    int passes = argc > 2 ? atoi(argv[2]) : 2;
    int forks = argc > 3 ? atoi(argv[3]) : 0, parent = 1;
    for (int k = 0; k < forks && parent; k++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("hold: fork");
            return 1;
        }
        parent = pid != 0;
    }
    uint64_t seed = (uint64_t)getpid() << 32;
    size_t pieces = mib * (1u << 20) / PIECE, words = PIECE / 8;
    uint64_t **mem = malloc(pieces * sizeof *mem);
    for (size_t p = 0; p < pieces; p++) {
        mem[p] = malloc(PIECE);
        if (!mem[p]) {
            fprintf(stderr, "hold: out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < words; i++)
            mem[p][i] = word(seed, p, i);
    }
    for (int r = 0; r < passes; r++)
        for (size_t p = 0; p < pieces; p++)
            for (size_t i = 0; i < words; i++)
                if (mem[p][i] != word(seed, p, i)) {
                    fprintf(stderr, "hold: pid %d: piece %zu word %zu wrong on pass %d\n", getpid(), p, i, r);
                    return 1;
                }
    printf("hold: ok\n");
    fflush(stdout);
    if (parent)
        for (int k = 0; k < forks; k++) {
            int st;
            if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) {
                fprintf(stderr, "hold: a child failed\n");
                return 1;
            }
        }
    if (argc > 4 && !strcmp(argv[4], "_exit"))
        _exit(0); /* no exit handlers, as a crash or Go's runtime */
    return 0;
}
