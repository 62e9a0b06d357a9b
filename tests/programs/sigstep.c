/* A signal arriving while GDB steps (gdb.base/sigstep.exp's "step to handler"): SIGALRM from an interval timer
   every 10 ms while main spins on one line until the handler ran (tests/e2e/test_gdbserver_signal_step.py). */
#include <signal.h>
#include <string.h>
#include <sys/time.h>

volatile int done;

void handler(int sig)
{
	done = sig;	/* line:handler */
}

int main(void)
{
	struct sigaction action;
	struct itimerval every = { { 0, 10000 }, { 0, 10000 } };

	memset(&action, 0, sizeof(action));
	action.sa_handler = handler;
	sigaction(SIGALRM, &action, 0);
	setitimer(ITIMER_REAL, &every, 0);
	while (!done);	/* line:loop */
	return 0;
}
