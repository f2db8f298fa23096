// What reading a clock costs at a signal handler's entry at 100 Hz: a
// SIGPROF handler (CPU timer, 10 ms) on a thread that only spins reads the
// time-stamp counter (RDTSC) and then CLOCK_MONOTONIC (the vDSO's
// clock_gettime), each timed by the counter. Between two signals the
// clock's code and the kernel's clock page leave the caches and the TLB;
// the counter is one instruction and reads no memory. See
// crates/corsnap-abi/src/signal/sample_time.rs.
//
//   cc -O2 -o clock_probe bench/programs/clock_probe.c && ./clock_probe
// prints the medians in counts of the TSC and in ns at the rate it measures.
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <x86intrin.h>

#define SAMPLES 400
static volatile uint64_t counter_cost[SAMPLES], clock_cost[SAMPLES];
static volatile int taken;

static void on_signal(int signo) {
    (void)signo;
    uint64_t t0 = __rdtsc();
    uint64_t t1 = __rdtsc();
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t t2 = __rdtsc();
    if (taken < SAMPLES) {
        counter_cost[taken] = t1 - t0;
        clock_cost[taken] = t2 - t1;
        taken++;
    }
}

static int by_value(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int main(void) {
    uint64_t c0 = __rdtsc(), n0 = now_ns();
    signal(SIGPROF, on_signal);
    struct itimerval every = {{0, 10000}, {0, 10000}};
    setitimer(ITIMER_PROF, &every, 0);
    volatile double x = 0;
    while (taken < SAMPLES)
        for (int i = 0; i < 1000000; i++) x += i * 0.5;
    double counts_per_ns = (double)(__rdtsc() - c0) / (double)(now_ns() - n0);
    qsort((void *)counter_cost, SAMPLES, 8, by_value);
    qsort((void *)clock_cost, SAMPLES, 8, by_value);
    printf("at a handler's entry, 100 Hz: RDTSC median %.0f ns; clock_gettime(CLOCK_MONOTONIC) median %.0f ns, "
           "p90 %.0f ns\n",
           counter_cost[SAMPLES / 2] / counts_per_ns, clock_cost[SAMPLES / 2] / counts_per_ns,
           clock_cost[SAMPLES * 9 / 10] / counts_per_ns);
    return 0;
}
