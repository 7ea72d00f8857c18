/*
 * ring3: a checksum computed at CPL 3 twice, with two different loop
 * structures, printed from ring 3 (port I/O through the TSS bitmap) and
 * checked in ring 0.  Ring 0 is emulated on this project's hosts, so it
 * only compares the two results.
 */
#include "kit.h"

#define BUF_SIZE	(1 << 20)
#define ROUNDS		4
#define FNV_OFFSET	0xcbf29ce484222325ull
#define FNV_PRIME	0x100000001b3ull

static u8 buf[BUF_SIZE] __attribute__((aligned(4096)));
static u64 sum_b;

/* FNV-1a, byte by byte, ROUNDS passes chained. */
static u64 __attribute__((noinline)) checksum_bytes(void)
{
	u64 h = FNV_OFFSET;
	for (int r = 0; r < ROUNDS; r++)
		for (u32 i = 0; i < BUF_SIZE; i++)
			h = (h ^ buf[i]) * FNV_PRIME;
	return h;
}

/* The same function over 64-bit words, bytes taken by shifts (little endian). */
static u64 __attribute__((noinline)) checksum_words(void)
{
	const u64 *w = (const u64 *)buf;
	u64 h = FNV_OFFSET;
	for (int r = ROUNDS; r > 0; r--) {
		for (u32 i = 0; i < BUF_SIZE / 8; i++) {
			u64 x = w[i];
			for (int k = 0; k < 64; k += 8)
				h = (h ^ ((x >> k) & 0xff)) * FNV_PRIME;
		}
	}
	return h;
}

static u64 ring3_work(u64 seed)
{
	unsigned level = cpl();
	if (level != 3)
		fail("ring3: running at CPL %u, expected 3", level);

	u64 x = seed, *w = (u64 *)buf;	/* xorshift64 fill */
	for (u32 i = 0; i < BUF_SIZE / 8; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		w[i] = x;
	}
	u64 a = checksum_bytes();
	sum_b = checksum_words();
	printf("ring3: cpl=%u checksum A=0x%016lx B=0x%016lx\n", level, a, sum_b);
	return a;
}

void guest_main(void)
{
	u64 a = enter_ring3(ring3_work, 0x9e3779b97f4a7c15ull);

	printf("ring3 checksum=0x%016lx\n", a);
	if (a != sum_b)
		fail("ring-3 checksums differ: A=0x%016lx B=0x%016lx", a, sum_b);
	if (a == 0)
		fail("ring-3 checksum is zero");
	pass();
}
