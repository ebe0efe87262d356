/*
 * masim: SeongJae Park's zswap test (sjp38/masim, run for zswap storing
 * incompressible pages raw), for `uzswap bench kernel`.
 *
 * Three regions of SIZE bytes each: the first two filled with "11111\n" over and
 * over (very compressible), the third from /dev/urandom (incompressible). Then, for
 * SECONDS, one-byte read-modify-writes at random offsets, each region chosen with
 * equal probability. Under a memory limit smaller than the three regions, the
 * swap system keeps reading pages in and pushing others out, a third of them
 * incompressible.
 *
 * usage: masim SIZE --seconds S [--seed N]   (SIZE with an optional k/m/g suffix)
 *
 * Output, "key=value" fields after the word "masim":
 *   masim phase=fill bytes=B usecs=U
 *   masim phase=rmw ops=N usecs=U
 *   masim phase=check mismatches=M
 *   masim done
 * The check: every increment adds one to the byte sum of all regions (mod 256), so
 * the final sum must equal the initial sum plus the number of operations.
 * The exit status is 3 when the check fails.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

static void usage(void)
{
	fprintf(stderr, "usage: masim SIZE --seconds S [--seed N]\n");
	exit(2);
}

static uint8_t byte_sum(const uint8_t *p, size_t n)
{
	uint8_t sum = 0;
	for (size_t i = 0; i < n; i++)
		sum += p[i];
	return sum;
}

int main(int argc, char **argv)
{
	size_t size = 0;
	int have_size = 0;
	double seconds = -1;
	uint64_t seed = 1;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--seconds") && i + 1 < argc)
			seconds = atof(argv[++i]);
		else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
			seed = strtoull(argv[++i], NULL, 10) | 1;
		else if (!have_size && parse_size(argv[i], &size) == 0)
			have_size = 1;
		else
			usage();
	}
	if (!have_size || size < 4096 || seconds <= 0)
		usage();

	uint8_t *region[3];
	for (int r = 0; r < 3; r++) {
		region[r] = mmap(NULL, size, PROT_READ | PROT_WRITE,
				 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
		if (region[r] == MAP_FAILED) {
			perror("masim: mmap");
			return 1;
		}
	}

	uint64_t t = now_usecs();
	static const char pattern[] = "11111\n";
	for (int r = 0; r < 2; r++)
		for (size_t i = 0; i < size; i++)
			region[r][i] = pattern[i % 6];
	int fd = open("/dev/urandom", O_RDONLY);
	if (fd < 0) {
		perror("masim: /dev/urandom");
		return 1;
	}
	for (size_t done = 0; done < size;) {
		size_t chunk = size - done < (1 << 20) ? size - done : (1 << 20);
		ssize_t n = read(fd, region[2] + done, chunk);
		if (n <= 0) {
			perror("masim: read /dev/urandom");
			return 1;
		}
		done += (size_t)n;
	}
	close(fd);
	uint8_t sum = 0;
	for (int r = 0; r < 3; r++)
		sum += byte_sum(region[r], size);
	printf("masim phase=fill bytes=%zu usecs=%llu\n", 3 * size,
	       (unsigned long long)(now_usecs() - t));
	fflush(stdout);

	uint64_t ops = 0, limit = (uint64_t)(seconds * 1e6);
	t = now_usecs();
	uint64_t elapsed = 0;
	while (elapsed < limit) {
		for (int k = 0; k < 1024; k++) {
			uint64_t r = next_random(&seed);
			region[r % 3][(r >> 8) % size]++;
		}
		ops += 1024;
		elapsed = now_usecs() - t;
	}
	printf("masim phase=rmw ops=%llu usecs=%llu\n", (unsigned long long)ops,
	       (unsigned long long)elapsed);

	uint8_t final_sum = 0;
	for (int r = 0; r < 3; r++)
		final_sum += byte_sum(region[r], size);
	int mismatches = final_sum != (uint8_t)(sum + ops);
	printf("masim phase=check mismatches=%d\n", mismatches);
	printf("masim done\n");
	return mismatches ? 3 : 0;
}
