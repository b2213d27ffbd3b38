"""An ssh host as a device (asyncssh): commands over exec channels, files over SFTP.

Host keys are checked explicitly: `known_hosts` names an OpenSSH known_hosts file that must hold
the host's key; skipping the check takes `accept_unknown_host_key=True` in so many words. The
connection sends keepalives, so a host that vanishes is noticed within
`keepalive_interval * keepalive_count_max` seconds even while a command runs.
"""
from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
import signal
import time
from pathlib import Path

import asyncssh

from device_agents.backends import (
    CommandTimeout,
    DeviceBackend,
    DeviceError,
    DeviceLostError,
    command_line,
)

GRACE_S = 5.0
DEADLINE_SCRIPT = ('t=$1; shift; if command -v timeout >/dev/null 2>&1; then '
                   'exec timeout -s KILL "$t" "$@"; fi; exec "$@"')
LOST = (asyncssh.ConnectionLost, asyncssh.DisconnectError, asyncssh.ChannelOpenError,
        ConnectionError, OSError, EOFError)


class SshBackend(DeviceBackend):
    transport = "ssh"

    def __init__(self, host: str, user: str, key: str | Path, *, port: int = 22,
                 known_hosts: str | Path | None = None, accept_unknown_host_key: bool = False,
                 work_dir: str = "kiln-agent", name: str | None = None,
                 connect_timeout: float = 15.0, keepalive_interval: float = 5.0,
                 keepalive_count_max: int = 3):
        if known_hosts is None and not accept_unknown_host_key:
            raise ValueError(f"ssh {host}: give known_hosts (a file holding the host's key), or "
                             f"set accept_unknown_host_key to skip the host key check")
        self.host, self.port, self.user = host, port, user
        self.key = Path(key).expanduser()
        self.known_hosts = str(Path(known_hosts).expanduser()) if known_hosts else None
        self.name = name or f"ssh:{user}@{host}:{port}"
        self.work_dir = work_dir
        self.connect_timeout = connect_timeout
        self.keepalive = (keepalive_interval, keepalive_count_max)
        self._conn: asyncssh.SSHClientConnection | None = None

    async def connect(self) -> None:
        if self._conn is not None:
            return
        try:
            self._conn = await asyncssh.connect(
                self.host, port=self.port, username=self.user, client_keys=[str(self.key)],
                known_hosts=self.known_hosts, agent_path=None, config=None,
                connect_timeout=self.connect_timeout, keepalive_interval=self.keepalive[0],
                keepalive_count_max=self.keepalive[1])
        except asyncssh.HostKeyNotVerifiable as exc:
            raise DeviceError(f"{self.name}: the host key is not in {self.known_hosts}: "
                              f"{exc}") from exc
        except asyncssh.PermissionDenied as exc:
            raise DeviceError(f"{self.name}: authentication as {self.user!r} with {self.key} "
                              f"was refused") from exc
        except (TimeoutError, *LOST) as exc:
            raise DeviceLostError(f"{self.name}: cannot connect: {exc}") from exc

    async def _connection(self) -> asyncssh.SSHClientConnection:
        await self.connect()
        assert self._conn is not None
        return self._conn

    async def run(self, argv: list[str], timeout: float) -> tuple[int, str, str]:
        # The host enforces the timeout itself with coreutils' `timeout` when it has one: sshd
        # does not pass signals to root's sessions, and a closed channel does not stop a process.
        line = command_line(["sh", "-c", DEADLINE_SCRIPT, "kiln", f"{timeout:.3f}", *argv])
        conn = await self._connection()
        start = time.monotonic()
        try:
            process = await conn.create_process(line, encoding=None)
            try:
                done = await asyncio.wait_for(process.wait(check=False), timeout + GRACE_S)
            except TimeoutError:
                with contextlib.suppress(Exception):
                    process.send_signal("KILL")  # honoured for non-root users (OpenSSH >= 7.9)
                process.close()
                raise CommandTimeout(f"{self.name}: {argv[0]} ran past its {timeout:g} s "
                                     f"timeout and was stopped") from None
        except LOST as exc:
            await self._drop()
            raise DeviceLostError(f"{self.name}: connection lost while running {argv[0]}: "
                                  f"{exc or type(exc).__name__}") from exc
        killed = done.exit_status in (137, -1) or done.exit_signal is not None
        if killed and time.monotonic() - start >= timeout:
            raise CommandTimeout(f"{self.name}: {argv[0]} ran past its {timeout:g} s timeout "
                                 f"and was killed")
        if done.exit_signal is not None:
            name = str(done.exit_signal[0])
            number = getattr(signal.Signals, f"SIG{name}", None)
            return (128 + int(number) if number else 255, _text(done.stdout),
                    _text(done.stderr) + f"\nkilled by signal {name}")
        if done.exit_status is None or done.exit_status < 0:  # closed without an exit status
            await self._drop()
            if not await self.alive():
                raise DeviceLostError(f"{self.name}: connection lost while running {argv[0]}")
            raise DeviceError(f"{self.name}: {argv[0]} ended without an exit status")
        return done.exit_status, _text(done.stdout), _text(done.stderr)

    async def push(self, local_path: str, remote_path: str, mode: int = 0o644) -> None:
        conn = await self._connection()
        folder = posixpath.dirname(remote_path) or "."
        tmp = posixpath.join(folder, f".{posixpath.basename(remote_path)}.{secrets.token_hex(6)}.part")
        try:
            async with conn.start_sftp_client() as sftp:
                await sftp.makedirs(folder, exist_ok=True)
                try:
                    await sftp.put(str(local_path), tmp)
                    await sftp.chmod(tmp, mode)
                    await sftp.posix_rename(tmp, remote_path)
                except BaseException:
                    try:
                        await sftp.remove(tmp)
                    except (asyncssh.SFTPError, *LOST):
                        pass
                    raise
        except asyncssh.SFTPError as exc:
            raise DeviceError(f"{self.name}: cannot push {local_path} to {remote_path}: "
                              f"{exc.reason}") from exc
        except LOST as exc:
            await self._drop()
            raise DeviceLostError(f"{self.name}: connection lost while pushing "
                                  f"{remote_path}: {exc}") from exc

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            try:
                await asyncio.wait_for(conn.wait_closed(), 5)
            except (TimeoutError, *LOST):
                pass


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data
