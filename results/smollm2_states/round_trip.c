/* How far apart this machine's two CPUs are: a cache line passed back and forth between a thread pinned to CPU 0
 * and one pinned to CPU 1, ``round_trip(n)`` times; returns ns per round trip. ~55-100 ns when they share a core
 * complex (its L3), ~330-600 ns when they do not (results/smollm2_states/README.md). Built by placement.py. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

static _Atomic int ball __attribute__((aligned(64)));
static int trips;
static double result;

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *returner(void *unused) {
    (void)unused;
    pin(1);
    for (int i = 0; i < trips; i++) {
        while (atomic_load_explicit(&ball, memory_order_acquire) != 1) {}
        atomic_store_explicit(&ball, 0, memory_order_release);
    }
    return 0;
}

static void *server(void *unused) {
    (void)unused;
    pin(0);
    pthread_t other;
    pthread_create(&other, 0, returner, 0);
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int i = 0; i < trips; i++) {
        atomic_store_explicit(&ball, 1, memory_order_release);
        while (atomic_load_explicit(&ball, memory_order_acquire) != 0) {}
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    pthread_join(other, 0);
    result = ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / trips;
    return 0;
}

double round_trip(int n) {
    trips = n;
    atomic_store(&ball, 0);
    pthread_t thread;
    pthread_create(&thread, 0, server, 0);
    pthread_join(thread, 0);
    return result;
}
