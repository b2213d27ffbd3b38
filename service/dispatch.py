"""How the API hands jobs to workers: one message per job, as workers.protocol says."""
from __future__ import annotations

import logging

from workers import protocol

log = logging.getLogger("kiln.service")


class Dispatcher:
    def __init__(self, celery_app):
        self.celery = celery_app

    def enqueue(self, job_id: str) -> None:
        protocol.send_compile(self.celery, protocol.CompileMessage(job_id=job_id))

    def enqueue_profile(self, run_id: str) -> None:
        """Send a profile run to a worker (workers.profile_jobs)."""
        protocol.send_profile(self.celery, protocol.ProfileMessage(run_id=run_id))

    def revoke(self, job_id: str) -> None:
        """Tell workers to drop the job's message (best effort: the database already says so)."""
        try:
            self.celery.control.revoke(job_id)
        except Exception:
            log.warning("could not broadcast revoke of job %s", job_id, exc_info=True)
