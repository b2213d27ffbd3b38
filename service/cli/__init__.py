"""The service's commands: `kiln serve`, `kiln api`, `kiln submit`, `kiln profile` and `kiln admin`.

One module per job: `servers` runs the service's processes, `jobs` is the client of a running
service, `profile` runs a job's artifact on a farm device, `admin` manages tenants, keys, agents and the schema. Imports of fastapi, sqlalchemy,
celery and httpx stay inside the handlers, so that `import kiln` and `kiln compile` never load them.
"""
from __future__ import annotations

from service.cli import admin, jobs, profile, servers


def add_commands(commands) -> None:
    """Register the service's subcommands on kiln's `commands` (argparse subparsers)."""
    servers.add_commands(commands)
    jobs.add_commands(commands)
    profile.add_commands(commands)
    admin.add_commands(commands)
