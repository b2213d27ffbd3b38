"""Kiln's Celery workers: the compile task, the stale-job reaper and the embedded broker."""
