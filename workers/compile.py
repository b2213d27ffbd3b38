"""Running one compile job: claim it, compile stage by stage, record the outcome.

Per-stage seconds come from the compiler's `on_stage` callbacks: a stage lasts from its callback
to the next one (the last until compile_artifact returns). A heartbeat thread keeps the claim
alive; when the job is cancelled or taken over, the next stage boundary stops the run.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
from functools import lru_cache

from sqlalchemy.exc import DBAPIError, OperationalError

from service.db import Database
from service.jobs import lifecycle
from service.profiles.lookups import LookupRecorder, save_compile, without_graph
from service.settings import Settings
from service.storage import Storage, file_sha256

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


def run_job(settings: Settings, db: Database, job_id: str, worker: str) -> str:
    """Run the job if it is ours to run; return what happened (for logs and tests)."""
    from kiln import pipeline
    from kiln.errors import KilnError

    claim = lifecycle.claim(db, job_id, worker, settings.stale_after_seconds, settings.max_attempts)
    if claim is None:
        return "skipped"
    storage = Storage(settings.storage_root)
    for leftover in storage.tmp.glob(f"build-{job_id}-*"):  # from a run whose worker died
        shutil.rmtree(leftover, ignore_errors=True)
    build_dir = storage.temp_dir(f"build-{job_id}-{claim.attempt}-")
    clock = StageClock()
    beat = Heartbeat(db, claim, settings.heartbeat_seconds)
    beat.start()

    def on_stage(stage: str) -> None:
        if beat.lost.is_set():
            raise JobAborted(job_id)
        if not lifecycle.record_stage(db, job_id, claim.attempt, stage, clock.enter(stage)):
            raise JobAborted(job_id)

    try:
        model_path = storage.model_path(claim.model_sha256)
        if not model_path.is_file():
            raise TransientError(f"model file {model_path} is missing from storage")
        named = build_dir / "model" / claim.model_filename  # reports name the user's file
        named.parent.mkdir()
        named.symlink_to(model_path)
        built = build_dir / "model.kiln"
        store = LookupRecorder(profile_store(settings, db, storage, claim.target))
        report = pipeline.compile_artifact(named, built, compile_options(claim), store, on_stage)
        if hasattr(store, "stats"):
            log.info("job %s: profile answers %s", job_id, store.stats())
        seconds = clock.enter(None)
        if beat.lost.is_set():
            raise JobAborted(job_id)
        save_compile(db, job_id, report, store.lookups)  # before the job reads as succeeded
        if lifecycle.succeed(db, storage, claim, built, without_graph(report), seconds,
                             file_sha256(built)):
            return "succeeded"
        return "aborted"
    except JobAborted:
        log.info("job %s stopped: cancelled or taken over", job_id)
        return "aborted"
    except KilnError as exc:
        lifecycle.fail(db, claim, str(exc), clock.enter(None))
        return "failed"
    except TRANSIENT:
        try:
            lifecycle.release(db, claim)
        except DBAPIError:
            log.warning("could not release job %s; the reaper will requeue it", job_id)
        raise
    except Exception as exc:  # a compiler bug: fail the job with what is known
        log.exception("job %s: internal compiler error", job_id)
        lifecycle.fail(db, claim, f"internal compiler error: {type(exc).__name__}: {exc}",
                       clock.enter(None))
        return "failed"
    finally:
        beat.stop()
        shutil.rmtree(build_dir, ignore_errors=True)
