/* The libraries of plugins.c, built with -DENTRY=first_entry (libkgtpfirst.so) and -DENTRY=second_entry
   (libkgtpsecond.so): one entry point, and a static kgtp_step() of the library's own. */
static int __attribute__((noinline)) kgtp_step(int x)
{
	return x * 3 + 1;	/* line:step */
}

int ENTRY(int x)
{
	return kgtp_step(x);
}
