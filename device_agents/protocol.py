"""The HTTP contract between device agents and the Kiln service (the service imports these models).

Every request carries `Authorization: Bearer <agent token>` (one token per agent); a missing or
wrong token gets 401. Bodies are JSON of the models below; errors are non-2xx statuses with a JSON
`{"detail": "..."}` body (FastAPI's shape).

    POST /v1/agents/devices    DeviceRegistration -> DeviceRegistered
        Register (or re-register) one device with the facts read from it. The service keys a
        device by (agent, name): registering the same name again returns the same device_id and
        updates the facts. It must recompute `facts.fingerprint` and refuse (422) a mismatch.
    POST /v1/agents/heartbeat  Heartbeat -> HeartbeatReply
        Every device of the agent with its status; `offline` devices have lost their connection.
        `unknown_device_ids` lists ids the service does not know (the agent registers them again).
    POST /v1/agents/claim      ClaimRequest -> ClaimReply
        Up to `max_tasks` measurement tasks for one device (an empty list when there is nothing to
        do). The service hands a device only tasks it can run (same architecture) and marks them
        claimed by it. 404 for an unknown device.
    GET  <MeasurementTask.artifact_url>   -> the .kiln file (application/octet-stream)
        A URL on the service (absolute, or a path relative to the service URL); the agent sends its
        token there only, and checks `artifact_sha256` (of the file's bytes) when given.
    POST /v1/agents/results    ResultUpload -> ResultAck
        The result of one claimed task: per-kernel latency samples, or `failed` with an error.
        409 when the task is not (any longer) claimed by that device; the agent drops the result.
    POST /v1/agents/release    ReleaseRequest -> ReleaseReply
        Claimed tasks the device will not finish (it went offline): they return to the queue.

Limits are part of the contract and enforced by these models on both sides: latencies are finite,
> 0 and < MAX_LATENCY_S seconds; at most MAX_KERNELS kernels, MAX_REPEATS samples per kernel,
MAX_RUN_SAMPLES per-run samples per kernel and MAX_TOTAL_RUN_SAMPLES in one result; a peak
resident memory, when given, is in [1, MAX_PEAK_RSS_BYTES].
"""
from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from device_agents.facts import HardwareFacts, Transport

PROTOCOL_VERSION = 1
PREFIX = "/v1/agents"
REGISTER_PATH = f"{PREFIX}/devices"
HEARTBEAT_PATH = f"{PREFIX}/heartbeat"
CLAIM_PATH = f"{PREFIX}/claim"
RESULTS_PATH = f"{PREFIX}/results"
RELEASE_PATH = f"{PREFIX}/release"

MAX_LATENCY_S = 60.0  # per kernel and per model run: anything slower is a broken measurement
MAX_KERNELS = 100_000
MAX_RUNS = 100_000
MAX_REPEATS = 100
MAX_RUN_SAMPLES = 1000  # per-run samples of one kernel in one result
MAX_TOTAL_RUN_SAMPLES = 1_000_000  # per-run samples of all kernels in one result
MAX_PEAK_RSS_BYTES = 1 << 42  # a runner's peak resident memory: 4 TiB is beyond any device
MAX_TASKS_PER_CLAIM = 64
MAX_ERROR_CHARS = 4000

