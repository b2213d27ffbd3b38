"""The workers' Celery app from Settings: the queue contract's app (workers.protocol) plus the
options of a worker.

At-least-once delivery: tasks are acknowledged after they finish (acks_late); one message is
reserved per compile slot at a time. The database, not the broker, is the record of a job, so a
task that runs twice is harmless (see service.jobs.lifecycle), and jobs whose worker vanished are
requeued by the reaper.

The pool is threads: each task's compile runs in its own limited child process (workers.sandbox),
so a pool of processes would add nothing but a second layer to supervise. (The prefork pool, with
the embedded broker, which cannot drive Celery's event loop, is billiard's blocking pool: its
children share one lock-guarded task pipe, and an idle child holds that lock while it waits, so
killing one left the lock taken and every later child blocked forever.)
"""
from __future__ import annotations

from celery import Celery

from service.settings import Settings
from workers.protocol import COMPILE_TASK, PROFILE_TASK, QUEUE, broker_app

__all__ = ["COMPILE_TASK", "PROFILE_TASK", "QUEUE", "make_celery"]


def make_celery(settings: Settings) -> Celery:
    app = broker_app(settings)
    app.conf.update(
        task_acks_late=True,
        worker_pool="threads",
        worker_prefetch_multiplier=1,
        worker_concurrency=settings.worker_concurrency,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        include=["workers.tasks", "workers.profile_jobs"],
    )
    app.kiln_settings = settings
    return app
