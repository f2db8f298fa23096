// The floor under a signal handler's time on this machine: a SIGPROF
// handler that does nothing but a fixed number of dependent loads (each
// address read from the last, as a stack walk's lookups are) from a buffer
// of a few MiB, on a thread that only spins (touching no memory of its
// own), sampled by a CPU timer at the rate asked for. Whatever the handler's
// loads find evicted from the caches between two samples was evicted by
// the rest of the machine (other processes, other VMs on the host), not by
// the program; the handler's time is taken as corsnap's is, with
// CLOCK_MONOTONIC at its entry and exit. bench/walks.py runs it beside
// corsnap's recordings, in the same rounds: corsnap's handler does about
// as many dependent reads of memory a sample as a deep stack has frames
// the caches do not hold.
//
//   handler_floor LOADS MIB SECONDS RATE   prints "median NS p99 NS samples N"
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_SAMPLES 1000000

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static uint64_t *chain;
static size_t chain_len;
static int loads;
static uint64_t *times;
static volatile size_t taken;
static volatile uint64_t sink;

static void on_sample(int sig, siginfo_t *info, void *context) {
    (void)sig, (void)info, (void)context;
    uint64_t entered = now_ns();
    // A different start each time: the loads are not those of the last
    // sample.
    uint64_t at = (entered * 2654435761u) % chain_len;
    for (int i = 0; i < loads; i++) at = chain[at];
    sink = at;
    uint64_t left = now_ns();
    if (taken < MAX_SAMPLES) times[taken++] = left - entered;
}

static int by_value(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: handler_floor LOADS MIB SECONDS RATE\n");
        return 2;
    }
    loads = atoi(argv[1]);
    chain_len = (size_t)atoi(argv[2]) << 17;  // MiB of 8-byte words
    double seconds = atof(argv[3]);
    long rate = atol(argv[4]);
    chain = malloc(chain_len * 8);
    times = malloc(MAX_SAMPLES * 8);
    if (!chain || !times || chain_len < 2 || rate <= 0) return 2;
    // One cycle through every word, in a random order (Sattolo's shuffle),
    // so that each load's address depends on the last and no two are near.
    for (size_t i = 0; i < chain_len; i++) chain[i] = i;
    srand(1);
    for (size_t i = chain_len - 1; i > 0; i--) {
        size_t j = (((size_t)rand() << 31) ^ (size_t)rand()) % i;
        uint64_t t = chain[i];
        chain[i] = chain[j];
        chain[j] = t;
    }
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sample;
    action.sa_flags = SA_SIGINFO | SA_RESTART;
    sigaction(SIGPROF, &action, NULL);
    struct sigevent event;
    memset(&event, 0, sizeof event);
    event.sigev_notify = SIGEV_THREAD_ID;
    event.sigev_signo = SIGPROF;
    event._sigev_un._tid = (pid_t)syscall(SYS_gettid);
    timer_t timer;
    if (timer_create(CLOCK_THREAD_CPUTIME_ID, &event, &timer) != 0) return 1;
    long period = 1000000000L / rate;
    struct itimerspec spec = {{period / 1000000000L, period % 1000000000L}, {period / 1000000000L, period % 1000000000L}};
    timer_settime(timer, 0, &spec, NULL);
    uint64_t end = now_ns() + (uint64_t)(seconds * 1e9);
    volatile uint64_t spin = 0;
    while (now_ns() < end)
        for (int i = 0; i < 1000; i++) spin++;
    struct itimerspec off = {{0, 0}, {0, 0}};
    timer_settime(timer, 0, &off, NULL);
    size_t n = taken;
    if (n == 0) return 1;
    qsort(times, n, sizeof *times, by_value);
    printf("median %llu p99 %llu samples %zu\n", (unsigned long long)times[(n - 1) / 2],
           (unsigned long long)times[(n - 1) * 99 / 100], n);
    return 0;
}
