/* A global the program never writes (tests/e2e/test_gdbserver_collect_globals.py): its pages are demand-zero ones
   the process has not touched when a tracepoint collects it, as gdb.trace/status-stop.c's buffer. */
int untouched[4096];

__attribute__((noinline)) void hit(int i)
{
	__asm__ volatile("" : : "r"(i) : "memory");
}

int main(void)
{
	for (int i = 0; i < 3; i++)
		hit(i);
	return 0;
}
