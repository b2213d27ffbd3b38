"""Requeue jobs whose worker went silent (SIGKILL, machine loss): a thread in each worker.

Every worker runs it; requeue_stale's conditional update lets exactly one of them requeue a job.
It also sends again the message of a job queued for long (in case the message was lost).
"""
from __future__ import annotations

import logging
import threading

from service.db import database
from service.jobs import lifecycle
from service.settings import Settings

log = logging.getLogger("kiln.worker")


def reap_once(settings: Settings, celery_app) -> list[str]:
    from service.dispatch import Dispatcher

    db = database(settings.database_url)
    dispatcher = Dispatcher(celery_app)
    ids = lifecycle.requeue_stale(db, settings.stale_after_seconds, settings.max_attempts)
    for job_id in ids:
        log.warning("job %s: its worker went silent; requeued", job_id)
        dispatcher.enqueue(job_id)
    from service.devices.service import reap

    lost = reap(db, settings.device_offline_after_seconds)
    if lost:
        log.warning("measurement tasks %s returned to the queue (device silent or lease expired)",
                    ", ".join(lost))
    waiting = lifecycle.resend_queued(db, settings.resend_queued_seconds)
    for job_id in waiting:
        log.info("job %s: queued for over %.0f s; its message is sent again", job_id,
                 settings.resend_queued_seconds)
        dispatcher.enqueue(job_id)
    return ids + waiting


def start(settings: Settings, celery_app) -> threading.Event:
    stop = threading.Event()

    def loop() -> None:
        while True:
            try:
                reap_once(settings, celery_app)
            except Exception:
                log.warning("reaper pass failed", exc_info=True)
            if stop.wait(settings.reap_interval_seconds):
                return

    threading.Thread(target=loop, name="kiln-reaper", daemon=True).start()
    return stop
