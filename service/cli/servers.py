"""`kiln serve` (API and a supervised worker on one machine, in the foreground or detached) and
`kiln api` (the API alone, for scale-out)."""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from service.cli.environment import child_env, hidden_alias, load_settings, server_args

DEFAULT_TENANT = "default"


def add_commands(commands) -> None:
    serve = commands.add_parser("serve", help="run the service on this machine: API and a worker, "
                                "SQLite and a file broker in one data folder")
    server_args(serve)
    serve.add_argument("--compile-processes", type=int, default=1, metavar="N",
                       help="compile processes of the embedded worker (default 1)")
    hidden_alias(serve, "--workers", "compile_processes")
    mode = serve.add_mutually_exclusive_group()
    mode.add_argument("--detach", action="store_true",
                      help="start in the background, wait until it answers, and return")
    mode.add_argument("--stop", action="store_true", help="stop a service started with --detach")
    serve.set_defaults(handler=_serve)

    api = commands.add_parser("api", help="run the API alone (scale-out: PostgreSQL and Redis)")
    server_args(api)
    api.add_argument("--api-processes", type=int, default=1, metavar="N",
                     help="API server processes (uvicorn workers; default 1)")
    hidden_alias(api, "--processes", "api_processes")
    api.add_argument("--no-migrate", action="store_true",
                     help="do not upgrade the database schema on start")
    api.set_defaults(handler=_api)


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


def _api(args: argparse.Namespace) -> int:
    import uvicorn

    settings = load_settings(args)
    if not args.no_migrate:
        from service.migrate import upgrade

        upgrade(settings.database_url)
    os.environ.update(child_env(settings))
    uvicorn.run("service.app:create_app", factory=True, host=settings.host, port=settings.port,
                workers=args.api_processes, log_level="info", timeout_graceful_shutdown=10)
    return 0


class WorkerSupervisor(threading.Thread):
    """Runs `kiln worker` as a child process and restarts it if it dies."""

    def __init__(self, settings, concurrency: int):
        super().__init__(name="kiln-worker-supervisor", daemon=True)
        self.settings, self.concurrency = settings, concurrency
        self.process: subprocess.Popen | None = None
        self.stopping = threading.Event()

    def _start(self) -> subprocess.Popen:
        command = [sys.executable, "-m", "kiln.cli", "worker", "--compile-processes",
                   str(self.concurrency), "--name", f"embedded-{os.getpid()}@%h"]
        return subprocess.Popen(command, env=child_env(self.settings),
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
    settings = load_settings(args)
    if args.stop:
        return _stop_detached(settings)
    if args.detach:
        return _start_detached(args, settings)

    from service.app import create_app
    from service.migrate import upgrade

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    ensure_default_key(settings)
    supervisor = WorkerSupervisor(settings, args.compile_processes)
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
    stop_hint = "kiln serve --stop" + (f" --data-dir {shlex.quote(args.data_dir)}"
                                       if args.data_dir else "")
    if _running_pid(settings):
        print(f"kiln serve: already running at {settings.api_url}; stop it with `{stop_hint}`")
        return 0
    if _port_in_use(settings.host, settings.port):
        print(f"kiln serve: port {settings.port} on {settings.host} is in use by another program; "
              "choose another with --port (or $KILN_PORT)", file=sys.stderr)
        return 1
    log = settings.data_dir / "serve.log"
    command = [sys.executable, "-m", "kiln.cli", "serve", "--compile-processes",
               str(args.compile_processes)]
    with log.open("ab") as out:
        process = subprocess.Popen(command, env=child_env(settings), stdout=out, stderr=out,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    _pid_file(settings).write_text(f"{process.pid}\n")
    if not _wait_ready(process, settings, KilnClient(settings.api_url, None, timeout=2.0), log):
        if process.poll() is None:
            process.terminate()
        _pid_file(settings).unlink(missing_ok=True)
        return 1
    print(f"kiln serve: running at {settings.api_url} (pid {process.pid}, log {log}); "
          f"stop it with `{stop_hint}`")
    print(f"kiln serve: dashboard at {settings.api_url}/ (sign in with the API key in "
          f"{settings.api_key_file})")
    return 0


def _wait_ready(process: subprocess.Popen, settings, client, log: Path) -> bool:
    """Until the started service answers (and is still the process answering: alive)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            print(f"kiln serve: failed to start (exit {process.returncode}); see {log}",
                  file=sys.stderr)
            return False
        try:
            client.health()
            if settings.api_key_file.is_file() and process.poll() is None:
                return True
        except Exception:
            pass
        time.sleep(0.3)
    print(f"kiln serve: no answer at {settings.api_url} after 120 s; see {log}", file=sys.stderr)
    return False


def _port_in_use(host: str, port: int) -> bool:
    """Whether binding the listening socket would fail, as uvicorn binds it (SO_REUSEADDR)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except OSError:
        return False  # uvicorn reports an unusable host itself
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError:
            return True
    return False


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

