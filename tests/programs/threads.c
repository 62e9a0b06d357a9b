/* POSIX threads as a program uses them: a mutex-protected counter, a condition variable, thread-local storage,
   each thread's own tid, a thread ending with pthread_exit's value, a timed wait, a measured nanosleep, a signal
   sent to the process taken by the one thread that does not block it. Its output
   does not depend on the order the threads ran in.
   "threads exit": a thread other than main ends the process with exit(42) while main waits for it to end.
   "threads segv": a thread's SIGSEGV ends the whole process while main waits for it. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define NTHREADS 4
#define ROUNDS 3000

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static long counter;
static int ready, go;
static __thread long tls_value = 5;
static long tids[NTHREADS];

static long gettid_(void)
{
	return syscall(SYS_gettid);
}

static long ns_between(const struct timespec *a, const struct timespec *b)
{
	return (b->tv_sec - a->tv_sec) * 1000000000L + (b->tv_nsec - a->tv_nsec);
}

static void *worker(void *arg)
{
	long id = (long)arg;

	tls_value += id * 10;	/* this thread's own copy, from the initial 5 */
	tids[id] = gettid_();
	pthread_mutex_lock(&lock);
	ready++;
	pthread_cond_broadcast(&cond);
	while (!go)
		pthread_cond_wait(&cond, &lock);
	pthread_mutex_unlock(&lock);
	for (int i = 0; i < ROUNDS; i++) {
		pthread_mutex_lock(&lock);
		counter++;
		pthread_mutex_unlock(&lock);
		if (i % 1000 == 0)
			sched_yield();
	}
	if (tls_value != 5 + id * 10)
		return (void *)-1L;
	if (id == NTHREADS - 1)
		pthread_exit((void *)(100 + id));
	return (void *)tls_value;
}

static volatile long handler_tid, receiver_tid;
static volatile int receiver_ready;

static void on_usr1(int sig)
{
	(void)sig;
	handler_tid = gettid_();
}

static void *receiver(void *arg)
{
	sigset_t usr1;
	struct timespec pause = { 0, 1000000L };

	(void)arg;
	receiver_tid = gettid_();
	sigemptyset(&usr1);
	sigaddset(&usr1, SIGUSR1);
	pthread_sigmask(SIG_UNBLOCK, &usr1, NULL);	/* main, whose mask it inherited, blocks it */
	receiver_ready = 1;
	while (!handler_tid)
		nanosleep(&pause, NULL);
	return NULL;
}

/* kill() to the process while main blocks the signal: the other thread takes it */
static int signal_to_the_process(void)
{
	pthread_t thread;
	sigset_t usr1, old;

	signal(SIGUSR1, on_usr1);
	sigemptyset(&usr1);
	sigaddset(&usr1, SIGUSR1);
	pthread_sigmask(SIG_BLOCK, &usr1, &old);
	pthread_create(&thread, NULL, receiver, NULL);
	while (!receiver_ready)
		sched_yield();
	kill(getpid(), SIGUSR1);
	pthread_join(thread, NULL);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	return handler_tid == receiver_tid && receiver_tid != getpid();
}

static void *ending(void *arg)
{
	struct timespec pause = { 0, 20 * 1000000L };

	nanosleep(&pause, NULL);	/* main is waiting for this thread by then */
	if (arg) {
		*(volatile int *)16 = 1;	/* SIGSEGV */
		return NULL;
	}
	exit(42);
}

static int end_from_a_thread(int segv)
{
	pthread_t thread;

	printf("main %s\n", segv ? "waits for a thread that faults" : "waits for a thread that exits");
	fflush(stdout);
	pthread_create(&thread, NULL, ending, segv ? (void *)1 : NULL);
	pthread_join(thread, NULL);
	printf("main: the thread ended and the process did not\n");
	return 1;
}

int main(int argc, char **argv)
{
	pthread_t threads[NTHREADS];
	struct timespec before, after, pause = { 0, 30 * 1000000L }, deadline;
	struct timeval tv;
	time_t now;
	int distinct = 1, err;

	if (argc > 1)
		return end_from_a_thread(!strcmp(argv[1], "segv"));
	for (long i = 0; i < NTHREADS; i++)
		if (pthread_create(&threads[i], NULL, worker, (void *)i)) {
			printf("pthread_create failed\n");
			return 2;
		}
	pthread_mutex_lock(&lock);
	while (ready < NTHREADS)
		pthread_cond_wait(&cond, &lock);
	go = 1;
	pthread_cond_broadcast(&cond);
	pthread_mutex_unlock(&lock);
	for (long i = 0; i < NTHREADS; i++) {
		void *value;

		pthread_join(threads[i], &value);
		printf("thread %ld returned %ld\n", i, (long)value);
	}
	printf("counter %ld (expected %d)\n", counter, NTHREADS * ROUNDS);
	for (int i = 0; i < NTHREADS; i++) {
		distinct &= tids[i] > 0 && tids[i] != getpid();
		for (int j = 0; j < i; j++)
			distinct &= tids[i] != tids[j];
	}
	printf("tids distinct and not the process's: %s; main's tid is the pid: %s\n", distinct ? "yes" : "no",
	       gettid_() == getpid() ? "yes" : "no");
	printf("main's thread-local value: %ld\n", tls_value);

	clock_gettime(CLOCK_MONOTONIC, &before);
	nanosleep(&pause, NULL);
	clock_gettime(CLOCK_MONOTONIC, &after);
	printf("nanosleep 30 ms lasted at least that: %s\n", ns_between(&before, &after) >= pause.tv_nsec ? "yes" : "no");

	clock_gettime(CLOCK_REALTIME, &deadline);
	deadline.tv_nsec += 20 * 1000000L;
	if (deadline.tv_nsec >= 1000000000L) {
		deadline.tv_sec++;
		deadline.tv_nsec -= 1000000000L;
	}
	pthread_mutex_lock(&lock);
	err = pthread_cond_timedwait(&cond, &lock, &deadline);
	pthread_mutex_unlock(&lock);
	clock_gettime(CLOCK_REALTIME, &after);
	printf("timed wait: %s, after its deadline: %s\n", err == ETIMEDOUT ? "ETIMEDOUT" : strerror(err),
	       ns_between(&deadline, &after) >= 0 ? "yes" : "no");
	gettimeofday(&tv, NULL);
	/* within a second either way: glibc's time() reads the coarse clock, a tick behind gettimeofday at most */
	now = time(NULL);
	printf("gettimeofday and time agree: %s\n", tv.tv_sec - now <= 1 && now - tv.tv_sec <= 1 ? "yes" : "no");
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &after);
	printf("process CPU time counted: %s\n", after.tv_sec > 0 || after.tv_nsec > 0 ? "yes" : "no");
	printf("kill() taken by the thread that does not block it: %s\n", signal_to_the_process() ? "yes" : "no");
	return 4;
}
