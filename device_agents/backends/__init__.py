"""Device backends: one async interface over the local machine, ssh hosts and adb devices.

    backend = LocalBackend(work_dir) | SshBackend(...) | AdbBackend(...)
    facts = await backend.facts()
    await backend.push("weights.bin", f"{backend.work_dir}/b/weights.bin")
    code, out, err = await backend.run(["/path/kiln-runner", "-n", "10", ...], timeout=60)
    await backend.sha256(path) -> hex or None (computed on the device; sha256_many for several)
    await backend.remove(path);  await backend.close()

Commands are argv lists of Kiln's own values (paths Kiln chose, numbers, fixed flags); a backend
that goes through a shell joins them with `command_line` (shlex.quote per argument), so what
arrives on the device is exactly that argv and nothing else runs. A device that stops answering
raises `DeviceLostError`; a command that overruns its timeout raises `CommandTimeout` (the device
itself still answers).
"""
from __future__ import annotations

import abc
import re
import shlex
from collections.abc import Sequence

from device_agents.facts import HardwareFacts, Transport, collect_facts

HEX64 = re.compile(r"[0-9a-f]{64}")
# One output line per file, in order: its sha256sum line, or "-" when it cannot be hashed.
SHA256_SCRIPT = ('for f in "$@"; do sha256sum "$f" 2>/dev/null || toybox sha256sum "$f" '
                 '2>/dev/null || echo -; done')


class DeviceError(Exception):
    """A device operation failed; the message names the device and what failed."""


class DeviceLostError(DeviceError):
    """The device stopped answering (disconnected, powered off, its server died)."""


class CommandTimeout(DeviceError):
    """A command ran past its timeout on a device that still answers; it was stopped."""


def command_line(argv: Sequence[str]) -> str:
    """`argv` as one POSIX shell command line: every argument quoted with shlex.quote."""
    if isinstance(argv, str) or not argv:
        raise ValueError("a command is a non-empty list of arguments, not a string")
    for arg in argv:
        if not isinstance(arg, str):
            raise TypeError(f"command arguments must be strings, got {type(arg).__name__}")
        if "\0" in arg:
            raise ValueError("a command argument contains a NUL byte")
    return " ".join(shlex.quote(a) for a in argv)


def parse_sha256sum(stdout: str) -> str | None:
    """The digest `sha256sum PATH` (coreutils or toybox) printed, or None."""
    first = stdout.strip().split(maxsplit=1)[0] if stdout.strip() else ""
    first = first.lstrip("\\").lower()  # coreutils escapes names with backslashes this way
    return first if HEX64.fullmatch(first) else None


class DeviceBackend(abc.ABC):
    """Access to one device. Implementations are async; one operation at a time per device."""

    transport: Transport
    name: str
    work_dir: str  # a folder on the device that belongs to the agent

    async def facts(self) -> HardwareFacts:
        """Hardware facts read from the device itself (see device_agents.facts)."""
        return await collect_facts(self.run, self.transport)

    @abc.abstractmethod
    async def push(self, local_path: str, remote_path: str, mode: int = 0o644) -> None:
        """Copy a local file to `remote_path` (parents created; replaced atomically)."""

    @abc.abstractmethod
    async def run(self, argv: list[str], timeout: float) -> tuple[int, str, str]:
        """Run `argv` on the device: (exit status, stdout, stderr)."""

    async def sha256(self, remote_path: str) -> str | None:
        """The SHA-256 of a file on the device, computed there; None when it does not exist."""
        return (await self.sha256_many([remote_path]))[remote_path]

    async def sha256_many(self, remote_paths: Sequence[str]) -> dict[str, str | None]:
        """`sha256` of several files in one command (toybox's sha256sum where there is no other)."""
        paths = list(dict.fromkeys(remote_paths))
        if any("\n" in p for p in paths):
            raise ValueError("remote paths must not contain newlines")
        code, out, err = await self.run(["sh", "-c", SHA256_SCRIPT, "kiln", *paths], 120)
        lines = out.splitlines()
        if code != 0 or len(lines) != len(paths):
            raise DeviceError(f"{self.name}: cannot hash files on the device (exit status "
                              f"{code}): {err.strip()[:300]}")
        return {p: parse_sha256sum(line) for p, line in zip(paths, lines)}

    async def remove(self, remote_path: str) -> None:
        """Delete a file or folder on the device (no error when it does not exist)."""
        code, _, err = await self.run(["rm", "-rf", "--", remote_path], 60)
        if code != 0:
            raise DeviceError(f"{self.name}: cannot remove {remote_path}: {err.strip()}")

    async def alive(self, timeout: float = 10.0) -> bool:
        """Whether the device answers a trivial command."""
        try:
            code, out, _ = await self.run(["echo", "kiln-alive"], timeout)
        except DeviceError:
            return False
        return code == 0 and "kiln-alive" in out

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the connection (idempotent)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
