/* argv, the environment, stderr, malloc of many sizes, doubles through printf (x87 on musl, SSE on glibc), and
   the exit status taken from an argument. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

int main(int argc, char **argv)
{
	const char *value = getenv("KGTP_TEST");
	unsigned long sum = 0;
	double x = 1.0;

	for (int i = 0; i < argc; i++)
		printf("argv[%d] = \"%s\"\n", i, argv[i]);
	printf("KGTP_TEST=%s\n", value ? value : "(unset)");
	for (int i = 1; i <= 200; i++) {
		char *p = malloc((size_t)i * 97);

		memset(p, i, (size_t)i * 97);
		sum += (unsigned char)p[i * 97 - 1];
		if (i % 3)
			free(p);
	}
	for (int i = 0; i < 10; i++)
		x = x * 1.1 + 0.0001;
	printf("sum %lu, x %.9f %g %Lf\n", sum, x, x * 1e10, (long double)x / 3);
	fprintf(stderr, "to stderr\n");
	return argc > 1 ? atoi(argv[argc - 1]) : 0;
}
