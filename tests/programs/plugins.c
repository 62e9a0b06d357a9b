/* Shared objects beside the program, found through its RUNPATH of $ORIGIN, as GDB's testsuite builds its programs
   (change-loc.exp, pending.exp): libkgtpfirst.so is a DT_NEEDED of the program, libkgtpsecond.so (or the library
   argv[1] names) is only dlopen()ed, after the first call of marker(), and dlclose()d after the second. Both are
   plugin.c; each object, the program too, has its own static kgtp_step(), so that `trace kgtp_step` has a location in each
   loaded. The exit status says how the program went: 0 with every call made, 1 when the dlopen() failed. */
#include <dlfcn.h>
#include <stdio.h>

extern int first_entry(int x);

static int __attribute__((noinline)) kgtp_step(int x)
{
	return x + 100;
}

void __attribute__((noinline)) marker(int round)
{
	__asm__ volatile("" : : "r"(round) : "memory");	/* line:marker */
}

int main(int argc, char **argv)
{
	const char *name = argc > 1 ? argv[1] : "libkgtpsecond.so";
	int (*second)(int);
	void *handle;
	int sum = kgtp_step(0) + first_entry(1);	/* line:main */

	marker(1);
	handle = dlopen(name, RTLD_NOW);
	if (!handle) {
		printf("dlopen: %s\n", dlerror());
		return 1;
	}
	second = (int (*)(int))dlsym(handle, "second_entry");
	for (int i = 0; i < 3; i++)
		sum += second(i);
	marker(2);
	dlclose(handle);
	sum += first_entry(2);
	marker(3);
	printf("sum %d\n", sum);
	return 0;
}
