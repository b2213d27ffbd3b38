"""Fixtures of the device agent tests: artifacts, a real OpenSSH server on loopback, a stand-in phone.

Artifacts are the runtime tests' hand-written-kernel model (tests/runtime/handmade.py: three
kernels, one input), built for this machine and for aarch64 with the real toolchains, so these
tests do not depend on the code generator.
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.runtime.artifact import build_artifact, open_artifact
from kiln.target import target
from tests.device_agents.adb_peer import AdbPeer, Phone, build_shim
from tests.device_agents.samples import STANDIN_FILES, STANDIN_PROPS
from tests.runtime.conftest import cross_toolchain_missing, kiln_cache  # noqa: F401  (autouse here too)
from tests.runtime.handmade import mlp

SSHD = "/usr/sbin/sshd"


def _build(name: str, target_name: str, folder: Path) -> Path:
    model = mlp()
    path = folder / f"mlp-{name}.kiln"
    build_artifact(model.plan, model.kernels, target(target_name), {"model": "mlp"}, path)
    return path


@pytest.fixture(scope="session")
def host_artifact_path(tmp_path_factory) -> Path:
    return _build("host", "host", tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="session")
def host_artifact(host_artifact_path, tmp_path_factory):
    return open_artifact(host_artifact_path, tmp_path_factory.mktemp("extracted"))


@pytest.fixture(scope="session")
def arm_artifact_path(tmp_path_factory) -> Path:
    missing = cross_toolchain_missing()
    if missing:
        pytest.skip(missing)
    return _build("aarch64", "aarch64", tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="session")
def arm_artifact(arm_artifact_path, tmp_path_factory):
    return open_artifact(arm_artifact_path, tmp_path_factory.mktemp("extracted"))


# ---------------------------------------------------------------------------------------------
# A real OpenSSH server on loopback

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        for child in children.get(pid, []):
            found.append(child)
            frontier.append(child)
    return found


@dataclass
class SshServer:
    port: int
    user: str
    key: Path  # the client's private key
    known_hosts: Path
    folder: Path
    process: subprocess.Popen

    def sessions(self) -> list[int]:
        """Processes sshd started for connections (and what they run)."""
        return _descendants(self.process.pid)

    def kill_all(self) -> None:
        """The host disappears: sshd and every session it started are killed."""
        for pid in [self.process.pid, *self.sessions()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(10)


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kiln-test", "-f",
                    str(path)], check=True, capture_output=True)


@pytest.fixture
def sshd(tmp_path_factory):
    """sshd -D on a free loopback port with a throwaway host key and client key."""
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None:
        pytest.skip("OpenSSH server not installed (apt-get install openssh-server)")
    folder = tmp_path_factory.mktemp("sshd")
    _keygen(folder / "host_ed25519")
    _keygen(folder / "client_ed25519")
    shutil.copy(folder / "client_ed25519.pub", folder / "authorized_keys")
    port, user = free_port(), getpass.getuser()
    host_key = (folder / "host_ed25519.pub").read_text().split()
    (folder / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key[0]} {host_key[1]}\n")
    (folder / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {folder}/host_ed25519
PidFile {folder}/sshd.pid
AuthorizedKeysFile {folder}/authorized_keys
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin prohibit-password
AllowUsers {user}
Subsystem sftp internal-sftp
LogLevel ERROR
""")
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation folder
    process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(folder / "sshd_config")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"sshd did not start: {process.stderr.read().decode()}")
            time.sleep(0.05)
    server = SshServer(port, user, folder / "client_ed25519", folder / "known_hosts", folder,
                       process)
    yield server
    if process.poll() is None:
        server.kill_all()


# ---------------------------------------------------------------------------------------------
# The stand-in phone

@pytest.fixture(scope="session")
def qemu_shim(tmp_path_factory) -> Path:
    missing = cross_toolchain_missing()
    if missing:
        pytest.skip(missing)
    return build_shim(tmp_path_factory.mktemp("shim"))


@pytest.fixture
def phone(tmp_path, qemu_shim):
    """An ADB peer on loopback: an aarch64 phone whose runners run under qemu-aarch64."""
    peer = AdbPeer(tmp_path / "phone", Phone(STANDIN_PROPS, STANDIN_FILES), qemu_shim)
    peer.start()
    yield peer
    peer.stop()
