"""Celery tasks. They take ids, read everything else from the database, and can run twice."""
from __future__ import annotations

import logging

from workers.app import COMPILE_TASK, app
from workers.compile import TRANSIENT, run_job
from workers.protocol import CompileMessage

log = logging.getLogger("kiln.worker")


def _db():
    from service.db import database

    return database(app.kiln_settings.database_url)


@app.task(name=COMPILE_TASK, bind=True, acks_late=True,
          max_retries=app.kiln_settings.task_max_retries)
def compile_job(self, job_id: str) -> str:
    """Compile job `job_id`; transient failures retry with exponential backoff."""
    job_id = CompileMessage(job_id=job_id).job_id  # the contract's checks (workers.protocol)
    try:
        outcome = run_job(app.kiln_settings, _db(), job_id, self.request.hostname or "worker")
    except TRANSIENT as exc:
        if self.request.retries >= self.max_retries:
            from service.jobs import lifecycle

            lifecycle.give_up(_db(), job_id, f"gave up after {self.request.retries + 1} "
                              f"transient failures; the last: {type(exc).__name__}: {exc}")
            raise
        delay = min(60, 2 ** self.request.retries)
        log.warning("job %s: transient failure (%s); retry in %ss", job_id, exc, delay)
        raise self.retry(exc=exc, countdown=delay)
    log.info("job %s: %s", job_id, outcome)
    return outcome
