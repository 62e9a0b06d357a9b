/* One process, several images: what a debugger's exec and vfork events meet. Its output does not depend on the
   machine it runs on.
   "execs N": image(N) says which image this is, then while N > 0 the process runs this program again
   (/proc/self/exe) as "execs N-1": the pid stays, each image is new (its memory, its stack, its auxiliary vector).
   "execs vfork": a vfork child runs this program again as "execs 0" while its parent waits (vfork's wait ends at the
   child's exec), then the parent reaps it.
   "execs fork-exec": a fork child does the same, its parent waiting for its end. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

__attribute__((noinline)) int image(int n)
{
	printf("image %d\n", n);	/* line:image */
	return n;
}

static void again(char **argv, int n)
{
	char next[16];
	char *args[] = { argv[0], next, NULL };

	snprintf(next, sizeof(next), "%d", n);
	execv("/proc/self/exe", args);
	perror("execv");
	_exit(127);
}

static int child_execs(char **argv, int use_vfork)
{
	int status;
	pid_t pid = use_vfork ? vfork() : fork();

	if (pid == 0)
		again(argv, 0);
	if (pid < 0 || waitpid(pid, &status, 0) != pid)
		return 1;
	printf("%s child: exited %d\n", use_vfork ? "vfork" : "fork", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
	return 0;
}

int main(int argc, char **argv)
{
	int n;

	setvbuf(stdout, NULL, _IONBF, 0);
	if (argc >= 2 && !strcmp(argv[1], "vfork"))
		return child_execs(argv, 1);
	if (argc >= 2 && !strcmp(argv[1], "fork-exec"))
		return child_execs(argv, 0);
	n = argc >= 2 ? atoi(argv[1]) : 0;
	image(n);
	if (n > 0)
		again(argv, n - 1);
	return 0;
}
