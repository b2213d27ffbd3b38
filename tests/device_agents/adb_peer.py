"""A stand-in Android phone for the adb backend's tests: a server that speaks the ADB wire protocol.

No Android device or adbd exists here, so this peer plays one on a loopback TCP port:

- transport: 24-byte message headers (command, arg0, arg1, length, checksum, magic) and payloads;
  CNXN handshake; AUTH with a token the client signs (RSA PKCS#1 v1.5 over the 20-byte token, as
  adbd verifies it), public keys sent with AUTH RSAPUBLICKEY accepted like a user tapping "allow"
  (`accept_new_keys`) and remembered; OPEN / OKAY / WRTE / CLSE streams with adb's flow control
  (one WRTE in flight per stream until the other side's OKAY);
- `shell:COMMAND`: runs `/bin/sh -c COMMAND` in the phone's folder, stdout and stderr mixed like
  adbd's legacy raw shell, no exit status. Its PATH holds only a few tools plus `getprop` (the
  phone's properties), `uname` (an Android kernel on aarch64) and a `cat` that shows the phone's
  /proc and /sys files instead of this machine's. Executables that are aarch64 ELF files run under
  `qemu-aarch64 -L /usr/aarch64-linux-gnu` through an LD_PRELOAD shim (qemu_exec_shim.c);
- `sync:`: SEND/DATA/DONE (push; parents created like adbd does, paths confined to the phone's
  folder), STAT, RECV (pull) and QUIT.

Test hooks: `commands` (every shell command received), `auth_log`, `vanish()` (the phone disappears: the port
closes and every connection is reset, as when a cable is pulled), `revive()`, `vanish_when` (vanish instead of
running a matching shell command), `corrupt_pushes` (flip one byte of every pushed file).

The peer runs its own event loop in a thread, so blocking adb-shell calls can be made from tests.
It is a test double for a device, not a security sandbox: shell commands run on this machine.
"""
from __future__ import annotations

import asyncio
import base64
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa, utils

HEADER = struct.Struct("<6I")
VERSION = 0x01000000
MAX_PAYLOAD = 256 * 1024
AUTH_TOKEN, AUTH_SIGNATURE, AUTH_RSAPUBLICKEY = 1, 2, 3
CHUNK = 64 * 1024
TOOLS = ("sh", "mkdir", "rm", "mv", "cp", "chmod", "sha256sum", "printf", "echo", "sleep",
         "head", "tail", "ls", "touch", "id", "wc", "env", "stat", "true", "false", "kill")
QEMU_SYSROOT = "/usr/aarch64-linux-gnu"
SHIM_SOURCE = Path(__file__).with_name("qemu_exec_shim.c")


def wire(name: bytes) -> int:
    return struct.unpack("<I", name)[0]


CNXN, AUTH, OPEN, OKAY, WRTE, CLSE = (wire(n) for n in (b"CNXN", b"AUTH", b"OPEN", b"OKAY",
                                                        b"WRTE", b"CLSE"))


def android_public_key(text: bytes) -> rsa.RSAPublicKey:
    """Android's base64 RSAPublicKey struct (what AUTH RSAPUBLICKEY and adbkey.pub hold)."""
    blob = base64.b64decode(text.split(b"\0")[0].split()[0])
    words, _n0inv, modulus, _rr, exponent = struct.unpack("<LL256s256sL", blob)
    if words != 64:
        raise ValueError("not a 2048-bit Android RSA public key")
    return rsa.RSAPublicNumbers(exponent, int.from_bytes(modulus, "little")).public_key()


def build_shim(folder: Path) -> Path:
    """Compile qemu_exec_shim.c into `folder`/qemu_exec_shim.so."""
    out = folder / "qemu_exec_shim.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(out), str(SHIM_SOURCE), "-ldl"],
                   check=True, capture_output=True)
    return out


@dataclass
class Phone:
    """What the stand-in phone reports about itself."""

    props: dict[str, str]
    files: dict[str, str]  # absolute /proc and /sys paths -> contents
    uname_release: str = "5.15.123-android14-11-gd9b1a5e5c1a2"
    uname_version: str = "#1 SMP PREEMPT Mon Jan 15 12:00:00 UTC 2024"


@dataclass
class _Stream:
    local_id: int
    remote_id: int
    kind: str
    can_write: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    sent_close: bool = False
    buffer: bytearray = field(default_factory=bytearray)
    task: asyncio.Task | None = None
    process: asyncio.subprocess.Process | None = None
    upload: dict | None = None
    incoming: asyncio.Queue = field(default_factory=asyncio.Queue)


