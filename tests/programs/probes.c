/* SystemTap SDT probes (<sys/sdt.h>) at known places, for static tracepoints in a program under the gdbserver role
   (tests/e2e/test_gdbserver_static.py): one with no argument, one with three (registers at -O2, frame slots at -O0),
   one with a constant, the last two hit once per round. */
#include <sys/sdt.h>

long total;
int rounds = 4;

__attribute__((noinline)) long step(long i, int negative)
{
	total += i;
	DTRACE_PROBE3(kgtp, step, i, negative, total);	/* line:step */
	return total;
}

int main(void)
{
	DTRACE_PROBE(kgtp, start);	/* line:start */
	for (int i = 1; i <= rounds; i++) {
		step(i, -i);
		STAP_PROBE2(kgtp, round, i, 7);	/* line:round */
	}
	return (int)(total & 0x7f);	/* line:end */
}
