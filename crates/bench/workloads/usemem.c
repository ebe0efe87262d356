/*
 * usemem: the vm-scalability usemem pattern, for `uzswap bench kernel`.
 *
 * Maps SIZE bytes of private anonymous memory, writes every 8-byte word with its
 * own index (as usemem does: each 4 KiB page holds 512 consecutive integers), then
 * reads it back and checks every word, either sequentially (PASSES times) or one
 * pass over the 4 KiB pages in a random order. Under a memory limit smaller than
 * SIZE, the write phase measures swap-out and the read phase swap-in.
 *
 * usage: usemem SIZE [--random] [--passes N] [--write-only] [--hugepage] [--seed S] [--procs N | --threads N]
 *   SIZE      bytes, with an optional k/m/g suffix (powers of 1024)
 *   --hugepage  madvise(MADV_HUGEPAGE) the mapping (THP, for 2 MiB folios)
 *   --procs N   N processes, forked before any memory is touched, each doing the
 *               work on SIZE/N bytes of its own (vm-scalability's usemem -n N)
 *   --threads N N threads of one process, each doing the work on its own SIZE/N
 *               bytes of one shared mapping, every phase started together: faults
 *               at once in one address space (one TLB to shoot down)
 *
 * Output, one line per phase, "key=value" fields after the word "usemem":
 *   usemem phase=write bytes=B usecs=U
 *   usemem phase=read order=seq|random passes=P bytes=B usecs=U mismatches=M
 *   usemem done
 * The exit status is 0 when every word read back was the word written, 3 if not.
 * With --threads N, bytes is the total and usecs the phase's wall time, from the
 * start all threads waited for to the last one's end.
 *
 * With --procs N the phases are in step: every process writes, all wait for the
 * last one, every process reads, all wait again, and only then do they exit, so
 * all N hold their memory at once throughout (without that, those that finish
 * first free theirs and the last ones run in RAM). The parent prints one line per
 * child and phase, starting with "usemem.proc" (proc=I), then the usemem lines
 * above summed as vm-scalability sums its processes: bytes is the total, and
 * usecs the time at which the total moves at the sum of the processes'
 * throughputs (total bytes over the sum of each one's bytes per microsecond), so
 * bytes/usecs is that sum; span_usecs is the phase's wall time, from the first
 * process's start to the last one's end. It exits 3 if any word was wrong, 1 if a
 * child failed otherwise.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <time.h>

#include "common.h"

#define PAGE 4096UL
#define ALIGN (2UL << 20)

static void usage(void)
{
	fprintf(stderr, "usage: usemem SIZE [--random] [--passes N] [--write-only] [--hugepage] [--seed S] [--procs N | --threads N]\n");
	exit(2);
}

/* What one process did: its phases, for the parent of --procs. */
struct result {
	uint64_t write_bytes, write_usecs, read_bytes, read_usecs, mismatches;
	int passes, failed;
};

/* The pipes of --procs: a child writes a byte to ready[1] at the end of phase P
 * and waits for one on go[P][0]; the parent hands out N once all N have come. A
 * pipe per phase, so that a quick child cannot take a slow one's byte. */
static int ready[2] = { -1, -1 }, go[2][2] = { { -1, -1 }, { -1, -1 } };

/* In a child of --procs: wait for the others; exits if the parent is gone. */
static void in_step(int phase)
{
	char c = 0;
	if (ready[1] < 0)
		return;
	if (write(ready[1], &c, 1) != 1 || read(go[phase][0], &c, 1) != 1)
		_exit(1);
}

static void print_write(const char *who, int proc, uint64_t bytes, uint64_t usecs, uint64_t span);
static void print_read(const char *who, int proc, int random_order, int passes, uint64_t bytes, uint64_t usecs,
		       uint64_t mismatches, uint64_t span);

