"""An adb device (a phone, over TCP or USB) as a device, through adb-shell, unmodified.

adb-shell is synchronous, so every call runs in this backend's own single worker thread (which
also keeps one device's traffic in order). Commands go to the `shell:` service as one command line
built by `command_line`; files go through the `sync:` service (SEND/DATA/DONE) to a temporary name
and are renamed into place with `mv`.

The legacy `shell:` service that adb-shell speaks reports no exit status and mixes stderr into
stdout, so Kiln wraps each command in a small script of its own:

- short commands (timeout <= DIRECT_MAX_S) run in the foreground with stderr sent to a file; the
  wrapper then prints a random marker with `$?` and the stderr file;
- longer ones (a runner measuring a big model) start in the background on the device writing
  stdout, stderr, pid and exit status into a job folder, and the agent polls it with short
  commands. No adb stream is then left open for minutes, so a device that vanishes mid-run is
  noticed at the next poll, and a run past its timeout is killed on the device (`kill -9`).

Any transport failure (connection refused, reset or silent, bad packets) closes the connection and
raises DeviceLostError; the next call reconnects.
"""
from __future__ import annotations

import asyncio
import contextlib
import secrets
import stat
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from adb_shell import exceptions as adb_errors
from adb_shell.adb_device import AdbDevice, AdbDeviceTcp, AdbDeviceUsb

from device_agents.backends import (
    CommandTimeout,
    DeviceBackend,
    DeviceError,
    DeviceLostError,
    command_line,
)

DIRECT_MAX_S = 60.0
MAX_OUTPUT_BYTES = 16 << 20  # per stream of one command
POLL_MIN_S, POLL_MAX_S = 0.02, 0.5
TRANSPORT_ERRORS = (OSError, adb_errors.AdbConnectionError, adb_errors.AdbTimeoutError,
                    adb_errors.TcpTimeoutException, adb_errors.InvalidChecksumError,
                    adb_errors.InvalidCommandError, adb_errors.InvalidResponseError,
                    adb_errors.UsbReadFailedError, adb_errors.UsbWriteFailedError,
                    adb_errors.UsbDeviceNotFoundError, struct.error)
T = TypeVar("T")


def load_signer(key_path: str | Path, create: bool = True):
    """adb-shell's signer for the private key at `key_path` (with `key_path`.pub next to it).

    A missing key pair is generated when `create` is set (as `adb` does on first use); the device
    then asks its user once to allow this computer.
    """
    from adb_shell.auth.keygen import keygen
    from adb_shell.auth.sign_cryptography import CryptographySigner

    path = Path(key_path).expanduser()
    if not path.is_file() or not Path(f"{path}.pub").is_file():
        if not create:
            raise DeviceError(f"adb key {path} (and {path}.pub) not found")
        path.parent.mkdir(parents=True, exist_ok=True)
        keygen(str(path))
        path.chmod(0o600)
    return CryptographySigner(str(path))


