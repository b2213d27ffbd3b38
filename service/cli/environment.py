"""The Settings a command runs with, and the environment that gives a child process the same."""
from __future__ import annotations

import argparse
import os

MISSING_EXTRA = ("the service needs its Python packages: pip install -e '.[service]' "
                 "(fastapi, uvicorn, sqlalchemy, alembic, celery, redis, httpx)")


def server_args(cmd) -> None:
    cmd.add_argument("--host", help="listen address (default $KILN_HOST or 127.0.0.1)")
    cmd.add_argument("--port", type=int, help="port (default $KILN_PORT or 8000)")
    cmd.add_argument("--data-dir", help="state folder (default $KILN_DATA_DIR or "
                     "~/.local/share/kiln)")


def hidden_alias(cmd, flag: str, dest: str) -> None:
    """An old spelling of an option, still accepted but not shown in --help."""
    cmd.add_argument(flag, dest=dest, type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def load_settings(args: argparse.Namespace | None = None):
    """Settings from KILN_* variables, overridden by --host, --port and --data-dir."""
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


def child_env(settings) -> dict[str, str]:
    """The environment that gives a child process the same Settings."""
    env = dict(os.environ)
    env.update({"KILN_DATA_DIR": str(settings.data_dir), "KILN_DATABASE_URL": settings.database_url,
                "KILN_BROKER_URL": settings.broker_url, "KILN_STORAGE_ROOT": str(settings.storage_root),
                "KILN_HOST": settings.host, "KILN_PORT": str(settings.port),
                "KILN_API_URL": settings.api_url})
    return env
