"""Measuring candidate kernels of one block on this CPU.

A batch is several candidate kernels of the same block (one per distinct source). Each candidate
is compiled to its own object through the toolchain's object cache (a kernel compiled once is
never compiled again, by the tuner or by an artifact build), and the batch is linked into one
shared library with a small timing loop (`HARNESS`). A child process (spawned once per tuning
run with `python -c`, restarted if a kernel kills it) loads the library, gives every kernel random inputs (the
block's constants with their real values, integer activations zero so that indices stay in
range), runs each candidate once to warm up, then takes samples round-robin over the candidates
— interleaved, so machine noise hits them alike — each sample long enough (`MIN_SAMPLE_S`) to
be timed well. Deadlines are absolute `time.monotonic()` values: compiles still running at the
deadline are killed, and the child takes no sample that its warm-up says would end past it.
"""
from __future__ import annotations

import ctypes
import math
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.codegen import Kernel
from kiln.codegen.render.c import pool_source
from kiln.ecg import Graph
from kiln.errors import KilnError
from kiln.runtime import driver
from kiln.runtime.toolchain import BuildCache, Compiler, ToolchainError, link_shared

MIN_SAMPLE_S = 0.003  # one sample repeats the kernel until it has run about this long
ALIGN = 64

HARNESS = pool_source() + r"""
/* Kiln tuner: timing loop. */
#include <stdint.h>
#include <time.h>
typedef void (*kiln_tune_fn)(void *const *args);
void kiln_tune_set_threads(int n) { kiln_pool_set_threads(n); }
double kiln_tune_run(kiln_tune_fn fn, void *const *args, int64_t calls) {
  struct timespec a, b;
  int64_t i;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (i = 0; i < calls; ++i) fn(args);
  clock_gettime(CLOCK_MONOTONIC, &b);
  return (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
}
"""


@dataclass
class Candidate:
    """One kernel to measure: `key` names it (the tuner's kernel hash)."""

    key: str
    kernel: Kernel


@dataclass
class BatchResult:
    samples: dict[str, list[float]] = field(default_factory=dict)  # key -> seconds per call
    failed: dict[str, str] = field(default_factory=dict)  # key -> why
    compile_s: float = 0.0
    run_s: float = 0.0


def tune_symbol(key: str) -> str:
    return f"kiln_tune_{re.sub(r'[^0-9A-Za-z_]', '_', key)}"


class Harness:
    """Builds and measures batches for one tuning run; `close()` ends its child process."""

    def __init__(self, graph: Graph, compiler: Compiler, cache: BuildCache | None = None,
                 threads: int | None = None, samples: int = 5, seed: int = 0):
        self.graph = graph
        self.compiler = compiler
        self.cache = cache or BuildCache()
        self.threads = threads or 0
        self.samples = samples
        self.rng = np.random.default_rng(seed)
        self._tmp = tempfile.TemporaryDirectory(prefix="kiln-tune-")
        self._batches = 0
        self._child: _Child | None = None
        self._activations: dict[str, np.ndarray] = {}

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None
        self._tmp.cleanup()

    def __enter__(self) -> "Harness":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- building -------------------------------------------------------------------------
    def build(self, candidates: Sequence[Candidate], deadline: float,
              result: BatchResult) -> Path | None:
        """Compile every candidate (failures go to `result.failed`) and link the survivors."""
        start = time.monotonic()
        sources = {c.key: driver.with_header(_renamed(c.kernel, tune_symbol(c.key)))
                   for c in candidates}
        sources["harness"] = HARNESS
        objects: dict[str, Path] = {}

        def compile_one(key: str) -> None:
            try:
                objects[key] = self.cache.objects(self.compiler, {key: sources[key]},
                                                  deadline)[key]
            except ToolchainError as exc:
                result.failed[key] = str(exc).splitlines()[0]

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(compile_one, sources))
        library = None
        if "harness" in objects and len(objects) > 1 and time.monotonic() < deadline:
            self._batches += 1
            library = Path(self._tmp.name) / f"batch{self._batches}.so"
            try:
                link_shared(self.compiler, list(objects.values()), library)
            except ToolchainError as exc:
                for c in candidates:
                    result.failed.setdefault(c.key, str(exc).splitlines()[0])
                library = None
        result.compile_s += time.monotonic() - start
        return library

    # --- measuring ------------------------------------------------------------------------
    def measure(self, candidates: Sequence[Candidate], deadline: float) -> BatchResult:
        result = BatchResult()
        if time.monotonic() >= deadline:
            return result
        library = self.build(candidates, deadline, result)
        if library is None:
            return result
        ready = [c for c in candidates if c.key not in result.failed]
        job = {"library": str(library), "threads": self.threads, "samples": self.samples,
               "deadline": deadline, "min_sample_s": MIN_SAMPLE_S,
               "candidates": [self._spec(c) for c in ready]}
        start = time.monotonic()
        if self._child is None:
            self._child = _Child()
        try:
            answer = self._child.ask(job, deadline)
        except _ChildDied as exc:
            self._child = None
            for c in ready:
                result.failed[c.key] = f"the measuring process stopped: {exc}"
            return result
        finally:
            result.run_s += time.monotonic() - start
        for c in ready:
            got = answer.get(tune_symbol(c.key))
            if isinstance(got, str):
                result.failed[c.key] = got
            elif got:
                result.samples[c.key] = got
        return result

    def _spec(self, c: Candidate) -> dict[str, Any]:
        """What the child needs to call the kernel: its symbol and its arguments' buffers."""
        k = c.kernel
        written = set(k.outputs)
        args: list[tuple[str, Any]] = []
        for name in k.args:
            if name in written:
                args.append(("zeros", _nbytes(self.graph, k, name)))
            elif name in k.derived_constants:
                args.append(("array", np.asarray(k.derived_constants[name])))
            else:
                args.append(("array", self._input(name)))
        if k.scratch_bytes > 0:
            args.append(("zeros", k.scratch_bytes))
        return {"symbol": tune_symbol(c.key), "args": args}

    def _input(self, name: str) -> np.ndarray:
        tensor = self.graph.tensors.get(name)
        if tensor is None:
            raise KilnError(f"kernel argument {name} is neither a tensor nor a derived constant")
        if tensor.is_constant:
            return np.ascontiguousarray(np.asarray(tensor.data, dtype=tensor.dtype))
        if name not in self._activations:
            dtype = np.dtype(tensor.dtype)
            if dtype.kind == "f":
                value = self.rng.standard_normal(tensor.shape).astype(dtype)
            else:  # indices, masks, counts: zero is in range for every op that reads them
                value = np.zeros(tensor.shape, dtype=dtype)
            self._activations[name] = value
        return self._activations[name]


