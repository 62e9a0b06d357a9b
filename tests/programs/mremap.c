/* mremap as a program uses it: a buffer grown page after page (in place while the addresses after it are free,
   moved when another mapping is in the way and MREMAP_MAYMOVE allows it), its bytes kept; ENOMEM when it cannot
   move; shrunk; moved to an address of the program's choice (MREMAP_FIXED); and realloc of a large block, which C
   libraries do with mremap. Prints only what holds on any machine. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define PAGE 4096UL

static int check(const unsigned char *p, unsigned long n, unsigned seed)
{
	for (unsigned long i = 0; i < n; i++)
		if (p[i] != (unsigned char)(i * seed + (i >> 12)))
			return 0;
	return 1;
}

static void fill(unsigned char *p, unsigned long from, unsigned long n, unsigned seed)
{
	for (unsigned long i = from; i < n; i++)
		p[i] = (unsigned char)(i * seed + (i >> 12));
}

static const char *yes(int ok)
{
	return ok ? "yes" : "no";
}

int main(void)
{
	unsigned long size = PAGE;
	unsigned char *buf, *area, *grown, *blocker, *fixed, *big;
	int kept = 1;

	/* a region reserved, then given back but for its first page: the buffer grows into free addresses */
	area = mmap(NULL, 64 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	munmap(area + PAGE, 63 * PAGE);
	buf = area;
	fill(buf, 0, size, 3);
	for (; size < 32 * PAGE; size += PAGE) {
		unsigned char *p = mremap(buf, size, size + PAGE, 0);

		if (p == MAP_FAILED) {
			printf("grow in place failed: %s\n", strerror(errno));
			return 1;
		}
		kept &= p == buf && check(p, size, 3);
		fill(p, size, size + PAGE, 3);
	}
	printf("grown in place to %lu pages, same address and bytes kept: %s\n", size / PAGE, yes(kept));

	/* a mapping in the way: no growth without MREMAP_MAYMOVE, a move with it */
	blocker = mmap(buf + size, PAGE, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
	printf("blocked: %s", yes(blocker == buf + size));
	printf(", without MREMAP_MAYMOVE: %s\n", mremap(buf, size, 2 * size, 0) == MAP_FAILED ? strerror(errno) : "grew");
	grown = mremap(buf, size, 4 * size, MREMAP_MAYMOVE);
	printf("moved: %s, bytes kept %s", yes(grown != MAP_FAILED && grown != buf), yes(check(grown, size, 3)));
	fill(grown, size, 4 * size, 3);
	printf(", new part usable %s\n", yes(check(grown, 4 * size, 3)));
	size *= 4;
	munmap(blocker, PAGE);

	/* shrunk, then moved where the program says */
	printf("shrunk: %s", yes(mremap(grown, size, 2 * PAGE, 0) == grown && check(grown, 2 * PAGE, 3)));
	fixed = mmap(NULL, 16 * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	big = mremap(grown, 2 * PAGE, 8 * PAGE, MREMAP_MAYMOVE | MREMAP_FIXED, fixed + 4 * PAGE);
	printf(", fixed at the address asked: %s, bytes kept %s", yes(big == fixed + 4 * PAGE), yes(check(big, 2 * PAGE, 3)));
	memset(big + 2 * PAGE, 1, 6 * PAGE);
	printf(", the old one gone: %s\n", yes(mremap(grown, PAGE, PAGE, 0) == MAP_FAILED && errno == EFAULT));
	printf("bad flags: %s\n", mremap(big, PAGE, PAGE, 0x80) == MAP_FAILED ? strerror(errno) : "accepted");

	/* realloc of blocks the C library maps on their own */
	{
		unsigned long n = 256 * 1024;
		unsigned char *p = malloc(n);

		fill(p, 0, n, 5);
		kept = 1;
		for (; n < 2UL << 20; n *= 2) {
			p = realloc(p, n * 2);
			kept &= p && check(p, n, 5);
			fill(p, n, n * 2, 5);
		}
		printf("realloc up to %lu MiB, bytes kept: %s\n", n >> 20, yes(kept && check(p, n, 5)));
		free(p);
	}
	return 0;
}
