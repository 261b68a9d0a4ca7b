/* The pod sandbox's init process (what registry.k8s.io/pause runs): it holds the pod's
 * namespaces, reaps orphaned children and exits on SIGINT/SIGTERM. Built statically
 * by hack/images.sh into the image containerd's CRI names as its sandbox image. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { _exit(128 + sig); }

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("pause (kubeshard)");
    return 0;
  }
  if (getpid() != 1) fprintf(stderr, "pause: warning: not pid 1\n");
  struct sigaction stop = {.sa_handler = on_stop};
  struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0) {
    fprintf(stderr, "pause: sigaction: %s\n", strerror(errno));
    return 1;
  }
  for (;;) pause();
}
