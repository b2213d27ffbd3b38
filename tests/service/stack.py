"""Real service processes for end-to-end tests and bench/service_load.py.

`EmbeddedStack` runs `kiln serve` (uvicorn and a supervised Celery worker, SQLite, file broker);
`ScaleOutStack` runs `uvicorn` and N `celery worker` processes against PostgreSQL and Redis.
Every process gets its own session (process group), and `stop()` always ends them all.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
PG_ADMIN_URL = os.environ.get("KILN_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

# Short timings so that a killed worker's job is requeued within seconds.
FAST = {"KILN_HEARTBEAT_SECONDS": "0.5", "KILN_STALE_AFTER_SECONDS": "4",
        "KILN_REAP_INTERVAL_SECONDS": "1", "KILN_BROKER_POLL_SECONDS": "0.05",
        "KILN_EVENTS_POLL_SECONDS": "0.1",
        # Compile tests answer profile misses from the cost model instead of measuring each
        # kernel (tests/device_agents/test_profile_store.py measures).
        "KILN_MEASURE_LOCAL": "0"}


def _die_with_parent() -> None:
    """SIGTERM to the child when the test process dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kiln_cli(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    """Run `kiln ARGS` in a subprocess; return its stdout (raises on a non-zero exit)."""
    done = subprocess.run([sys.executable, "-m", "kiln.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"kiln {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done.stdout


class Stack:
    def __init__(self, folder: Path, env: dict[str, str]):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **FAST, "KILN_DATA_DIR": str(self.folder / "data"),
                    "KILN_PORT": str(self.port), "KILN_HOST": "127.0.0.1",
                    "PYTHONPATH": str(REPO), **env}
        self.processes: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, command: list[str]) -> subprocess.Popen:
        log = (self.folder / f"{name}.log").open("ab")
        process = subprocess.Popen(command, env=self.env, cwd=REPO, stdout=log, stderr=log,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=_die_with_parent)
        log.close()
        self.processes[name] = process
        return process

    def wait_ready(self, timeout: float = 90, url: str | None = None) -> None:
        """Until `url` (default the stack's API) answers its health check; a process of the stack
        that exits meanwhile is an error."""
        url = url or self.url
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.processes.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode}:\n{self.log(name)[-3000:]}")
            try:
                if httpx.get(f"{url}/v1/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"no answer at {url} after {timeout} s")

    def log(self, name: str) -> str:
        path = self.folder / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a process and everything it started (its pool children)."""
        process = self.processes[name]
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 20
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for process in self.processes.values():  # the whole group, stragglers included
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()

    def create_key(self, tenant: str) -> str:
        """A new tenant and its key, made by `kiln admin create-tenant` and `create-key`."""
        kiln_cli(self.env, "admin", "create-tenant", tenant)
        return kiln_cli(self.env, "admin", "create-key", tenant, "--name", "tests").strip()

    @property
    def database_url(self) -> str:
        """The database the stack's processes share (its SQLite file unless one was given)."""
        return self.env.get("KILN_DATABASE_URL") or \
            f"sqlite:///{Path(self.env['KILN_DATA_DIR']) / 'kiln.sqlite'}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class EmbeddedStack(Stack):
    """`kiln serve`: one uvicorn, one Celery worker (restarted if it dies), SQLite, file broker."""

    def __init__(self, folder: Path, concurrency: int = 2, env: dict[str, str] | None = None):
        super().__init__(folder, env or {})
        self.concurrency = concurrency

    def start(self) -> "EmbeddedStack":
        self.spawn("serve", [sys.executable, "-m", "kiln.cli", "serve", "--compile-processes",
                             str(self.concurrency)])
        self.wait_ready()
        key_file = Path(self.env["KILN_DATA_DIR"]) / "api-key"
        self.api_key = key_file.read_text().strip()
        return self

    def worker_pids(self) -> list[int]:
        """Processes `kiln serve` started for its worker (the worker and its pool)."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.processes["serve"].pid)],
                             capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


class ScaleOutStack(Stack):
    """`uvicorn` and N `celery worker` processes; PostgreSQL and Redis on this machine."""

    def __init__(self, folder: Path, database_url: str, workers: int = 2,
                 env: dict[str, str] | None = None):
        self.key_prefix = f"kilntest-{uuid.uuid4().hex[:10]}:"
        super().__init__(folder, {"KILN_DATABASE_URL": database_url, "KILN_BROKER_URL": REDIS_URL,
                                  "KILN_BROKER_KEY_PREFIX": self.key_prefix, **(env or {})})
        self.workers = workers

    def start(self) -> "ScaleOutStack":
        kiln_cli(self.env, "admin", "migrate")
        self.spawn("api", [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app",
                           "--host", "127.0.0.1", "--port", str(self.port), "--log-level",
                           "warning"])
        for i in range(self.workers):
            self.start_worker(i)
        self.wait_ready()
        return self

    def start_worker(self, i: int) -> subprocess.Popen:
        return self.spawn(f"worker{i}", [
            sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-Q", "kiln",
            "--hostname", f"w{i}@%h", "--concurrency", "1", "--loglevel", "INFO",
            "--without-mingle", "--without-gossip", "--without-heartbeat"])

    def stop(self) -> None:
        super().stop()
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{self.key_prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


def create_database(admin_url: str = PG_ADMIN_URL) -> str:
    """A fresh PostgreSQL database; returns its URL (drop it with drop_database)."""
    import psycopg

    name = f"kiln_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_psycopg(admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


def drop_database(url: str, admin_url: str = PG_ADMIN_URL) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(_psycopg(admin_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _psycopg(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def postgres_available() -> bool:
    try:
        import psycopg

        with psycopg.connect(_psycopg(PG_ADMIN_URL), connect_timeout=3):
            return True
    except Exception:
        return False


def redis_available() -> bool:
    try:
        import redis

        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping())
    except Exception:
        return False
