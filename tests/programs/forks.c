/* Processes as a program makes them: fork, the child exec'ing this program again (/proc/self/exe) with arguments and
   an environment, a pipe between the two across the exec and a close-on-exec descriptor closed by it, the child's
   exit code read by the parent's wait4; the child's memory its own; a child ended by a signal; WNOHANG before and
   after a child ends; waitid (P_PID with WNOWAIT, P_ALL) and its siginfo; vfork; posix_spawn; a SIGCHLD handler and
   SIGCHLD's default (a sleep not cut short); an orphan; the errors: ECHILD, execve's ENOENT and EFAULT, wait4's
   EINVAL. Its output does not depend on the machine it runs on.
   "forks work": the parent and its child both call work() (a debugger's breakpoint there, set in the parent before
   the fork, must not end the child).
   "forks many N": N children one after another, each one's status checked.
   "forks bomb": children until fork fails, then every one reaped, and a fork again.
   "forks hog MB": MB of memory touched, then a fork (ENOMEM where RAM cannot hold the copy).
   "forks zombie": a child that ends while its parent sleeps (a zombie until the parent's wait), its pid printed.
   "forks thread-exec main|thread": execve while another thread sleeps, from the main thread or from a thread of
   its own (the exec'd program then has the process's pid and only its one thread).
   "forks exec-child CODE FD CLOEXEC-FD": what the exec'd child runs. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* a call's result and errno's name, in that order */
#define SHOW(what, call) do { long result_; errno = 0; result_ = (long)(call); \
			      printf("%s: %ld %s\n", what, result_, result_ < 0 ? name(errno) : "no error"); } while (0)

extern char **environ;
static int value = 1;
static char *volatile bad = (char *)8;	/* an address no process maps (volatile: the compiler cannot see it) */
static volatile sig_atomic_t sigchld_count;

static const char *name(int error)
{
	switch (error) {
	case ECHILD: return "ECHILD";
	case ENOENT: return "ENOENT";
	case EFAULT: return "EFAULT";
	case EINVAL: return "EINVAL";
	case EAGAIN: return "EAGAIN";
	case ENOMEM: return "ENOMEM";
	default: return "another error";
	}
}

static void describe(const char *what, int status)
{
	if (WIFEXITED(status))
		printf("%s: exited %d\n", what, WEXITSTATUS(status));
	else if (WIFSIGNALED(status))
		printf("%s: killed by signal %d\n", what, WTERMSIG(status));
	else
		printf("%s: status %#x\n", what, status);
}

static void read_all(int fd, const char *what)
{
	char buf[256];
	ssize_t n;
	size_t total = 0;

	while ((n = read(fd, buf + total, sizeof(buf) - 1 - total)) > 0)
		total += (size_t)n;
	buf[total] = 0;
	printf("%s: %s", what, buf);
}

static int exec_child(char **argv)
{
	char line[160];
	int fd = atoi(argv[3]), cloexec = atoi(argv[4]);
	int closed = fcntl(cloexec, F_GETFD) == -1 && errno == EBADF;

	snprintf(line, sizeof(line), "argc %d, %s, close-on-exec %s, FORKS=%s\n", (int)(argv[5] ? 6 : 5),
		 argv[1], closed ? "closed" : "open", getenv("FORKS") ? getenv("FORKS") : "(unset)");
	if (write(fd, line, strlen(line)) < 0)
		return 100;
	return atoi(argv[2]);
}

static volatile int works;	/* work()'s calls in this process (a RIP-relative load to trace fast) */

__attribute__((noinline)) int work(int who)
{
	works++;	/* line:works */
	return who * 2 + 1;	/* line:work */
}

static int debug_session(void)
{
	int status;
	pid_t pid = fork();

	if (pid == 0)
		_exit(work(3));	/* 7, once the child has run through the breakpoint's address */
	printf("parent work %d\n", work(0));
	waitpid(pid, &status, 0);
	describe("child that ran work()", status);
	return WIFEXITED(status) && WEXITSTATUS(status) == 7 ? 0 : 1;
}

static void on_sigchld(int sig)
{
	(void)sig;
	sigchld_count++;
}

static void *exec_from_thread(void *arg)
{
	char **argv = arg;
	char *child_argv[] = { argv[0], "exec-child", "8", "1", "99", NULL };

	execve("/proc/self/exe", child_argv, environ);
	return NULL;
}

static void *sleeper(void *arg)
{
	(void)arg;
	for (;;)
		pause();
	return NULL;
}

static int thread_exec(char **argv, int from_thread)
{
	pthread_t thread;

	if (pthread_create(&thread, NULL, sleeper, NULL))
		return 2;
	if (!from_thread)
		exec_from_thread(argv);
	else if (!pthread_create(&thread, NULL, exec_from_thread, argv))
		pthread_join(thread, NULL);
	return 1;	/* execve failed */
}

