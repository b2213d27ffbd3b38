"""`kiln admin`: tenants, API keys, device agents and schema migrations."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from service.cli.environment import load_settings
from service.cli.output import print_table


def add_commands(commands) -> None:
    admin = commands.add_parser("admin", help="tenants, API keys, device agents and migrations")
    admin_commands = admin.add_subparsers(dest="admin_command", required=True)
    tenant = admin_commands.add_parser("create-tenant", help="add a tenant; print its id")
    tenant.add_argument("name")
    tenant.set_defaults(handler=_create_tenant)
    key = admin_commands.add_parser("create-key", help="add an API key; print it (shown once)")
    key.add_argument("tenant", help="tenant name or id")
    key.add_argument("--name", default="", help="a label for the key")
    key.set_defaults(handler=_create_key)
    keys = admin_commands.add_parser("list-keys", help="list API keys (never their secrets)")
    keys.add_argument("--tenant", help="only this tenant's (name or id)")
    keys.set_defaults(handler=_list_keys)
    revoke_key = admin_commands.add_parser("revoke-key", help="revoke an API key: requests with "
                                           "it get 401 from now on")
    revoke_key.add_argument("key", help="the key's id or prefix (from list-keys), or the key")
    revoke_key.set_defaults(handler=_revoke_key)
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


def _migrate(args: argparse.Namespace) -> int:
    from service.migrate import upgrade

    settings = load_settings(args)
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

    settings = load_settings(args)
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

    settings = load_settings(args)
    upgrade(settings.database_url)
    try:
        print(create_key(database(settings.database_url), args.tenant, args.name))
    except TenantError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _list_keys(args: argparse.Namespace) -> int:
    from service.db import database
    from service.tenants.service import TenantError, list_keys

    settings = load_settings(args)
    try:
        keys = list_keys(database(settings.database_url), args.tenant)
    except TenantError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    print_table(("id", "prefix", "tenant", "name", "created", "revoked"), (
        (k.id, k.prefix, tenant, k.name, f"{k.created_at:%Y-%m-%d %H:%M}",
         f"revoked {k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "") for k, tenant in keys))
    return 0


def _revoke_key(args: argparse.Namespace) -> int:
    from service.db import database
    from service.tenants.service import TenantError, revoke_key

    settings = load_settings(args)
    try:
        key = revoke_key(database(settings.database_url), args.key)
    except TenantError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    print(f"API key {key.prefix} ({key.name or 'no name'}): revoked")
    return 0


def _create_agent(args: argparse.Namespace) -> int:
    from service.db import database
    from service.devices.service import AgentError, create_agent
    from service.migrate import upgrade

    settings = load_settings(args)
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

    settings = load_settings(args)
    if not revoke_agent(database(settings.database_url), args.agent):
        print(f"kiln: error: no agent named or with id {args.agent!r}", file=sys.stderr)
        return 2
    print(f"agent {args.agent}: revoked")
    return 0
