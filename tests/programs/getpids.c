/* getpid() without end: each round is one system call's round trip, user wrapper and loop included, for the
   machine's instruction count to measure (tests/machine/round_trip.py). */
#include <unistd.h>

int main(void)
{
	for (;;)
		getpid();
}
