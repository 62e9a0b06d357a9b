/* ud2: the kernel ends the process with SIGILL. */
int main(void)
{
	__builtin_trap();
}
