/* setgroups() with its list in swapped-out memory, as a forked child of CPython's
 * subprocess calls it with a list in its heap. glibc applies setgroups on every
 * thread of the process (SIGSETXID), uzswap's own threads too, each handing the kernel
 * the caller's list: were the list swapped out there, uzswap's fault thread would
 * fault on it inside the kernel.
 *
 * usage: setgroups MIB    (MIB of other memory written after the lists, to push them
 * out). Needs CAP_SETGID (root): prints "SKIP: ..." and exits 0 without it. Sets the
 * process's groups to what they were (a short list, then the same ids repeated past a
 * thousand), so it changes nothing. Prints "setgroups: ok" and whether each list was
 * swapped out (not present in /proc/self/pagemap) when setgroups was called. */
#define _GNU_SOURCE
#include <grp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <errno.h>

#define LONG 4096 /* ids in the long list: past what fits on a stack copy */

static int present(const void *p) {
    uint64_t e = 0;
    int fd = open("/proc/self/pagemap", O_RDONLY);
    if (fd < 0) { perror("pagemap"); exit(1); }
    off_t off = (off_t)((uintptr_t)p / 4096) * 8;
    if (pread(fd, &e, 8, off) != 8) { perror("pagemap read"); exit(1); }
    close(fd);
    return (int)((e >> 63) & 1);
}

static void *idle(void *arg) { (void)arg; pause(); return NULL; }

static void push_out(char **junk, size_t mib) {
    for (size_t i = 0; i < mib; i++) {
        junk[i] = malloc(1 << 20);
        if (!junk[i]) { perror("malloc"); exit(1); }
        for (size_t j = 0; j < (1 << 20); j += 4096) junk[i][j] = (char)(i + j / 4096 + 1);
    }
}

static void call(gid_t *list, size_t n, const char *what) {
    int out = !present(list);
    if (setgroups(n, list) != 0) { fprintf(stderr, "setgroups (%s): %s\n", what, strerror(errno)); exit(1); }
    printf("setgroups %s list of %zu: %s\n", what, n, out ? "swapped out" : "resident");
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 64;
    gid_t now[64];
    int n = getgroups(64, now);
    if (n < 0) { perror("getgroups"); return 1; }
    if (n == 0) now[n++] = getegid();
    if (setgroups(n, now) != 0) {
        printf("SKIP: setgroups needs CAP_SETGID (%s)\n", strerror(errno));
        return 0;
    }
    pthread_t t; /* a thread of the program's own, as well as uzswap's */
    if (pthread_create(&t, 0, idle, 0)) { perror("pthread_create"); return 1; }

    /* Each list at the start of its own 1 MiB block, written once, then left. */
    gid_t *shortl = malloc(1 << 20), *longl = malloc(1 << 20);
    if (!shortl || !longl) { perror("malloc"); return 1; }
    memcpy(shortl, now, n * sizeof(gid_t));
    for (size_t i = 0; i < LONG; i++) longl[i] = now[i % n];
    char **junk = calloc(mib, sizeof(char *));
    push_out(junk, mib);

    call(shortl, n, "short");
    call(longl, LONG, "long");

    gid_t back[LONG];
    int m = getgroups(LONG, back);
    if (m < 0) { perror("getgroups"); return 1; }
    for (int i = 0; i < m; i++) {
        int found = 0;
        for (int j = 0; j < n; j++) found |= back[i] == now[j];
        if (!found) { fprintf(stderr, "group %u was not in the list\n", back[i]); return 1; }
    }
    if (setgroups(n, now) != 0) { perror("setgroups (restore)"); return 1; }
    for (size_t i = 0; i < mib; i++)
        for (size_t j = 0; j < (1 << 20); j += 4096)
            if (junk[i][j] != (char)(i + j / 4096 + 1)) { fprintf(stderr, "byte lost\n"); return 1; }
    printf("setgroups: ok\n");
    return 0;
}
