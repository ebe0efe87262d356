/* stdio streams and a directory stream whose buffers the program's own allocator
 * placed in memory uzswap manages, as a jemalloc-linked program's are: the allocator
 * here maps 2 MiB chunks with mmap and hands out pieces of them, so glibc's FILEs, DIRs
 * and their buffers (which glibc mallocs) sit in managed memory. Between the calls on
 * each stream the program touches four times its budget of other memory, so that the
 * buffers' folios go out; glibc's own write(2), read(2) and getdents64 on them (a flush
 * from inside putc or fprintf, a refill from inside getc, fgets or readdir) then meet
 * swapped-out memory; so does stdout's flush, its buffer malloc'd by glibc too.
 * Where the kernel does not wait for such faults
 * (UFFD_USER_MODE_ONLY, the SIGBUS path), the stdio calls failed with EFAULT: a stream
 * error, output lost. Also checked: errno after a flush that fails (through a buffer
 * the program set, which the shim holds in place) and after a read at the end of a
 * file (the hold once left EEXIST there).
 *
 *   cc -O2 -pthread -o stdiobuf examples/stdiobuf.c
 *   uzswap run --budget 16M -- ./stdiobuf DIR
 *
 * Prints "stdiobuf: ok" and exits 0 when every byte written came back.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define CHUNK (2u << 20)
#define LINES (64 * 16)
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char *chunk, *next;

void *malloc(size_t n) {
    n = (n + 15) & ~(size_t)15;
    pthread_mutex_lock(&lock);
    if (!chunk || next + n > chunk + CHUNK) {
        size_t len = n > CHUNK ? n : CHUNK;
        void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            pthread_mutex_unlock(&lock);
            return NULL;
        }
        if (n > CHUNK) {
            pthread_mutex_unlock(&lock);
            return p;
        }
        chunk = next = p;
    }
    void *p = next;
    next += n;
    pthread_mutex_unlock(&lock);
    return p;
}
void free(void *p) { (void)p; }
void *calloc(size_t a, size_t b) { return malloc(a * b); } /* fresh mappings are zero */
void *realloc(void *p, size_t n) {
    void *q = malloc(n);
    if (q && p) memcpy(q, p, n); /* over-reads into the chunk at worst: never past it */
    return q;
}

/* Four times the budget of other memory, written over again each time: the streams'
 * folios go out. */
static unsigned char *churned[32];
static int churns;
static void churn(void) {
    for (int i = 0; i < 32; i++) {
        if (!churned[i]) churned[i] = malloc(CHUNK + 4096);
        for (size_t j = 0; j < CHUNK; j += 512) churned[i][j] = (unsigned char)(j / 512 + i + churns);
    }
    churns++;
}

/* The buffer (malloc'd by setvbuf) in another folio than the FILE (malloc'd by
 * fopen), as an allocator with size classes keeps them apart: glibc touches the FILE
 * first, which would bring a folio holding both back. */
static void *volatile gap; /* kept: an allocation unused is optimized out */
static void apart(void) { gap = malloc(256 << 10); }

static void fail(const char *what) {
    printf("stdiobuf: BAD %s\n", what);
    exit(1);
}

