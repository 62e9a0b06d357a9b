/* A program to debug under gdbserver (built with -g -O0): a loop calling a function, a global counter, locals, a
   function returning a struct and one returning a double, its result on stdout, a line on stderr, and its exit
   status taken from the counter. argv[1] chooses how it ends: "exit" (the default) returns, "segv" stores
   through a null pointer after printing, "loop" spins until the debugger clears `spinning`. The tests find their
   lines by the markers in the comments (`line:NAME`). */
#include <stdio.h>
#include <string.h>

struct pair {
	long sum;
	long product;
};

long counter;			/* what add() adds to; a watchpoint's global */
int limit = 4;			/* rounds of main's loop: the debugger may change it */
volatile int spinning = 1;	/* "loop" spins while it is set */
volatile long spins;		/* how often it went round */

long add(long step)
{
	long before = counter;	/* line:add */

	counter = before + step;	/* line:store */
	return counter;		/* line:add-return */
}

struct pair combine(long a, long b)
{
	struct pair result;

	result.sum = a + b;	/* line:combine */
	result.product = a * b;
	return result;
}

double half(long value)
{
	return value / 2.0;	/* line:half */
}

int main(int argc, char **argv)
{
	const char *end = argc > 1 ? argv[1] : "exit";	/* line:main */
	int looping = strcmp(end, "loop") == 0;
	long total = 0;
	struct pair both;
	double halved;
	int i;

	for (i = 1; i <= limit; i++)	/* line:for */
		total += add(i);	/* line:call */
	both = combine(total, counter);	/* line:combine-call */
	halved = half(total);	/* line:half-call */
	printf("total %ld counter %ld sum %ld product %ld half %.1f\n", total, counter, both.sum, both.product,
	       halved);	/* line:print */
	fflush(stdout);
	fprintf(stderr, "ending: %s\n", end);	/* line:stderr */
	if (strcmp(end, "segv") == 0) {
		volatile int *nowhere = 0;

		*nowhere = 1;	/* line:fault */
	}
	while (looping && spinning)
		spins++;	/* line:spin */
	return (int)(counter % 64);	/* line:return */
}
