/* Kiln's thread pool: runs a kernel's parallel loops (kiln_parallel_for), caller included.
 *
 * A loop's iterations are cut into chunks, and each chunk has an owner list: list t holds the
 * chunks thread t takes first (the caller is thread 0), so a static schedule keeps its
 * placement from one kernel to the next while every thread is awake. A thread that has emptied
 * its own list takes chunks from the others'. The loop is finished when all its chunks are done,
 * whoever did them: a worker that is still asleep, descheduled or slow to wake (a virtual CPU
 * that went idle) delays nothing, because the caller takes its chunks. OpenMP's join waits for
 * every thread of the team; after an idle pause that wait cost more than the loop itself.
 *
 * Workers spin for KILN_SPIN_US microseconds (environment; default KILN_POOL_SPIN_US) after a
 * job, then sleep on a futex. A job is published by bumping `gen` twice: odd while its fields are
 * written (after every worker has left the previous job), even once they are valid. A worker
 * enters a job by raising `active` and checking that `gen` has not moved; the caller writes a
 * new job only after `active` falls to 0 with `gen` odd, so no worker reads a half-written job.
 * All definitions are weak and hidden: every kernel's source carries this file, and the linker
 * keeps one pool per library or program. */
#ifndef KILN_POOL_DEFINED
#define KILN_POOL_DEFINED
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KILN_POOL_MAX_THREADS 64
#define KILN_POOL_SPIN_US 300
#define KILN_POOL_PIECES 4 /* chunks per thread of an even split, so a late thread's can move */
#define KILN_POOL_API __attribute__((weak, visibility("hidden")))

enum { KILN_POOL_DYNAMIC, KILN_POOL_EVEN, KILN_POOL_CYCLIC };
typedef void (*kiln_pool_task)(const void *context, int64_t begin, int64_t end);

typedef struct {
    _Alignas(64) atomic_llong next; /* chunks of this list handed out so far */
} kiln_pool_list;

typedef struct {
    _Alignas(64) atomic_uint gen;
    atomic_int sleepers;
    _Alignas(64) atomic_int active;
    _Alignas(64) atomic_llong done;
    _Alignas(64) atomic_int busy;
    atomic_int stop;
    atomic_int threads;   /* threads per job, the caller's included */
    int requested;        /* kiln_pool_set_threads; 0: the default */
    int default_threads;  /* kiln_pool_default_threads, once read */
    int workers;          /* worker threads started */
    int fork_handler;     /* kiln_pool_after_fork is registered */
    long spin_ns;
    pthread_t ids[KILN_POOL_MAX_THREADS];
    /* the job */
    kiln_pool_task fn;
    const void *context;
    int64_t total, chunk, chunks;
    int mode, lists;
    kiln_pool_list list[KILN_POOL_MAX_THREADS];
} kiln_pool;

KILN_POOL_API kiln_pool kiln_pool_state;
KILN_POOL_API _Thread_local int kiln_pool_in_task;

static inline void kiln_pool_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A wait on other threads: pause, and every KILN_POOL_YIELD_SPINS pauses give the CPU away, in
 * case the thread waited for is descheduled on this very CPU (a loaded machine). */
#define KILN_POOL_YIELD_SPINS 4096
static inline void kiln_pool_wait_step(unsigned *spins) {
    kiln_pool_relax();
    if (++*spins % KILN_POOL_YIELD_SPINS == 0) sched_yield();
}

static inline long kiln_pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Threads this process may run on: the affinity mask's CPUs (taskset), else the online count. */
KILN_POOL_API int kiln_pool_default_threads(void) {
    const char *env = getenv("OMP_NUM_THREADS");
    unsigned long mask[16] = {0};
    long bytes;
    int count = 0, i;
    if (env && atoi(env) > 0) return atoi(env);
    bytes = syscall(SYS_sched_getaffinity, 0, sizeof mask, mask);
    for (i = 0; bytes > 0 && i < (int)(bytes / (long)sizeof mask[0]); i++)
        count += __builtin_popcountl(mask[i]);
    if (count <= 0) count = (int)sysconf(_SC_NPROCESSORS_ONLN);
    return count > 0 ? count : 1;
}

