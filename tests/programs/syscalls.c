/* System calls without end (getppid, then write every 4096 rounds): a process for a tracepoint to watch; `rounds`
   counts them for a debugger reading the running program's memory. */
#include <unistd.h>

volatile unsigned long rounds;

int main(void)
{
	for (unsigned long i = 0;; i++) {
		rounds = i;
		getppid();
		if (i % 4096 == 0)
			write(1, "round\n", 6);
	}
}
