/* Signals and GDB's steps (tests/e2e/test_gdbserver_signal_step.py, after gdb.base/sigstep.exp and siginfo.exp):
   without arguments, SIGALRM from an interval timer every 10 ms while main spins on one line until the handler
   ran; with one (`raise`), one SIGALRM sent by main itself, by a `syscall` instruction of its own line, so the
   handler returns into main. */
#include <signal.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

volatile int done;

void handler(int sig)
{
	static const struct itimerval off;

	setitimer(ITIMER_REAL, &off, 0);	/* line:handler (once is enough) */
	done = sig;
}

int main(int argc, char **argv)
{
	struct sigaction action;
	struct itimerval every = { { 0, 10000 }, { 0, 10000 } };
	long nr = 62;	/* kill */

	memset(&action, 0, sizeof(action));
	action.sa_handler = handler;
	sigaction(SIGALRM, &action, 0);
	if (argc > 1) {
		asm volatile("syscall" : "+a"(nr) : "D"((long)getpid()), "S"((long)SIGALRM) : "rcx", "r11", "memory");	/* line:raise */
		return done != SIGALRM;	/* line:return */
	}
	setitimer(ITIMER_REAL, &every, 0);
	while (!done);	/* line:loop */
	return 0;
}
