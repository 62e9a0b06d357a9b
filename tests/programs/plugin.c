/* The libraries of plugins.c, built with -DENTRY=first_entry (libkgtpfirst.so) and -DENTRY=second_entry
   (libkgtpsecond.so): one entry point, and a static kgtp_step() of the library's own, which begins its work with a
   5-byte nop labelled kgtp_fast_point, room for a fast tracepoint's jump (as GDB's testsuite labels its
   FAST_TRACEPOINT_LABEL). */
static int __attribute__((noinline)) kgtp_step(int x)
{
	__asm__ volatile(".globl kgtp_fast_point\nkgtp_fast_point:\n\tnopl 0x7f(%rax,%rax,1)");
	return x * 3 + 1;	/* line:step */
}

int ENTRY(int x)
{
	return kgtp_step(x);
}