int main(int argc, char **argv) {
    /* A chunk of its own for what follows: the first may have been mapped before
     * uzswap started (libc's own mallocs at startup), and is not managed then. */
    pthread_mutex_lock(&lock);
    chunk = NULL;
    pthread_mutex_unlock(&lock);
    char path[4096];
    snprintf(path, sizeof path, "%s/stdiobuf.txt", argc > 1 ? argv[1] : "/tmp");
    char path_txt[4096];
    strcpy(path_txt, path);
    /* Line buffering asked for before any output stays when uzswap gives stdout a
     * buffer of its own (at this first fopen). glibc's private flag _IO_LINE_BUF. */
    setvbuf(stdout, NULL, _IOLBF, 0);
    FILE *f = fopen(path, "w");
    if (!f) fail("fopen");
    if (!(stdout->_flags & 0x200)) fail("stdout lost the line buffering asked for");
    /* Records of 64 bytes, a line each, churning after every 64th: the 4 KiB buffer
     * is full then, and the next record's fprintf flushes it (from inside libc),
     * gone out meanwhile, before it writes. Half the records end with putc. */
    apart();
    if (setvbuf(f, NULL, _IOFBF, 4096) != 0) fail("setvbuf");
    for (int line = 0; line < LINES; line++) {
        fprintf(f, "line %06d ", line);
        if (line % 2) {
            for (int k = 0; k < 51; k++) putc('a' + (line + k) % 26, f);
            putc('\n', f);
        } else {
            for (int k = 0; k < 51; k++) fprintf(f, "%c", 'a' + (line + k) % 26);
            fprintf(f, "\n");
        }
        if (line % 64 == 63) churn();
        if (ferror(f)) fail("write (fprintf, putc)");
    }
    if (fclose(f) != 0) fail("fclose");
    /* The same records to stdout, fully buffered, whose buffer glibc mallocs at its
     * first use: in managed memory too, away from its FILE (libc's). */
    apart();
    setvbuf(stdout, NULL, _IOFBF, 0);
    for (int line = 0; line < LINES; line++) {
        printf("line %06d ", line);
        for (int k = 0; k < 51; k++) putchar('a' + (line + k) % 26);
        putchar('\n');
        if (line % 64 == 63) churn();
        if (ferror(stdout)) fail("write to stdout (printf, putchar)");
    }
    f = fopen(path, "r");
    if (!f) fail("fopen to read");
    apart();
    if (setvbuf(f, NULL, _IOFBF, 4096) != 0) fail("setvbuf");
    char want[128], got[128];
    for (int line = 0; line < LINES; line++) {
        int n = snprintf(want, sizeof want, "line %06d ", line);
        for (int k = 0; k < 51; k++) want[n++] = 'a' + (line + k) % 26;
        want[n++] = '\n';
        want[n] = 0;
        /* Half by getc, half by fgets: every 64th line the buffer is used up, and the
         * next call's refill reads into it, gone out meanwhile. */
        if (line % 2) {
            int i = 0, c;
            while (i < (int)sizeof got - 1 && (c = getc(f)) != EOF) {
                got[i++] = (char)c;
                if (c == '\n') break;
            }
            got[i] = 0;
        } else if (!fgets(got, sizeof got, f)) {
            got[0] = 0;
        }
        if (strcmp(want, got) != 0) {
            snprintf(path, sizeof path, "read line %d (getc, fgets): %s", line, ferror(f) ? "a stream error" : "wrong bytes");
            fail(path);
        }
        if (line % 64 == 63) churn();
    }
    fclose(f);
    for (int i = 0; i < 32; i++)
        for (size_t j = 0; j < CHUNK; j += 512)
            if (churned[i][j] != (unsigned char)(j / 512 + i + churns - 1)) fail("memory");
    /* A failed flush says why, through the shim's hold of a buffer the program set
     * (in managed memory, gone out): the full device, ENOSPC. */
    errno = 0;
    FILE *full = fopen("/dev/full", "w");
    if (!full) fail("fopen /dev/full");
    if (errno) fail("fopen of a device that is no terminal left errno set"); /* (isatty's ENOTTY) */
    apart();
    char *own = malloc(4096);
    if (setvbuf(full, own, _IOFBF, 4096) != 0) fail("setvbuf");
    fputs("x", full);
    churn();
    errno = 0;
    if (fflush(full) != EOF || errno != ENOSPC) {
        snprintf(path, sizeof path, "fflush on /dev/full: errno %d, not ENOSPC", errno);
        fail(path);
    }
    fclose(full);
    /* And a read that meets the end of the file leaves errno alone, as without uzswap
     * (a program may set it to 0 first and look at it after). */
    f = fopen(path_txt, "r");
    if (!f) fail("fopen to read again");
    apart();
    if (setvbuf(f, malloc(4096), _IOFBF, 4096) != 0) fail("setvbuf");
    fseek(f, 0, SEEK_END);
    churn();
    errno = 0;
    if (fread(got, 1, sizeof got, f) != 0 || !feof(f) || errno != 0) {
        snprintf(path, sizeof path, "fread at the end: errno %d", errno);
        fail(path);
    }
    fclose(f);

    /* A directory of 300 entries with long names (several refills of readdir's 32 KiB
     * buffer), read with the memory churned just before each refill: glibc's DIR
     * (private, but stable: fd, lock, allocation, size, offset, ...) says when its
     * buffer is used up. This needs no help: readdir touches the DIR's head (its lock,
     * its offsets) before getdents64, which brings the folio back with the start of
     * the buffer, and getdents64 stops short, without an error, at a page missing
     * further on. */
    char name[4400];
    snprintf(path, sizeof path, "%s/stdiobuf.d", argc > 1 ? argv[1] : "/tmp");
    mkdir(path, 0700);
    for (int i = 0; i < 300; i++) {
        snprintf(name, sizeof name, "%s/%0200d", path, i);
        FILE *e = fopen(name, "w");
        if (!e) fail("create a directory entry");
        fclose(e);
    }
    apart();
    DIR *d = opendir(path);
    if (!d) fail("opendir");
    struct dir_head { int fd, lock; size_t allocation, size, offset; } *h = (void *)d;
    int entries = 0;
    for (;;) {
        if (h->offset >= h->size && h->size > 0) churn();
        errno = 0;
        struct dirent *e = readdir(d);
        if (!e) {
            if (errno) fail("readdir: an error");
            break;
        }
        entries++;
    }
    closedir(d);
    for (int i = 0; i < 300; i++) {
        snprintf(name, sizeof name, "%s/%0200d", path, i);
        unlink(name);
    }
    rmdir(path);
    if (entries != 302) {
        snprintf(name, sizeof name, "readdir: %d entries of 302", entries);
        fail(name);
    }
    printf("stdiobuf: ok\n");
    return 0;
}
