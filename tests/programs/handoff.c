/* A thread that waits for a new thread in a loop of usleep(1), as GDB's in-process agent waits for its helper
   thread at load: five times, a thread is created with every signal blocked and the creator spins until it has
   run. Prints whether the spinning thread's own CPU time over the five waits stayed under a second (natively some
   microseconds: the new thread runs on another CPU, or when the first short sleep gives the CPU away; on a kernel
   that takes a tick as soon as interrupts are on again, the next tick at most, per wait). */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static volatile int helper_tid;

static void *helper(void *arg)
{
	helper_tid = (int)syscall(SYS_gettid);
	return arg;
}

static long thread_cpu_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	return t.tv_sec * 1000000000L + t.tv_nsec;
}

int main(void)
{
	long spent = 0;

	for (int round = 0; round < 5; round++) {
		sigset_t all, old;
		pthread_t thread;
		long start;

		helper_tid = 0;
		sigfillset(&all);
		pthread_sigmask(SIG_SETMASK, &all, &old);
		if (pthread_create(&thread, NULL, helper, NULL) != 0)
			return 1;
		pthread_sigmask(SIG_SETMASK, &old, NULL);
		start = thread_cpu_ns();
		while (helper_tid == 0)
			usleep(1);
		spent += thread_cpu_ns() - start;
		pthread_join(thread, NULL);
		printf("round %d: the new thread ran, with a tid of its own %s\n", round,
		       helper_tid != (int)syscall(SYS_gettid) ? "yes" : "no");
	}
	printf("the waits took under a second of the waiting thread's time: %s\n", spent < 1000000000L ? "yes" : "no");
	return 0;
}
