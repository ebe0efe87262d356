/*
 * Helpers the workload programs share: a monotonic clock, SIZE arguments with a
 * k/m/g suffix, and a seeded random sequence that is the same on every system.
 * Built at bench time beside the programs (see crates/bench/src/kernel/programs.rs).
 */
#ifndef UZSWAP_WORKLOAD_COMMON_H
#define UZSWAP_WORKLOAD_COMMON_H

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

static uint64_t now_usecs(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

static int parse_size(const char *s, size_t *out)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || end == s)
		return -1;
	switch (*end) {
	case 'g': case 'G': v <<= 10; /* fall through */
	case 'm': case 'M': v <<= 10; /* fall through */
	case 'k': case 'K': v <<= 10; end++; break;
	case '\0': break;
	default: return -1;
	}
	if (*end != '\0')
		return -1;
	*out = (size_t)v;
	return 0;
}

/* xorshift64*: a fixed, seeded order that is the same on every system. */
static uint64_t next_random(uint64_t *state)
{
	uint64_t x = *state;
	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	*state = x;
	return x * 0x2545F4914F6CDD1DULL;
}

#endif
