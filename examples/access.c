/* Managed memory keeps its contents through every change of protection and every
 * access the kernel makes on the program's behalf, while most of it is swapped out:
 *
 *   cc -O2 -o access examples/access.c
 *   uzswap run --budget 32M -- ./access 128
 *
 * Each step first pushes the checked buffer out (by writing a second buffer as large
 * as the budget), then:
 *   mprotect     PROT_READ, PROT_NONE, PROT_EXEC, PROT_READ|PROT_EXEC and back to
 *                read-write, on the whole buffer and on every other 64 KiB piece (W^X
 *                flips of part of a range), checking every byte in between
 *   mlock        mlock, check, munlock
 *   madvise      MADV_DONTFORK then a fork (the child must not see it), MADV_DOFORK,
 *                MADV_WIPEONFORK then a fork (the child sees zeros, the parent its data)
 *   syscalls     write(2) of the buffer to a pipe, read back by a thread; read(2) and
 *                pread(2) from a file into it; pwritev/preadv and writev/readv of it
 *   stdio        fwrite and fread (and their _unlocked forms) of the whole buffer
 *   sendmsg      sendmsg and recvmsg of part of it, in three pieces, as one datagram;
 *                send and recv of one datagram; recv with MSG_WAITALL of 4 MiB on a
 *                stream socket
 *   procmem      pread of /proc/self/mem over the buffer
 *   vmreadv      process_vm_readv and process_vm_writev of our own pid
 *   debugger     another process reads ours through /proc/PID/mem and
 *                process_vm_readv: each piece comes right or is refused (EIO, EFAULT)
 * Prints "access: ok" and exits 0 when every byte was right everywhere.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static uint8_t *buf, *other;
static size_t len;

static void fail(const char *step, const char *why) {
    fprintf(stderr, "access: %s: %s\n", step, why);
    exit(1);
}

static uint64_t word(size_t i, uint64_t v) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ v;
    x ^= x >> 29;
    return x * 0xBF58476D1CE4E5B9ull;
}

static uint64_t version = 1;

static void fill(void) {
    version++;
    for (size_t i = 0; i < len / 8; i++)
        ((uint64_t *)buf)[i] = word(i, version);
}

static void check_range(const uint8_t *p, size_t off, size_t n, const char *step) {
    for (size_t i = off / 8; i < (off + n) / 8; i++)
        if (((const uint64_t *)p)[i - off / 8] != word(i, version)) {
            fprintf(stderr, "access: %s: byte %zu is wrong\n", step, i * 8);
            exit(1);
        }
}

static void check(const char *step) {
    check_range(buf, 0, len, step);
}

/* Writes the other buffer, as large as the budget, so the checked one goes out. */
static void push_out(void) {
    static uint8_t v;
    memset(other, ++v, len);
}

/* Sends `whole` bytes (4 MiB) of `feed_from` on a stream socket. */
static const size_t whole = 4 << 20;
static uint8_t *feed_from;
static void *feed(void *arg) {
    int fd = *(int *)arg;
    for (size_t put = 0; put < whole;) {
        ssize_t n = send(fd, feed_from + put, whole - put, 0);
        if (n <= 0)
            fail("recv", "stream send");
        put += n;
    }
    return 0;
}

static void *drain(void *arg) {
    int fd = *(int *)arg;
    uint8_t *copy = malloc(len);
    size_t got = 0;
    while (got < len) {
        ssize_t n = read(fd, copy + got, len - got);
        if (n <= 0)
            fail("syscalls", "pipe read");
        got += n;
    }
    check_range(copy, 0, len, "syscalls (write to a pipe)");
    free(copy);
    return 0;
}

