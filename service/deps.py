"""FastAPI dependencies: the process's settings, database and storage, the caller's tenant, and
the paging parameters of list routes."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from service.db import Database
from service.problems import APIError
from service.settings import Settings
from service.storage import Storage
from service.limits.service import take_token, too_many_requests
from service.tenants.service import tenant_for_key

_bearer = HTTPBearer(auto_error=False, description="an API key: `Authorization: Bearer kiln_…`")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="an API key")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_db(request: Request) -> Database:
    return request.app.state.db


def get_storage(request: Request) -> Storage:
    return request.app.state.storage


def current_tenant(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    header: Annotated[str | None, Depends(_header)],
) -> str:
    """The id of the tenant whose API key came with the request; 401 otherwise."""
    key = bearer.credentials if bearer else header
    challenge = {"WWW-Authenticate": 'Bearer realm="kiln"'}
    if not key:
        raise APIError(401, "Unauthorized", "missing API key: send `Authorization: Bearer <key>` "
                       "or `X-API-Key: <key>`", headers=challenge)
    tenant = tenant_for_key(request.app.state.db, key)
    if tenant is None:
        raise APIError(401, "Unauthorized", "invalid or revoked API key", headers=challenge)
    return tenant


Tenant = Annotated[str, Depends(current_tenant)]


def rate_limited(request: Request, tenant: Tenant) -> None:
    """Take a token from the caller's tenant's bucket; 429 with Retry-After when it is empty."""
    settings: Settings = request.app.state.settings
    if settings.rate_limit_per_second > 0:
        wait = take_token(request.app.state.db, tenant, settings.rate_limit_per_second,
                          settings.rate_limit_burst)
        if wait > 0:
            raise too_many_requests(settings.rate_limit_per_second, settings.rate_limit_burst,
                                    wait)


DB = Annotated[Database, Depends(get_db)]
Store = Annotated[Storage, Depends(get_storage)]
Config = Annotated[Settings, Depends(get_settings)]

MAX_OFFSET = 2**63 - 1  # a SQL OFFSET is a signed 64-bit integer on every database
Limit = Annotated[int, Query(ge=1, le=1000, description="at most this many items")]
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET, description="skip this many items first")]
