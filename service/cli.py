"""`kiln serve`, `kiln api`, `kiln submit` and `kiln admin`: the service from the command line.

Imports of fastapi, sqlalchemy, celery and httpx stay inside the handlers, so that `import kiln`
and `kiln compile` never load them.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

DEFAULT_TENANT = "default"
MISSING_EXTRA = ("the service needs its Python packages: pip install -e '.[service]' "
                 "(fastapi, uvicorn, sqlalchemy, alembic, celery, redis, httpx)")


def add_commands(commands) -> None:
    from kiln.tune import DEFAULT_BUDGET_S, TUNE_MODES

    serve = commands.add_parser("serve", help="run the service on this machine: API and a worker, "
                                "SQLite and a file broker in one data folder")
    _server_args(serve)
    serve.add_argument("--workers", type=int, default=1, metavar="N",
                       help="compile processes of the embedded worker (default 1)")
    mode = serve.add_mutually_exclusive_group()
    mode.add_argument("--detach", action="store_true",
                      help="start in the background, wait until it answers, and return")
    mode.add_argument("--stop", action="store_true", help="stop a service started with --detach")
    serve.set_defaults(handler=_serve)

    api = commands.add_parser("api", help="run the API alone (scale-out: PostgreSQL and Redis)")
    _server_args(api)
    api.add_argument("--processes", type=int, default=1, metavar="N", help="uvicorn workers")
    api.add_argument("--no-migrate", action="store_true",
                     help="do not upgrade the database schema on start")
    api.set_defaults(handler=_api)

    submit = commands.add_parser("submit", help="compile a model on a Kiln service")
    submit.add_argument("model", help="path to an .onnx file")
    submit.add_argument("--target", default="host", help="host, x86_64 or aarch64 (default host)")
    submit.add_argument("--partitioner", default="dnnfusion", help="default dnnfusion")
    submit.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,…",
                        help="value of an input's symbolic dimensions (repeatable)")
    submit.add_argument("--no-rewrite", action="store_true", help="skip math-property rewrites")
    submit.add_argument("--tune", default="off", choices=TUNE_MODES,
                        help="tune kernel schedules on the worker's CPU: quick (a few fixed "
                        "candidates per block) or full (a genetic search); measurements go into "
                        "the service's profile database (default: off)")
    submit.add_argument("--tune-budget", type=_budget, metavar="SECONDS",
                        help="time limit for tuning (default: " + ", ".join(
                            f"{m} {s:g} s" for m, s in DEFAULT_BUDGET_S.items())
                        + "; the service allows at most 3600 s)")
    submit.add_argument("--wait", action="store_true",
                        help="follow the job with a progress bar, then download the artifact "
                        "and print the report")
    submit.add_argument("-o", "--output", metavar="MODEL.kiln",
                        help="where --wait puts the artifact (default: MODEL's name, .kiln)")
    _client_args(submit)
    submit.set_defaults(handler=_submit)

    admin = commands.add_parser("admin", help="tenants, API keys, device agents and migrations")
    admin_commands = admin.add_subparsers(dest="admin_command", required=True)
    tenant = admin_commands.add_parser("create-tenant", help="add a tenant; print its id")
    tenant.add_argument("name")
    tenant.set_defaults(handler=_create_tenant)
    key = admin_commands.add_parser("create-key", help="add an API key; print it (shown once)")
    key.add_argument("tenant", help="tenant name or id")
    key.add_argument("--name", default="", help="a label for the key")
    key.set_defaults(handler=_create_key)
    agent = admin_commands.add_parser("create-agent", help="add a device agent; print its token "
                                      "(shown once, stored hashed)")
    agent.add_argument("name", help="a unique name for the agent")
    agent.add_argument("--token-file", metavar="PATH",
                       help="write the token to PATH (mode 0600) instead of printing it")
    agent.set_defaults(handler=_create_agent)
    revoke = admin_commands.add_parser("revoke-agent", help="revoke an agent's token; its "
                                       "devices go offline and their tasks return to the queue")
    revoke.add_argument("agent", help="agent name or id")
    revoke.set_defaults(handler=_revoke_agent)
    migrate = admin_commands.add_parser("migrate", help="upgrade the database schema to head")
    migrate.set_defaults(handler=_migrate)


def _server_args(cmd) -> None:
    cmd.add_argument("--host", help="listen address (default $KILN_HOST or 127.0.0.1)")
    cmd.add_argument("--port", type=int, help="port (default $KILN_PORT or 8000)")
    cmd.add_argument("--data-dir", help="state folder (default $KILN_DATA_DIR or "
                     "~/.local/share/kiln)")


def _client_args(cmd) -> None:
    cmd.add_argument("--url", help="service URL (default $KILN_URL, else the local service)")
    cmd.add_argument("--api-key", help="API key (default $KILN_API_KEY, else the local "
                     "service's default key)")


def _settings(args: argparse.Namespace | None = None):
    try:
        from service.settings import Settings
    except ImportError as exc:
        raise SystemExit(f"kiln: {MISSING_EXTRA} ({exc})") from None
    overrides = {}
    for name in ("host", "port", "data_dir"):
        value = getattr(args, name, None) if args is not None else None
        if value is not None:
            overrides[name] = value
    try:
        import fastapi, sqlalchemy, celery, alembic  # noqa: F401, E401
    except ImportError as exc:
        raise SystemExit(f"kiln: {MISSING_EXTRA} ({exc})") from None
    return Settings(**overrides)


def _env_for(settings) -> dict[str, str]:
    """The environment that gives a child process the same Settings."""
    env = dict(os.environ)
    env.update({"KILN_DATA_DIR": str(settings.data_dir), "KILN_DATABASE_URL": settings.database_url,
                "KILN_BROKER_URL": settings.broker_url, "KILN_STORAGE_ROOT": str(settings.storage_root),
                "KILN_HOST": settings.host, "KILN_PORT": str(settings.port),
                "KILN_API_URL": settings.api_url})
    return env


# ---------------------------------------------------------------------------------------------
# Admin

def _migrate(args: argparse.Namespace) -> int:
    from service.migrate import upgrade

    settings = _settings(args)
    upgrade(settings.database_url)
    print(f"database at head: {_safe_url(settings.database_url)}")
    return 0


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _create_tenant(args: argparse.Namespace) -> int:
    from service.db import database
    from service.migrate import upgrade
    from service.tenants.service import TenantError, create_tenant

    settings = _settings(args)
    upgrade(settings.database_url)
    try:
        tenant = create_tenant(database(settings.database_url), args.name)
    except TenantError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    print(tenant.id)
    return 0


def _create_key(args: argparse.Namespace) -> int:
    from service.db import database
    from service.migrate import upgrade
    from service.tenants.service import TenantError, create_key

    settings = _settings(args)
    upgrade(settings.database_url)
    try:
        print(create_key(database(settings.database_url), args.tenant, args.name))
    except TenantError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _create_agent(args: argparse.Namespace) -> int:
    from service.db import database
    from service.devices.service import AgentError, create_agent
    from service.migrate import upgrade

    settings = _settings(args)
    upgrade(settings.database_url)
    try:
        _agent, token = create_agent(database(settings.database_url), args.name)
    except AgentError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    if args.token_file:
        path = Path(args.token_file)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        print(f"agent {args.name}: token written to {path}")
    else:
        print(token)
    return 0


def _revoke_agent(args: argparse.Namespace) -> int:
    from service.db import database
    from service.devices.service import revoke_agent

    settings = _settings(args)
    if not revoke_agent(database(settings.database_url), args.agent):
        print(f"kiln: error: no agent named or with id {args.agent!r}", file=sys.stderr)
        return 2
    print(f"agent {args.agent}: revoked")
    return 0


def ensure_default_key(settings) -> str:
    """The local service's key: the default tenant's, kept in `data_dir/api-key` (mode 0600)."""
    from service.db import database
    from service.tenants.service import TenantError, create_key, create_tenant, tenant_for_key

    db = database(settings.database_url)
    path = settings.api_key_file
    if path.is_file():
        key = path.read_text().strip()
        if tenant_for_key(db, key):
            return key
    try:
        create_tenant(db, DEFAULT_TENANT)
    except TenantError:
        pass  # it exists already
    key = create_key(db, DEFAULT_TENANT, "kiln serve")
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".api-key.{os.getpid()}")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.replace(staged, path)
    return key


# ---------------------------------------------------------------------------------------------
# Servers

def _api(args: argparse.Namespace) -> int:
    import uvicorn

    settings = _settings(args)
    if not args.no_migrate:
        from service.migrate import upgrade

        upgrade(settings.database_url)
    os.environ.update(_env_for(settings))
    uvicorn.run("service.app:create_app", factory=True, host=settings.host, port=settings.port,
                workers=args.processes, log_level="info", timeout_graceful_shutdown=10)
    return 0


class WorkerSupervisor(threading.Thread):
    """Runs `kiln worker` as a child process and restarts it if it dies."""

    def __init__(self, settings, concurrency: int):
        super().__init__(name="kiln-worker-supervisor", daemon=True)
        self.settings, self.concurrency = settings, concurrency
        self.process: subprocess.Popen | None = None
        self.stopping = threading.Event()

    def _start(self) -> subprocess.Popen:
        command = [sys.executable, "-m", "kiln.cli", "worker", "--concurrency",
                   str(self.concurrency), "--name", f"embedded-{os.getpid()}@%h"]
        return subprocess.Popen(command, env=_env_for(self.settings),
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def run(self) -> None:
        backoff = 1.0
        while not self.stopping.is_set():
            started = time.monotonic()
            self.process = self._start()
            code = self.process.wait()
            if self.stopping.is_set():
                return
            backoff = 1.0 if time.monotonic() - started > 60 else min(backoff * 2, 30.0)
            print(f"kiln serve: worker exited with {code}; restarting in {backoff:.0f} s",
                  file=sys.stderr)
            self.stopping.wait(backoff)

    def stop(self) -> None:
        self.stopping.set()
        process = self.process
        if process and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _uvicorn_server(app, settings):
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises SIGTERM after shutting down, which would end this process
            # before it stops its worker; here the signal only asks the server to exit.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
            yield

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            timeout_graceful_shutdown=10)
    return Server(config)


def _die_with_parent() -> None:
    """In a child: get SIGTERM when the parent dies (Linux), so no worker outlives `kiln serve`."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pid_file(settings) -> Path:
    return settings.data_dir / "serve.pid"


