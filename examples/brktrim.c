/* brktrim.c ROUNDS: a stack of blocks in glibc's brk heap, pushed (the heap grows),
   popped from the top (glibc trims the heap with brk, often a page at a time), pushed
   again (it regrows, as a new mapping uzswap never registered), every live byte
   checked each round; "brktrim ok", or the first wrong byte. Plain: about 1.4 s for
   6 rounds. Under `uzswap run --budget 20M -- brktrim 10`, with the heap adopted, it
   read zeros at the top of the regrown heap in 2 to 4 of 6 runs, until a folio
   unmapped in pieces was dropped as one unmapped whole and a torn one no longer
   taken out (crates/runtime region.rs, "Pages unmapped"); the tests run it
   (crates/cli/tests/run_c.rs). */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#define N 60000
static unsigned char *p[N]; static size_t len[N]; static uint32_t tag[N];
static uint64_t rng = 88172645463325252ull;
static uint64_t rnd(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }
static unsigned char v(int i, size_t k) { return (unsigned char)(tag[i] * 31 + k * 7 + (k >> 9)); }
int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 20, top = 0; uint32_t t = 1;
    for (int r = 0; r < rounds; r++) {
        while (top < N) { len[top] = 16 + rnd() % 3000; p[top] = malloc(len[top]); tag[top] = t++; for (size_t k = 0; k < len[top]; k++) p[top][k] = v(top, k); top++; }
        for (int i = 0; i < top; i++) for (size_t k = 0; k < len[i]; k++) if (p[i][k] != v(i, k)) { printf("BAD round %d block %d/%d off %zu len %zu at %p: %d, not %d\n", r, i, top, k, len[i], (void *)&p[i][k], p[i][k], v(i, k)); return 1; }
        int keep = (int)(rnd() % (N / 2));
        while (top > keep) { top--; free(p[top]); }
    }
    printf("brktrim ok\n");
    return 0;
}
