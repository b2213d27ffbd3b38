"""Celery configuration from Settings, shared by the workers and the API (which only sends).

At-least-once delivery: tasks are acknowledged after they finish (acks_late) and given back when
their pool process dies (reject_on_worker_lost); one message is reserved per process at a time.
The database, not the broker, is the record of a job, so a task that runs twice is harmless
(see service.jobs.lifecycle), and jobs whose worker vanished are requeued by the reaper.
"""
from __future__ import annotations

from celery import Celery

from service.settings import Settings
from workers import broker

COMPILE_TASK = "kiln.compile"
PROFILE_TASK = "kiln.profile"  # workers.profile_jobs
QUEUE = "kiln"


def make_celery(settings: Settings) -> Celery:
    broker.register()
    app = Celery("kiln", broker=settings.broker_url, set_as_current=False)
    options: dict = {}
    if settings.embedded_broker:
        options = broker.transport_options(settings.broker_dir, settings.broker_poll_seconds)
    elif settings.broker_url.startswith(("redis://", "rediss://")):
        # Redis gives unacknowledged messages back after the visibility timeout; the reaper
        # (stale heartbeat) is quicker, so this is the safety net for lost messages.
        options = {"visibility_timeout": max(600, int(settings.stale_after_seconds * 4))}
        if settings.broker_key_prefix:
            options["global_keyprefix"] = settings.broker_key_prefix
    app.conf.update(
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue=QUEUE,
        task_serializer="json",
        accept_content=["json"],
        worker_concurrency=settings.worker_concurrency,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        enable_utc=True,
        include=["workers.tasks", "workers.profile_jobs"],
    )
    app.kiln_settings = settings
    return app