class AdbBackend(DeviceBackend):
    transport = "adb"

    def __init__(self, device_factory: Callable[[], AdbDevice], signer: Any, name: str,
                 work_dir: str = "/data/local/tmp/kiln", io_timeout: float = 10.0,
                 auth_timeout: float = 30.0, direct_max_s: float = DIRECT_MAX_S):
        self.name = name
        self.direct_max_s = direct_max_s
        self.work_dir = work_dir
        self._factory = device_factory
        self._signer = signer
        self.io_timeout = io_timeout
        self.auth_timeout = auth_timeout
        self._device: AdbDevice | None = None
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def tcp(cls, host: str, port: int, signer: Any, name: str | None = None,
            **kwargs: Any) -> AdbBackend:
        io_timeout = kwargs.get("io_timeout", 10.0)
        return cls(lambda: AdbDeviceTcp(host, port, default_transport_timeout_s=io_timeout),
                   signer, name or f"adb:{host}:{port}", **kwargs)

    @classmethod
    def usb(cls, serial: str, signer: Any, name: str | None = None,
            **kwargs: Any) -> AdbBackend:
        io_timeout = kwargs.get("io_timeout", 10.0)
        return cls(lambda: AdbDeviceUsb(serial=serial, default_transport_timeout_s=io_timeout),
                   signer, name or f"adb-usb:{serial}", **kwargs)

    # --- the worker thread -------------------------------------------------------------------
    def _connected(self) -> AdbDevice:
        if self._device is None or not self._device.available:
            device = self._factory()
            try:
                ok = device.connect(rsa_keys=[self._signer], auth_timeout_s=self.auth_timeout,
                                    read_timeout_s=self.io_timeout)
            except adb_errors.DeviceAuthError as exc:
                device.close()
                raise DeviceError(f"{self.name}: the device refused this agent's adb key; allow "
                                  f"it on the device ({exc})") from exc
            except TRANSPORT_ERRORS as exc:
                device.close()
                raise DeviceLostError(f"{self.name}: cannot connect (or the device did not "
                                      f"allow this agent's adb key within {self.auth_timeout:g} "
                                      f"s): {type(exc).__name__}: {exc}") from exc
            except BaseException:
                device.close()
                raise
            if not ok:
                device.close()
                raise DeviceLostError(f"{self.name}: the adb connection was not accepted")
            self._device = device
        return self._device

    def _drop(self) -> None:
        device, self._device = self._device, None
        if device is not None:
            with contextlib.suppress(Exception):  # closing a broken connection
                device.close()

    async def _call(self, what: str, fn: Callable[[AdbDevice], T]) -> T:
        def work() -> T:
            try:
                return fn(self._connected())
            except DeviceError:
                self._drop()
                raise
            except TRANSPORT_ERRORS as exc:
                self._drop()
                raise DeviceLostError(f"{self.name}: adb connection lost while {what}: "
                                      f"{type(exc).__name__}: {exc}") from exc
            except adb_errors.AdbCommandFailureException as exc:
                raise DeviceError(f"{self.name}: {what} failed: {exc}") from exc

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-adb")
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def _shell(self, line: str, timeout: float, what: str) -> str:
        def shell(device: AdbDevice) -> str:
            out = device.shell(line, transport_timeout_s=self.io_timeout,
                               read_timeout_s=timeout + self.io_timeout,
                               timeout_s=timeout + self.io_timeout, decode=False)
            return out.decode(errors="replace") if isinstance(out, bytes) else out

        return await self._call(what, shell)

    # --- DeviceBackend ---------------------------------------------------------------------
    async def run(self, argv: list[str], timeout: float) -> tuple[int, str, str]:
        line = command_line(argv)
        if timeout <= self.direct_max_s:
            return await self._run_direct(line, argv[0], timeout)
        return await self._run_job(line, argv[0], timeout)

    async def _run_direct(self, line: str, program: str, timeout: float) -> tuple[int, str, str]:
        token = secrets.token_hex(8)
        marker = f"KILN-EXIT-{token}"
        err = command_line([f"{self.work_dir}/.stderr-{token}"])
        script = (f"mkdir -p {command_line([self.work_dir])} 2>/dev/null; {line} 2>{err}; "
                  f"printf '\\n{marker} %d\\n' $?; cat {err} 2>/dev/null; rm -f {err}")
        text = await self._shell(script, timeout, f"running {program}")
        at = text.rfind(f"\n{marker} ")
        if at < 0:
            raise DeviceError(f"{self.name}: {program} did not finish (no exit status)")
        status_line, _, stderr = text[at + 1:].partition("\n")
        try:
            code = int(status_line.split()[1])
        except (IndexError, ValueError):
            raise DeviceError(f"{self.name}: unreadable exit status from {program}") from None
        return code, text[:at], stderr

    async def _run_job(self, line: str, program: str, timeout: float) -> tuple[int, str, str]:
        job = f"{self.work_dir}/.jobs/{secrets.token_hex(8)}"
        q = {name: command_line([f"{job}/{name}"]) for name in ("out", "err", "pid", "st", "status")}
        launch = (f"mkdir -p {command_line([job])} || exit 1; "
                  f"( {line} >{q['out']} 2>{q['err']} </dev/null & echo $! >{q['pid']}; wait $!; "
                  f"echo $? >{q['st']}; mv {q['st']} {q['status']} ) >/dev/null 2>&1 </dev/null & "
                  f"echo kiln-launched")
        if "kiln-launched" not in await self._shell(launch, self.io_timeout, f"starting {program}"):
            raise DeviceError(f"{self.name}: could not start {program} on the device")
        deadline = time.monotonic() + timeout
        pause = POLL_MIN_S
        while True:
            status = (await self._shell(f"cat {q['status']} 2>/dev/null", self.io_timeout,
                                        f"waiting for {program}")).strip()
            if status.isdigit():
                break
            if time.monotonic() > deadline:
                await self._shell(f"kill -9 $(cat {q['pid']}) 2>/dev/null; rm -rf "
                                  f"{command_line([job])}", self.io_timeout, f"stopping {program}")
                raise CommandTimeout(f"{self.name}: {program} ran past its {timeout:g} s timeout "
                                     f"and was killed")
            await asyncio.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
        marker = f"KILN-STDERR-{secrets.token_hex(8)}"
        text = await self._shell(
            f"head -c {MAX_OUTPUT_BYTES} {q['out']}; printf '\\n{marker}\\n'; "
            f"head -c {MAX_OUTPUT_BYTES} {q['err']}; rm -rf {command_line([job])}",
            self.io_timeout + 60, f"reading the output of {program}")
        at = text.rfind(f"\n{marker}\n")
        if at < 0:
            raise DeviceError(f"{self.name}: could not read the output of {program}")
        return int(status), text[:at], text[at + len(marker) + 2:]

    async def push(self, local_path: str, remote_path: str, mode: int = 0o644) -> None:
        folder = remote_path.rsplit("/", 1)[0] or "/"
        tmp = f"{remote_path}.{secrets.token_hex(6)}.part"
        code, _, err = await self.run(["mkdir", "-p", folder], self.io_timeout)
        if code != 0:
            raise DeviceError(f"{self.name}: cannot create {folder}: {err.strip()}")
        size = Path(local_path).stat().st_size
        await self._call(f"pushing {remote_path}", lambda device: device.push(
            str(local_path), tmp, st_mode=stat.S_IFREG | (mode & 0o7777),
            transport_timeout_s=self.io_timeout,
            read_timeout_s=self.io_timeout + size / (1 << 20)))
        code, _, err = await self.run(["mv", "-f", tmp, remote_path], self.io_timeout)
        if code != 0:
            await self.run(["rm", "-f", tmp], self.io_timeout)
            raise DeviceError(f"{self.name}: cannot move {tmp} to {remote_path}: {err.strip()}")

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(executor, self._drop)
            finally:
                executor.shutdown(wait=False)
