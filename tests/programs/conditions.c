/* A loop of 1000 calls to f(i), for breakpoint conditions the target evaluates (tests/stub/test_breakpoint_conditions.py,
   tests/e2e/test_gdbserver_conditions.py): `break f if i == 500` stops once. With an argument N, N threads each run
   the loop at once (the sum printed is then N times as large). The sum of the i's is printed at the end. The tests
   find their lines by the markers in the comments (`line:NAME`). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

long sum;
pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

__attribute__((noinline)) void f(int i)
{
	pthread_mutex_lock(&lock);	/* line:f */
	sum += i;
	pthread_mutex_unlock(&lock);
}

void *loop(void *arg)
{
	for (int i = 1; i <= 1000; i++)
		f(i);
	return arg;
}

int main(int argc, char **argv)
{
	int threads = argc > 1 ? atoi(argv[1]) : 0;
	pthread_t t[8];

	if (threads > 8)
		threads = 8;
	for (int n = 0; n < threads; n++)
		pthread_create(&t[n], NULL, loop, NULL);
	if (threads == 0)
		loop(NULL);
	for (int n = 0; n < threads; n++)
		pthread_join(t[n], NULL);
	printf("sum %ld\n", sum);	/* line:done */
	return 0;
}
