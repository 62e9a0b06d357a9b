/* Signals as a program uses them: a handler with siginfo (raise: tgkill), an ignored signal, a blocked one
   taken when unblocked, a SIGSEGV handler leaving by siglongjmp, the FPU of the interrupted code kept across a
   handler, and a default action ending the process. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <setjmp.h>

static volatile int got, code;
static volatile void *where;
static sigjmp_buf env;

static void handler(int sig, siginfo_t *info, void *uc) { got = sig; code = info->si_code; where = info->si_addr; }
static void segv(int sig, siginfo_t *info, void *uc) { where = info->si_addr; siglongjmp(env, 1); }
static double fp_in_handler;
static void fpu_handler(int sig) { fp_in_handler = 2.5 * sig; }

int main(void)
{
	struct sigaction sa;
	setvbuf(stdout, 0, _IONBF, 0);
	memset(&sa, 0, sizeof(sa));
	sa.sa_sigaction = handler;
	sa.sa_flags = SA_SIGINFO;
	sigaction(SIGUSR1, &sa, 0);
	raise(SIGUSR1);
	printf("raised: got %d code %d\n", got, code);
	signal(SIGUSR2, SIG_IGN);
	kill(getpid(), SIGUSR2);
	printf("ignored SIGUSR2\n");
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGUSR1);
	got = 0;
	sigprocmask(SIG_BLOCK, &set, 0);
	kill(getpid(), SIGUSR1);
	printf("blocked: got %d\n", got);
	sigprocmask(SIG_UNBLOCK, &set, 0);
	printf("unblocked: got %d\n", got);
	sa.sa_sigaction = segv;
	sigaction(SIGSEGV, &sa, 0);
	if (!sigsetjmp(env, 1))
		*(volatile int *)0x1234 = 1;
	printf("segv at %p\n", (void *)where);
	double x = 1.25;
	signal(SIGUSR1, fpu_handler);
	raise(SIGUSR1);
	printf("fpu %g %g\n", x * 2, fp_in_handler);
	signal(SIGTERM, SIG_DFL);
	raise(SIGTERM);
	printf("not reached\n");
	return 0;
}
