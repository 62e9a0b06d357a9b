/* Globals and a function whose expressions GDB 13 compiles to agent bytecode for the recorded corpus
   (tests/agent/record_corpus.py). Built with: gcc -g -O2 -no-pie -o agent_corpus agent_corpus.c */

int counter1 = 1, counter2 = 2;
unsigned int ucount = 7;
char cvar = -3;
unsigned char ucvar = 200;
short svar = -300;
unsigned short usvar = 60000;
long lvar = -5;
unsigned long ulvar = 5;
long minval = -9223372036854775807L - 1;
long neg1 = -1;
long zero = 0;

struct point {
	int x;
	short y;
	char tag;
	long z;
} pt = { 1, 2, 'p', 3 }, *ppt = &pt;

int arr[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
char name[16] = "kgtp";
char *nameptr = name;

/* The thesis' test function (Fahem 2012, §2.4.1): its parameters arrive in %edi and %esi. */
__attribute__((noinline)) int kgtp_test_function(int counter1, int counter2)
{
	return counter1 + counter2;
}

int main(void)
{
	return kgtp_test_function(counter1, counter2);
}
