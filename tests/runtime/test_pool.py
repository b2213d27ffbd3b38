"""Kiln's thread pool (kiln/codegen/render/pool.c), driven directly by a C program: every
iteration of every schedule runs exactly once, on at most the threads asked for, also when two
threads call it at once, from inside a task (nested loops run serially), in a forked child,
after the workers were stopped, and when workers sleep between loops."""
from __future__ import annotations

import subprocess

import pytest

from kiln.codegen.render.c import pool_source

PROGRAM = r"""
#include <stdio.h>
#include <sys/wait.h>
#define MAX_TOTAL 100003
static atomic_int hits[2][MAX_TOTAL];
static pthread_t seen[2][KILN_POOL_MAX_THREADS];
static atomic_int distinct[2];
static const int second = 1;

static void note_thread(int slot) {
    pthread_t me = pthread_self();
    int n = atomic_load(&distinct[slot]), i;
    for (i = 0; i < n; i++) if (pthread_equal(seen[slot][i], me)) return;
    i = atomic_fetch_add(&distinct[slot], 1);
    if (i < KILN_POOL_MAX_THREADS) seen[slot][i] = me;
}

/* context: NULL, or the index of the array to mark (a job's, whichever thread runs it) */
static void mark(const void *context, int64_t begin, int64_t end) {
    int slot = context ? *(const int *)context : 0;
    int64_t i;
    if (slot == 0) note_thread(slot);
    for (i = begin; i < end; i++) atomic_fetch_add(&hits[slot][i], 1);
}

static void nested(const void *context, int64_t begin, int64_t end) {
    int64_t i;
    (void)context;
    for (i = begin; i < end; i++) kiln_parallel_for(mark, NULL, 1, 1, KILN_POOL_DYNAMIC);
}

static int check(int which, int64_t total, int times, const char *what) {
    int64_t i;
    for (i = 0; i < MAX_TOTAL; i++) {
        int expected = i < total ? times : 0, got = atomic_exchange(&hits[which][i], 0);
        if (got != expected) {
            printf("FAIL %s: iteration %lld ran %d times, not %d\n", what, (long long)i, got,
                   expected);
            return 1;
        }
    }
    return 0;
}

static int schedules(void) {
    static const int64_t totals[] = {1, 2, 3, 7, 64, 1000, MAX_TOTAL};
    static const int64_t chunks[] = {0, 1, 5, 1000};
    static const int threads[] = {1, 2, 3, 8};
    int t, n, c, mode, failed = 0;
    char what[128];
    for (t = 0; t < 4; t++) {
        kiln_pool_set_threads(threads[t]);
        for (n = 0; n < 7; n++)
            for (c = 0; c < 4; c++)
                for (mode = 0; mode < 3; mode++) {
                    atomic_store(&distinct[0], 0);
                    kiln_parallel_for(mark, NULL, totals[n], chunks[c], mode);
                    snprintf(what, sizeof what, "threads %d total %lld chunk %lld mode %d",
                             threads[t], (long long)totals[n], (long long)chunks[c], mode);
                    failed |= check(0, totals[n], 1, what);
                    if (atomic_load(&distinct[0]) > threads[t]) {
                        printf("FAIL %s: ran on %d threads\n", what, atomic_load(&distinct[0]));
                        failed = 1;
                    }
                }
    }
    return failed;
}

static void *other_caller(void *arg) {
    int i;
    (void)arg;
    for (i = 0; i < 2000; i++) kiln_parallel_for(mark, &second, 5000, 7, KILN_POOL_DYNAMIC);
    return NULL;
}

static int two_callers(void) {
    pthread_t other;
    int i;
    kiln_pool_set_threads(2);
    pthread_create(&other, NULL, other_caller, NULL);
    for (i = 0; i < 2000; i++) kiln_parallel_for(mark, NULL, 5000, 0, KILN_POOL_EVEN);
    pthread_join(other, NULL);
    return check(0, 5000, 2000, "first caller") | check(1, 5000, 2000, "second caller");
}

static int in_a_child(void) {
    pid_t child;
    int status;
    kiln_pool_set_threads(2);
    kiln_parallel_for(mark, NULL, 1000, 1, KILN_POOL_DYNAMIC);  /* workers started */
    if (check(0, 1000, 1, "before fork")) return 1;
    child = fork();
    if (child == 0) {
        kiln_parallel_for(mark, NULL, 1000, 0, KILN_POOL_EVEN);
        kiln_parallel_for(mark, NULL, 1000, 3, KILN_POOL_CYCLIC);
        _exit(check(0, 1000, 2, "in a forked child"));
    }
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status)) {
        printf("FAIL the forked child\n");
        return 1;
    }
    return 0;
}

int main(void) {
    int failed = schedules();
    kiln_pool_set_threads(2);
    kiln_parallel_for(nested, NULL, 300, 1, KILN_POOL_DYNAMIC);
    failed |= check(0, 1, 300, "nested loops");
    failed |= two_callers();
    failed |= in_a_child();
    kiln_pool_shutdown();
    kiln_parallel_for(mark, NULL, 777, 0, KILN_POOL_EVEN);
    failed |= check(0, 777, 1, "after shutdown");
    usleep(20000);  /* the workers (KILN_SPIN_US=0) are asleep */
    kiln_parallel_for(mark, NULL, 4096, 16, KILN_POOL_CYCLIC);
    failed |= check(0, 4096, 1, "after the workers slept");
    if (!failed) printf("ok\n");
    return failed;
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pool")
    (folder / "pool_test.c").write_text(pool_source() + PROGRAM)
    subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread",
                    str(folder / "pool_test.c"), "-o", str(folder / "pool_test")], check=True)
    return folder / "pool_test"


@pytest.mark.parametrize("spin_us", ["0", "300"])
def test_every_iteration_runs_exactly_once(program, spin_us):
    done = subprocess.run([str(program)], capture_output=True, text=True, timeout=120,
                          env={"KILN_SPIN_US": spin_us})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
