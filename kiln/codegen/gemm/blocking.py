"""GotoBLAS cache blocking: how a packed GEMM splits its output into parallel tasks."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.codegen.microkernel import MicroKernel


@dataclass(frozen=True)
class Blocking:
    mc: int
    nc: int
    kc: int


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# The most of their time a balanced split's tasks may leave threads idle: equal tasks run in
# ceil(tasks / threads) rounds, and a last round only partly filled keeps the other threads
# waiting (9 tasks on 4 threads: a quarter of the time).
IDLE_SHARE = 1 / 8


def idle_share(tasks: int, threads: int) -> float:
    """The share of `threads` threads' time that `tasks` equal tasks leave idle."""
    return 1 - tasks / (threads * -(-tasks // threads))


# The most threads a split is balanced for: each halving for balance re-reads a block of the
# operand it cuts across (a transformer's weights, cold), which costs more on the 2–4 core
# machines Kiln runs on than an 8-thread tail saves (2-core AVX-512 Xeon, interleaved in-model
# A/B, DistilBERT: 0.95× with 12 tasks of 128 × 3072 × 768 instead of 24, balanced for 8).
BALANCE_THREADS = 4


def balanced(tasks: int, max_threads: int) -> bool:
    """Whether `tasks` equal tasks split evenly (at most `IDLE_SHARE` idle) over 2, 4, … up to
    `max_threads` threads."""
    threads = 2
    while threads <= max_threads:
        if idle_share(tasks, threads) > IDLE_SHARE:
            return False
        threads *= 2
    return True


def blocking(m: int, n: int, k: int, batch: int, uk: MicroKernel, mc: int, nc: int,
             kc: int, min_tasks: int = 8, balance: bool = False) -> Blocking:
    """Cache blocks of whole micro-tiles, split evenly (no thin leftover block), and enough
    parallel tasks (blocks × batch) to keep `min_tasks` threads' worth of work queued; with
    `balance`, also as many as split evenly over 2 and `BALANCE_THREADS` threads (on a 2-core Zen 3,
    CPU-time medians of interleaved runs, products of 197 × 768 by 768 and of 257 × 768 by 768
    took 0.97× and 0.96× the time in 36 tasks as in 9, one of 197 × 3072 by 768 0.95×). Each
    block along N reads all of A and each block along M all of B, so every halving goes to the
    axis that adds the fewer re-read elements: N for a transformer's activations times its
    weights, M for a late convolution's weights (megabytes) times a 7×7 image."""
    def even(total: int, limit: int, unit: int) -> int:
        parts = -(-total // max(limit, unit))
        return round_up(-(-total // parts), unit)

    def halved(size: int, unit: int) -> int:
        return round_up(size // 2, unit)

    kc = -(-k // -(-k // max(kc, 1)))
    mc, nc = even(m, mc, uk.mr), even(n, nc, uk.nr)

    def split_further(tasks: int) -> bool:
        return tasks < min_tasks or (balance and not balanced(tasks, BALANCE_THREADS))

    while split_further(batch * -(-m // mc) * -(-n // nc)) and (mc > uk.mr or nc > uk.nr):
        more_rows = -(-m // halved(mc, uk.mr)) - -(-m // mc) if mc > uk.mr else math.inf
        more_cols = -(-n // halved(nc, uk.nr)) - -(-n // nc) if nc > uk.nr else math.inf
        if more_rows * n < more_cols * m:  # extra row blocks re-read B (k × n), columns A (m × k)
            mc = halved(mc, uk.mr)
        else:
            nc = halved(nc, uk.nr)
    return Blocking(mc, nc, kc)
