/* A store through a null pointer: the kernel ends the process with SIGSEGV (no handlers yet). */
#include <stdio.h>

int main(void)
{
	volatile int *p = 0;

	printf("before the fault\n");
	fflush(stdout);
	*p = 1;
	printf("after the fault\n");
	return 0;
}
