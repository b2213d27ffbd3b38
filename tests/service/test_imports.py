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
