/* The pod sandbox's process: holds the pod's namespaces, reaps orphans, exits on SIGINT/SIGTERM.
 * Kubernetes' own pause image comes from a registry this machine cannot reach; this is the same
 * job, built static into a FROM-scratch image by tools/cluster/images.sh. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { _exit(sig == SIGTERM || sig == SIGINT ? 0 : 1); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction term = {.sa_handler = quit};
    struct sigaction child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    if (getpid() != 1) return 1; /* only ever PID 1 of its own namespace */
    sigaction(SIGINT, &term, NULL);
    sigaction(SIGTERM, &term, NULL);
    sigaction(SIGCHLD, &child, NULL);
    for (;;) pause();
}
