/* Traced and debugged under the gdbserver role (tests/e2e/test_gdbserver_tracing.py): a loop calling add(), a
   global counter, a write() per round (a system call the kernel's tracepoints see), then a signal with a handler. */
#include <signal.h>
#include <string.h>
#include <unistd.h>

int counter;
volatile int handled;

__attribute__((noinline)) int add(int a, int b)
{
	return a + b;
}

static void on_usr1(int sig)
{
	handled = sig;
}

int main(void)
{
	int total = 0;

	for (int i = 0; i < 5; i++) {
		total = add(total, i);
		counter++;
		write(1, "tick\n", 5);
	}
	signal(SIGUSR1, on_usr1);
	raise(SIGUSR1);
	return total + handled;	/* 10 + 10 */
}
