/* A program that tidies its file descriptors the way daemons, supervisors and
 * fork-then-exec children do, after part of its memory was swapped out, then checks
 * every byte. uzswap's own descriptors must survive each way, and never take a
 * number the program expects.
 *
 *   cc -O2 -o fdclose examples/fdclose.c
 *   uzswap run --budget 64M -- ./fdclose close_range 256
 *
 * Ways (the first argument):
 *   close_range  close_range(3, ~0U, 0) through libc
 *   closefrom    closefrom(3)
 *   procfd       close every descriptor listed in /proc/self/fd from 3 up
 *   dup2         dup2 /dev/null over every descriptor listed in /proc/self/fd from 3 up
 *   raw          the close_range system call itself, which no preload sees
 *   every        close() and then dup2() of /dev/null on every number from 3 to the
 *                hard limit (uzswap's descriptors are not listed in /proc/self/fd,
 *                and sit above the soft limit: this names them anyway)
 *   watch        nothing closed: for 2.5 s, while it reads its memory (faults, reclaim,
 *                the stats file published every second), an open must always get the
 *                lowest free descriptor it got before uzswap started
 *
 * It also checks that the lowest free descriptor is the same before and after uzswap
 * starts managing memory. Prints "fdclose: ok" and exits 0 when all is well.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int listed(int *out, int max) {
    DIR *d = opendir("/proc/self/fd");
    if (!d) {
        perror("opendir");
        exit(2);
    }
    int n = 0, self = dirfd(d);
    struct dirent *e;
    while ((e = readdir(d)) && n < max) {
        int fd = atoi(e->d_name);
        if (e->d_name[0] != '.' && fd >= 3 && fd != self)
            out[n++] = fd;
    }
    closedir(d);
    return n;
}

static uint64_t word(size_t i, uint64_t seed) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 29;
    return x * 0xBF58476D1CE4E5B9ull;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: fdclose close_range|closefrom|procfd|dup2|every|raw|watch MiB\n");
        return 2;
    }
    const char *way = argv[1];
    size_t mib = strtoul(argv[2], 0, 10);
    int before = open("/dev/null", O_RDONLY);
    close(before);

    /* Chunks of 4 MiB: each is managed; the first ones go out as the rest come in. */
    size_t chunk = 4 << 20, n = mib * (1 << 20) / chunk, words = chunk / 8;
    uint64_t **c = calloc(n, sizeof *c);
    for (size_t k = 0; k < n; k++) {
        c[k] = malloc(chunk);
        if (!c[k]) {
            perror("malloc");
            return 2;
        }
        for (size_t i = 0; i < words; i++)
            c[k][i] = word(k * words + i, 7);
    }
    int after = open("/dev/null", O_RDONLY);
    if (after != before) {
        fprintf(stderr, "fdclose: the lowest free descriptor was %d, is %d once memory is managed\n", before, after);
        return 1;
    }
    close(after);

    int fds[4096];
    int m = listed(fds, 4096);
    if (!strcmp(way, "close_range")) {
        if (close_range(3, ~0U, 0) != 0) {
            perror("close_range");
            return 1;
        }
    } else if (!strcmp(way, "closefrom")) {
        closefrom(3);
    } else if (!strcmp(way, "procfd")) {
        for (int i = 0; i < m; i++)
            close(fds[i]);
    } else if (!strcmp(way, "dup2")) {
        int null = open("/dev/null", O_RDONLY);
        for (int i = 0; i < m; i++)
            if (fds[i] != null)
                dup2(null, fds[i]);
        close(null);
    } else if (!strcmp(way, "every")) {
        struct rlimit lim;
        getrlimit(RLIMIT_NOFILE, &lim);
        int null = open("/dev/null", O_RDONLY);
        for (rlim_t fd = 3; fd < lim.rlim_max && fd < (1 << 20); fd++)
            if ((int)fd != null)
                dup2(null, (int)fd);
        for (rlim_t fd = 3; fd < lim.rlim_max && fd < (1 << 20); fd++)
            close((int)fd);
    } else if (!strcmp(way, "raw")) {
        if (syscall(SYS_close_range, 3, ~0U, 0) != 0) {
            perror("close_range");
            return 1;
        }
    } else if (!strcmp(way, "watch")) {
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        long opens = 0;
        do {
            int fd = open("/dev/null", O_RDONLY);
            if (fd != before) {
                fprintf(stderr, "fdclose: watch: the lowest free descriptor was %d, is %d after %ld opens\n", before, fd, opens);
                return 1;
            }
            close(fd);
            opens++;
            volatile uint64_t seen = c[(size_t)opens % n][((size_t)opens * 509) % words];
            (void)seen;
            clock_gettime(CLOCK_MONOTONIC, &t);
        } while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < 2500000000L);
        m = 0;
    } else {
        fprintf(stderr, "fdclose: unknown way %s\n", way);
        return 2;
    }
    printf("fdclose: %s closed %d descriptors listed in /proc/self/fd\n", way, m);
    fflush(stdout);

    /* Every byte, twice: the second pass reads what the first one's faults and the
     * reclaimer moved about after the descriptors went. */
    for (int pass = 0; pass < 2; pass++)
        for (size_t k = 0; k < n; k++)
            for (size_t i = 0; i < words; i++)
                if (c[k][i] != word(k * words + i, 7)) {
                    fprintf(stderr, "fdclose: pass %d: chunk %zu word %zu is %#llx, want %#llx\n", pass, k, i,
                            (unsigned long long)c[k][i], (unsigned long long)word(k * words + i, 7));
                    return 1;
                }
    for (size_t k = 0; k < n; k++)
        free(c[k]);
    free(c);
    printf("fdclose: ok\n");
    return 0;
}
