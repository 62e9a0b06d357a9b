/* stat() and access() of directories (tests/machine/test_directories.py): the root, the program's own directory
   (the machine's holds the program: it exists there too) and one that exists nowhere, as the native run says. */
#include <errno.h>
#include <libgen.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	char own[4096];
	const char *paths[3];
	const char *names[3] = {"/", "its own directory", "/no/such/directory"};

	strncpy(own, argv[0], sizeof(own) - 1);
	own[sizeof(own) - 1] = 0;
	paths[0] = "/";
	paths[1] = dirname(own);
	paths[2] = "/no/such/directory";
	for (int i = 0; i < 3; i++) {
		struct stat st;
		int found = stat(paths[i], &st) == 0;
		int err = errno;

		printf("%s: %s, ", names[i], found ? (S_ISDIR(st.st_mode) ? "a directory" : "not a directory")
						   : strerror(err));
		printf("search %s\n", access(paths[i], X_OK) == 0 ? "allowed" : strerror(errno));
	}
	return 0;
}
