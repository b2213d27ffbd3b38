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


def blocking(m: int, n: int, k: int, batch: int, uk: MicroKernel, mc: int, nc: int,
             kc: int, min_tasks: int = 8) -> Blocking:
    """Cache blocks of whole micro-tiles, split evenly (no thin leftover block), and enough
    parallel tasks (blocks × batch) to keep `min_tasks` threads' worth of work queued. Each
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
    while batch * -(-m // mc) * -(-n // nc) < min_tasks and (mc > uk.mr or nc > uk.nr):
        more_rows = -(-m // halved(mc, uk.mr)) - -(-m // mc) if mc > uk.mr else math.inf
        more_cols = -(-n // halved(nc, uk.nr)) - -(-n // nc) if nc > uk.nr else math.inf
        if more_rows * n < more_cols * m:  # extra row blocks re-read B (k × n), columns A (m × k)
            mc = halved(mc, uk.mr)
        else:
            nc = halved(nc, uk.nr)
    return Blocking(mc, nc, kc)
