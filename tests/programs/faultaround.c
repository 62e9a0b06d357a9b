/* Fault-around (fixtures/kernel/mm.c, fault_around): the program maps its own file three ways and touches one
   page of each, then prints where they are and waits to be killed, so the host can see which pages its tables
   have: a read of a read-only file mapping ("read"), a write to a private writable one ("write"), a read of an
   anonymous one ("anon"). "faultaround ADDRESS-OF-EACH-TOUCHED-PAGE" lines, then it pauses. */
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PAGE 4096
#define TOUCHED 21	/* the page touched in each mapping: inside a 16-page window that starts at page 16 or later */

int main(void)
{
	struct stat st;
	int fd = open("/proc/self/exe", O_RDONLY);
	volatile unsigned char *read_map, *write_map, *anon;
	unsigned char sink;

	if (fd < 0 || fstat(fd, &st) || st.st_size < 64 * PAGE)
		return 1;
	read_map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
	write_map = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	anon = mmap(NULL, 64 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (read_map == MAP_FAILED || write_map == MAP_FAILED || anon == MAP_FAILED)
		return 2;
	sink = read_map[TOUCHED * PAGE + 5];
	write_map[TOUCHED * PAGE + 5] = 'X';
	sink += anon[TOUCHED * PAGE + 5];
	printf("read %p write %p anon %p size %ld sink %u\n", (void *)read_map, (void *)write_map, (void *)anon,
	       (long)st.st_size, sink);
	fflush(stdout);
	for (;;)
		pause();
}
