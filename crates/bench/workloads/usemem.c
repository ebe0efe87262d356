/*
 * usemem: the vm-scalability usemem pattern, for `uzswap bench kernel`.
 *
 * Maps SIZE bytes of private anonymous memory, writes every 8-byte word with its
 * own index (as usemem does: each 4 KiB page holds 512 consecutive integers), then
 * reads it back and checks every word, either sequentially (PASSES times) or one
 * pass over the 4 KiB pages in a random order. Under a memory limit smaller than
 * SIZE, the write phase measures swap-out and the read phase swap-in.
 *
 * usage: usemem SIZE [--random] [--passes N] [--write-only] [--hugepage] [--seed S]
 *   SIZE      bytes, with an optional k/m/g suffix (powers of 1024)
 *   --hugepage  madvise(MADV_HUGEPAGE) the mapping (THP, for 2 MiB folios)
 *
 * Output, one line per phase, "key=value" fields after the word "usemem":
 *   usemem phase=write bytes=B usecs=U
 *   usemem phase=read order=seq|random passes=P bytes=B usecs=U mismatches=M
 *   usemem done
 * The exit status is 0 when every word read back was the word written, 3 if not.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "common.h"

#define PAGE 4096UL
#define ALIGN (2UL << 20)

static void usage(void)
{
	fprintf(stderr, "usage: usemem SIZE [--random] [--passes N] [--write-only] [--hugepage] [--seed S]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	size_t size = 0;
	int random_order = 0, write_only = 0, hugepage = 0, passes = 1, have_size = 0;
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
		} else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
			seed = strtoull(argv[++i], NULL, 10) | 1;
		} else if (!have_size && parse_size(argv[i], &size) == 0) {
			have_size = 1;
		} else {
			usage();
		}
	}
	if (!have_size || size < PAGE)
		usage();
	size &= ~(PAGE - 1);

	/* Over-map and align to 2 MiB so every large folio size can be used. */
	char *raw = mmap(NULL, size + ALIGN, PROT_READ | PROT_WRITE,
			 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (raw == MAP_FAILED) {
		perror("usemem: mmap");
		return 1;
	}
	uint64_t *words = (uint64_t *)(((uintptr_t)raw + ALIGN - 1) & ~(ALIGN - 1));
	if (hugepage && madvise(words, size, MADV_HUGEPAGE))
		perror("usemem: madvise(MADV_HUGEPAGE)");

	size_t nwords = size / sizeof(uint64_t);
	uint64_t t = now_usecs();
	for (size_t i = 0; i < nwords; i++)
		words[i] = i;
	printf("usemem phase=write bytes=%zu usecs=%llu\n", size,
	       (unsigned long long)(now_usecs() - t));
	fflush(stdout);
	if (write_only) {
		printf("usemem done\n");
		return 0;
	}

	size_t mismatches = 0, pages = size / PAGE, per_page = PAGE / sizeof(uint64_t);
	if (random_order) {
		/* The permutation is built before the clock starts; it is 4 MiB per GiB. */
		uint32_t *order = malloc(pages * sizeof(uint32_t));
		if (!order) {
			perror("usemem: malloc");
			return 1;
		}
		for (size_t p = 0; p < pages; p++)
			order[p] = (uint32_t)p;
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
			for (size_t i = 0; i < nwords; i++)
				mismatches += words[i] != i;
	}
	printf("usemem phase=read order=%s passes=%d bytes=%zu usecs=%llu mismatches=%zu\n",
	       random_order ? "random" : "seq", passes, size * (size_t)passes,
	       (unsigned long long)(now_usecs() - t), mismatches);
	printf("usemem done\n");
	return mismatches ? 3 : 0;
}