class AdbPeer:
    def __init__(self, root: Path, phone: Phone, shim: Path, *, require_auth: bool = True,
                 accept_new_keys: bool = True, qemu: str | None = None):
        self.root = Path(root).resolve()
        self.phone = phone
        self.shim = shim
        self.require_auth = require_auth
        self.accept_new_keys = accept_new_keys
        self.qemu = qemu or shutil.which("qemu-aarch64") or "qemu-aarch64"
        self.authorized: list[rsa.RSAPublicKey] = []
        self.commands: list[str] = []
        self.auth_log: list[str] = []  # how each connection got in: none, signature, new-key
        self.vanish_when: Callable[[str], bool] | None = None
        self.corrupt_pushes = False
        self.vanished = threading.Event()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="adb-peer", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._prepare()

    # --- the phone's file system ---------------------------------------------------------------
    @property
    def data_dir(self) -> Path:
        """The phone's /data/local/tmp (where agents keep their files)."""
        return self.root / "data" / "local" / "tmp"

    def _prepare(self) -> None:
        bin_dir = self.root / "system" / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            found = shutil.which(tool)
            if found and not (bin_dir / tool).exists():
                (bin_dir / tool).symlink_to(found)
        fake = self.root / "fake"
        for path, text in self.phone.files.items():
            target = fake / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        props = "".join(f"[{k}]: [{v}]\n" for k, v in sorted(self.phone.props.items()))
        (self.root / "props.txt").write_text(props)
        scripts = {
            "getprop": f"""#!/bin/sh
if [ $# -eq 0 ]; then exec /bin/cat {self.root}/props.txt; fi
/bin/sed -n "s/^\\[$1\\]: \\[\\(.*\\)\\]$/\\1/p" {self.root}/props.txt
""",
            "uname": f"""#!/bin/sh
case "$1" in
  -a) echo "Linux localhost {self.phone.uname_release} {self.phone.uname_version} aarch64 Toybox" ;;
  -m) echo aarch64 ;;
  -r) echo "{self.phone.uname_release}" ;;
  *) echo Linux ;;
esac
""",
            "cat": f"""#!/bin/sh
[ $# -eq 0 ] && exec /bin/cat
status=0
for a in "$@"; do
  case "$a" in
    /proc/*|/sys/*)
      if [ -f "{fake}$a" ]; then /bin/cat -- "{fake}$a" || status=1
      else echo "cat: $a: No such file or directory" >&2; status=1; fi ;;
    *) /bin/cat -- "$a" || status=1 ;;
  esac
done
exit $status
""",
        }
        for name, text in scripts.items():
            path = bin_dir / name
            if path.is_symlink():
                path.unlink()
            path.write_text(text)
            path.chmod(0o755)

    def shell_env(self) -> dict[str, str]:
        return {"PATH": str(self.root / "system" / "bin"), "HOME": str(self.data_dir),
                "TMPDIR": str(self.data_dir), "LD_PRELOAD": str(self.shim),
                "KILN_PEER_QEMU": self.qemu, "KILN_PEER_SYSROOT": QEMU_SYSROOT,
                "ANDROID_DATA": "/data", "LANG": "C.UTF-8"}

    def confined(self, path: str) -> Path | None:
        resolved = Path(os.path.normpath(path))
        if not resolved.is_absolute():
            resolved = self.root / resolved
        return resolved if resolved == self.root or self.root in resolved.parents else None

    # --- lifetime ------------------------------------------------------------------------------
    def start(self) -> int:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self.port

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def vanish(self) -> None:
        """The phone disappears: the port closes and every connection is reset."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._vanish(), self._loop).result(10)

    def revive(self) -> None:
        """The phone comes back on the same port."""
        asyncio.run_coroutine_threadsafe(self._revive(), self._loop).result(10)

    async def _revive(self) -> None:
        self.vanished.clear()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _vanish(self) -> None:
        self.vanished.set()
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.reset()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.vanish()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.vanished.is_set():
            writer.close()
            return
        conn = _Connection(self, reader, writer)
        self._connections.add(conn)
        try:
            await conn.run()
        finally:
            self._connections.discard(conn)
            await conn.shutdown()


class _Connection:
    def __init__(self, peer: AdbPeer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.peer = peer
        self.reader, self.writer = reader, writer
        self.online = False
        self.token = b""
        self.client_max = 4096
        self.streams: dict[int, _Stream] = {}
        self.next_id = 1

    def send(self, command: int, arg0: int, arg1: int, data: bytes = b"") -> None:
        if self.writer.is_closing():
            return
        header = HEADER.pack(command, arg0, arg1, len(data), sum(data) & 0xFFFFFFFF,
                             command ^ 0xFFFFFFFF)
        self.writer.write(header + data)

    def reset(self) -> None:
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.writer.transport.abort()

    async def shutdown(self) -> None:
        for stream in self.streams.values():
            await self._end(stream)
        self.writer.close()

    async def run(self) -> None:
        try:
            while True:
                header = await self.reader.readexactly(HEADER.size)
                command, arg0, arg1, length, checksum, magic = HEADER.unpack(header)
                if magic != command ^ 0xFFFFFFFF or length > MAX_PAYLOAD:
                    return
                data = await self.reader.readexactly(length) if length else b""
                if checksum and sum(data) & 0xFFFFFFFF != checksum:
                    return
                if not await self.dispatch(command, arg0, arg1, data):
                    return
                await self.writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            return

    async def dispatch(self, command: int, arg0: int, arg1: int, data: bytes) -> bool:
        if command == CNXN:
            self.client_max = max(4096, min(arg1, MAX_PAYLOAD))
            if self.peer.require_auth:
                self._challenge()
            else:
                self.peer.auth_log.append("none")
                self._accept()
            return True
        if command == AUTH:
            return self._auth(arg0, data)
        if not self.online:
            return False
        if command == OPEN:
            await self._open(arg0, data.rstrip(b"\0").decode(errors="replace"))
        elif command == OKAY:
            stream = self.streams.get(arg1)
            if stream is not None:
                stream.remote_id = arg0
                stream.can_write.set()
        elif command == WRTE:
            stream = self.streams.get(arg1)
            if stream is None:
                self.send(CLSE, 0, arg0)
                return True
            self.send(OKAY, stream.local_id, stream.remote_id)
            if stream.kind == "sync":
                stream.incoming.put_nowait(data)
        elif command == CLSE:
            stream = self.streams.pop(arg1, None)
            if stream is not None:
                if not stream.sent_close:
                    self.send(CLSE, stream.local_id, stream.remote_id)
                    stream.sent_close = True
                await self._end(stream)
        return True

    # --- handshake -----------------------------------------------------------------------------
    def _challenge(self) -> None:
        self.token = secrets.token_bytes(20)
        self.send(AUTH, AUTH_TOKEN, 0, self.token)

    def _accept(self) -> None:
        self.online = True
        banner = (b"device::ro.product.name=kiln_standin;ro.product.model=Kiln_Stand-in;"
                  b"ro.product.device=standin;\0")
        self.send(CNXN, VERSION, MAX_PAYLOAD, banner)

    def _auth(self, kind: int, data: bytes) -> bool:
        if kind == AUTH_SIGNATURE and self.token:
            for key in self.peer.authorized:
                try:
                    key.verify(data, self.token, padding.PKCS1v15(), utils.Prehashed(hashes.SHA1()))
                except (InvalidSignature, ValueError):
                    continue
                self.peer.auth_log.append("signature")
                self._accept()
                return True
            self._challenge()
            return True
        if kind == AUTH_RSAPUBLICKEY:
            if not self.peer.accept_new_keys:
                return True  # a real phone waits for its user; the client times out
            try:
                self.peer.authorized.append(android_public_key(data))
            except (ValueError, struct.error):
                return False
            self.peer.auth_log.append("new-key")
            self._accept()
            return True
        return False

    # --- streams -------------------------------------------------------------------------------
    async def _open(self, remote_id: int, service: str) -> None:
        local_id, self.next_id = self.next_id, self.next_id + 1
        if service.startswith("shell:"):
            command = service[len("shell:"):]
            self.peer.commands.append(command)
            if self.peer.vanish_when is not None and self.peer.vanish_when(command):
                await self.peer._vanish()
                return
            stream = _Stream(local_id, remote_id, "shell")
        elif service == "sync:":
            stream = _Stream(local_id, remote_id, "sync")
        else:
            self.send(CLSE, 0, remote_id)
            return
        self.streams[local_id] = stream
        self.send(OKAY, local_id, remote_id)
        if stream.kind == "shell":
            stream.task = asyncio.create_task(self._shell(stream, command))
        else:
            stream.task = asyncio.create_task(self._sync_loop(stream))

    async def _write(self, stream: _Stream, data: bytes) -> bool:
        """Send `data` in WRTE packets, each after the client's OKAY for the previous one."""
        step = min(self.client_max, CHUNK)
        for start in range(0, len(data), step):
            stream.can_write.clear()
            self.send(WRTE, stream.local_id, stream.remote_id, data[start:start + step])
            await self.writer.drain()
            await stream.can_write.wait()
            if stream.closed:
                return False
        return True

    async def _close(self, stream: _Stream) -> None:
        if not stream.sent_close and not stream.closed:
            stream.sent_close = True
            self.send(CLSE, stream.local_id, stream.remote_id)
            await self.writer.drain()

    async def _end(self, stream: _Stream) -> None:
        stream.closed = True
        stream.can_write.set()
        if stream.process is not None and stream.process.returncode is None:
            try:
                os.killpg(stream.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if stream.task is not None and stream.task is not asyncio.current_task():
            stream.task.cancel()

    async def _shell(self, stream: _Stream, command: str) -> None:
        try:
            stream.process = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", command, cwd=self.peer.root, env=self.peer.shell_env(),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            assert stream.process.stdout is not None
            while chunk := await stream.process.stdout.read(CHUNK):
                if not await self._write(stream, chunk):
                    return
            await stream.process.wait()
            await self._close(stream)
        except (ConnectionError, OSError):
            return

    # --- sync: ---------------------------------------------------------------------------------
    async def _reply(self, stream: _Stream, ident: bytes, *values: int, data: bytes = b"") -> None:
        await self._write(stream, ident + struct.pack(f"<{len(values)}I", *values) + data)

    async def _fail(self, stream: _Stream, message: str) -> None:
        stream.upload = None
        text = message.encode()
        await self._reply(stream, b"FAIL", len(text), data=text)

    async def _sync_loop(self, stream: _Stream) -> None:
        try:
            while not stream.closed:
                stream.buffer += await stream.incoming.get()
                await self._sync(stream)
        except (ConnectionError, OSError):
            return

    async def _sync(self, stream: _Stream) -> None:
        buf = stream.buffer
        while len(buf) >= 8:
            ident, size = bytes(buf[:4]), struct.unpack("<I", buf[4:8])[0]
            if ident == b"DONE":
                del buf[:8]
                await self._finish_upload(stream, mtime=size)
                continue
            if ident == b"QUIT":
                del buf[:8]
                await self._close(stream)
                continue
            if len(buf) < 8 + size:
                return
            payload = bytes(buf[8:8 + size])
            del buf[:8 + size]
            if ident == b"SEND":
                self._start_upload(stream, payload.decode(errors="replace"))
            elif ident == b"DATA":
                if stream.upload is not None:
                    stream.upload["data"] += payload
            elif ident == b"STAT":
                await self._stat(stream, payload.decode(errors="replace"))
            elif ident == b"RECV":
                await self._send_file(stream, payload.decode(errors="replace"))
            else:
                await self._fail(stream, f"unsupported sync request {ident!r}")

    def _start_upload(self, stream: _Stream, spec: str) -> None:
        path, _, mode = spec.rpartition(",")
        stream.upload = {"path": path, "mode": int(mode or "0"), "data": bytearray()}

    async def _finish_upload(self, stream: _Stream, mtime: int) -> None:
        upload, stream.upload = stream.upload, None
        if upload is None:
            await self._fail(stream, "DONE without SEND")
            return
        target = self.peer.confined(upload["path"])
        if target is None:
            await self._fail(stream, f"{upload['path']}: permission denied")
            return
        data = upload["data"]
        if self.peer.corrupt_pushes and data:
            data[len(data) // 2] ^= 0xFF
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(bytes(data))
            target.chmod(upload["mode"] & 0o777 or 0o644)
            os.utime(target, (mtime, mtime))
        except OSError as exc:
            await self._fail(stream, f"{upload['path']}: {exc.strerror}")
            return
        await self._reply(stream, b"OKAY", 0)

    async def _stat(self, stream: _Stream, path: str) -> None:
        target = self.peer.confined(path)
        try:
            st = target.stat() if target is not None else None
        except OSError:
            st = None
        if st is None:
            await self._reply(stream, b"STAT", 0, 0, 0)
        else:
            await self._reply(stream, b"STAT", st.st_mode & 0xFFFFFFFF,
                              st.st_size & 0xFFFFFFFF, int(st.st_mtime))

    async def _send_file(self, stream: _Stream, path: str) -> None:
        target = self.peer.confined(path)
        try:
            data = target.read_bytes() if target is not None else None
        except OSError:
            data = None
        if data is None:
            await self._fail(stream, f"{path}: No such file or directory")
            return
        for start in range(0, len(data), CHUNK):
            part = data[start:start + CHUNK]
            await self._reply(stream, b"DATA", len(part), data=part)
        await self._reply(stream, b"DONE", 0)
