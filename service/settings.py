"""One Settings object for the service, the workers and the CLI, read from KILN_* variables.

The defaults are the embedded ones: every piece of state (SQLite database, broker folder, stored
models and artifacts, API key of the default tenant) lives in one data folder.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or "~/.local/share"
    return Path(base).expanduser() / "kiln"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    data_dir: Path = Field(default_factory=_default_data_dir,
                           description="folder holding all embedded state")
    database_url: str = Field("", description="SQLAlchemy URL; default SQLite in data_dir")
    broker_url: str = Field("", description="Celery broker; default a folder in data_dir")
    broker_key_prefix: str = Field("", description="prefix of every broker key (Redis)")
    storage_root: Path | None = Field(None, description="models and artifacts; default data_dir/storage")
    profile_db: Path | None = Field(None, description="kiln profile store of the workers")

    api_url: str = Field("", description="where clients reach the API; default from host and port")
    host: str = "127.0.0.1"
    port: int = 8000

    cookie_secure: bool = Field(True, description=(
        "the dashboard's session cookie is Secure (browsers send it over HTTPS and to "
        "localhost only); turn off only behind a trusted plain-HTTP proxy"))
    max_upload_bytes: int = Field(256 << 20, gt=0, description="largest accepted ONNX upload")
    default_target: str = "host"
    default_partitioner: str = "dnnfusion"

    # Per-tenant limits, shared by every API process (service.limits); 0 turns one off.
    rate_limit_per_second: float = Field(50.0, ge=0, description=(
        "requests per second a tenant may make on average (token bucket; 0: no limit)"))
    rate_limit_burst: int = Field(200, ge=1, description="requests a tenant may make at once")
    max_active_jobs: int = Field(100, ge=0, description="queued or running jobs per tenant")
    max_event_streams: int = Field(50, ge=0, description="open job event streams per tenant")
    max_stored_bytes: int = Field(20 << 30, ge=0, description=(
        "bytes of models and artifacts stored per tenant; an upload past it is refused"))

    worker_concurrency: int = Field(1, ge=1, description="compiles a worker runs at once")
    # Each compile runs in a child process with these limits (workers.sandbox); hitting one fails
    # the job as a model too large to compile.
    compile_memory_mb: int = Field(8192, ge=256, description=(
        "address space of a compile process (RLIMIT_AS), in MiB"))
    compile_cpu_seconds: int = Field(3600, ge=1, description=(
        "CPU seconds of a compile process (RLIMIT_CPU), plus its tuning budget on every core"))
    compile_timeout_seconds: float = Field(1800.0, gt=0, description=(
        "wall-clock seconds of a compile, plus its tuning budget"))
    heartbeat_seconds: float = Field(5.0, gt=0, description="how often a running job says alive")
    stale_after_seconds: float = Field(60.0, gt=0, description="silence after which a job is re-run")
    reap_interval_seconds: float = Field(10.0, gt=0, description="how often workers look for them")
    resend_queued_seconds: float = Field(900.0, gt=0, description=(
        "a job queued this long gets its message sent again (a lost message costs no job)"))
    max_attempts: int = Field(3, ge=1, description="worker losses before a job is failed")
    task_max_retries: int = Field(5, ge=0, description="retries of transient failures")
    broker_poll_seconds: float = Field(0.2, gt=0, description="polling of the embedded broker")
    events_poll_seconds: float = Field(0.25, gt=0, description="polling behind the SSE stream")

    # Device agents and the profiling database (service.devices, service.profiles).
    agent_lease_seconds: float = Field(300.0, gt=0, description=(
        "a claimed measurement task returns to the queue when its device has not mentioned it in "
        "a heartbeat for this long"))
    device_offline_after_seconds: float = Field(90.0, gt=0, description=(
        "a device without a heartbeat for this long is offline; its claimed tasks are requeued"))
    measure_max_attempts: int = Field(3, ge=1, description="claims of a measurement task before it fails")
    measure_local: bool = Field(True, description=(
        "on a profile miss for the host target, workers measure the kernel on their own CPU"))
    measure_wait_seconds: float = Field(30.0, ge=0, description=(
        "how long a compile waits for an agent to measure one missed kernel"))
    measure_budget_seconds: float = Field(120.0, ge=0, description=(
        "total waiting for agents per compile; after it the cost model answers at once"))
    measure_task_ttl_seconds: float = Field(3600.0, gt=0, description=(
        "a measurement task nobody claimed for this long expires"))
    measure_runs: int = Field(10, ge=1, le=100_000, description="timed runs per measurement")

    @model_validator(mode="after")
    def _fill_defaults(self) -> "Settings":
        self.data_dir = self.data_dir.expanduser()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'kiln.sqlite'}"
        if not self.broker_url:
            self.broker_url = "kilnfs://"
        if self.storage_root is None:
            self.storage_root = self.data_dir / "storage"
        if not self.api_url:
            self.api_url = f"http://{self.host}:{self.port}"
        return self

    @property
    def embedded_broker(self) -> bool:
        return self.broker_url.startswith("kilnfs://")

    @property
    def broker_dir(self) -> Path:
        return self.data_dir / "broker"

    @property
    def api_key_file(self) -> Path:
        """The default tenant's key, written by `kiln serve` for local clients."""
        return self.data_dir / "api-key"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
