/* Sleeping as a program asks for it: nanosleep of 50 ms, usleep, clock_nanosleep to an absolute time, each
   measured on CLOCK_MONOTONIC; the time slept is at least what was asked and not far beyond it (a plausible
   bound, seconds: the machine is emulated). Prints only what holds on any machine. */
#define _GNU_SOURCE
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#define MS 1000000L

static long now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void report(const char *what, long asked, long slept, int result)
{
	printf("%s of %ld ms: returned %d, at least that long %s, under 5 s %s\n", what, asked / MS, result,
	       slept >= asked ? "yes" : "no", slept < 5000 * MS ? "yes" : "no");
}

int main(void)
{
	struct timespec req = { 0, 50 * MS }, rem = { 7, 7 }, until;
	long start;
	int result;

	start = now_ns();
	result = nanosleep(&req, &rem);
	report("nanosleep", 50 * MS, now_ns() - start, result);
	start = now_ns();
	result = usleep(20000);
	report("usleep", 20 * MS, now_ns() - start, result);
	clock_gettime(CLOCK_MONOTONIC, &until);
	start = until.tv_sec * 1000000000L + until.tv_nsec;
	until.tv_nsec += 30 * MS;
	if (until.tv_nsec >= 1000000000L) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000L;
	}
	result = clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL);
	report("clock_nanosleep to a time", 30 * MS, now_ns() - start, result);
	return 0;
}
