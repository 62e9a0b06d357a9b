/* Standard input to standard output (read() on fd 0 until end of file), then on stderr how many bytes and whether
   stdout is a terminal (TCGETS): the console's input and terminal side (tests/e2e/test_programs.py). */
#include <stdio.h>
#include <unistd.h>
int main(void) {
  char buf[256]; long total = 0; ssize_t n;
  while ((n = read(0, buf, sizeof buf)) > 0) { write(1, buf, n); total += n; }
  fprintf(stderr, "read %ld tty %d\n", total, isatty(1));
  return 0;
}
