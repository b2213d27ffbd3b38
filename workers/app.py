"""The workers' Celery app: `celery -A workers.app worker` (what `kiln worker` runs).

Configured from the environment's Settings (see workers.config); starts the reaper on boot.
"""
from __future__ import annotations

from celery.signals import worker_ready

from service.settings import get_settings
from workers.config import make_celery
from workers.protocol import COMPILE_TASK, PROFILE_TASK, QUEUE

__all__ = ["app", "COMPILE_TASK", "PROFILE_TASK", "QUEUE"]

app = make_celery(get_settings())


@worker_ready.connect(weak=False)
def _start_reaper(sender=None, **_kwargs) -> None:
    from workers import reaper

    reaper.start(app.kiln_settings, app)