static inline int kiln_pool_clamp(int threads) {
    return threads < 1 ? 1 : threads > KILN_POOL_MAX_THREADS ? KILN_POOL_MAX_THREADS : threads;
}

/* Threads a parallel loop runs on, the caller's included. */
KILN_POOL_API int kiln_pool_threads(void) {
    kiln_pool *p = &kiln_pool_state;
    if (p->requested > 0) return p->requested;
    if (p->default_threads == 0) p->default_threads = kiln_pool_clamp(kiln_pool_default_threads());
    return p->default_threads;
}

/* Threads for the next loops (0: the default); call it between runs, not during one. */
KILN_POOL_API void kiln_pool_set_threads(int threads) {
    kiln_pool_state.requested = threads > 0 ? kiln_pool_clamp(threads) : 0;
}

/* The chunk the j-th claim on list t gets, or -1 once the list is empty. */
static inline int64_t kiln_pool_chunk_of(const kiln_pool *p, int t, int64_t j) {
    if (p->mode == KILN_POOL_DYNAMIC) return j < p->chunks ? j : -1;
    if (p->mode == KILN_POOL_CYCLIC) {
        int64_t c = t + j * p->lists;
        return c < p->chunks ? c : -1;
    }
    {
        int64_t first = p->chunks * t / p->lists, last = p->chunks * (t + 1) / p->lists;
        return first + j < last ? first + j : -1;
    }
}

static void kiln_pool_work(kiln_pool *p, int self) {
    int k;
    kiln_pool_in_task = 1;
    for (k = 0; k < p->lists; k++) {
        int t = (self + k) % p->lists;
        for (;;) {
            int64_t j = atomic_fetch_add_explicit(&p->list[t].next, 1, memory_order_relaxed);
            int64_t c = kiln_pool_chunk_of(p, t, j), begin, end;
            if (c < 0) break;
            if (p->mode == KILN_POOL_EVEN) {
                begin = p->total * c / p->chunks;
                end = p->total * (c + 1) / p->chunks;
            } else {
                begin = c * p->chunk;
                end = begin + p->chunk < p->total ? begin + p->chunk : p->total;
            }
            p->fn(p->context, begin, end);
            atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
        }
    }
    kiln_pool_in_task = 0;
}

static long kiln_pool_futex(atomic_uint *word, int op, unsigned value) {
    return syscall(SYS_futex, (unsigned *)word, op, value, NULL, NULL, 0);
}

/* The next even generation after `seen`: spin for the pool's spin time, then sleep. */
static unsigned kiln_pool_wait(kiln_pool *p, unsigned seen) {
    long deadline = kiln_pool_now_ns() + p->spin_ns;
    unsigned g;
    int spins = 0;
    for (;;) {
        g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen && !(g & 1u)) return g;
        if (atomic_load_explicit(&p->stop, memory_order_relaxed)) return g;
        kiln_pool_relax();
        if (++spins % 64 || kiln_pool_now_ns() < deadline || (g & 1u)) continue;
        atomic_fetch_add(&p->sleepers, 1);
        if (atomic_load(&p->gen) == seen && !atomic_load(&p->stop))
            kiln_pool_futex(&p->gen, FUTEX_WAIT_PRIVATE, seen);
        atomic_fetch_sub(&p->sleepers, 1);
        deadline = kiln_pool_now_ns() + p->spin_ns;
    }
}

static void *kiln_pool_worker(void *arg) {
    kiln_pool *p = &kiln_pool_state;
    int self = (int)(intptr_t)arg;
    unsigned seen = atomic_load(&p->gen);
    for (;;) {
        unsigned g = kiln_pool_wait(p, seen);
        if (atomic_load(&p->stop)) return NULL;
        seen = g;
        if (self >= atomic_load_explicit(&p->threads, memory_order_relaxed)) continue;
        atomic_fetch_add(&p->active, 1);
        if (atomic_load(&p->gen) == g) kiln_pool_work(p, self);
        atomic_fetch_sub_explicit(&p->active, 1, memory_order_release);
    }
}

