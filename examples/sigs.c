/* Signals under uzswap behave as without it, while memory is managed and swapped:
 *
 *   cc -O2 -pthread -o sigs examples/sigs.c
 *   uzswap run --budget 32M --fault-path sigbus -- ./sigs 96
 *
 * 1. A signal the program blocks stays pending for its sigwait: no thread of uzswap's
 *    takes it (a handler run on a thread the program never made is not transparent).
 * 2. What is inherited across exec stays: SIGHUP ignored under nohup, a blocked
 *    SIGWINCH (checked when the program is run so: pass "inherited" as the second
 *    argument).
 * 3. A SIGBUS handler: sigaction reports it as installed (flags, mask); raise(SIGBUS)
 *    runs it once with its sa_mask blocked and, with SA_RESETHAND, the default back.
 * 4. A SIGBUS with the default disposition kills (a child that raises it dies of it).
 * 5. A handler on an alternate stack (SA_ONSTACK) runs there.
 * Then every byte of the managed memory is checked. Prints "sigs: ok" and exits 0.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t usr1_handled, bus_count, bus_usr2_blocked, bus_reset, onstack;
static char *altstack;
static size_t altstack_len = 1 << 16;

static void fail(const char *what) {
    fprintf(stderr, "sigs: %s\n", what);
    exit(1);
}

static uint64_t word(size_t i) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 29;
    return x * 0xBF58476D1CE4E5B9ull;
}

static void on_usr1(int sig) {
    (void)sig;
    usr1_handled = 1;
}

static void on_bus(int sig, siginfo_t *info, void *ctx) {
    (void)sig, (void)info, (void)ctx;
    sigset_t now;
    pthread_sigmask(SIG_BLOCK, 0, &now);
    bus_usr2_blocked = sigismember(&now, SIGUSR2);
    struct sigaction cur;
    sigaction(SIGBUS, 0, &cur);
    bus_reset = cur.sa_handler == SIG_DFL;
    bus_count++;
}

static void on_segv_onstack(int sig) {
    (void)sig;
    char here;
    onstack = &here >= altstack && &here < altstack + altstack_len;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 96, words = mib * (1 << 20) / 8;
    int inherited = argc > 2 && !strcmp(argv[2], "inherited");
    sigset_t at_start;
    pthread_sigmask(SIG_BLOCK, 0, &at_start);
    if (inherited && !sigismember(&at_start, SIGWINCH))
        fail("SIGWINCH was blocked at exec and is not any more");
    uint64_t *mem = malloc(words * 8);
    if (!mem)
        fail("malloc");
    for (size_t i = 0; i < words; i++)
        mem[i] = word(i);

    /* 1. Blocked SIGUSR1 stays pending for sigwait. */
    sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &usr1, 0);
    signal(SIGUSR1, on_usr1);
    for (int i = 0; i < 20; i++) {
        kill(getpid(), SIGUSR1);
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, 0);
    }
    if (usr1_handled)
        fail("a blocked SIGUSR1 ran its handler (on a thread the program did not make)");
    int got = 0;
    if (sigwait(&usr1, &got) != 0 || got != SIGUSR1)
        fail("sigwait did not get the pending SIGUSR1");

    /* 2. Inherited SIG_IGN. */
    if (inherited) {
        struct sigaction hup;
        sigaction(SIGHUP, 0, &hup);
        if (hup.sa_handler != SIG_IGN)
            fail("SIGHUP was ignored at exec and is not any more");
        kill(getpid(), SIGHUP);
    }

    /* 3. A SIGBUS handler, as installed, run as the kernel runs it. */
    struct sigaction sa, back;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_bus;
    sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGUSR2);
    sigaction(SIGBUS, &sa, 0);
    sigaction(SIGBUS, 0, &back);
    if (back.sa_sigaction != on_bus || !(back.sa_flags & SA_SIGINFO) || !(back.sa_flags & SA_RESETHAND) ||
        !sigismember(&back.sa_mask, SIGUSR2))
        fail("sigaction does not report the SIGBUS handler as installed");
    raise(SIGBUS);
    if (bus_count != 1 || !bus_usr2_blocked || !bus_reset)
        fail("the SIGBUS handler did not run once, with its mask, then reset (SA_RESETHAND)");

    /* 4. The default SIGBUS kills. */
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGBUS, SIG_DFL);
        raise(SIGBUS);
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
    if (!WIFSIGNALED(st) || WTERMSIG(st) != SIGBUS)
        fail("a child raising SIGBUS under SIG_DFL did not die of it");

    /* 5. SA_ONSTACK. */
    altstack = malloc(altstack_len);
    stack_t ss = {.ss_sp = altstack, .ss_size = altstack_len, .ss_flags = 0};
    if (sigaltstack(&ss, 0))
        fail("sigaltstack");
    struct sigaction os;
    memset(&os, 0, sizeof os);
    os.sa_handler = on_segv_onstack;
    os.sa_flags = SA_ONSTACK;
    sigemptyset(&os.sa_mask);
    sigaction(SIGUSR2, &os, 0);
    raise(SIGUSR2);
    if (!onstack)
        fail("an SA_ONSTACK handler did not run on the alternate stack");

    for (size_t i = 0; i < words; i++)
        if (mem[i] != word(i))
            fail("managed memory changed");
    printf("sigs: ok\n");
    return 0;
}
