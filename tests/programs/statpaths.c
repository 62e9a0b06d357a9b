/* stat() and lstat() of each path it is given, as the kernel answers them (tests/stub/test_hostio.py compares the
   gdbserver role's vFile:stat and vFile:lstat with them): a line per path and call, its fields or its errno. */
#include <errno.h>
#include <stdio.h>
#include <sys/stat.h>

static void show(const char *call, const char *path, int result, const struct stat *st)
{
	if (result != 0)
		printf("%s %s errno %d\n", call, path, errno);
	else
		printf("%s %s dev %lu ino %lu mode %o nlink %lu size %ld blksize %ld blocks %ld\n", call, path,
		       (unsigned long)st->st_dev, (unsigned long)st->st_ino, (unsigned)st->st_mode,
		       (unsigned long)st->st_nlink, (long)st->st_size, (long)st->st_blksize, (long)st->st_blocks);
}

int main(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		struct stat st;

		show("stat", argv[i], stat(argv[i], &st), &st);
		show("lstat", argv[i], lstat(argv[i], &st), &st);
	}
	return 0;
}
