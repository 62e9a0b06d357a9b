/* A library loaded after the program started: dlopen() of libgcc_s.so.1, which the machine's archive carries with
   every glibc program (glibc's libc opens it itself to unwind a thread's stack). The debugger sees the library
   appear between the two calls of loaded(). */
#include <dlfcn.h>
#include <stdio.h>

void loaded(const char *what)
{
	printf("%s\n", what);	/* line:loaded */
}

int main(void)
{
	void *handle;
	void *symbol;

	loaded("before");
	handle = dlopen("libgcc_s.so.1", RTLD_NOW);
	if (!handle) {
		printf("dlopen: %s\n", dlerror());
		return 1;
	}
	symbol = dlsym(handle, "_Unwind_Find_FDE");
	loaded(symbol ? "opened" : "no symbol");
	return dlclose(handle) ? 2 : 0;
}
