/*
 * forker: fork from a process with a lot of memory, for `uzswap bench kernel`.
 *
 * Maps SIZE bytes of private anonymous memory and writes every 8-byte word with
 * its own index (as usemem does), then forks FORKS short-lived children one after
 * another: each child writes one page of the inherited memory (one copy on write)
 * and _exits; the parent waits for it before the next fork. Under a memory limit
 * smaller than SIZE, most of the memory is swapped out when the forks happen. At
 * the end the parent checks one word in every page: the forks must not have
 * changed its data.
 *
 * usage: forker SIZE [--forks K]
 *   SIZE      bytes, with an optional k/m/g suffix (powers of 1024)
 *   --forks   how many children (default 16)
 *
 * Output, one line per phase, "key=value" fields after the word "forker":
 *   forker phase=write bytes=B usecs=U
 *   forker phase=fork forks=K usecs=U max_usecs=M   (U: all fork+wait, summed)
 *   forker phase=check pages=P mismatches=M
 *   forker done
 * The exit status is 0 when all is well, 3 if a word was wrong, 1 if a child failed.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"

#define PAGE 4096UL

static void usage(void)
{
	fprintf(stderr, "usage: forker SIZE [--forks K]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	size_t size = 0;
	int forks = 16, have_size = 0;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--forks") && i + 1 < argc) {
			forks = atoi(argv[++i]);
			if (forks < 1)
				usage();
		} else if (!have_size && parse_size(argv[i], &size) == 0) {
			have_size = 1;
		} else {
			usage();
		}
	}
	if (!have_size || size < PAGE)
		usage();
	size &= ~(PAGE - 1);

	uint64_t *words = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (words == MAP_FAILED) {
		perror("forker: mmap");
		return 1;
	}
	size_t nwords = size / sizeof(uint64_t), pages = size / PAGE, per_page = PAGE / sizeof(uint64_t);
	uint64_t t = now_usecs();
	for (size_t i = 0; i < nwords; i++)
		words[i] = i;
	printf("forker phase=write bytes=%zu usecs=%llu\n", size, (unsigned long long)(now_usecs() - t));
	fflush(stdout);

	uint64_t total = 0, max = 0, seed = 1;
	int failed = 0;
	for (int k = 0; k < forks; k++) {
		/* A different page each time, the same on every system. */
		size_t page = next_random(&seed) % pages;
		t = now_usecs();
		pid_t pid = fork();
		if (pid < 0) {
			perror("forker: fork");
			return 1;
		}
		if (pid == 0) {
			memset(&words[page * per_page], 0xa5, PAGE);
			_exit(0);
		}
		int status;
		if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
			failed = 1;
		uint64_t took = now_usecs() - t;
		total += took;
		if (took > max)
			max = took;
	}
	printf("forker phase=fork forks=%d usecs=%llu max_usecs=%llu\n", forks, (unsigned long long)total,
	       (unsigned long long)max);

	size_t mismatches = 0;
	for (size_t p = 0; p < pages; p++) {
		size_t i = p * per_page + (p % per_page);
		mismatches += words[i] != i;
	}
	printf("forker phase=check pages=%zu mismatches=%zu\n", pages, mismatches);
	if (failed) {
		fprintf(stderr, "forker: a child failed\n");
		return 1;
	}
	printf("forker done\n");
	return mismatches ? 3 : 0;
}
