/* File system calls on the program's own file: open (by /proc/self/exe and by argv[0]), fstat, read, lseek,
   pread, mmap (whole, at an offset, a private writable copy), close; and the errors of a missing file and a
   closed descriptor. Prints what it found (the same natively); exits 1 at the first thing that is wrong. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static int failed(const char *what)
{
	printf("FAILED: %s (errno %d)\n", what, errno);
	return 1;
}

int main(int argc, char **argv)
{
	static unsigned char buf[65536], chunk[256];
	unsigned long sum = 0, mapped_sum = 0;
	struct stat st, by_name;
	unsigned char *map, *at_page, *copy;
	long size, n, middle;
	int fd, fd2;

	(void)argc;
	fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return failed("open /proc/self/exe");
	if (fstat(fd, &st) || !S_ISREG(st.st_mode))
		return failed("fstat");
	size = (long)st.st_size;
	if (read(fd, chunk, 16) != 16 || memcmp(chunk, "\177ELF\2\1", 6))
		return failed("read the ELF header");
	printf("fd %d, a 64-bit little-endian ELF file\n", fd);
	if (lseek(fd, 0, SEEK_CUR) != 16 || lseek(fd, 0, SEEK_END) != size || lseek(fd, 0, SEEK_SET) != 0)
		return failed("lseek");
	while ((n = read(fd, buf, sizeof(buf))) > 0)
		for (long i = 0; i < n; i++)
			sum += buf[i];
	if (n < 0)
		return failed("read to the end");
	if (read(fd, buf, 1) != 0)
		return failed("read at the end");
	printf("read %ld bytes, byte sum %lu\n", size, sum);

	middle = size / 2;
	if (lseek(fd, middle, SEEK_SET) != middle || read(fd, buf, 100) != 100)
		return failed("lseek and read in the middle");
	if (pread(fd, chunk, 100, middle) != 100 || memcmp(buf, chunk, 100))
		return failed("pread in the middle");
	if (lseek(fd, 0, SEEK_CUR) != middle + 100)
		return failed("pread moved the offset");
	if (pread(fd, chunk, sizeof(chunk), size - 10) != 10 || pread(fd, chunk, 1, size + 5) != 0)
		return failed("pread at the end");
	printf("pread matches read at %ld\n", middle);

	map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
	if (map == MAP_FAILED)
		return failed("mmap");
	for (long i = 0; i < size; i++)
		mapped_sum += map[i];
	if (mapped_sum != sum || memcmp(map + middle, buf, 100))
		return failed("the mapping's bytes");
	at_page = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE, fd, 4096);
	if (at_page == MAP_FAILED || pread(fd, buf, 4096, 4096) != 4096 || memcmp(at_page, buf, 4096))
		return failed("mmap at offset 4096");
	copy = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	if (copy == MAP_FAILED)
		return failed("mmap a private copy");
	copy[0] = 'X';
	if (pread(fd, chunk, 1, 0) != 1 || chunk[0] != 0x7f || map[0] != 0x7f || copy[0] != 'X')
		return failed("a private mapping's write stays in it");
	printf("mmap matches: whole file, at offset 4096, a private copy\n");
	munmap(map, (size_t)size);
	munmap(at_page, 4096);
	munmap(copy, 4096);

	fd2 = open(argv[0], O_RDONLY);
	if (fd2 < 0 || fstat(fd2, &by_name) || by_name.st_size != st.st_size)
		return failed("open argv[0]");
	printf("argv[0] is the same file, fd %d\n", fd2);
	if (close(fd2))
		return failed("close");
	snprintf((char *)buf, sizeof(buf), "/.//proc/self/../self/exe");	/* resolved by name */
	fd2 = open((char *)buf, O_RDONLY);
	if (fd2 != 4 || fstat(fd2, &by_name) || by_name.st_size != st.st_size || close(fd2))
		return failed("open through . and .. and //");
	if (close(fd))
		return failed("close");
	if (lseek(1, 0, SEEK_CUR) != -1 || errno != ESPIPE)
		return failed("lseek on standard output");
	if (read(fd, buf, 1) != -1 || errno != EBADF)
		return failed("read of a closed descriptor");
	printf("read after close: EBADF\n");
	if (open("/no/such/file", O_RDONLY) != -1 || errno != ENOENT)
		return failed("open of a missing file");
	if (access("/no/such/file", F_OK) != -1 || errno != ENOENT)
		return failed("access of a missing file");
	if (stat("/no/such/file", &st) != -1 || errno != ENOENT)
		return failed("stat of a missing file");
	printf("a missing file: ENOENT\n");
	return 0;
}