/* The other process of the "debugger" step: reads `len` bytes at `addr` of `pid`. */
static int read_other(char **argv) {
    pid_t pid = atoi(argv[2]);
    uint8_t *at = (uint8_t *)(uintptr_t)strtoul(argv[3], 0, 10);
    len = strtoul(argv[4], 0, 10);
    version = strtoull(argv[5], 0, 10);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/mem", pid);
    int m = open(path, O_RDONLY);
    uint8_t *piece = malloc(1 << 20);
    int counts[4] = {0, 0, 0, 0}; /* mem right, mem refused, vm right, vm refused */
    for (size_t off = 0; off < len; off += 1 << 20) {
        ssize_t n = m < 0 ? -1 : pread(m, piece, 1 << 20, (off_t)(uintptr_t)(at + off));
        if (n == 1 << 20) {
            check_range(piece, off, 1 << 20, "debugger (/proc/PID/mem)");
            counts[0]++;
        } else {
            counts[1]++;
        }
        struct iovec l = {piece, 1 << 20}, r = {at + off, 1 << 20};
        n = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (n == 1 << 20) {
            check_range(piece, off, 1 << 20, "debugger (process_vm_readv)");
            counts[2]++;
        } else {
            counts[3]++;
        }
    }
    printf("/proc/PID/mem: %d MiB right, %d MiB refused; process_vm_readv: %d MiB right, %d MiB refused\n", counts[0],
           counts[1], counts[2], counts[3]);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 6 && !strcmp(argv[1], "read-other"))
        return read_other(argv);
    len = (argc > 1 ? strtoul(argv[1], 0, 10) : 128) << 20;
    buf = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    other = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED || other == MAP_FAILED)
        fail("mmap", "failed");
    fill();

    /* mprotect, whole and in pieces. */
    int prots[] = {PROT_READ, PROT_NONE, PROT_EXEC, PROT_READ | PROT_EXEC};
    for (int k = 0; k < 4; k++) {
        push_out();
        if (mprotect(buf, len, prots[k]))
            fail("mprotect", "whole");
        push_out();
        if (mprotect(buf, len, PROT_READ | PROT_WRITE))
            fail("mprotect", "back");
        check("mprotect (whole range and back)");
        push_out();
        for (size_t off = 0; off < len; off += 128 << 10)
            if (mprotect(buf + off, 64 << 10, prots[k]))
                fail("mprotect", "piece");
        push_out();
        if (mprotect(buf, len, PROT_READ))
            fail("mprotect", "read");
        check("mprotect (pieces, then read-only)");
        if (mprotect(buf, len, PROT_READ | PROT_WRITE))
            fail("mprotect", "back");
        fill();
    }

    /* mlock. */
    push_out();
    if (mlock(buf, len) == 0) {
        check("mlock");
        munlock(buf, len);
        push_out();
        check("munlock");
    }

    /* madvise DONTFORK / WIPEONFORK. */
    push_out();
    madvise(buf, len, MADV_DONTFORK);
    pid_t pid = fork();
    if (pid == 0) {
        /* The range is not in the child: mincore fails with ENOMEM, or, if something
         * the child mapped since landed there (under uzswap, the child's own runtime
         * starts inside fork), it does not hold the parent's bytes. */
        unsigned char vec;
        _exit(mincore(buf, 4096, &vec) == -1 || ((uint64_t *)buf)[0] != word(0, version) ? 0 : 1);
    }
    int st;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st))
        fail("madvise", "MADV_DONTFORK range reached the child");
    madvise(buf, len, MADV_DOFORK);
    check("madvise (DONTFORK)");
    push_out();
    madvise(buf, len, MADV_WIPEONFORK);
    pid = fork();
    if (pid == 0) {
        for (size_t i = 0; i < len; i += 4096)
            if (buf[i])
                _exit(1);
        _exit(0);
    }
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st))
        fail("madvise", "MADV_WIPEONFORK: the child did not see zeros");
    madvise(buf, len, MADV_KEEPONFORK);
    check("madvise (WIPEONFORK, parent)");

    /* System calls reading and writing the buffer. */
    push_out();
    int p[2];
    if (pipe(p))
        fail("syscalls", "pipe");
    pthread_t t;
    pthread_create(&t, 0, drain, &p[0]);
    size_t put = 0;
    while (put < len) {
        ssize_t n = write(p[1], buf + put, len - put);
        if (n <= 0)
            fail("syscalls", "write from the buffer");
        put += n;
    }
    pthread_join(t, 0);
    close(p[0]);
    close(p[1]);
    char path[] = "/tmp/uzswap-access-XXXXXX";
    int fd = mkstemp(path);
    unlink(path);
    if (fd < 0 || write(fd, buf, len) != (ssize_t)len)
        fail("syscalls", "write to a file");
    version++;
    memset(buf, 0, len);
    push_out();
    version--;
    if (pread(fd, buf, len, 0) != (ssize_t)len)
        fail("syscalls", "pread into the buffer");
    check("syscalls (pread)");
    push_out();
    lseek(fd, 0, SEEK_SET);
    size_t got = 0;
    while (got < len) {
        ssize_t n = read(fd, buf + got, len - got);
        if (n <= 0)
            fail("syscalls", "read into the buffer");
        got += n;
    }
    check("syscalls (read)");
    /* Vectored: the buffer in three pieces, written and read back by offset (64 MiB in
       all: the shim goes piece by piece), then the first 768 KiB in three (one call). */
    struct iovec v[3] = {{buf, len / 4}, {buf + len / 4, len / 2}, {buf + 3 * (len / 4), len - 3 * (len / 4)}};
    push_out();
    if (pwritev(fd, v, 3, 0) != (ssize_t)len)
        fail("syscalls", "pwritev from the buffer");
    version++;
    memset(buf, 0, len);
    push_out();
    version--;
    if (preadv(fd, v, 3, 0) != (ssize_t)len)
        fail("syscalls", "preadv into the buffer");
    check("syscalls (preadv)");
    struct iovec w[3] = {{buf, 128 << 10}, {buf + (128 << 10), 512 << 10}, {buf + (640 << 10), 128 << 10}};
    push_out();
    lseek(fd, 0, SEEK_SET);
    if (writev(fd, w, 3) != 768 << 10)
        fail("syscalls", "writev from the buffer");
    memset(buf, 0, 768 << 10);
    push_out();
    lseek(fd, 0, SEEK_SET);
    if (readv(fd, w, 3) != 768 << 10)
        fail("syscalls", "readv into the buffer");
    close(fd);
    check("syscalls (writev, readv)");

    /* stdio: fwrite and fread hand a large buffer to write(2) and read(2) from inside
       libc, where no preload sees the call. */
    push_out();
    FILE *f = tmpfile();
    if (!f || fwrite(buf, 1, len, f) != len || fflush(f))
        fail("stdio", "fwrite from the buffer");
    version++;
    memset(buf, 0, len);
    push_out();
    version--;
    rewind(f);
    if (fread(buf, 8, len / 8, f) != len / 8)
        fail("stdio", "fread into the buffer");
    check("stdio (fwrite, fread)");
    push_out();
    rewind(f);
    if (fwrite_unlocked(buf, 4096, len / 4096, f) != len / 4096 || fflush(f))
        fail("stdio", "fwrite_unlocked from the buffer");
    memset(buf, 0, len);
    push_out();
    rewind(f);
    if (fread_unlocked(buf, 1, len, f) != len)
        fail("stdio", "fread_unlocked into the buffer");
    fclose(f);
    check("stdio (fwrite_unlocked, fread_unlocked)");

    /* sendmsg and recvmsg on a datagram socket pair: 512 KiB in three pieces, one
       datagram. */
    int sv[2];
    int size = 1 << 20;
    if (socketpair(AF_UNIX, SOCK_DGRAM, 0, sv) || setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &size, sizeof size) ||
        setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &size, sizeof size))
        fail("sendmsg", "socketpair");
    /* A receive that fails does not come again: it must not wait for ever. */
    struct timeval tv = {.tv_sec = 5};
    if (setsockopt(sv[1], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv))
        fail("sendmsg", "SO_RCVTIMEO");
    struct iovec m[3] = {{buf, 64 << 10}, {buf + (64 << 10), 384 << 10}, {buf + (448 << 10), 64 << 10}};
    struct msghdr h = {.msg_iov = m, .msg_iovlen = 3};
    push_out();
    if (sendmsg(sv[0], &h, 0) != 512 << 10) {
        perror("sendmsg");
        fail("sendmsg", "sendmsg from the buffer");
    }
    memset(buf, 0, 512 << 10);
    push_out();
    if (recvmsg(sv[1], &h, 0) != 512 << 10) {
        perror("recvmsg");
        fail("recvmsg", "recvmsg into the buffer");
    }
    check("sendmsg, recvmsg");
    /* send and recv of one datagram: the datagram the kernel fails to copy into a
       missing page is dropped, so a receive must never be tried in place. */
    push_out();
    if (send(sv[0], buf, 256 << 10, 0) != 256 << 10)
        fail("send", "send from the buffer");
    memset(buf, 0, 256 << 10);
    push_out();
    if (recv(sv[1], buf, 256 << 10, 0) != 256 << 10) {
        perror("recv");
        fail("recv", "recv into the buffer");
    }
    close(sv[0]);
    close(sv[1]);
    check("send, recv");
    /* recv with MSG_WAITALL of 4 MiB on a stream: all of it in one call. */
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        fail("recv", "socketpair");
    feed_from = malloc(whole);
    memcpy(feed_from, buf, whole);
    memset(buf, 0, whole);
    push_out();
    pthread_t feeder;
    pthread_create(&feeder, 0, feed, &sv[0]);
    ssize_t all = recv(sv[1], buf, whole, MSG_WAITALL);
    if (all != (ssize_t)whole) {
        fprintf(stderr, "access: recv MSG_WAITALL gave %zd of %zu\n", all, whole);
        fail("recv", "recv MSG_WAITALL into the buffer");
    }
    pthread_join(feeder, 0);
    free(feed_from);
    close(sv[0]);
    close(sv[1]);
    check("recv (MSG_WAITALL)");

    /* /proc/self/mem. */
    push_out();
    int mem = open("/proc/self/mem", O_RDWR);
    uint8_t *copy = malloc(1 << 20);
    for (size_t off = 0; off < len; off += 1 << 20) {
        ssize_t n = pread(mem, copy, 1 << 20, (off_t)(uintptr_t)(buf + off));
        if (n != 1 << 20) {
            perror("pread /proc/self/mem");
            fail("procmem", "read of swapped-out memory failed");
        }
        check_range(copy, off, 1 << 20, "procmem");
    }
    close(mem);

    /* process_vm_readv / writev on ourselves. */
    push_out();
    for (size_t off = 0; off < len; off += 1 << 20) {
        struct iovec l = {copy, 1 << 20}, r = {buf + off, 1 << 20};
        if (process_vm_readv(getpid(), &l, 1, &r, 1, 0) != 1 << 20) {
            perror("process_vm_readv");
            fail("vmreadv", "read of swapped-out memory failed");
        }
        check_range(copy, off, 1 << 20, "vmreadv");
    }
    push_out();
    for (size_t off = 0; off < len; off += 1 << 20) {
        memcpy(copy, buf + off, 1 << 20);
        struct iovec l = {copy, 1 << 20}, r = {buf + off, 1 << 20};
        push_out();
        if (process_vm_writev(getpid(), &l, 1, &r, 1, 0) != 1 << 20) {
            perror("process_vm_writev");
            fail("vmwritev", "write into swapped-out memory failed");
        }
        if (off > 8 << 20)
            break;
    }
    check("vmwritev");
    /* Another process reading ours, as a debugger or profiler does: /proc/PID/mem
     * (which userfaultfd cannot serve for a page not in place: EIO) and
     * process_vm_readv (served on the thread path). Each read gives the right bytes
     * or an error, never wrong bytes. The reader is spawned (not forked: a forked
     * child would share the pages, which then could not be swapped out). */
    push_out();
    unsigned char *vec = malloc(len / 4096);
    size_t resident = 0;
    if (mincore(buf, len, vec) == 0)
        for (size_t i = 0; i < len / 4096; i++)
            resident += vec[i] & 1;
    free(vec);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "/proc/%d/exe read-other %d %lu %zu %llu", getpid(), getpid(), (unsigned long)(uintptr_t)buf, len,
             (unsigned long long)version);
    FILE *rd = popen(cmd, "r");
    char line[256] = "";
    if (!rd || !fgets(line, sizeof line, rd) || pclose(rd) != 0)
        fail("debugger", "the reading process failed (it read wrong bytes)");
    printf("access: with %zu of %zu pages in place, another process read %s", resident, len / 4096, line);
    check("debugger");

    free(copy);
    printf("access: ok\n");
    return 0;
}
