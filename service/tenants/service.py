"""Creating tenants and keys, and resolving a presented key to its tenant."""
from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from service.db import Database, utcnow
from service.tenants.tables import ApiKey, Tenant

KEY_PREFIX = "kiln_"


class TenantError(Exception):
    """A tenant or key operation that cannot be done (message names why)."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_tenant(db: Database, name: str) -> Tenant:
    name = name.strip()
    if not name:
        raise TenantError("a tenant needs a non-empty name")
    try:
        with db.write() as s:
            tenant = Tenant(name=name)
            s.add(tenant)
            s.flush()
            return tenant
    except IntegrityError:
        raise TenantError(f"a tenant named {name!r} exists already") from None


def find_tenant(db: Database, name_or_id: str) -> Tenant | None:
    with db.read() as s:
        return s.scalars(select(Tenant).where(
            (Tenant.id == name_or_id) | (Tenant.name == name_or_id))).first()


def create_key(db: Database, tenant_name_or_id: str, name: str = "") -> str:
    """Make a new key for the tenant; return it (the only time it is seen in clear)."""
    tenant = find_tenant(db, tenant_name_or_id)
    if tenant is None:
        raise TenantError(f"no tenant named or with id {tenant_name_or_id!r}")
    prefix = secrets.token_hex(6)
    key = f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    with db.write() as s:
        s.add(ApiKey(tenant_id=tenant.id, prefix=prefix, key_hash=hash_key(key), name=name))
    return key


def tenant_for_key(db: Database, key: str) -> str | None:
    """The tenant id of a valid, unrevoked key; None otherwise."""
    if not key.startswith(KEY_PREFIX):
        return None
    prefix, sep, _secret = key[len(KEY_PREFIX):].partition("_")
    if not sep:
        return None
    with db.read() as s:
        row = s.scalars(select(ApiKey).where(ApiKey.prefix == prefix)).first()
    if row is None or row.revoked_at is not None:
        return None
    return row.tenant_id if hmac.compare_digest(row.key_hash, hash_key(key)) else None


def list_keys(db: Database, tenant_name_or_id: str | None = None) -> list[tuple[ApiKey, str]]:
    """(key, tenant name) of every key, or of one tenant's; oldest first. No secret is stored."""
    query = select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id)
    if tenant_name_or_id is not None:
        tenant = find_tenant(db, tenant_name_or_id)
        if tenant is None:
            raise TenantError(f"no tenant named or with id {tenant_name_or_id!r}")
        query = query.where(ApiKey.tenant_id == tenant.id)
    with db.read() as s:
        return [(key, name) for key, name in s.execute(query.order_by(ApiKey.created_at))]


def revoke_key(db: Database, ident: str) -> ApiKey:
    """Revoke a key given by its id, its prefix or the key itself; repeating is harmless."""
    if ident.startswith(KEY_PREFIX):
        ident = ident[len(KEY_PREFIX):].partition("_")[0]
    with db.write() as s:
        key = s.scalars(select(ApiKey).where((ApiKey.id == ident) | (ApiKey.prefix == ident))
                        ).first()
        if key is None:
            raise TenantError(f"no API key with id or prefix {ident!r} (kiln admin list-keys "
                              "shows them)")
        if key.revoked_at is None:
            key.revoked_at = utcnow()
        return key
