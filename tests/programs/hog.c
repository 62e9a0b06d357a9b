/* Memory without end. "hog": anonymous mappings of 1 MiB, every page touched, until something stops it (on the
   machine: its RAM runs out and the kernel's OOM killer ends it with SIGKILL). "hog limit": the same under an
   RLIMIT_AS of 32 MiB, then sbrk under an RLIMIT_DATA of 8 MiB: each stops with ENOMEM within its limit. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#define MIB (1UL << 20)

int main(int argc, char **argv)
{
	int limited = argc > 1 && !strcmp(argv[1], "limit");
	unsigned long mapped = 0;
	struct rlimit limit = { 32 * MIB, 32 * MIB }, seen;

	if (limited) {
		printf("setrlimit RLIMIT_AS: %d", setrlimit(RLIMIT_AS, &limit));
		getrlimit(RLIMIT_AS, &seen);
		printf(", getrlimit gives it back: %s\n", seen.rlim_cur == limit.rlim_cur ? "yes" : "no");
	} else {
		printf("taking memory\n");
	}
	fflush(stdout);
	for (;;) {
		char *p = mmap(NULL, MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

		if (p == MAP_FAILED) {
			printf("mmap stopped: %s, within the limit %s\n", strerror(errno),
			       limited && mapped <= 32 * MIB ? "yes" : "no");
			break;
		}
		for (unsigned long i = 0; i < MIB; i += 4096)
			p[i] = 1;
		mapped += MIB;
	}
	if (limited) {
		unsigned long grown = 0;

		limit.rlim_cur = limit.rlim_max = RLIM_INFINITY;
		setrlimit(RLIMIT_AS, &limit);
		limit.rlim_cur = limit.rlim_max = 8 * MIB;
		printf("setrlimit RLIMIT_DATA: %d\n", setrlimit(RLIMIT_DATA, &limit));
		while (sbrk(64 * 1024) != (void *)-1)
			grown += 64 * 1024;
		printf("sbrk stopped: %s, within the limit %s\n", strerror(errno), grown <= 8 * MIB ? "yes" : "no");
	}
	return 0;
}
