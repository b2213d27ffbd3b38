"""The compiler library stays free of the service's dependencies."""
from __future__ import annotations

import subprocess
import sys

from tests.service.stack import REPO

HEAVY = ("fastapi", "starlette", "sqlalchemy", "celery", "kombu", "alembic", "httpx", "uvicorn",
         "redis", "psycopg", "pydantic_settings")


def test_kiln_and_its_cli_do_not_load_the_service_stack():
    code = ("import sys, kiln, kiln.pipeline, kiln.cli; kiln.cli.build_parser(); "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_the_api_needs_only_the_queue_contract(tmp_path):
    """Issue 12 §5: the API sends jobs through workers.protocol; it builds no worker app and
    loads none of the workers' code (their tasks, the compile, the sandbox)."""
    code = ("import sys; from service.app import create_app; "
            "from service.settings import Settings; "
            f"app = create_app(Settings(data_dir={str(tmp_path)!r})); "
            "print(','.join(sorted(m for m in sys.modules if m.startswith('workers'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "workers,workers.broker,workers.protocol"
