"""How OpenMP's worker threads wait between parallel regions (one region per kernel), for the
in-process loader and the runner alike, unless the user chose a policy.

A short spin (GOMP_SPINCOUNT=1000 pause loops, some tens of microseconds), then sleep. The spin
covers the gap between one kernel and the next; sleeping at once (PASSIVE) costs a futex wake per
kernel, and after an idle pause each wake on a VM costs far more: MobileNetV2 (53 kernels, 2
threads, quiet) ran in 12.0 ms per call after a pause with PASSIVE, 5.5 ms with 1000 spins, 6.1 ms
spinning for ever (ACTIVE). A long spin is what hurts on a loaded machine (a spinning worker the
OS deschedules holds every barrier hostage): with four busy processes on 2 cores MobileNetV2 took
18 ms with PASSIVE, 21 ms with 1000 spins, 37 ms with 3000, and Swin-T 13–16 s per call with
libgomp's default 300000.
"""
from __future__ import annotations

import os

SPIN_COUNT = 1000
OPENMP_WAIT = {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
USER_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_wait_environment() -> dict[str, str]:
    """The variables that give OpenMP's workers Kiln's wait policy: none if the user chose one."""
    return {} if any(name in os.environ for name in USER_WAIT_SETTINGS) else dict(OPENMP_WAIT)


def runner_prelude() -> str:
    """The definition runner.c's constructor sets the spin count from (its one source is here)."""
    return f'#define KILN_GOMP_SPINCOUNT "{SPIN_COUNT}"\n'
