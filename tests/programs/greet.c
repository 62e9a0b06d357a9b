/* A shared library for the dynamic linking tests (tests/programs.py builds it as lib/libkgtpgreet.so.1.0 with the
   soname libkgtpgreet.so.1): a function and a variable another object relocates against. */
int kgtp_counter = 41;

const char *kgtp_greeting(void)
{
	return "hello from a library";
}
