/* The first program: standard output, an exit status. */
#include <stdio.h>

int main(void)
{
	printf("hello, world\n");
	return 3;
}
