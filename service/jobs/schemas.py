from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
MAX_TUNE_BUDGET_S = 3600.0  # a job's tuning budget at most (the worker is held that long)


class JobCreate(BaseModel):
    """What to compile: an uploaded model, for a target, with a partitioner and options."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model_id": "3f2c…", "target": "host", "partitioner": "dnnfusion",
         "shapes": {"input_ids": [1, 128]}, "tune": "quick", "tune_budget_s": 30}]})

    model_id: str = Field(max_length=64)
    target: str = Field("host", description="one of kiln.target.TARGET_NAMES, or cuda-sm<NN>")
    partitioner: str = Field("dnnfusion", description="one of kiln.plan.partitioner_names()")
    shapes: dict[str, list[int]] = Field(default_factory=dict,
                                         description="values of the inputs' symbolic dimensions")
    rewrite: bool = Field(True, description="apply the math-property rewrites")
    tune: str = Field("reuse", description="schedule tuning on the worker's CPU before code "
                      "generation: one of kiln.tune.TUNE_MODES (off, reuse: the schedules an "
                      "earlier tuning chose, measuring nothing; quick, full)")
    tune_budget_s: float | None = Field(None, description="seconds for tuning, at most "
                                        f"{MAX_TUNE_BUDGET_S:g} (default: kiln.tune."
                                        "DEFAULT_BUDGET_S of the mode)")

    @field_validator("target")
    @classmethod
    def _known_target(cls, value: str) -> str:
        from kiln.errors import KilnError
        from kiln.target import target

        try:
            target(value)
        except KilnError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("partitioner")
    @classmethod
    def _known_partitioner(cls, value: str) -> str:
        from kiln.plan import partitioner_names

        names = partitioner_names()
        if value not in names:
            raise ValueError(f"unknown partitioner {value!r}; choose one of {', '.join(names)}")
        return value

    @field_validator("tune")
    @classmethod
    def _known_tune_mode(cls, value: str) -> str:
        from kiln.tune import TuneError, check_mode

        try:
            return check_mode(value)
        except TuneError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("tune_budget_s", mode="before")
    @classmethod
    def _budget_not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would take true for 1.0
            raise ValueError(f"the tuning budget must be a number of seconds, not {value!r}")
        return value

    @field_validator("tune_budget_s")
    @classmethod
    def _budget_in_range(cls, value: float | None) -> float | None:
        from kiln.tune import TuneError, check_budget

        try:
            value = check_budget(value)
        except TuneError as exc:
            raise ValueError(str(exc)) from None
        if value is not None and value > MAX_TUNE_BUDGET_S:
            raise ValueError(f"the tuning budget must be at most {MAX_TUNE_BUDGET_S:g} seconds, "
                             f"not {value!r}")
        return value

    @field_validator("shapes")
    @classmethod
    def _positive_dims(cls, value: dict[str, list[int]]) -> dict[str, list[int]]:
        from kiln.frontend import MAX_TENSOR_ELEMENTS

        for name, dims in value.items():
            if any(d <= 0 for d in dims):
                raise ValueError(f"dimensions of input {name!r} must be positive, got {dims}")
            if math.prod(dims) > MAX_TENSOR_ELEMENTS:
                raise ValueError(f"input {name!r} of shape {dims} would have more than "
                                 f"{MAX_TENSOR_ELEMENTS} elements, the compiler's limit")
        return value


class ArtifactOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    sha256: str
    size_bytes: int
    created_at: datetime


class StepOut(BaseModel):
    """Progress within the running stage, as the compiler reports it."""

    done: int = Field(ge=0, description="steps done")
    total: int | None = Field(None, ge=1, description="steps in all; null when not known ahead")
    text: str = Field(description="the step in hand, for a person to read")


class JobOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    model_id: str
    target: str
    partitioner: str
    shapes: dict[str, list[int]]
    rewrite: bool
    tune: str
    tune_budget_s: float | None
    state: JobState
    stage: str | None = Field(description="the compiler stage running or last run")
    progress: int = Field(ge=0, le=100)
    stage_seconds: dict[str, float] = Field(description="seconds per finished stage")
    step: StepOut | None = Field(None, description="progress within the running stage, when "
                                 "the stage reports it")
    queue_position: int | None = Field(None, description=(
        "a queued job's place in the queue (1: the next to start), counting every tenant's "
        "queued jobs created before it; null unless queued (and in lists)"))
    error: str | None = Field(description="why the job failed (the compiler's message)")
    attempts: int = Field(description="runs started (more than one after a lost worker)")
    worker: str | None = Field(description="the worker running it or that ran it last")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    artifact: ArtifactOut | None = None
    links: dict[str, str] = Field(default_factory=dict)


def job_out(job: Any, artifact: Any | None = None, queue_position: int | None = None) -> JobOut:
    out = JobOut.model_validate(job)
    out.artifact = ArtifactOut.model_validate(artifact) if artifact is not None else None
    if job.state == "running" and job.step_done is not None:
        out.step = StepOut(done=job.step_done, total=job.step_total, text=job.step_text or "")
    out.queue_position = queue_position if job.state == "queued" else None
    base = f"/v1/jobs/{job.id}"
    out.links = {"self": base, "events": f"{base}/events", "cancel": f"{base}/cancel"}
    if job.state == "succeeded":
        out.links |= {"artifact": f"{base}/artifact", "report": f"{base}/report"}
    return out