def _serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.stop:
        return _stop_detached(settings)
    if args.detach:
        return _start_detached(args, settings)

    from service.app import create_app
    from service.migrate import upgrade

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    ensure_default_key(settings)
    supervisor = WorkerSupervisor(settings, args.workers)
    supervisor.start()
    try:
        print(f"kiln serve: {settings.api_url} (data in {settings.data_dir}; API key in "
              f"{settings.api_key_file})", file=sys.stderr, flush=True)
        print(f"kiln serve: dashboard at {settings.api_url}/ (sign in with that API key)",
              file=sys.stderr, flush=True)
        _uvicorn_server(create_app(settings), settings).run()
    finally:
        supervisor.stop()
    return 0


def _start_detached(args: argparse.Namespace, settings) -> int:
    from service.client import KilnClient

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if _running_pid(settings):
        print(f"kiln serve: already running at {settings.api_url}")
        return 0
    log = settings.data_dir / "serve.log"
    command = [sys.executable, "-m", "kiln.cli", "serve", "--workers", str(args.workers)]
    with log.open("ab") as out:
        process = subprocess.Popen(command, env=_env_for(settings), stdout=out, stderr=out,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    _pid_file(settings).write_text(f"{process.pid}\n")
    client = KilnClient(settings.api_url, None, timeout=2.0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            print(f"kiln serve: failed to start (exit {process.returncode}); see {log}",
                  file=sys.stderr)
            return 1
        try:
            client.health()
            if settings.api_key_file.is_file():
                break
        except Exception:
            pass
        time.sleep(0.3)
    else:
        print(f"kiln serve: no answer at {settings.api_url} after 120 s; see {log}", file=sys.stderr)
        return 1
    print(f"kiln serve: running at {settings.api_url} (pid {process.pid}, log {log}); "
          f"stop it with `kiln serve --stop`")
    print(f"kiln serve: dashboard at {settings.api_url}/ (sign in with the API key in "
          f"{settings.api_key_file})")
    return 0


def _running_pid(settings) -> int | None:
    try:
        pid = int(_pid_file(settings).read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def _stop_detached(settings) -> int:
    pid = _running_pid(settings)
    if pid is None:
        print("kiln serve: not running")
        return 0
    os.kill(pid, signal.SIGTERM)
    for _ in range(300):
        try:
            os.kill(pid, 0)
        except OSError:
            break
        time.sleep(0.1)
    _pid_file(settings).unlink(missing_ok=True)
    print(f"kiln serve: stopped (pid {pid})")
    return 0


# ---------------------------------------------------------------------------------------------
# Client

def client_from(args: argparse.Namespace):
    from service.client import KilnClient

    settings = _settings()
    url = args.url or os.environ.get("KILN_URL") or settings.api_url
    key = args.api_key or os.environ.get("KILN_API_KEY")
    if not key and url == settings.api_url and settings.api_key_file.is_file():
        key = settings.api_key_file.read_text().strip()  # only ever sent to the local service
    if not key:
        raise SystemExit("kiln: no API key: pass --api-key or set KILN_API_KEY (a local "
                         "`kiln serve` writes one to its data folder)")
    return KilnClient(url, key)


class ProgressBar:
    WIDTH = 30

    def __init__(self, stream=sys.stderr):
        self.stream, self.tty, self.last = stream, stream.isatty(), None

    def __call__(self, job: dict) -> None:
        key = (job["state"], job.get("stage"), job["progress"])
        if key == self.last:
            return
        self.last = key
        filled = self.WIDTH * job["progress"] // 100
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        text = f"[{bar}] {job['progress']:3d}% {job['state']}"
        text += f" ({job['stage']})" if job.get("stage") and job["state"] == "running" else ""
        if self.tty:
            self.stream.write(f"\r{text:<70}")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and self.last is not None:
            self.stream.write("\n")
            self.stream.flush()


def _budget(text: str) -> float:
    """--tune-budget: a positive number of seconds (the service checks its upper bound)."""
    from kiln.errors import KilnError
    from kiln.tune import check_budget

    try:
        return check_budget(text)
    except KilnError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _submit(args: argparse.Namespace) -> int:
    from kiln import frontend
    from kiln.report import format_report
    from service.client import ServiceError

    shapes = dict(frontend.parse_shape_arg(s) for s in args.shape)
    model_path = Path(args.model)
    if not model_path.is_file():
        print(f"kiln: error: model file not found: {model_path}", file=sys.stderr)
        return 2
    with client_from(args) as client:
        try:
            model = client.upload_model(model_path)
            job = client.submit(model["id"], args.target, args.partitioner,
                                {k: list(v) for k, v in shapes.items()}, not args.no_rewrite,
                                args.tune, args.tune_budget)
            tuning = f", tune {args.tune}" if args.tune != "off" else ""
            print(f"job {job['id']} queued: {model_path.name} for {args.target} "
                  f"({args.partitioner}{tuning})", file=sys.stderr)
            if not args.wait:
                print(job["id"])
                return 0
            bar = ProgressBar()
            try:
                job = client.wait(job["id"], on_progress=bar)
            finally:
                bar.done()
            if job["state"] != "succeeded":
                print(f"kiln: job {job['id']} {job['state']}: {job.get('error') or ''}",
                      file=sys.stderr)
                return 1
            output = Path(args.output or f"{model_path.stem}.kiln")
            client.download_artifact(job["id"], output)
            report = client.report(job["id"])
        except ServiceError as exc:
            print(f"kiln: error: {exc}", file=sys.stderr)
            return 2
    print(format_report(report))
    if "tuning" in report:
        from kiln.cli import format_tuning

        print(format_tuning(report["tuning"]))
    seconds = ", ".join(f"{k} {v:.2f}s" for k, v in job["stage_seconds"].items())
    print(f"wrote {output} ({job['artifact']['size_bytes']} bytes); job {job['id']}: {seconds}")
    return 0
