"""Running work in a child process with memory, CPU and wall-clock limits.

    result = sandbox.run(work, request, Limits(memory_bytes=8 << 30, cpu_seconds=3600,
                                                wall_seconds=1800),
                         on_message=handle, stop=cancelled_event)

`work(request, reporter)` runs in a child forked from a forkserver (started once per worker process
and preloaded with the compiler, so a child starts in milliseconds). The child sets its own limits
first: RLIMIT_AS (address space) and RLIMIT_CPU; the parent kills it at the wall-clock deadline or
as soon as `stop` is set. While it runs, `reporter.send(...)` hands messages to `on_message` in the
parent. What ends it:

- `work` returns: `run` returns its value;
- `work` raises `WorkError(kind, message)`: `run` raises it as it is; any other exception is a
  `WorkError("internal", ...)`, and a MemoryError (or one caused by it) is a `("limit", ...)`;
- a crash signal (SEGV, ABRT, BUS, ILL, FPE): `WorkError("crash", ...)`; SIGXCPU or the deadline:
  `WorkError("limit", ...)`;
- any other signal (SIGKILL or SIGTERM from outside: the OOM killer, a shutdown), or the
  forkserver's end: `WorkError("lost", ...)`, which is not the work's fault;
- `stop` set, or `on_message` raising: the child is killed and `Stopped` (or what `on_message`
  raised) propagates.
"""
from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}
POLL_SECONDS = 0.2
FORKSERVER_GONE = 255  # multiprocessing's exit code for a child whose forkserver ended first
PRELOAD = ["kiln.pipeline", "workers.compile"]  # imported once, in the forkserver


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    cpu_seconds: int
    wall_seconds: float

    def describe_memory(self) -> str:
        return f"{self.memory_bytes / (1 << 20):.0f} MiB"


class WorkError(Exception):
    """Why the work ended without a result: kind is crash, limit, lost, internal, or one of the
    work's own (it raises WorkError itself)."""

    def __init__(self, kind: str, message: str, limit: str | None = None):
        super().__init__(message)
        self.kind, self.message = kind, message
        self.limit = limit  # memory, cpu or time, for a limit hit


class Stopped(Exception):
    """The parent asked the child to stop (the job was cancelled or taken over)."""


class Reporter:
    """The child's end of the message pipe."""

    def __init__(self, conn: Connection):
        self._conn = conn

    def send(self, *message: Any) -> None:
        self._conn.send(message)


_context_lock = threading.Lock()
_context = None


def _forkserver():
    global _context
    with _context_lock:
        if _context is None:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD)
        return _context


def run(work: Callable[[Any, Reporter], Any], request: Any, limits: Limits,
        on_message: Callable[[tuple], None], stop: threading.Event) -> Any:
    ctx = _forkserver()
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(work, request, limits, sender),
                        name="kiln-compile", daemon=False)
    try:
        child.start()
    except BaseException:
        receiver.close()
        raise
    finally:
        sender.close()  # the child holds its own copy
    deadline = time.monotonic() + limits.wall_seconds
    outcome: tuple | None = None
    try:
        while outcome is None:
            if stop.is_set():
                raise Stopped()
            if time.monotonic() > deadline:
                raise WorkError("limit", f"it ran past its time limit of {limits.wall_seconds:g} s",
                                "time")
            ready = wait([receiver, child.sentinel], timeout=POLL_SECONDS)
            if receiver in ready:
                try:
                    message = receiver.recv()
                except EOFError:  # the child is gone; its exit code says why
                    child.join()
                    raise _ended(child.exitcode, limits) from None
                if message[0] in ("result", "error"):
                    outcome = message
                else:
                    on_message(message)
            elif child.sentinel in ready:
                child.join()
                raise _ended(child.exitcode, limits)
    finally:
        receiver.close()
        if child.is_alive():
            child.kill()
        child.join()
        child.close()
    if outcome[0] == "error":
        raise WorkError(*outcome[1:])
    return outcome[1]


def _ended(exitcode: int | None, limits: Limits) -> WorkError:
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode)
        if sig in CRASH_SIGNALS:
            return WorkError("crash", f"the compiler crashed with {sig.name}")
        if sig == signal.SIGXCPU:
            return WorkError("limit", f"it used more than its CPU limit of {limits.cpu_seconds} s",
                             "cpu")
        return WorkError("lost", f"the compile process was ended by {sig.name} from outside")
    if exitcode == FORKSERVER_GONE:
        return WorkError("lost", "the compile process's forkserver ended (a shutdown?)")
    return WorkError("internal", f"the compile process exited with code {exitcode} "
                     "without a result")


# --- the child -----------------------------------------------------------------------------------
def _child_main(work, request, limits: Limits, conn: Connection) -> None:
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 5))
    try:
        outcome: tuple = ("result", work(request, Reporter(conn)))
    except WorkError as exc:
        outcome = ("error", exc.kind, exc.message, exc.limit)
    except BaseException as exc:  # noqa: BLE001 - everything reaches the parent, by name
        if caused_by_memory(exc):
            outcome = ("error", "limit", f"it needed more memory than its limit of "
                       f"{limits.describe_memory()}: {_one_line(exc)}", "memory")
        else:
            outcome = ("error", "internal", f"{type(exc).__name__}: {_one_line(exc)}", None)
    conn.send(outcome)
    conn.close()


def caused_by_memory(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, MemoryError):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _die_with_parent() -> None:
    """SIGKILL when the parent (the forkserver, which ends with its worker) ends (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent ended before prctl
        os._exit(1)
