/* A signal raised through a `syscall` instruction of the program's own, labelled so tracepoints can sit on it and on
   the instruction after it (tests/e2e/test_gdbserver_syscall_probe.py): kill(getpid(), SIGUSR1) three times, a
   handler counting, as gdb.trace/signal.exp does through libc's kill. */
#include <signal.h>
#include <string.h>
#include <unistd.h>

static volatile int handled;

static void on_usr1(int sig)
{
	handled++;
}

__attribute__((noinline)) static long raw_kill(long pid, long sig)
{
	long ret;

	__asm__ volatile(".globl at_syscall\nat_syscall: syscall\n.globl after_syscall\nafter_syscall:"
			 : "=a"(ret) : "a"(62L), "D"(pid), "S"(sig) : "rcx", "r11", "memory");
	return ret;
}

int main(void)
{
	struct sigaction act;

	memset(&act, 0, sizeof act);
	act.sa_handler = on_usr1;
	act.sa_flags = SA_NODEFER;
	sigaction(SIGUSR1, &act, NULL);
	for (int i = 0; i < 3; i++)
		raw_kill(getpid(), SIGUSR1);
	return handled;	/* 3 */
}