/* Stops and joins the workers (a library being unloaded must not leave them running). */
KILN_POOL_API void kiln_pool_shutdown(void) {
    kiln_pool *p = &kiln_pool_state;
    int i;
    if (p->workers == 0) return;
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->gen, 2u);
    kiln_pool_futex(&p->gen, FUTEX_WAKE_PRIVATE, INT_MAX);
    for (i = 1; i <= p->workers; i++) pthread_join(p->ids[i], NULL);
    p->workers = 0;
    atomic_store(&p->stop, 0);
}

/* A forked child has none of the parent's workers: start again from none. */
static void kiln_pool_after_fork(void) {
    kiln_pool *p = &kiln_pool_state;
    p->workers = 0;
    atomic_store(&p->active, 0);
    atomic_store(&p->sleepers, 0);
    atomic_store(&p->busy, 0);
    kiln_pool_in_task = 0;
}

static void kiln_pool_start(kiln_pool *p, int threads) {
    const char *spin = getenv("KILN_SPIN_US");
    if (p->workers == 0)
        p->spin_ns = 1000L * (spin && atol(spin) >= 0 ? atol(spin) : KILN_POOL_SPIN_US);
    if (!p->fork_handler)
        p->fork_handler = pthread_atfork(NULL, NULL, kiln_pool_after_fork) == 0;
    while (p->workers + 1 < threads) {
        int self = p->workers + 1;
        if (pthread_create(&p->ids[self], NULL, kiln_pool_worker, (void *)(intptr_t)self) != 0)
            break;
        p->workers = self;
    }
}

/* Runs fn(context, begin, end) over chunks of [0, total): `mode` KILN_POOL_EVEN splits it into
 * equal contiguous parts, one run of them per thread; KILN_POOL_CYCLIC hands chunks of `chunk`
 * iterations to threads in turn (chunk k to thread k mod threads, in every loop alike);
 * KILN_POOL_DYNAMIC hands chunks of `chunk` to whoever asks first. Returns when all are done. */
KILN_POOL_API void kiln_parallel_for(kiln_pool_task fn, const void *context, int64_t total,
                                     int64_t chunk, int mode) {
    kiln_pool *p = &kiln_pool_state;
    unsigned spins = 0;
    int threads, t;
    if (total <= 0) return;
    threads = kiln_pool_threads();
    if (threads > total) threads = (int)total;
    if (threads <= 1 || kiln_pool_in_task || atomic_exchange(&p->busy, 1)) {
        fn(context, 0, total);
        return;
    }
    kiln_pool_start(p, threads);
    if (p->workers + 1 < threads) threads = p->workers + 1;
    atomic_fetch_add(&p->gen, 1u); /* odd: a job is being written */
    while (atomic_load(&p->active) != 0) kiln_pool_wait_step(&spins);
    if (chunk < 1) chunk = 1;
    p->fn = fn;
    p->context = context;
    p->total = total;
    p->chunk = chunk;
    p->mode = mode;
    if (mode == KILN_POOL_EVEN) {
        p->chunks = (int64_t)threads * KILN_POOL_PIECES < total ? (int64_t)threads * KILN_POOL_PIECES
                                                                : total;
        p->lists = threads;
    } else {
        p->chunks = (total + chunk - 1) / chunk;
        p->lists = mode == KILN_POOL_CYCLIC ? threads : 1;
    }
    for (t = 0; t < p->lists; t++) atomic_store_explicit(&p->list[t].next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->threads, threads, memory_order_relaxed);
    atomic_fetch_add(&p->gen, 1u); /* even: the job is ready */
    if (atomic_load(&p->sleepers) > 0) kiln_pool_futex(&p->gen, FUTEX_WAKE_PRIVATE, INT_MAX);
    kiln_pool_work(p, 0);
    while (atomic_load_explicit(&p->done, memory_order_acquire) < p->chunks)
        kiln_pool_wait_step(&spins);
    atomic_store_explicit(&p->busy, 0, memory_order_release);
}

__attribute__((destructor)) static void kiln_pool_unload(void) { kiln_pool_shutdown(); }
#endif
