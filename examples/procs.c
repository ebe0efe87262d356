/* A program that makes processes every way libc offers while most of its memory is
 * swapped out: fork, vfork, forkpty, posix_spawn (with file actions, and with fd 0
 * closed), daemon, system, popen and clone(CLONE_VM). Children that share or copy the
 * memory check it; the parent checks every byte after each.
 *
 *   cc -O2 -o procs examples/procs.c -lutil
 *   uzswap run --budget 32M -- ./procs 128
 *
 * Prints "procs: ok" and exits 0 when every child did what it should and every byte
 * was right.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pty.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;
static uint64_t *mem;
static size_t words;

static uint64_t word(size_t i) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 29;
    return x * 0xBF58476D1CE4E5B9ull;
}

/* Every word (stride 1) or a sample; returns the number of wrong words. */
static size_t check(size_t stride) {
    size_t bad = 0;
    for (size_t i = 0; i < words; i += stride)
        if (mem[i] != word(i))
            bad++;
    return bad;
}

static int fail(const char *what, const char *why) {
    fprintf(stderr, "procs: %s: %s\n", what, why);
    exit(1);
}

static void after(const char *what) {
    if (check(1))
        fail(what, "the parent's memory changed");
}

static int wait_ok(pid_t pid, const char *what) {
    int st;
    if (waitpid(pid, &st, 0) != pid)
        fail(what, "waitpid");
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "procs: %s: child status %#x\n", what, st);
        exit(1);
    }
    return 0;
}

static int clone_child(void *arg) {
    (void)arg;
    return check(1) ? 1 : 0;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 128;
    words = mib * (1 << 20) / 8;
    mem = malloc(words * 8);
    if (!mem)
        fail("malloc", "no memory");
    for (size_t i = 0; i < words; i++)
        mem[i] = word(i);

    /* fork: the child sees every byte. */
    pid_t pid = fork();
    if (pid == 0)
        _exit(check(1) ? 1 : 0);
    wait_ok(pid, "fork");
    after("fork");

    /* vfork: the child shares the memory until it execs. */
    pid = vfork();
    if (pid == 0) {
        if (mem[words / 2] != word(words / 2))
            _exit(1);
        execl("/bin/true", "true", (char *)0);
        _exit(127);
    }
    wait_ok(pid, "vfork");
    after("vfork");

    /* forkpty: the child writes to its terminal. */
    int master;
    pid = forkpty(&master, 0, 0, 0);
    if (pid == 0) {
        if (check(64))
            _exit(1);
        printf("pty child\n");
        fflush(stdout);
        _exit(0);
    }
    if (pid < 0)
        fail("forkpty", "failed");
    char buf[256];
    ssize_t n = read(master, buf, sizeof buf - 1);
    if (n <= 0 || !memmem(buf, n, "pty child", 9))
        fail("forkpty", "no output from the child");
    wait_ok(pid, "forkpty");
    close(master);
    after("forkpty");

    /* posix_spawn with file actions: the child's stdout goes to a pipe. */
    int p[2];
    if (pipe(p))
        fail("pipe", "failed");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    posix_spawn_file_actions_addclose(&fa, p[0]);
    char *echo[] = {"echo", "spawned", 0};
    if (posix_spawnp(&pid, "echo", &fa, 0, echo, environ))
        fail("posix_spawn", "failed");
    close(p[1]);
    n = read(p[0], buf, sizeof buf - 1);
    close(p[0]);
    if (n <= 0 || !memmem(buf, n, "spawned", 7))
        fail("posix_spawn", "no output");
    wait_ok(pid, "posix_spawn");
    posix_spawn_file_actions_destroy(&fa);
    after("posix_spawn");

    /* posix_spawn with fd 0 closed: the child must find fd 0 closed, not one of ours. */
    int saved = dup(0);
    close(0);
    char *probe[] = {"sh", "-c", "if [ -e /proc/self/fd/0 ]; then exit 1; fi", 0};
    if (posix_spawnp(&pid, "sh", 0, 0, probe, environ))
        fail("posix_spawn (fd 0 closed)", "failed");
    wait_ok(pid, "posix_spawn with fd 0 closed (the child found fd 0 open)");
    dup2(saved, 0);
    close(saved);
    after("posix_spawn (fd 0 closed)");

    /* system and popen. */
    if (system("exit 0") != 0)
        fail("system", "nonzero status");
    FILE *f = popen("echo popened", "r");
    if (!f || !fgets(buf, sizeof buf, f) || strcmp(buf, "popened\n") || pclose(f) != 0)
        fail("popen", "wrong output");
    after("system/popen");

    /* clone(CLONE_VM): a child sharing the memory checks every byte. */
    size_t stack_len = 1 << 20;
    char *stack = mmap(0, stack_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    pid = clone(clone_child, stack + stack_len, CLONE_VM | SIGCHLD, 0);
    if (pid < 0)
        fail("clone", "failed");
    wait_ok(pid, "clone(CLONE_VM)");
    munmap(stack, stack_len);
    after("clone");

    /* daemon: the grandchild checks the memory and reports through a pipe. */
    if (pipe(p))
        fail("pipe", "failed");
    pid = fork();
    if (pid == 0) {
        close(p[0]);
        if (daemon(1, 1) != 0)
            _exit(1);
        char verdict = check(1) ? 'x' : 'k';
        write(p[1], &verdict, 1);
        _exit(0);
    }
    close(p[1]);
    char verdict = 0;
    if (read(p[0], &verdict, 1) != 1 || verdict != 'k')
        fail("daemon", "the daemon saw wrong memory or died");
    close(p[0]);
    waitpid(pid, 0, 0);
    after("daemon");

    free(mem);
    printf("procs: ok\n");
    return 0;
}
