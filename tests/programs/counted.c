/* Rounds without end of user work the performance counters must tell apart (tests/machine/test_counters.py): a
   rep stosb (which the emulator runs as one block per byte: blocks that end without a branch), a loop, and a
   system call. */
#include <unistd.h>

static char buffer[256];

int main(void)
{
	for (;;) {
		void *to = buffer;
		unsigned long n = sizeof buffer;

		__asm__ volatile("rep stosb" : "+D"(to), "+c"(n) : "a"(0) : "memory");
		getppid();
	}
}
