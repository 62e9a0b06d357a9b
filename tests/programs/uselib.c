/* A program that needs a library of its own (greet.c), found through its RUNPATH or RPATH ($ORIGIN/lib). */
#include <stdio.h>

const char *kgtp_greeting(void);
extern int kgtp_counter;

int main(void)
{
	printf("%s, counter %d\n", kgtp_greeting(), ++kgtp_counter);
	return 5;
}
