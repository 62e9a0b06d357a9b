/* System calls without end (getppid, then write every 4096 rounds): a process for a tracepoint to watch. */
#include <unistd.h>

int main(void)
{
	for (unsigned long i = 0;; i++) {
		getppid();
		if (i % 4096 == 0)
			write(1, "round\n", 6);
	}
}
