"""How the API hands jobs to workers: one Celery message per job, task id = job id."""
from __future__ import annotations

import logging

log = logging.getLogger("kiln.service")


class Dispatcher:
    def __init__(self, celery_app):
        self.celery = celery_app

    def enqueue(self, job_id: str) -> None:
        from workers.config import COMPILE_TASK

        self.celery.send_task(COMPILE_TASK, args=[job_id], task_id=job_id,
                              retry=True, retry_policy={"max_retries": 3, "interval_start": 0.2,
                                                        "interval_step": 0.5, "interval_max": 2})

    def enqueue_profile(self, run_id: str) -> None:
        """Send a profile run to a worker (workers.profile_jobs)."""
        from workers.config import PROFILE_TASK

        self.celery.send_task(PROFILE_TASK, args=[run_id], task_id=f"profile-{run_id}",
                              retry=True, retry_policy={"max_retries": 3, "interval_start": 0.2,
                                                        "interval_step": 0.5, "interval_max": 2})

    def revoke(self, job_id: str) -> None:
        """Tell workers to drop the job's message (best effort: the database already says so)."""
        try:
            self.celery.control.revoke(job_id)
        except Exception:
            log.warning("could not broadcast revoke of job %s", job_id, exc_info=True)
