"""The queue contract between the API and the workers: both sides import this module (as the
service and the agents share device_agents.protocol).

    app = broker_app(settings)                            # reaches Settings.broker_url
    send_compile(app, CompileMessage(job_id=job.id))      # the API
    @app.task(name=COMPILE_TASK) def compile_job(self, job_id)   # the workers (workers.tasks)

One message per compile job: task COMPILE_TASK on queue QUEUE, task id = the job id, keyword
arguments CompileMessage. The database, not the message, is the record of a job: the message says
which job to run, so a lost message (the reaper sends it again) or a repeated one (claims are
atomic) is harmless. The broker is the embedded folder broker (kilnfs://, workers.broker) or Redis.
"""
from __future__ import annotations

from celery import Celery
from pydantic import BaseModel, ConfigDict, Field

from service.settings import Settings
from workers import broker

QUEUE = "kiln"
COMPILE_TASK = "kiln.compile"
PROFILE_TASK = "kiln.profile"  # one profile run (workers.profile_jobs), task id profile-<run id>
SEND_RETRY = {"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2}


class CompileMessage(BaseModel):
    """Compile job `job_id` (everything else is read from the database)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(min_length=1, max_length=32)


def transport_options(settings: Settings) -> dict:
    if settings.embedded_broker:
        return broker.transport_options(settings.broker_dir, settings.broker_poll_seconds)
    if settings.broker_url.startswith(("redis://", "rediss://")):
        # Redis gives unacknowledged messages back after the visibility timeout; the reaper
        # (stale heartbeat) is quicker, so this is the safety net for lost messages.
        options: dict = {"visibility_timeout": max(600, int(settings.stale_after_seconds * 4))}
        if settings.broker_key_prefix:
            options["global_keyprefix"] = settings.broker_key_prefix
        return options
    return {}


def broker_app(settings: Settings) -> Celery:
    """A Celery app on the settings' broker with the contract's serialization: what the API needs
    to send; workers.config adds the worker's options to it."""
    broker.register()
    app = Celery("kiln", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        broker_transport_options=transport_options(settings),
        broker_connection_retry_on_startup=True,
        task_default_queue=QUEUE,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_send_sent_event=False,
        enable_utc=True,
    )
    return app


def send_compile(app: Celery, message: CompileMessage) -> None:
    app.send_task(COMPILE_TASK, kwargs=message.model_dump(), task_id=message.job_id, queue=QUEUE,
                  retry=True, retry_policy=SEND_RETRY)


class ProfileMessage(BaseModel):
    """Run profile run `run_id` on the worker's own CPU (everything else is read from the database)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(min_length=1, max_length=32)


def send_profile(app: Celery, message: ProfileMessage) -> None:
    app.send_task(PROFILE_TASK, kwargs=message.model_dump(), task_id=f"profile-{message.run_id}",
                  queue=QUEUE, retry=True, retry_policy=SEND_RETRY)
