"""The Settings a command runs with, and the environment that gives a child process the same."""
from __future__ import annotations

import argparse
import importlib.util
import os

MISSING_EXTRA = ("the service needs its Python packages: pip install -e '.[service]' "
                 "(fastapi, uvicorn, sqlalchemy, alembic, celery, redis, httpx)")
SERVICE_PACKAGES = ("fastapi", "sqlalchemy", "celery", "alembic")


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
    missing = [name for name in SERVICE_PACKAGES if not _installed(name)]
    if missing:
        raise SystemExit(f"kiln: {MISSING_EXTRA} (No module named {', '.join(missing)})")
    return Settings(**overrides)


def _installed(package: str) -> bool:
    """Whether a top-level package can be imported, without importing it (importing fastapi,
    sqlalchemy, celery and alembic takes longer than a client command's whole work)."""
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:
        return False


def child_env(settings) -> dict[str, str]:
    """The environment that gives a child process the same Settings."""
    env = dict(os.environ)
    env.update({"KILN_DATA_DIR": str(settings.data_dir), "KILN_DATABASE_URL": settings.database_url,
                "KILN_BROKER_URL": settings.broker_url, "KILN_STORAGE_ROOT": str(settings.storage_root),
                "KILN_HOST": settings.host, "KILN_PORT": str(settings.port),
                "KILN_API_URL": settings.api_url})
    return env
