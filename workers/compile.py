"""Running one compile job: claim it, compile it in a limited child process, record the outcome.

The worker thread (the parent) claims the job, keeps the claim alive (Heartbeat), records the
stages and progress the child reports, and stops the child as soon as the job is cancelled or
taken over (the heartbeat finds the claim gone). The child (workers.sandbox, limits from the
settings) builds the profile store and runs the compiler; a crash or a limit fails the job at
once, naming the cause and the stage. Per-stage seconds come from the compiler's `on_stage`
callbacks: a stage lasts from its callback to the next one (the last until the child's result).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from functools import lru_cache
from pathlib import Path

from sqlalchemy.exc import DBAPIError, OperationalError

from service.db import Database
from service.jobs import lifecycle
from service.profiles.lookups import LookupRecorder, save_compile, without_graph
from service.settings import Settings
from service.storage import Storage, file_sha256
from workers import sandbox

log = logging.getLogger("kiln.worker")


class TransientError(Exception):
    """A failure worth retrying (database or storage unavailable), not the compiler's fault."""


class JobAborted(Exception):
    """The job was cancelled or taken over by another run while this one was compiling."""


TRANSIENT = (OperationalError, TransientError)


class StageClock:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._stage: str | None = None
        self._since = 0.0

    def enter(self, stage: str | None) -> dict[str, float]:
        now = time.perf_counter()
        if self._stage is not None:
            self.seconds[self._stage] = round(self.seconds.get(self._stage, 0.0)
                                              + now - self._since, 4)
        self._stage, self._since = stage, now
        return dict(self.seconds)


class Heartbeat(threading.Thread):
    def __init__(self, db: Database, claim: lifecycle.Claim, interval: float):
        super().__init__(name=f"heartbeat-{claim.job_id}", daemon=True)
        self.db, self.claim, self.interval = db, claim, interval
        self.lost = threading.Event()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                if not lifecycle.heartbeat(self.db, self.claim.job_id, self.claim.attempt):
                    self.lost.set()
                    return
            except DBAPIError:
                log.warning("heartbeat of job %s failed", self.claim.job_id, exc_info=True)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=self.interval + 5)


@lru_cache(maxsize=4)
def _file_profile_store(path: str):
    from kiln.profile.local import default_store

    return default_store(path)


def profile_store(settings: Settings, db: Database, storage: Storage, target: str):
    """The compile's ProfileStore: the service database (workers.profile_store), or the kiln
    SQLite file at KILN_PROFILE_DB when one is configured."""
    if settings.profile_db:
        return _file_profile_store(str(settings.profile_db))
    from workers.profile_store import DatabaseProfileStore

    return DatabaseProfileStore(db, storage, settings, target)


def compile_options(claim: lifecycle.Claim):
    from kiln.pipeline import CompileOptions

    wanted = {"partitioner": claim.partitioner, "target": claim.target, "rewrite": claim.rewrite,
              "shapes": {k: tuple(v) for k, v in claim.shapes.items()},
              "tune": claim.tune, "tune_budget": claim.tune_budget_s}
    known = {f.name for f in dataclasses.fields(CompileOptions)}
    return CompileOptions(**{k: v for k, v in wanted.items() if k in known})


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """What the child needs to compile a job (pickled to it)."""

    settings: Settings
    claim: lifecycle.Claim
    model: Path
    out: Path


class CompileEvents:
    """The compiler's callbacks in the child, sent to the parent as messages."""

    def __init__(self, reporter: sandbox.Reporter):
        self.reporter = reporter

    def stage(self, stage: str) -> None:
        self.reporter.send("stage", stage)

    def progress(self, stage: str, done: int, total: int, what: str) -> None:
        self.reporter.send("progress", stage, int(done), int(total), str(what))


def compile_in_child(request: CompileRequest, reporter: sandbox.Reporter) -> dict:
    """The child's work: the compile of one job; the report, or WorkError saying why not."""
    from kiln import pipeline
    from kiln.errors import KilnError
    from service.db import database

    settings, claim, events = request.settings, request.claim, CompileEvents(reporter)
    try:
        storage = Storage(settings.storage_root)
        inner = profile_store(settings, database(settings.database_url), storage, claim.target)
        farm = inner.farm() if claim.tune != "off" and hasattr(inner, "farm") else None
        store = LookupRecorder(inner)
        report = pipeline.compile_artifact(request.model, request.out, compile_options(claim),
                                           store, on_stage=events.stage,
                                           on_progress=events.progress, farm=farm)
    except KilnError as exc:
        if sandbox.caused_by_memory(exc):
            raise  # the sandbox names the memory limit
        raise sandbox.WorkError("model", str(exc)) from None
    except TRANSIENT as exc:
        raise sandbox.WorkError("transient", f"{type(exc).__name__}: {exc}") from None
    if hasattr(store.inner, "stats"):
        report = report | {"profile_answers": store.stats()}
    return report | {"profile_lookups": store.lookups}


def compile_limits(settings: Settings, claim: lifecycle.Claim) -> sandbox.Limits:
    """The settings' limits, widened by the job's tuning budget (tuning measures on every core)."""
    from kiln.tune import DEFAULT_BUDGET_S

    measures = claim.tune in DEFAULT_BUDGET_S  # off and reuse measure nothing
    tuning = claim.tune_budget_s or DEFAULT_BUDGET_S[claim.tune] if measures else 0.0
    return sandbox.Limits(memory_bytes=settings.compile_memory_mb << 20,
                          cpu_seconds=int(settings.compile_cpu_seconds
                                          + tuning * (os.cpu_count() or 1)),
                          wall_seconds=settings.compile_timeout_seconds + tuning)


