/* The pod sandbox's process for the test bed's node: sleeps until SIGINT or SIGTERM and reaps children, as
 * Kubernetes' own pause does. Built static (gcc -static) into the localhost/pause image by scripts/image. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { _exit(128 + sig); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction stop_action = {.sa_handler = stop};
  struct sigaction reap_action = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGINT, &stop_action, NULL);
  sigaction(SIGTERM, &stop_action, NULL);
  sigaction(SIGCHLD, &reap_action, NULL);
  for (;;) pause();
}
