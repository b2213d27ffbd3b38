"""The local machine as a device: subprocesses (no shell) working in a private folder."""
from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path

from device_agents.backends import CommandTimeout, DeviceBackend, DeviceError
from kiln.files import temporary_beside


class LocalBackend(DeviceBackend):
    transport = "local"

    def __init__(self, work_dir: str | Path, name: str = "local"):
        self.name = name
        folder = Path(work_dir).expanduser().resolve()
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.work_dir = str(folder)

    async def push(self, local_path: str, remote_path: str, mode: int = 0o644) -> None:
        dest = Path(remote_path)
        try:
            with temporary_beside(dest) as tmp:
                await asyncio.to_thread(shutil.copyfile, local_path, tmp)
                os.chmod(tmp, mode)
                os.replace(tmp, dest)
        except OSError as exc:
            raise DeviceError(f"{self.name}: cannot copy {local_path} to {dest}: {exc}") from exc

    async def run(self, argv: list[str], timeout: float) -> tuple[int, str, str]:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=self.work_dir, start_new_session=True)
        except FileNotFoundError:
            return 127, "", f"{argv[0]}: not found"
        except OSError as exc:
            return 126, "", f"{argv[0]}: {exc}"
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            _kill_group(proc.pid)
            await proc.wait()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise CommandTimeout(f"{self.name}: {argv[0]} ran past its {timeout:g} s timeout "
                                 f"and was killed") from None
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    async def sha256_many(self, remote_paths: Sequence[str]) -> dict[str, str | None]:
        def digest(path: str) -> str | None:
            sha = hashlib.sha256()
            try:
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        sha.update(chunk)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None
            return sha.hexdigest()

        return await asyncio.to_thread(lambda: {p: digest(p) for p in remote_paths})

    async def remove(self, remote_path: str) -> None:
        path = Path(remote_path)
        if path.is_dir() and not path.is_symlink():
            await asyncio.to_thread(shutil.rmtree, path, True)
        else:
            path.unlink(missing_ok=True)

    async def close(self) -> None:
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
