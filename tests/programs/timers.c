/* Interval timers and waiting for a signal: alarm() and pause(), ITIMER_VIRTUAL firing while the program spins,
   ITIMER_REAL with an interval firing again and again; compared with the native run (tests/e2e/test_programs.py). */
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
#include <sys/time.h>
volatile int alarms, vt;
void on_alarm(int s) { alarms++; }
void on_vt(int s) { vt++; }
int main(void) {
  setvbuf(stdout, 0, _IONBF, 0);
  signal(SIGALRM, on_alarm);
  alarm(1);
  pause();
  printf("alarm %d left %u\n", alarms, alarm(0));
  signal(SIGVTALRM, on_vt);
  struct itimerval it = {{0, 10000}, {0, 10000}};
  if (setitimer(ITIMER_VIRTUAL, &it, 0)) { perror("setitimer"); return 1; }
  while (vt < 3) ;
  struct itimerval z = {{0,0},{0,0}}; setitimer(ITIMER_VIRTUAL, &z, 0);
  printf("vt %d\n", vt >= 3);
  struct itimerval r = {{0, 20000}, {0, 20000}}; setitimer(ITIMER_REAL, &r, 0);
  while (alarms < 4) pause();
  printf("alarms %d\n", alarms);
  return 0;
}