static int zombie(void)
{
	struct timespec nap = { 0, 500 * 1000 * 1000 };
	int status;
	pid_t pid = fork();

	if (pid == 0)
		_exit(3);
	printf("child %d\n", (int)pid);
	nanosleep(&nap, NULL);
	if (waitpid(pid, &status, 0) != pid)
		return 1;
	describe("the zombie", status);
	return 0;
}

static int many(int count)
{
	for (int i = 0; i < count; i++) {
		int status;
		pid_t pid = fork();

		if (pid < 0) {
			printf("fork %d: %s\n", i, name(errno));
			return 1;
		}
		if (pid == 0)
			_exit(i & 0xff);
		if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != (i & 0xff)) {
			describe("a child", status);
			return 1;
		}
	}
	printf("%d children ended as they were told\n", count);
	return 0;
}

static int bomb(void)
{
	int fds[2], children = 0, reaped = 0, status, error;
	pid_t pid;

	if (pipe(fds))
		return 2;
	for (;;) {
		char c;

		pid = fork();
		if (pid == 0) {
			close(fds[1]);
			_exit(read(fds[0], &c, 1) == 0 ? 0 : 1);	/* end of file once the parent lets go */
		}
		if (pid < 0)
			break;
		children++;
	}
	error = errno;
	close(fds[1]);
	while (wait(&status) > 0)
		reaped += WIFEXITED(status) && WEXITSTATUS(status) == 0;
	printf("fork failed with %s after %d children; %d reaped\n", name(error), children, reaped);
	pid = fork();
	if (pid == 0)
		_exit(9);
	waitpid(pid, &status, 0);
	describe("a fork after them", status);
	return reaped == children ? 0 : 1;
}

static int hog(long megabytes)
{
	size_t size = (size_t)megabytes << 20;
	char *memory = malloc(size);
	int status;
	pid_t pid;

	if (!memory)
		return 2;
	memset(memory, 1, size);
	pid = fork();
	if (pid < 0) {
		printf("fork with %ld MiB: %s\n", megabytes, name(errno));
		return 0;
	}
	if (pid == 0)
		_exit(memory[size - 1]);
	waitpid(pid, &status, 0);
	describe("fork with all that memory", status);
	return 0;
}