Identifier = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")]
DeviceName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}$")]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
CName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
BlockId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
Latency = Annotated[float, Field(gt=0.0, lt=MAX_LATENCY_S, allow_inf_nan=False)]
ShortText = Annotated[str, StringConstraints(max_length=MAX_ERROR_CHARS)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceRegistration(_Model):
    name: DeviceName  # unique within the agent: "local", "gpu-box", "pixel-7"
    transport: Transport
    address: str = Field("", max_length=256)  # "kiln@10.0.0.5:22", "192.168.1.20:5555", "usb:SERIAL"
    facts: HardwareFacts
    fingerprint: Sha256  # facts.fingerprint; the service recomputes it
    agent_version: str = Field(max_length=64)
    protocol: int = PROTOCOL_VERSION

    @model_validator(mode="after")
    def _fingerprint_matches(self) -> DeviceRegistration:
        if self.fingerprint != self.facts.fingerprint:
            raise ValueError("fingerprint does not match the facts")
        return self


class DeviceRegistered(_Model):
    device_id: Identifier


class DeviceState(str, enum.Enum):
    online = "online"  # connected, idle
    busy = "busy"  # connected, measuring
    offline = "offline"  # connection lost; its claimed tasks were released


class DeviceHeartbeat(_Model):
    device_id: Identifier
    status: DeviceState
    task_ids: list[Identifier] = Field(default_factory=list, max_length=MAX_TASKS_PER_CLAIM)
    error: ShortText | None = None  # why it is offline


class Heartbeat(_Model):
    devices: list[DeviceHeartbeat] = Field(max_length=1000)
    agent_version: str = Field(max_length=64)
    protocol: int = PROTOCOL_VERSION


class HeartbeatReply(_Model):
    unknown_device_ids: list[Identifier] = Field(default_factory=list)


class ClaimRequest(_Model):
    device_id: Identifier
    max_tasks: int = Field(1, ge=1, le=MAX_TASKS_PER_CLAIM)


class MeasurementTask(_Model):
    task_id: Identifier
    artifact_url: str = Field(min_length=1, max_length=2048)
    artifact_sha256: Sha256 | None = None  # of the .kiln file's bytes
    runs: int = Field(ge=1, le=MAX_RUNS)  # timed runs per runner invocation (-n)
    warmup: int = Field(2, ge=0, le=MAX_RUNS)  # untimed runs first (-w)
    repeats: int = Field(3, ge=1, le=MAX_REPEATS)  # runner invocations: samples per kernel
    threads: int | None = Field(None, ge=0, le=1024)  # -t; None: the runner's default
    timeout_s: float = Field(600.0, gt=0, le=3600)  # per runner invocation


class ClaimReply(_Model):
    tasks: list[MeasurementTask] = Field(default_factory=list, max_length=MAX_TASKS_PER_CLAIM)


class KernelSamples(_Model):
    """One kernel's latency: the runner's median over `runs` runs, once per repeat, and (from
    runners that report them) the per-run times of every repeat, concatenated."""

    symbol: CName  # Kiln's kernel symbol, e.g. "k3_fused_matmul_add"
    block: BlockId  # the fusion plan block it computes, e.g. "b3"
    samples_s: list[Latency] = Field(min_length=1, max_length=MAX_REPEATS)
    run_samples_s: list[Latency] = Field(default_factory=list, max_length=MAX_RUN_SAMPLES)


class LatencySummary(_Model):
    """The runner's statistics of whole-model runs in one invocation."""

    median_s: Latency
    p10_s: Latency
    p90_s: Latency
    min_s: Latency
    max_s: Latency

    @model_validator(mode="after")
    def _ordered(self) -> LatencySummary:
        if not self.min_s <= self.p10_s <= self.median_s <= self.p90_s <= self.max_s:
            raise ValueError("latency statistics are not ordered min <= p10 <= median <= p90 <= max")
        return self


class ResultUpload(_Model):
    task_id: Identifier
    device_id: Identifier
    status: Literal["ok", "failed"]
    error: ShortText | None = None
    kernels: list[KernelSamples] = Field(default_factory=list, max_length=MAX_KERNELS)
    totals: list[LatencySummary] = Field(default_factory=list, max_length=MAX_REPEATS)
    runs: int = Field(0, ge=0, le=MAX_RUNS)
    warmup: int = Field(0, ge=0, le=MAX_RUNS)
    threads: int = Field(0, ge=0, le=1024)  # as the runner reported it
    runner_version: str = Field("", max_length=64)  # "kiln-runner <kiln version>"
    runner_sha256: Sha256 | None = None
    artifact_hash: Sha256 | None = None  # the artifact manifest's content_hash
    bundle_id: Sha256 | None = None
    emulated: bool = False  # measured on an emulator: not the hardware's speed
    # the runner process's peak resident memory, the largest of its invocations (None: a runner
    # built before runners reported it)
    peak_rss_bytes: int | None = Field(None, ge=1, le=MAX_PEAK_RSS_BYTES)
    # the artifact's target (its manifest's): which of the device's classes its entries are filed
    # under (device_agents.facts.device_class); None: its CPU's
    target: str | None = Field(None, max_length=32)

    @field_validator("target")
    @classmethod
    def _known_target(cls, value: str | None) -> str | None:
        from kiln.target import TARGET_NAMES

        if value is not None and value not in TARGET_NAMES:
            raise ValueError(f"unknown target {value!r}")
        return value

    @field_validator("error")
    @classmethod
    def _trim(cls, value: str | None) -> str | None:
        return value.strip()[:MAX_ERROR_CHARS] if value is not None else None

    @model_validator(mode="after")
    def _consistent(self) -> ResultUpload:
        if self.status == "failed":
            if not self.error:
                raise ValueError("a failed result needs an error")
            return self
        if self.error is not None:
            raise ValueError("a successful result has no error")
        if not self.totals:
            raise ValueError("a successful result needs the runner's totals")
        repeats = len(self.totals)
        uneven = [k.symbol for k in self.kernels if len(k.samples_s) != repeats]
        if uneven:
            raise ValueError(f"kernel {uneven[0]} has a sample count other than the {repeats} "
                             f"runner invocations")
        if len({k.symbol for k in self.kernels}) != len(self.kernels):
            raise ValueError("a kernel symbol appears twice")
        if sum(len(k.run_samples_s) for k in self.kernels) > MAX_TOTAL_RUN_SAMPLES:
            raise ValueError(f"more than {MAX_TOTAL_RUN_SAMPLES} per-run samples in one result")
        if self.runs < 1:
            raise ValueError("a successful result needs runs >= 1")
        return self


class ResultAck(_Model):
    accepted: bool = True


class ReleaseRequest(_Model):
    device_id: Identifier
    task_ids: list[Identifier] = Field(max_length=1000)
    reason: ShortText = ""


class ReleaseReply(_Model):
    released: list[Identifier] = Field(default_factory=list)
