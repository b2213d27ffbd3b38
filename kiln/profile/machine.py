"""Facts about the machine kernels run on: what it is (static facts) and how fast it is (measured).

Static facts — CPU model, logical cores, ISA features, cache sizes — come from /proc/cpuinfo
(kiln.cpuinfo) and sysfs and make up the `fingerprint` that groups identical hardware in the profile database. Two
figures are measured with numpy: peak GFLOP/s (float32 1024×1024 matmul through numpy's BLAS, all
threads, best of a few runs) and memory bandwidth GB/s (float32 `add` of arrays larger than the
last-level cache, counting two reads and one write, best of a few runs). Measuring takes well under
2 s; `host_machine()` does it once per machine and caches the result as JSON under
`$KILN_CACHE_DIR` (default `~/.cache/kiln`), named by the fingerprint, so later processes reuse it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.cpuinfo import host_caches, host_cpuinfo
from kiln.files import cache_dir, write_atomic

CACHE_VERSION = 1
# ISA features recorded (x86 flag names; `neon` stands for Arm's Advanced SIMD, `asimd` on aarch64).
ISA_FEATURES = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "neon", "sve")

# Measurement budget: each measurement stops repeating once it has used its share.
_MATMUL_N = 1024
_MATMUL_RUNS, _MATMUL_BUDGET_S = 10, 0.5
_STREAM_RUNS, _STREAM_BUDGET_S = 8, 0.3
_STREAM_MIN_BYTES, _STREAM_MAX_BYTES = 32 << 20, 128 << 20  # per array


@dataclass(frozen=True)
class MachineFacts:
    cpu_model: str
    logical_cores: int
    isa: tuple[str, ...]  # sorted subset of ISA_FEATURES
    l1d_bytes: int | None
    l2_bytes: int | None
    l3_bytes: int | None
    arch: str  # platform.machine(), e.g. x86_64, aarch64
    peak_gflops: float  # measured: float32 matmul
    bandwidth_gbs: float  # measured: float32 streaming add, bytes read + written per second

    @property
    def fingerprint(self) -> str:
        return static_fingerprint(self.cpu_model, self.logical_cores, self.isa, self.l1d_bytes,
                                  self.l2_bytes, self.l3_bytes, self.arch)

    @property
    def peak_flops(self) -> float:
        return self.peak_gflops * 1e9

    @property
    def bandwidth_bytes(self) -> float:
        return self.bandwidth_gbs * 1e9

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["isa"] = list(self.isa)
        d["fingerprint"] = self.fingerprint
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MachineFacts":
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = fields - d.keys()
        if missing:
            raise ValueError(f"machine facts lack {', '.join(sorted(missing))}")
        kwargs = {k: d[k] for k in fields}
        kwargs["isa"] = tuple(kwargs["isa"])
        facts = cls(**kwargs)
        if "fingerprint" in d and d["fingerprint"] != facts.fingerprint:
            raise ValueError("machine facts: fingerprint does not match the facts")
        if not (facts.peak_gflops > 0 and facts.bandwidth_gbs > 0):
            raise ValueError("machine facts: measured figures must be positive")
        return facts


def static_fingerprint(cpu_model: str, logical_cores: int, isa: tuple[str, ...],
                       l1d: int | None, l2: int | None, l3: int | None, arch: str) -> str:
    """Short sha256 of the static facts: identical hardware gets the same fingerprint."""
    text = json.dumps([cpu_model, logical_cores, sorted(isa), l1d, l2, l3, arch],
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- static facts ---------------------------------------------------------------------------

def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def _isa(flags: set[str], arch: str) -> tuple[str, ...]:
    found = {f for f in ISA_FEATURES if f in flags}
    if "asimd" in flags or arch in ("aarch64", "arm64"):  # Advanced SIMD is mandatory on aarch64
        found.add("neon")
    return tuple(sorted(found))


def static_facts() -> dict[str, Any]:
    """The static facts (no measurement) and their fingerprint."""
    cpu = host_cpuinfo()
    flags = set(cpu["flags"])
    arch = platform.machine() or "unknown"
    facts = {
        "cpu_model": cpu["cpu_model"] or platform.processor() or arch,
        "logical_cores": os.cpu_count() or 1,
        "isa": _isa(flags, arch),
        "arch": arch,
    }
    caches = host_caches()
    facts["l1d_bytes"], facts["l2_bytes"], facts["l3_bytes"] = (
        caches.get(f"{level}_bytes") for level in ("l1d", "l2", "l3"))
    facts["fingerprint"] = static_fingerprint(
        facts["cpu_model"], facts["logical_cores"], facts["isa"], facts["l1d_bytes"],
        facts["l2_bytes"], facts["l3_bytes"], facts["arch"])
    return facts


# --- measurement ----------------------------------------------------------------------------

def _best_time(fn, runs: int, budget_s: float) -> float:
    fn()  # warm-up: page faults, BLAS thread start
    best = float("inf")
    start = time.perf_counter()
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return max(best, 1e-9)


def measure(l3_bytes: int | None = None) -> tuple[float, float]:
    """(peak GFLOP/s, bandwidth GB/s) of this machine, measured with numpy in well under 2 s."""
    n = _MATMUL_N
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty_like(a)
    t = _best_time(lambda: np.matmul(a, b, out=c), _MATMUL_RUNS, _MATMUL_BUDGET_S)
    gflops = 2.0 * n ** 3 / t / 1e9
    del a, b, c

    per_array = min(max(_STREAM_MIN_BYTES, l3_bytes or 0), _STREAM_MAX_BYTES)
    count = per_array // 4
    x = np.ones(count, dtype=np.float32)
    y = np.ones(count, dtype=np.float32)
    z = np.empty(count, dtype=np.float32)
    t = _best_time(lambda: np.add(x, y, out=z), _STREAM_RUNS, _STREAM_BUDGET_S)
    gbs = 3.0 * count * 4 / t / 1e9  # two reads, one write
    return gflops, gbs


_memo: dict[Path, MachineFacts] = {}
_lock = threading.Lock()


def host_machine(refresh: bool = False) -> MachineFacts:
    """This machine's facts, measured once per machine and cached on disk and in the process.

    The cache file is `$KILN_CACHE_DIR/machine-<fingerprint>.json`; `refresh=True` measures again
    and rewrites it. An unreadable or corrupt cache file is measured over; an unwritable cache
    folder only costs a measurement in every process.
    """
    static = static_facts()
    path = cache_dir() / f"machine-{static['fingerprint']}.json"
    with _lock:
        if not refresh and path in _memo:
            return _memo[path]
        facts = None if refresh else _load(path, static["fingerprint"])
        if facts is None:
            gflops, gbs = measure(static["l3_bytes"])
            kwargs = {k: v for k, v in static.items() if k != "fingerprint"}
            facts = MachineFacts(peak_gflops=gflops, bandwidth_gbs=gbs, **kwargs)
            try:
                write_atomic(path, json.dumps({"version": CACHE_VERSION, "facts": facts.to_dict()},
                                              indent=1, sort_keys=True), durable=True)
            except OSError:
                pass
        _memo[path] = facts
        return facts


def _load(path: Path, fingerprint: str) -> MachineFacts | None:
    text = _read(path)
    if text is None:
        return None
    try:
        data = json.loads(text)
        if data.get("version") != CACHE_VERSION:
            return None
        facts = MachineFacts.from_dict(data["facts"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return facts if facts.fingerprint == fingerprint else None
