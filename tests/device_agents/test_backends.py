"""The three backends against real peers: this machine, a real sshd on loopback, the stand-in phone.

Each backend gets the same round trip (push, hash on the device, run, remove) and the same
quoting test: arguments and paths with spaces, quotes, `;`, `$(…)`, backquotes, globs and
newlines arrive as exactly those strings, and nothing else runs.
"""
from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from device_agents.backends import (
    CommandTimeout,
    DeviceError,
    DeviceLostError,
    command_line,
)
from device_agents.backends.adb import AdbBackend, load_signer
from device_agents.backends.local import LocalBackend
from device_agents.backends.ssh import SshBackend
from tests.device_agents.adb_peer import AdbPeer, Phone


def ssh_backend(sshd, work_dir, **kwargs) -> SshBackend:
    return SshBackend("127.0.0.1", sshd.user, sshd.key, port=sshd.port,
                      known_hosts=sshd.known_hosts, work_dir=str(work_dir), name="ssh-test",
                      **kwargs)


def adb_backend(phone, tmp_path, **kwargs) -> AdbBackend:
    return AdbBackend.tcp("127.0.0.1", phone.port, load_signer(tmp_path / "adbkey"),
                          name="phone-test", work_dir=str(phone.data_dir / "kiln"), **kwargs)


@pytest.fixture(params=["local", "ssh", "adb"])
def backend(request, tmp_path):
    if request.param == "local":
        made = LocalBackend(tmp_path / "local-work")
    elif request.param == "ssh":
        made = ssh_backend(request.getfixturevalue("sshd"), tmp_path / "ssh work")
    else:
        made = adb_backend(request.getfixturevalue("phone"), tmp_path)
    return made


def run(coroutine, *backends):
    """Run `coroutine` in a fresh event loop, closing `backends` in the same loop."""
    async def main():
        try:
            return await coroutine
        finally:
            for backend in backends:
                await backend.close()

    return asyncio.run(main())


def test_command_line_quotes_every_argument():
    assert command_line(["printf", "%s", "a b", "it's", ""]) == "printf %s 'a b' 'it'\"'\"'s' ''"
    with pytest.raises(ValueError):
        command_line("rm -rf /")
    with pytest.raises(ValueError):
        command_line(["echo", "nul\0byte"])


def test_round_trip_and_hostile_names(backend, tmp_path):
    canary = tmp_path / "canary"
    nasty = ["a b", "it's", 'say "hi"', f"x; touch {canary}", f"$(touch {canary})",
             f"`touch {canary}`", "*", "\\", "--", "-n", "tab\there", "new\nline", "", "ünï",
             f"| touch {canary} &"]
    local = tmp_path / "payload.bin"
    data = os.urandom(200_000)
    local.write_bytes(data)
    remote = f"{backend.work_dir}/we ird; 'dir' $(touch {canary})/fi\"le `x` *.bin"

    async def scenario():
        await backend.push(str(local), remote, mode=0o600)
        assert await backend.sha256(remote) == hashlib.sha256(data).hexdigest()
        code, out, err = await backend.run(["printf", "[%s]", *nasty], 30)
        assert (code, out) == (0, "".join(f"[{a}]" for a in nasty)), err
        code, out, _ = await backend.run(["wc", "-c", remote], 30)
        assert code == 0 and out.split()[0] == str(len(data))
        code, out, err = await backend.run(["sh", "-c", 'echo out; echo err >&2; exit 7'], 30)
        assert (code, out, err.strip()) == (7, "out\n", "err")
        await backend.remove(remote)
        assert await backend.sha256(remote) is None
        code, _, _ = await backend.run(["no-such-program-kiln"], 30)
        assert code == 127

    run(scenario(), backend)
    assert not canary.exists()