int main(int argc, char **argv)
{
	int fds[2], cloexec[2], status;
	pid_t pid;
	siginfo_t info;
	char fd_text[16], cloexec_text[16];

	setvbuf(stdout, NULL, _IONBF, 0);	/* nothing buffered for a child to write again */
	if (argc >= 5 && !strcmp(argv[1], "exec-child"))
		return exec_child(argv);
	if (argc >= 2 && !strcmp(argv[1], "work"))
		return debug_session();
	if (argc >= 3 && !strcmp(argv[1], "many"))
		return many(atoi(argv[2]));
	if (argc >= 2 && !strcmp(argv[1], "bomb"))
		return bomb();
	if (argc >= 3 && !strcmp(argv[1], "hog"))
		return hog(atol(argv[2]));
	if (argc >= 2 && !strcmp(argv[1], "zombie"))
		return zombie();
	if (argc >= 3 && !strcmp(argv[1], "thread-exec"))
		return thread_exec(argv, !strcmp(argv[2], "thread"));

	/* fork, then exec with a pipe across it */
	if (pipe(fds) || pipe2(cloexec, O_CLOEXEC))
		return 2;
	snprintf(fd_text, sizeof(fd_text), "%d", fds[1]);
	snprintf(cloexec_text, sizeof(cloexec_text), "%d", cloexec[1]);
	pid = fork();
	if (pid == 0) {
		char *child_argv[] = { argv[0], "exec-child", "7", fd_text, cloexec_text, NULL };
		char *child_env[] = { "FORKS=yes", NULL };

		close(fds[0]);
		execve("/proc/self/exe", child_argv, child_env);
		_exit(99);
	}
	close(fds[1]);
	close(cloexec[0]);
	close(cloexec[1]);
	read_all(fds[0], "the exec'd child wrote");
	close(fds[0]);
	if (waitpid(pid, &status, 0) != pid)
		return 3;
	describe("exec'd child", status);

	/* the child's memory is its own */
	pid = fork();
	if (pid == 0) {
		value = 2;
		_exit(value);
	}
	waitpid(pid, &status, 0);
	describe("child that changed its copy", status);
	printf("the parent's value is still %d\n", value);

	/* a child ended by a signal */
	pid = fork();
	if (pid == 0) {
		raise(SIGTERM);
		_exit(0);
	}
	waitpid(pid, &status, 0);
	describe("child that raised SIGTERM", status);

	/* WNOHANG while the child waits, then its end */
	if (pipe(fds))
		return 2;
	pid = fork();
	if (pid == 0) {
		char c;

		close(fds[1]);
		_exit(read(fds[0], &c, 1) == 1 ? c - '0' : 50);
	}
	close(fds[0]);
	printf("WNOHANG while it runs: %d\n", (int)waitpid(pid, &status, WNOHANG));
	if (write(fds[1], "3", 1) != 1)
		return 2;
	close(fds[1]);
	printf("then: %s\n", waitpid(pid, &status, 0) == pid ? "its pid" : "something else");
	describe("child told to end", status);

	/* waitid: P_PID with WNOWAIT leaves the zombie, P_ALL reaps it */
	pid = fork();
	if (pid == 0)
		_exit(4);
	memset(&info, 0, sizeof(info));
	if (waitid(P_PID, (id_t)pid, &info, WEXITED | WNOWAIT))
		return 4;
	printf("waitid P_PID: %s, code %s, status %d\n", info.si_pid == pid ? "its pid" : "another pid",
	       info.si_code == CLD_EXITED ? "CLD_EXITED" : "other", info.si_status);
	memset(&info, 0, sizeof(info));
	if (waitid(P_ALL, 0, &info, WEXITED))
		return 4;
	printf("waitid P_ALL: %s, signo %s, status %d\n", info.si_pid == pid ? "its pid" : "another pid",
	       info.si_signo == SIGCHLD ? "SIGCHLD" : "other", info.si_status);
	SHOW("waitid with no child", waitid(P_ALL, 0, &info, WEXITED | WNOHANG));

	/* vfork, then the parent goes on */
	pid = vfork();
	if (pid == 0)
		_exit(6);
	waitpid(pid, &status, 0);
	describe("vfork child", status);

	/* posix_spawn (glibc's and musl's: a clone sharing the memory, the caller waiting), of this program */
	if (pipe(fds))
		return 2;
	snprintf(fd_text, sizeof(fd_text), "%d", fds[1]);
	{
		char *spawn_argv[] = { argv[0], "exec-child", "5", fd_text, "99", "extra", NULL };

		if (posix_spawn(&pid, "/proc/self/exe", NULL, NULL, spawn_argv, environ))
			return 5;
		printf("posix_spawn of a missing file: %s\n", name(posix_spawn(&pid, "/no/such/program", NULL, NULL,
									   spawn_argv, environ)));	/* its child reaped by it */
	}
	close(fds[1]);
	read_all(fds[0], "the spawned child wrote");
	close(fds[0]);
	while (waitpid(-1, &status, 0) > 0)
		describe("spawned child", status);

	/* SIGCHLD: ignored by default (a sleep goes on), taken by a handler */
	pid = fork();
	if (pid == 0)
		_exit(0);
	{
		struct timespec nap = { 0, 200 * 1000 * 1000 };
		struct sigaction act;

		printf("nanosleep while a child ends: %d\n", nanosleep(&nap, NULL));
		waitpid(pid, &status, 0);
		memset(&act, 0, sizeof(act));
		act.sa_handler = on_sigchld;
		sigaction(SIGCHLD, &act, NULL);
	}
	pid = fork();
	if (pid == 0)
		_exit(0);
	waitpid(pid, &status, 0);
	printf("SIGCHLD handler ran %d time(s)\n", (int)sigchld_count);
	signal(SIGCHLD, SIG_DFL);

	/* an orphan: its parent ends first, it is reparented and goes on */
	if (pipe(fds))
		return 2;
	pid = fork();
	if (pid == 0) {
		pid_t parent = getpid();

		if (fork() == 0) {
			while (getppid() == parent)
				usleep(1000);
			if (write(fds[1], "reparented\n", 11) != 11)
				_exit(1);
			_exit(0);
		}
		_exit(0);
	}
	close(fds[1]);
	waitpid(pid, &status, 0);
	describe("orphan's parent", status);
	read_all(fds[0], "the orphan wrote");
	close(fds[0]);

	/* the errors */
	SHOW("wait with no child", wait(&status));
	SHOW("wait4 with a bad option", waitpid(-1, &status, 0x100000));
	{
		char *none[] = { argv[0], NULL };

		SHOW("execve of a missing file", execve("/no/such/program", none, environ));
		SHOW("execve of a bad path", execve(bad, none, environ));
		SHOW("execve with a bad argv", execve("/proc/self/exe", (char **)bad, environ));
		none[1] = bad;
		SHOW("execve with a bad argument", execve("/proc/self/exe", none, environ));
	}
	return 0;
}
