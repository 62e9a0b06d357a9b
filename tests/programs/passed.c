/* main sends its spinning thread one signal the debugger passes (SIGUSR1), then meets stop_here() (the debugger's
   breakpoint) and spins too; the thread takes the signal and spins on, with no system call. Nothing stops either
   of them again unless the debugger asks: tests/stub/test_process_all_stop.py. */
#include <pthread.h>
#include <signal.h>

volatile long spins, taken;

static void handler(int sig)
{
	taken++;
}

static void *spin(void *arg)
{
	for (;;)
		spins++;
	return 0;
}

__attribute__((noinline)) void stop_here(void)
{
	__asm__ volatile("" ::: "memory");
}

int main(void)
{
	pthread_t thread;

	signal(SIGUSR1, handler);
	pthread_create(&thread, 0, spin, 0);
	while (!spins)
		;
	pthread_kill(thread, SIGUSR1);
	stop_here();
	for (;;)
		spins++;
	return 0;
}
