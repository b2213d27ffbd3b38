"""Dashboard sign-in: an API key in a form gives a session cookie; every form carries a CSRF token.

The cookie (`kiln_session`) is a random token, Secure, HttpOnly and SameSite=Strict; the database
keeps only its SHA-256 (dashboard_sessions), bound to the API key that signed in, so revoking the
key ends the session. Each session has its CSRF token, checked on every POST (form field `csrf`
or header `X-CSRF-Token`). The sign-in form, before any session, uses a double-submit token: a
`kiln_signin_csrf` cookie that must equal the form's field. `/v1` never reads these cookies.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import parse_qs

from fastapi import Request
from sqlalchemy import delete, select

from service.dashboard.tables import DashboardSession
from service.db import Database, utcnow
from service.tenants.service import KEY_PREFIX, tenant_for_key
from service.tenants.tables import ApiKey, Tenant

SESSION_COOKIE = "kiln_session"
SIGNIN_CSRF_COOKIE = "kiln_signin_csrf"
SESSION_HOURS = 12
MAX_FORM_BYTES = 64 << 10


class SignInRequired(Exception):
    """No valid session: the dashboard sends the browser to the sign-in page."""


class CsrfError(Exception):
    """A POST without this session's CSRF token."""


@dataclass(frozen=True)
class Session:
    tenant_id: str
    tenant_name: str
    csrf: str


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def sign_in(db: Database, api_key: str) -> tuple[str, Session] | None:
    """A new session for a valid key: (cookie token, session); None for a wrong key."""
    api_key = api_key.strip()
    tenant_id = tenant_for_key(db, api_key)
    if tenant_id is None:
        return None
    prefix = api_key[len(KEY_PREFIX):].partition("_")[0]
    token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    now = utcnow()
    with db.write() as s:
        key = s.scalars(select(ApiKey).where(ApiKey.prefix == prefix)).one()
        s.execute(delete(DashboardSession).where(DashboardSession.expires_at < now))
        s.add(DashboardSession(token_hash=_hash(token), tenant_id=tenant_id, api_key_id=key.id,
                               csrf_token=csrf, expires_at=now + timedelta(hours=SESSION_HOURS)))
        name = s.get(Tenant, tenant_id).name
    return token, Session(tenant_id, name, csrf)


def session_of(db: Database, request: Request) -> Session:
    """The request's session; SignInRequired when it has none (or it expired, or its key was
    revoked)."""
    token = request.cookies.get(SESSION_COOKIE)
    if not token:
        raise SignInRequired()
    with db.read() as s:
        row = s.execute(select(DashboardSession, ApiKey.revoked_at, Tenant.name)
                        .join(ApiKey, ApiKey.id == DashboardSession.api_key_id)
                        .join(Tenant, Tenant.id == DashboardSession.tenant_id)
                        .where(DashboardSession.token_hash == _hash(token))).first()
    if row is None:
        raise SignInRequired()
    session, revoked, name = row
    if revoked is not None or session.expires_at < utcnow():
        raise SignInRequired()
    return Session(session.tenant_id, name, session.csrf_token)


def sign_out(db: Database, request: Request) -> None:
    token = request.cookies.get(SESSION_COOKIE)
    if token:
        with db.write() as s:
            s.execute(delete(DashboardSession).where(DashboardSession.token_hash == _hash(token)))


async def read_form(request: Request) -> dict[str, str]:
    """An application/x-www-form-urlencoded body (bounded), first value per field."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise CsrfError("form too large")
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {k: v[0] for k, v in fields.items()}


def check_csrf(session: Session, request: Request, form: dict[str, str] | None = None) -> None:
    sent = request.headers.get("x-csrf-token") or (form or {}).get("csrf", "")
    if not sent or not hmac.compare_digest(sent, session.csrf):
        raise CsrfError("missing or wrong CSRF token")


def check_signin_csrf(request: Request, form: dict[str, str]) -> None:
    cookie, sent = request.cookies.get(SIGNIN_CSRF_COOKIE, ""), form.get("csrf", "")
    if not cookie or not sent or not hmac.compare_digest(cookie, sent):
        raise CsrfError("missing or wrong CSRF token")


def new_signin_csrf() -> str:
    return secrets.token_urlsafe(32)
