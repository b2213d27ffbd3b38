"""The agent's side of the HTTP contract in device_agents.protocol (httpx, async)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from device_agents import protocol as p
from kiln.files import temporary_beside

M = TypeVar("M", bound=BaseModel)
MAX_ARTIFACT_BYTES = 4 << 30


class ServiceError(Exception):
    """The service refused a request or could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class AuthError(ServiceError):
    """The service rejected the agent's token (401/403)."""


class ServiceClient:
    def __init__(self, base_url: str, token: str, timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.base = httpx.URL(base_url.rstrip("/") + "/")
        self._http = httpx.AsyncClient(
            base_url=self.base, timeout=timeout, transport=transport, follow_redirects=False,
            headers={"Authorization": f"Bearer {token}", "User-Agent": "kiln-agent"})

    async def _post(self, path: str, body: BaseModel, reply: type[M]) -> M:
        try:
            response = await self._http.post(path, content=body.model_dump_json(),
                                             headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            raise ServiceError(f"POST {path}: {type(exc).__name__}: {exc}") from exc
        _check(response, f"POST {path}")
        try:
            return reply.model_validate_json(response.content)
        except ValidationError as exc:
            raise ServiceError(f"POST {path}: unexpected reply: {exc.errors()[0]['msg']}",
                               response.status_code) from None

    async def register(self, body: p.DeviceRegistration) -> p.DeviceRegistered:
        return await self._post(p.REGISTER_PATH, body, p.DeviceRegistered)

    async def heartbeat(self, body: p.Heartbeat) -> p.HeartbeatReply:
        return await self._post(p.HEARTBEAT_PATH, body, p.HeartbeatReply)

    async def claim(self, body: p.ClaimRequest) -> p.ClaimReply:
        return await self._post(p.CLAIM_PATH, body, p.ClaimReply)

    async def results(self, body: p.ResultUpload) -> p.ResultAck:
        return await self._post(p.RESULTS_PATH, body, p.ResultAck)

    async def release(self, body: p.ReleaseRequest) -> p.ReleaseReply:
        return await self._post(p.RELEASE_PATH, body, p.ReleaseReply)

    def artifact_url(self, url: str) -> httpx.URL:
        """`url` resolved against the service; refused unless it is on the service's origin."""
        resolved = self.base.join(url)
        if (resolved.scheme, resolved.host, resolved.port) != (self.base.scheme, self.base.host,
                                                               self.base.port):
            raise ServiceError(f"artifact URL {url!r} is not on the service ({self.base}); the "
                               f"agent sends its token to the service only")
        return resolved

    async def download(self, url: str, dest: Path, sha256: str | None = None,
                       max_bytes: int = MAX_ARTIFACT_BYTES) -> Path:
        """Stream the artifact at `url` to `dest` (atomically), checking size and hash."""
        target = self.artifact_url(url)
        digest, size = hashlib.sha256(), 0
        with temporary_beside(dest) as tmp:
            try:
                with open(tmp, "wb") as out:
                    async with self._http.stream("GET", target) as response:
                        if response.status_code >= 400:
                            await response.aread()
                        _check(response, f"GET {url}")
                        async for chunk in response.aiter_bytes(1 << 20):
                            size += len(chunk)
                            if size > max_bytes:
                                raise ServiceError(f"GET {url}: the artifact exceeds {max_bytes} "
                                                   f"bytes")
                            digest.update(chunk)
                            out.write(chunk)
            except httpx.HTTPError as exc:
                raise ServiceError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
            if sha256 is not None and digest.hexdigest() != sha256:
                raise ServiceError(f"GET {url}: the artifact's sha256 is {digest.hexdigest()}, "
                                   f"expected {sha256}")
            os.replace(tmp, dest)
        return dest

    async def close(self) -> None:
        await self._http.aclose()


def _check(response: httpx.Response, what: str) -> None:
    if response.status_code < 400:
        return
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        detail = response.text
    message = f"{what}: HTTP {response.status_code}: {str(detail)[:500]}"
    if response.status_code in (401, 403):
        raise AuthError(message, response.status_code)
    raise ServiceError(message, response.status_code)
