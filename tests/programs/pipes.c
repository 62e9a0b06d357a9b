/* Pipes and descriptors as a program uses them: a thread writes more than a pipe holds while main reads it to end
   of file; stdout put onto a pipe with dup2 and back; dup, dup3's O_CLOEXEC, F_DUPFD; a non-blocking empty pipe;
   a write with no reader left (EPIPE and SIGPIPE); statx against stat, of the program and of a pipe; sysinfo's
   figures. Its output does not depend on the machine.
   "pipes sigpipe": a write with no reader left and SIGPIPE's default action ends the program (141). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#define TOTAL 200000	/* more than a pipe holds (64 KiB): the writer waits for the reader */

struct kstatx {	/* struct statx, as the kernel lays it out (musl has no statx() of its own) */
	unsigned int mask, blksize;
	unsigned long long attributes;
	unsigned int nlink, uid, gid;
	unsigned short mode, spare0;
	unsigned long long ino, size, blocks, attributes_mask;
	struct { long long sec; unsigned int nsec; int reserved; } atime, btime, ctime, mtime;
	unsigned int rdev_major, rdev_minor, dev_major, dev_minor;
	unsigned long long spare[14];
};

static int fds[2];

static unsigned char byte_at(long i)
{
	return (unsigned char)(i * 7 + i / 251);
}

static void *writer(void *arg)
{
	unsigned char buf[3000];
	long sent = 0;

	(void)arg;
	while (sent < TOTAL) {
		long n = TOTAL - sent < (long)sizeof(buf) ? TOTAL - sent : (long)sizeof(buf);

		for (long i = 0; i < n; i++)
			buf[i] = byte_at(sent + i);
		if (write(fds[1], buf, (size_t)n) != n)
			return (void *)1L;
		sent += n;
	}
	close(fds[1]);	/* the reader sees end of file */
	return NULL;
}

static volatile int sigpipes;

static void on_sigpipe(int sig)
{
	(void)sig;
	sigpipes++;
}

static const char *yes(int ok)
{
	return ok ? "yes" : "no";
}

int main(int argc, char **argv)
{
	pthread_t thread;
	unsigned char buf[4096];
	long got = 0, bad = 0, reads = 0;
	void *result;
	char text[64];
	int q[2], saved, fd;
	ssize_t n;

	if (argc > 1 && !strcmp(argv[1], "sigpipe")) {
		if (pipe(q))
			return 1;
		close(q[0]);
		printf("writing to a pipe nobody reads\n");
		fflush(stdout);
		write(q[1], "x", 1);
		printf("still here\n");
		return 0;
	}

	/* a thread writes, main reads to end of file */
	if (pipe(fds))
		return 1;
	pthread_create(&thread, NULL, writer, NULL);
	while ((n = read(fds[0], buf, sizeof(buf))) > 0) {
		for (long i = 0; i < n; i++)
			bad += buf[i] != byte_at(got + i);
		got += n;
		reads++;
	}
	pthread_join(thread, &result);
	printf("read %ld bytes, %ld wrong, end of file %s, writer %s\n", got, bad, yes(n == 0), yes(result == NULL));
	printf("several reads: %s\n", yes(reads > 1));
	close(fds[0]);

	/* stdout onto a pipe and back */
	if (pipe(q))
		return 1;
	saved = dup(1);
	fflush(stdout);
	printf("dup2 gives %d\n", dup2(q[1], 1) == 1);
	fflush(stdout);
	dup2(saved, 1);
	close(saved);
	close(q[1]);
	n = read(q[0], text, sizeof(text) - 1);
	text[n > 0 ? n : 0] = 0;
	printf("through the pipe: %s", text);
	printf("then end of file: %s\n", yes(read(q[0], text, sizeof(text)) == 0));
	close(q[0]);

	/* descriptors */
	fd = dup3(0, 20, O_CLOEXEC);
	printf("dup3 to 20 with O_CLOEXEC: %d, FD_CLOEXEC %s\n", fd, yes(fcntl(20, F_GETFD) == FD_CLOEXEC));
	printf("dup3 onto itself: %s\n", strerror(dup3(20, 20, 0) < 0 ? errno : 0));
	printf("dup2 onto itself: %d\n", dup2(20, 20));
	close(20);
	printf("dup of a closed descriptor: %s\n", strerror(dup(20) < 0 ? errno : 0));
	printf("F_DUPFD from 30: %d\n", fd = fcntl(1, F_DUPFD, 30));
	printf("writes to the console: %s\n", yes(write(fd, "", 0) == 0));
	close(fd);
	if (pipe2(q, O_NONBLOCK))
		return 1;
	printf("empty non-blocking pipe: %s\n", strerror(read(q[0], text, 1) < 0 ? errno : 0));
	printf("pipe's ends: %s, %s\n", yes((fcntl(q[0], F_GETFL) & O_ACCMODE) == O_RDONLY),
	       yes((fcntl(q[1], F_GETFL) & O_ACCMODE) == O_WRONLY));
	printf("reading the writing end: %s\n", strerror(read(q[1], text, 1) < 0 ? errno : 0));
	printf("lseek on a pipe: %s\n", strerror(lseek(q[0], 0, SEEK_SET) < 0 ? errno : 0));

	/* no reader left */
	signal(SIGPIPE, on_sigpipe);
	close(q[0]);
	errno = 0;
	n = write(q[1], "x", 1);
	printf("write with no reader: %ld %s, SIGPIPE %d\n", (long)n, strerror(errno), sigpipes);
	close(q[1]);

	/* statx */
	{
		struct kstatx stx;
		struct stat st;
		int p[2];

		memset(&stx, 0, sizeof(stx));
		stat("/proc/self/exe", &st);
		printf("statx: %ld", syscall(SYS_statx, AT_FDCWD, "/proc/self/exe", 0, 0x7ff, &stx));
		printf(", size as stat's %s, a regular file %s, basic stats %s, inode as stat's %s\n",
		       yes(stx.size == (unsigned long long)st.st_size), yes(S_ISREG(stx.mode)),
		       yes((stx.mask & 0x7ff) == 0x7ff), yes(stx.ino == st.st_ino));
		pipe(p);
		fstat(p[0], &st);
		syscall(SYS_statx, p[0], "", AT_EMPTY_PATH, 0x7ff, &stx);
		printf("statx of a pipe: a fifo %s, as fstat %s\n", yes(S_ISFIFO(stx.mode)),
		       yes(S_ISFIFO(st.st_mode) && stx.ino == st.st_ino));
		errno = 0;
		syscall(SYS_statx, AT_FDCWD, "/no/such/file", 0, 0x7ff, &stx);
		printf("statx of a missing file: %s\n", strerror(errno));
	}

	/* sysinfo */
	{
		struct sysinfo si;

		printf("sysinfo: %d", sysinfo(&si));
		printf(", uptime %s, RAM %s, free %s, tasks %s\n", yes(si.uptime >= 0 && si.uptime < 100000000),
		       yes(si.totalram > 0 && si.mem_unit >= 1), yes(si.freeram > 0 && si.freeram <= si.totalram),
		       yes(si.procs >= 1));
	}
	return 0;
}