def _nbytes(graph: Graph, kernel: Kernel, name: str) -> int:
    tensor = graph.tensors.get(name)
    if tensor is None:
        raise KilnError(f"kernel output {name} is not a tensor of the graph")
    return int(tensor.nbytes)


def _renamed(kernel: Kernel, symbol: str) -> str:
    return re.sub(rf"\b{re.escape(kernel.symbol)}", symbol, kernel.source)


# --- the measuring child process ------------------------------------------------------------------
class _ChildDied(Exception):
    pass


class _Child:
    """A child Python process that measures jobs (pickled frames over its stdin/stdout); killed
    when it overruns a deadline. Started with `python -c`, not multiprocessing, so that the
    parent's main module is never re-imported (a script, a REPL, a Celery worker)."""

    GRACE_S = 0.5  # a kernel call in progress at the deadline may finish

    def __init__(self):
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from kiln.measure.harness import _serve; _serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)

    def ask(self, job: dict[str, Any], deadline: float) -> dict[str, Any]:
        try:
            _write_frame(self.process.stdin, job)
            answer = _read_frame(self.process.stdout, deadline + self.GRACE_S)
        except (OSError, EOFError, ValueError) as exc:
            code = self.process.poll()
            self.close()
            raise _ChildDied(f"exit code {code}" if code is not None else str(exc)) from None
        if answer is None:
            self.close()
            raise _ChildDied("it ran past the tuning deadline")
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.close()  # end of input: the child returns
                self.process.wait(0.5)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


def _write_frame(stream, value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_frame(stream, deadline: float | None = None) -> Any:
    """One pickled value; None when `deadline` passes first. EOFError when the stream ends."""
    fd = stream.fileno()

    def read(n: int) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                    return None
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise EOFError("the measuring process closed its output")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    head = read(8)
    if head is None:
        return None
    body = read(struct.unpack("<Q", head)[0])
    return None if body is None else pickle.loads(body)


def _serve() -> None:
    """The child's loop: jobs from stdin, answers to the original stdout (fd 1 is pointed at
    stderr, so nothing a kernel or library prints can corrupt the frames)."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    jobs = sys.stdin.buffer
    while True:
        try:
            job = _read_frame(jobs)
        except EOFError:
            return
        _write_frame(answers, _measure(job))


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    return raw[offset:offset + nbytes]


def _buffer(kind: str, value: Any) -> np.ndarray:
    if kind == "zeros":
        return _aligned(max(int(value), 1))
    data = np.ascontiguousarray(value)
    out = _aligned(max(data.nbytes, 1))
    out[:data.nbytes] = data.reshape(-1).view(np.uint8)
    return out


def _measure(job: dict[str, Any]) -> dict[str, Any]:
    """symbol -> seconds per call (a list of samples), or an error string."""
    lib = ctypes.CDLL(job["library"])
    lib.kiln_tune_run.restype = ctypes.c_double
    lib.kiln_tune_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.kiln_tune_set_threads.argtypes = [ctypes.c_int]
    lib.kiln_tune_set_threads(int(job["threads"]))
    deadline = job["deadline"]
    out: dict[str, Any] = {}
    runs = []
    for spec in job["candidates"]:
        buffers = [_buffer(kind, value) for kind, value in spec["args"]]
        pointers = (ctypes.c_void_p * max(len(buffers), 1))(*(b.ctypes.data for b in buffers))
        fn = ctypes.cast(getattr(lib, spec["symbol"]), ctypes.c_void_p)
        runs.append([spec["symbol"], fn, pointers, buffers, 0.0, 1])
    # Warm up: one call each (first touch of every buffer), which also sizes the samples.
    for run in runs:
        if time.monotonic() >= deadline:
            break
        first = lib.kiln_tune_run(run[1], run[2], 1)
        run[4] = max(first, 1e-7)
        run[5] = max(1, int(job["min_sample_s"] / run[4]))
        out[run[0]] = []
    for _ in range(int(job["samples"])):
        for run in runs:
            symbol, fn, pointers, _, single, calls = run
            if symbol not in out or time.monotonic() + single * calls >= deadline:
                continue
            seconds = lib.kiln_tune_run(fn, pointers, calls)
            if math.isfinite(seconds) and seconds > 0:
                out[symbol].append(seconds / calls)
    return out