def test_timeouts_stop_the_command(backend):
    async def scenario():
        if isinstance(backend, AdbBackend):
            backend.direct_max_s = 0  # the background-job path, polled and killed on the phone
        with pytest.raises(CommandTimeout, match="timeout"):
            await backend.run(["sleep", "30"], 0.5)
        assert await backend.alive()

    run(scenario(), backend)


def test_local_runs_in_its_private_folder(tmp_path):
    backend = LocalBackend(tmp_path / "w")
    code, out, _ = run(backend.run(["pwd"], 10))
    assert (code, out.strip()) == (0, str(tmp_path / "w"))


def test_ssh_facts_are_this_machines(sshd, tmp_path):
    async def scenario():
        backend = ssh_backend(sshd, tmp_path / "w")
        try:
            return await backend.facts(), await LocalBackend(tmp_path / "l").facts()
        finally:
            await backend.close()

    remote, local = run(scenario())
    assert remote.fingerprint == local.fingerprint
    assert remote.kind in ("cpu", "gpu-host")


def test_ssh_host_key_is_checked(sshd, tmp_path):
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"[127.0.0.1]:{sshd.port} ssh-ed25519 "
                     "AAAAC3NzaC1lZDI1NTE5AAAAIJdD7y3aLq454yWBdwLWbieU1ebz9/cu7/QEXn9OIeZJ\n")
    backend = SshBackend("127.0.0.1", sshd.user, sshd.key, port=sshd.port, known_hosts=wrong)
    with pytest.raises(DeviceError, match="host key"):
        run(backend.run(["true"], 10))
    with pytest.raises(ValueError, match="known_hosts"):
        SshBackend("127.0.0.1", sshd.user, sshd.key, port=sshd.port)


def test_ssh_host_that_vanishes_is_lost(sshd, tmp_path):
    async def scenario():
        backend = ssh_backend(sshd, tmp_path / "w")
        assert await backend.alive()
        sshd.kill_all()
        with pytest.raises(DeviceLostError):
            await backend.run(["true"], 10)
        assert not await backend.alive()

    run(scenario())


def test_phone_facts_come_from_the_phone(phone, tmp_path):
    async def scenario():
        backend = adb_backend(phone, tmp_path)
        try:
            return await backend.facts()
        finally:
            await backend.close()

    facts = run(scenario())
    assert facts.kind == "phone" and facts.emulated
    assert (facts.arch, facts.abi, facts.logical_cores) == ("aarch64", "arm64-v8a", 8)
    assert facts.device_model == "Google Kiln Stand-in"
    assert facts.core_types == {"Cortex-A55": 4, "Cortex-A78": 2, "Cortex-X1": 2}
    assert facts.max_freq_khz == 2850000 and facts.l3_bytes == 4 << 20
    assert facts.os == "Android 14 (API 34)"


def test_adb_key_is_offered_once_then_signed(phone, tmp_path):
    async def connect_twice():
        for _ in range(2):
            backend = adb_backend(phone, tmp_path)
            assert await backend.alive()
            await backend.close()

    run(connect_twice())
    assert phone.auth_log == ["new-key", "signature"]
    assert (tmp_path / "adbkey").is_file() and (tmp_path / "adbkey.pub").is_file()


def test_adb_phone_that_refuses_the_key(tmp_path, qemu_shim):
    peer = AdbPeer(tmp_path / "strict", Phone({}, {}), qemu_shim, accept_new_keys=False)
    peer.start()
    try:
        backend = AdbBackend.tcp("127.0.0.1", peer.port, load_signer(tmp_path / "k"),
                                 auth_timeout=0.5, io_timeout=2)
        with pytest.raises(DeviceLostError, match="did not allow"):
            run(backend.run(["true"], 5))
    finally:
        peer.stop()


def test_adb_phone_that_vanishes_is_lost(phone, tmp_path):
    async def scenario():
        backend = adb_backend(phone, tmp_path)
        assert await backend.alive()
        phone.vanish()
        with pytest.raises(DeviceLostError):
            await backend.run(["true"], 10)
        assert not await backend.alive()

    run(scenario())
