/* brkregrow.c: the brk heap grown by 8 MiB (sbrk), trimmed by 3 MiB and 5 pages (so
   that the trim ends inside a folio), regrown, each step given a second for uzswap's
   scan; says whether the regrown part (its whole 64 KiB folios) is registered with a
   userfaultfd (smaps "um": adopted anew) and checks every byte. Prints "brkregrow: ok"
   and "regrown: adopted" or "regrown: not adopted". Plain: ok, not adopted. */
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
static char buf[1 << 20];
/* Whether [lo, hi) lies inside one registered mapping. */
static int registered(uintptr_t lo, uintptr_t hi) {
    int fd = open("/proc/self/smaps", O_RDONLY); size_t n = 0; ssize_t r;
    while ((r = read(fd, buf + n, sizeof buf - 1 - n)) > 0) n += r;
    buf[n] = 0; close(fd);
    int in = 0;
    for (char *l = strtok(buf, "\n"); l; l = strtok(0, "\n")) {
        unsigned long a, b;
        if (sscanf(l, "%lx-%lx ", &a, &b) == 2) in = a <= lo && hi <= b;
        else if (in && !strncmp(l, "VmFlags:", 8)) return strstr(l, " um") != 0;
    }
    return 0;
}
int main(void) {
    printf("brkregrow: start\n"); fflush(stdout); /* stdio's buffer, before the heap moves */
    char *p = sbrk(0); size_t n = 8 << 20; long cut = (3 << 20) + 5 * 4096;
    if (sbrk(n) == (void *)-1) return 2;
    memset(p, 1, n); sleep(1);
    sbrk(-cut); sleep(1);
    char *q = sbrk(0); sbrk(cut); memset(q, 2, cut); sleep(1);
    uintptr_t f = 64 << 10, lo = ((uintptr_t)q + f - 1) / f * f, hi = ((uintptr_t)q + cut) / f * f;
    int adopted = registered(lo, hi);
    for (size_t i = 0; i < n; i++)
        if (p[i] != (i < n - cut ? 1 : 2)) { printf("brkregrow: BAD at %zu: %d\n", i, p[i]); return 1; }
    printf("regrown: %s\nbrkregrow: ok\n", adopted ? "adopted" : "not adopted");
    return 0;
}