class JobRecorder:
    """The parent's side of the child's messages: stages and progress into the job's row."""

    PROGRESS_EVERY_S = 0.5  # at most two progress writes a second (the last of a stage always)

    def __init__(self, db: Database, claim: lifecycle.Claim, beat: Heartbeat):
        self.db, self.claim, self.beat = db, claim, beat
        self.clock = StageClock()
        self.stage: str | None = None
        self._last_progress = 0.0

    def __call__(self, message: tuple) -> None:
        if self.beat.lost.is_set():
            raise JobAborted(self.claim.job_id)
        kind, *fields = message
        if kind == "stage":
            self.stage = fields[0]
            if not lifecycle.record_stage(self.db, self.claim.job_id, self.claim.attempt,
                                          self.stage, self.clock.enter(self.stage)):
                raise JobAborted(self.claim.job_id)
        elif kind == "progress":
            stage, done, total, what = fields
            now = time.monotonic()
            last_step = total and done >= total
            if not last_step and now - self._last_progress < self.PROGRESS_EVERY_S:
                return
            self._last_progress = now
            if not lifecycle.record_progress(self.db, self.claim.job_id, self.claim.attempt,
                                             stage, done, total, what):
                raise JobAborted(self.claim.job_id)

    def seconds(self) -> dict[str, float]:
        return self.clock.enter(None)


LIMIT_SETTINGS = {"memory": "KILN_COMPILE_MEMORY_MB", "cpu": "KILN_COMPILE_CPU_SECONDS",
                  "time": "KILN_COMPILE_TIMEOUT_SECONDS"}


def failure_message(error: sandbox.WorkError, stage: str | None) -> str:
    """The job's error for a compile that ended without an artifact."""
    where = f" (in stage {stage})" if stage else ""
    if error.kind == "crash":
        return (f"invalid model{where}: {error.message}; the model is malformed or uses an "
                "operator in a way the compiler's libraries cannot handle")
    if error.kind == "limit":
        return (f"model too large to compile{where}: {error.message} "
                f"({LIMIT_SETTINGS.get(error.limit, 'KILN_COMPILE_*')})")
    if error.kind == "internal":
        return f"internal compiler error: {error.message}"
    return error.message


def run_job(settings: Settings, db: Database, job_id: str, worker: str,
            work=compile_in_child) -> str:
    """Run the job if it is ours to run; return what happened (for logs and tests).

    `work(request, reporter)` is what the child runs (tests give their own).
    """
    claim = lifecycle.claim(db, job_id, worker, settings.stale_after_seconds, settings.max_attempts)
    if claim is None:
        return "skipped"
    storage = Storage(settings.storage_root)
    for leftover in storage.tmp.glob(f"build-{job_id}-*"):  # from a run whose worker died
        shutil.rmtree(leftover, ignore_errors=True)
    build_dir = storage.temp_dir(f"build-{job_id}-{claim.attempt}-")
    beat = Heartbeat(db, claim, settings.heartbeat_seconds)
    beat.start()
    recorder = JobRecorder(db, claim, beat)
    try:
        model_path = storage.model_path(claim.model_sha256)
        if not model_path.is_file():
            raise TransientError(f"model file {model_path} is missing from storage")
        named = build_dir / "model" / claim.model_filename  # reports name the user's file
        named.parent.mkdir()
        named.symlink_to(model_path)
        built = build_dir / "model.kiln"
        request = CompileRequest(settings, claim, named, built)
        try:
            report = sandbox.run(work, request, compile_limits(settings, claim), recorder,
                                 beat.lost)
        except sandbox.Stopped:
            raise JobAborted(job_id) from None
        if "profile_answers" in report:
            log.info("job %s: profile answers %s", job_id, report.pop("profile_answers"))
        lookups = report.pop("profile_lookups", [])  # a compile that asked the store nothing
        seconds = recorder.seconds()
        if beat.lost.is_set():
            raise JobAborted(job_id)
        save_compile(db, job_id, report, lookups)  # before the job reads as succeeded
        if lifecycle.succeed(db, storage, claim, built, without_graph(report), seconds,
                             file_sha256(built)):
            return "succeeded"
        return "aborted"
    except JobAborted:
        log.info("job %s stopped: cancelled or taken over", job_id)
        return "aborted"
    except sandbox.WorkError as exc:
        if exc.kind in ("transient", "lost"):
            _give_back(db, claim)
            raise TransientError(exc.message) from None
        log.warning("job %s failed: %s: %s", job_id, exc.kind, exc.message)
        lifecycle.fail(db, claim, failure_message(exc, recorder.stage), recorder.seconds())
        return "failed"
    except TRANSIENT:
        _give_back(db, claim)
        raise
    except Exception as exc:  # a bug of this module: fail the job with what is known
        log.exception("job %s: internal error", job_id)
        lifecycle.fail(db, claim, f"internal compiler error: {type(exc).__name__}: {exc}",
                       recorder.seconds())
        return "failed"
    finally:
        beat.stop()
        shutil.rmtree(build_dir, ignore_errors=True)


def _give_back(db: Database, claim: lifecycle.Claim) -> None:
    try:
        lifecycle.release(db, claim)
    except DBAPIError:
        log.warning("could not release job %s; the reaper will requeue it", claim.job_id)
