/* Three threads calling work() under a mutex, a short sleep between calls, joined by main: debugged under the
   gdbserver role (tests/e2e/test_gdbserver_threads.py). Without arguments each thread calls work() 3 times; with
   "forever" they go on until `stop_all` is set (a debugger sets it), main waiting in pthread_join meanwhile. */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

int counter;
volatile int forever, stop_all;
pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

__attribute__((noinline)) void work(int id)
{
	pthread_mutex_lock(&lock);
	counter += id;
	pthread_mutex_unlock(&lock);
}

void *run(void *arg)
{
	for (int i = 0; forever ? !stop_all : i < 3; i++) {
		work((long)arg);
		usleep(1000);
	}
	return arg;
}

int main(int argc, char **argv)
{
	pthread_t t[3];

	forever = argc > 1;
	for (long i = 0; i < 3; i++)
		pthread_create(&t[i], 0, run, (void *)(i + 1));
	if (forever) {
		printf("started\n");
		fflush(stdout);
	}
	for (int i = 0; i < 3; i++)
		pthread_join(t[i], 0);
	printf("counter %d\n", forever ? -1 : counter);
	fflush(stdout);
	return 0;
}
