/* Three threads calling work() under a mutex, a short sleep between calls, joined by main: debugged under the
   gdbserver role (tests/e2e/test_gdbserver_threads.py): a breakpoint in the threads, `info threads`, switching. */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
int counter;
pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
__attribute__((noinline)) void work(int id) { pthread_mutex_lock(&lock); counter += id; pthread_mutex_unlock(&lock); }
void *run(void *arg) { for (int i = 0; i < 3; i++) { work((long)arg); usleep(1000); } return arg; }
int main(void) {
  pthread_t t[3];
  for (long i = 0; i < 3; i++) pthread_create(&t[i], 0, run, (void *)(i + 1));
  for (int i = 0; i < 3; i++) pthread_join(t[i], 0);
  printf("counter %d\n", counter);
  fflush(stdout);
  return 0;
}