/* Maps `size` bytes (aligned to 2 MiB, so every large folio size can be used). */
static uint64_t *map_words(size_t size, int hugepage)
{
	char *raw = mmap(NULL, size + ALIGN, PROT_READ | PROT_WRITE,
			 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (raw == MAP_FAILED) {
		perror("usemem: mmap");
		return NULL;
	}
	uint64_t *words = (uint64_t *)(((uintptr_t)raw + ALIGN - 1) & ~(ALIGN - 1));
	if (hugepage && madvise(words, size, MADV_HUGEPAGE))
		perror("usemem: madvise(MADV_HUGEPAGE)");
	return words;
}

/* Writes every word of pages [first, first + pages) with its index. */
static void write_pages(uint64_t *words, size_t first, size_t pages)
{
	size_t per_page = PAGE / sizeof(uint64_t);
	for (size_t i = first * per_page; i < (first + pages) * per_page; i++)
		words[i] = i;
}

/* Reads back pages [first, first + pages): `passes` times in order, or once in a
 * random order (built before the clock starts: 4 MiB per GiB). Fills the read
 * fields of `res`; failed if the order cannot be built. */
static void read_pages(uint64_t *words, size_t first, size_t pages, int random_order, int passes, uint64_t seed,
		       struct result *res)
{
	size_t mismatches = 0, per_page = PAGE / sizeof(uint64_t);
	uint64_t t;
	if (random_order) {
		uint32_t *order = malloc(pages * sizeof(uint32_t));
		if (!order) {
			perror("usemem: malloc");
			res->failed = 1;
			return;
		}
		for (size_t p = 0; p < pages; p++)
			order[p] = (uint32_t)(first + p);
		for (size_t p = pages - 1; p > 0; p--) {
			size_t j = next_random(&seed) % (p + 1);
			uint32_t tmp = order[p];
			order[p] = order[j];
			order[j] = tmp;
		}
		passes = 1;
		t = now_usecs();
		for (size_t p = 0; p < pages; p++) {
			size_t base = (size_t)order[p] * per_page;
			for (size_t w = 0; w < per_page; w++)
				mismatches += words[base + w] != base + w;
		}
		free(order);
	} else {
		t = now_usecs();
		for (int pass = 0; pass < passes; pass++)
			for (size_t i = first * per_page; i < (first + pages) * per_page; i++)
				mismatches += words[i] != i;
	}
	res->read_usecs = now_usecs() - t;
	res->read_bytes = pages * PAGE * (size_t)passes;
	res->passes = passes;
	res->mismatches = mismatches;
}

static struct result work(size_t size, int random_order, int write_only, int hugepage, int passes, uint64_t seed)
{
	struct result res = { 0 };
	uint64_t *words = map_words(size, hugepage);
	if (!words) {
		res.failed = 1;
		return res;
	}
	uint64_t t = now_usecs();
	write_pages(words, 0, size / PAGE);
	res.write_bytes = size;
	res.write_usecs = now_usecs() - t;
	in_step(0);
	if (write_only)
		return res;
	read_pages(words, 0, size / PAGE, random_order, passes, seed, &res);
	in_step(1);
	return res;
}

/* --threads: one mapping, a slice of it per thread, phases started together. */
struct slice {
	pthread_t thread;
	uint64_t *words;
	size_t first, pages;
	int random_order, write_only, passes;
	uint64_t seed;
	struct result res;
};
static pthread_barrier_t phase_start, phase_end;

static void *slice_work(void *arg)
{
	struct slice *s = arg;
	pthread_barrier_wait(&phase_start);
	write_pages(s->words, s->first, s->pages);
	pthread_barrier_wait(&phase_end);
	if (s->write_only)
		return NULL;
	pthread_barrier_wait(&phase_start);
	read_pages(s->words, s->first, s->pages, s->random_order, s->passes, s->seed, &s->res);
	pthread_barrier_wait(&phase_end);
	return NULL;
}

static int run_threads(int threads, size_t size, int random_order, int write_only, int hugepage, int passes, uint64_t seed)
{
	size_t each = size / PAGE / (size_t)threads;
	if (!each)
		usage();
	uint64_t *words = map_words(each * PAGE * (size_t)threads, hugepage);
	struct slice *slices = calloc((size_t)threads, sizeof *slices);
	if (!words || !slices || pthread_barrier_init(&phase_start, NULL, (unsigned)threads + 1) ||
	    pthread_barrier_init(&phase_end, NULL, (unsigned)threads + 1))
		return 1;
	for (int i = 0; i < threads; i++) {
		struct slice *s = &slices[i];
		*s = (struct slice){ .words = words, .first = (size_t)i * each, .pages = each, .random_order = random_order,
				     .write_only = write_only, .passes = passes, .seed = seed + 2 * (uint64_t)i };
		if (pthread_create(&s->thread, NULL, slice_work, s)) {
			perror("usemem: pthread_create");
			return 1;
		}
	}
	uint64_t bytes = each * PAGE * (size_t)threads;
	pthread_barrier_wait(&phase_start);
	uint64_t t = now_usecs();
	pthread_barrier_wait(&phase_end);
	print_write("usemem", -1, bytes, now_usecs() - t, 0);
	fflush(stdout);
	struct result sum = { 0 };
	int failed = 0;
	if (!write_only) {
		pthread_barrier_wait(&phase_start);
		t = now_usecs();
		pthread_barrier_wait(&phase_end);
		uint64_t span = now_usecs() - t;
		for (int i = 0; i < threads; i++) {
			sum.read_bytes += slices[i].res.read_bytes;
			sum.mismatches += slices[i].res.mismatches;
			sum.passes = slices[i].res.passes;
			failed |= slices[i].res.failed;
		}
		print_read("usemem", -1, random_order, sum.passes, sum.read_bytes, span, sum.mismatches, 0);
	}
	for (int i = 0; i < threads; i++)
		pthread_join(slices[i].thread, NULL);
	if (failed)
		return 1;
	printf("usemem done\n");
	return sum.mismatches ? 3 : 0;
}

static void print_write(const char *who, int proc, uint64_t bytes, uint64_t usecs, uint64_t span)
{
	printf("%s", who);
	if (proc >= 0)
		printf(" proc=%d", proc);
	printf(" phase=write bytes=%llu usecs=%llu", (unsigned long long)bytes, (unsigned long long)usecs);
	if (span)
		printf(" span_usecs=%llu", (unsigned long long)span);
	printf("\n");
}

static void print_read(const char *who, int proc, int random_order, int passes, uint64_t bytes, uint64_t usecs,
		       uint64_t mismatches, uint64_t span)
{
	printf("%s", who);
	if (proc >= 0)
		printf(" proc=%d", proc);
	printf(" phase=read order=%s passes=%d bytes=%llu usecs=%llu mismatches=%llu",
	       random_order ? "random" : "seq", passes, (unsigned long long)bytes, (unsigned long long)usecs,
	       (unsigned long long)mismatches);
	if (span)
		printf(" span_usecs=%llu", (unsigned long long)span);
	printf("\n");
}

/* The children of --procs, and whether each has been reaped (and how). */
static pid_t *pids;
static int *reaped, *statuses;

/* Reaps a child that has ended, without waiting; 1 if there was one. */
static int reap_one(int procs)
{
	int status;
	pid_t pid = waitpid(-1, &status, WNOHANG);
	for (int i = 0; pid > 0 && i < procs; i++) {
		if (pids[i] == pid) {
			reaped[i] = 1;
			statuses[i] = status;
			return 1;
		}
	}
	return 0;
}

/* In the parent of --procs: waits for all `procs` children to end a phase, then
 * lets them on; 0 when they all came, -1 (the children killed) if one ended
 * before: it failed, or was killed, and the others would wait for it forever. */
static int step(int procs, int phase)
{
	char c[64] = { 0 };
	for (int got = 0; got < procs;) {
		struct pollfd pfd = { .fd = ready[0], .events = POLLIN };
		int r = poll(&pfd, 1, 100);
		if (r == 0 || (r < 0 && errno == EINTR)) {
			if (reap_one(procs)) {
				for (int i = 0; i < procs; i++)
					if (!reaped[i])
						kill(pids[i], SIGKILL);
				return -1;
			}
			continue;
		}
		ssize_t n = read(ready[0], c, (size_t)(procs - got) < sizeof c ? (size_t)(procs - got) : sizeof c);
		if (n <= 0)
			return -1;
		got += (int)n;
	}
	for (int sent = 0; sent < procs;) {
		ssize_t n = write(go[phase][1], c, (size_t)(procs - sent) < sizeof c ? (size_t)(procs - sent) : sizeof c);
		if (n <= 0)
			return -1;
		sent += (int)n;
	}
	return 0;
}

/* The time at which `bytes` moves at `rate` bytes per microsecond (at least 1). */
static uint64_t summed_usecs(uint64_t bytes, double rate)
{
	if (rate <= 0)
		return 0;
	double u = (double)bytes / rate;
	return u < 1 ? 1 : (uint64_t)(u + 0.5);
}

static int run_procs(int procs, size_t size, int random_order, int write_only, int hugepage, int passes, uint64_t seed)
{
	size_t each = (size / (size_t)procs) & ~(PAGE - 1);
	if (each < PAGE)
		usage();
	int fds[2];
	if (pipe(fds) || pipe(ready) || pipe(go[0]) || pipe(go[1])) {
		perror("usemem: pipe");
		return 1;
	}
	fflush(stdout);
	pids = calloc((size_t)procs, sizeof(pid_t));
	reaped = calloc((size_t)procs, sizeof(int));
	statuses = calloc((size_t)procs, sizeof(int));
	if (!pids || !reaped || !statuses) {
		perror("usemem: calloc");
		return 1;
	}
	/* Every child is forked before any of the workload's memory is touched. */
	uint64_t start = now_usecs();
	for (int i = 0; i < procs; i++) {
		pid_t pid = fork();
		if (pid < 0) {
			perror("usemem: fork");
			return 1;
		}
		if (pid == 0) {
			close(fds[0]);
			close(ready[0]);
			close(go[0][1]);
			close(go[1][1]);
			struct { int proc; struct result r; } rec;
			rec.proc = i;
			rec.r = work(each, random_order, write_only, hugepage, passes, seed + 2 * (uint64_t)i);
			/* One record, smaller than PIPE_BUF: written whole. exit, not _exit: a
			 * process under uzswap reports its counters from an atexit handler
			 * (stdout's buffer is empty: flushed before the fork). */
			exit(write(fds[1], &rec, sizeof rec) == (ssize_t)sizeof rec && !rec.r.failed ? 0 : 1);
		}
		pids[i] = pid;
	}
	close(fds[1]);
	close(ready[1]);
	close(go[0][0]);
	close(go[1][0]);
	ready[1] = -1;
	/* The phases' wall times; a child that is gone fails the run below. */
	uint64_t write_span = 0, read_span = 0;
	if (step(procs, 0) == 0) {
		uint64_t t = now_usecs();
		write_span = t - start;
		if (!write_only && step(procs, 1) == 0)
			read_span = now_usecs() - t;
	}
	close(go[0][1]);
	close(go[1][1]);
	struct result sum = { 0 };
	double write_rate = 0, read_rate = 0;
	int got = 0, failed = 0;
	struct { int proc; struct result r; } rec;
	while (read(fds[0], &rec, sizeof rec) == (ssize_t)sizeof rec) {
		struct result *r = &rec.r;
		got++;
		print_write("usemem.proc", rec.proc, r->write_bytes, r->write_usecs, 0);
		sum.write_bytes += r->write_bytes;
		if (r->write_usecs)
			write_rate += (double)r->write_bytes / (double)r->write_usecs;
		if (!write_only) {
			print_read("usemem.proc", rec.proc, random_order, r->passes, r->read_bytes, r->read_usecs,
				   r->mismatches, 0);
			sum.read_bytes += r->read_bytes;
			sum.mismatches += r->mismatches;
			sum.passes = r->passes;
			if (r->read_usecs)
				read_rate += (double)r->read_bytes / (double)r->read_usecs;
		}
	}
	for (int i = 0; i < procs; i++) {
		int status = statuses[i];
		if ((!reaped[i] && waitpid(pids[i], &status, 0) != pids[i]) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
			fprintf(stderr, "usemem: process %d of %d failed\n", i, procs);
			failed = 1;
		}
	}
	if (got != procs) {
		fprintf(stderr, "usemem: %d of %d processes reported\n", got, procs);
		return 1;
	}
	print_write("usemem", -1, sum.write_bytes, summed_usecs(sum.write_bytes, write_rate), write_span);
	if (!write_only)
		print_read("usemem", -1, random_order, sum.passes, sum.read_bytes, summed_usecs(sum.read_bytes, read_rate),
			   sum.mismatches, read_span);
	if (failed)
		return sum.mismatches ? 3 : 1;
	printf("usemem done\n");
	return sum.mismatches ? 3 : 0;
}

int main(int argc, char **argv)
{
	size_t size = 0;
	int random_order = 0, write_only = 0, hugepage = 0, passes = 1, have_size = 0, procs = 0, threads = 0;
	uint64_t seed = 1;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--random")) {
			random_order = 1;
		} else if (!strcmp(argv[i], "--write-only")) {
			write_only = 1;
		} else if (!strcmp(argv[i], "--hugepage")) {
			hugepage = 1;
		} else if (!strcmp(argv[i], "--passes") && i + 1 < argc) {
			passes = atoi(argv[++i]);
			if (passes < 1)
				usage();
		} else if (!strcmp(argv[i], "--procs") && i + 1 < argc) {
			procs = atoi(argv[++i]);
			if (procs < 1 || procs > 1024)
				usage();
		} else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
			threads = atoi(argv[++i]);
			if (threads < 1 || threads > 1024)
				usage();
		} else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
			seed = strtoull(argv[++i], NULL, 10) | 1;
		} else if (!have_size && parse_size(argv[i], &size) == 0) {
			have_size = 1;
		} else {
			usage();
		}
	}
	if (!have_size || size < PAGE || (procs && threads))
		usage();
	size &= ~(PAGE - 1);
	if (threads)
		return run_threads(threads, size, random_order, write_only, hugepage, passes, seed);
	if (procs)
		return run_procs(procs, size, random_order, write_only, hugepage, passes, seed);

	struct result r = work(size, random_order, write_only, hugepage, passes, seed);
	if (r.failed)
		return 1;
	print_write("usemem", -1, r.write_bytes, r.write_usecs, 0);
	fflush(stdout);
	if (!write_only)
		print_read("usemem", -1, random_order, r.passes, r.read_bytes, r.read_usecs, r.mismatches, 0);
	printf("usemem done\n");
	return r.mismatches ? 3 : 0;
}
