/* brktrim.c ROUNDS: reproduces an open bug (README, "Known bug"): a stack of blocks
   in glibc's brk heap, pushed (the heap grows), popped from the top (glibc trims the
   heap with brk), pushed again (it regrows), every live byte checked each round.
   Plain: "brktrim ok" in about 1.4 s for 6 rounds. Under
   `uzswap run --budget 32M -- brktrim 10` (or 20M), with the heap adopted, 4 of 6
   runs printed BAD (round 5, a block near the top: the part trimmed and regrown);
   with --adopt no, 2 of 2 ok. Not run by the tests until the bug is fixed. */
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
        for (int i = 0; i < top; i++) for (size_t k = 0; k < len[i]; k++) if (p[i][k] != v(i, k)) { printf("BAD round %d block %d/%d off %zu len %zu\n", r, i, top, k, len[i]); return 1; }
        int keep = (int)(rnd() % (N / 2));
        while (top > keep) { top--; free(p[top]); }
    }
    printf("brktrim ok\n");
    return 0;
}
