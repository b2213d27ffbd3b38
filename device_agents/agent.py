"""The agent: discover devices, register them, heartbeat, claim and measure, report.

    agent = Agent(load_config("agent.toml"))
    await agent.run()            # until stopped; `await agent.run(once=True)` does one round

Devices: this machine's CPU (unless `local = false`), the configured ssh hosts and adb devices
(TCP), and phones on USB when `[adb_usb] enabled` and adb-shell's USB transport is installed
(without it, or without USB access, USB discovery logs why and finds nothing). Each device is
connected, its facts read from the device itself, and registered (`POST /v1/agents/devices`);
devices that cannot be reached stay offline and are retried every `reconnect_interval`.

Per online device a worker claims up to `max_tasks` tasks (`POST /v1/agents/claim`) and for each
downloads the artifact (cached by its sha256), measures it (device_agents.measure) and uploads the
result (`POST /v1/agents/results`); a task that cannot be measured there (wrong architecture,
runner failure, refused report, hash mismatch on the device) is reported `failed` with the reason.
When the device disappears mid-batch (DeviceLostError, or a timeout after which it no longer
answers), the device is marked offline, every task of the batch it had not finished is released
(`POST /v1/agents/release`) so the service queues it again, and a heartbeat reports the device
offline at once; the reconnect loop brings it back later.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

import kiln
from device_agents import protocol as p
from device_agents.backends import (
    CommandTimeout,
    DeviceBackend,
    DeviceError,
    DeviceLostError,
)
from device_agents.client import AuthError, ServiceClient, ServiceError
from device_agents.config import AgentConfig
from device_agents.facts import FactsError, HardwareFacts, Transport
from device_agents.measure import Measurement, MeasurementError, measure
from kiln.errors import KilnError
from kiln.runtime.artifact import Artifact, open_artifact
from kiln.tune.report import format_seconds

AGENT_VERSION = f"kiln-agent {kiln.__version__}"
log = logging.getLogger("kiln.agent")


@dataclass
class Device:
    """One device the agent manages; `make_backend` opens a fresh connection to it."""

    name: str
    transport: Transport
    address: str
    make_backend: Callable[[], DeviceBackend]
    backend: DeviceBackend | None = None
    facts: HardwareFacts | None = None
    device_id: str | None = None
    state: p.DeviceState = p.DeviceState.offline
    error: str | None = None
    tasks: list[str] = field(default_factory=list)  # claimed and not finished


def devices_from_config(config: AgentConfig) -> list[Device]:
    from device_agents.backends.adb import AdbBackend, load_signer
    from device_agents.backends.local import LocalBackend
    from device_agents.backends.ssh import SshBackend

    devices = []
    if config.local:
        folder = config.work_dir / "devices" / config.local_name
        devices.append(Device(config.local_name, "local", "",
                              lambda: LocalBackend(folder, name=config.local_name)))
    for s in config.ssh:
        devices.append(Device(
            s.name, "ssh", f"{s.user}@{s.host}:{s.port}",
            lambda s=s: SshBackend(s.host, s.user, s.key, port=s.port, known_hosts=s.known_hosts,
                                   accept_unknown_host_key=s.accept_unknown_host_key,
                                   work_dir=s.work_dir, name=s.name)))
    for a in config.adb:
        devices.append(Device(
            a.name, "adb", f"{a.host}:{a.port}",
            lambda a=a: AdbBackend.tcp(a.host, a.port, load_signer(config.adb_key), name=a.name,
                                       work_dir=a.work_dir)))
    return devices


def usb_serials() -> list[str]:
    """Serial numbers of adb devices on USB; empty (with the reason logged) when unavailable."""
    try:
        from adb_shell.transport.usb_transport import UsbTransport
    except ImportError:
        log.info("USB discovery skipped: adb-shell's USB transport is not installed "
                 "(pip install 'adb-shell[usb]')")
        return []
    try:
        return [t.serial_number for t in UsbTransport.find_all_adb_devices()]
    except Exception as exc:  # noqa: BLE001 - libusb errors of every kind (no access, no bus)
        log.warning("USB discovery failed: %s", exc)
        return []


def describe(m: Measurement, most: int = 3) -> str:
    """One line: each kernel's median (the slowest `most` named) and the whole run's."""
    medians = sorted(((statistics.median(k.samples_s), k.symbol) for k in m.kernels), reverse=True)
    named = ", ".join(f"{symbol} {format_seconds(s)}" for s, symbol in medians[:most])
    more = f" and {len(medians) - most} more" if len(medians) > most else ""
    total = statistics.median(t.median_s for t in m.totals)
    emulated = " (emulated)" if m.emulated else ""
    return (f"{len(medians)} kernel(s): {named}{more}; whole run {format_seconds(total)} "
            f"(median of {len(m.totals)}x{m.runs} runs, {m.threads} threads){emulated}")


def _failed(base: dict, exc: BaseException) -> p.ResultUpload:
    return p.ResultUpload(status="failed", error=str(exc) or type(exc).__name__, **base)


class Agent:
    def __init__(self, config: AgentConfig, client: ServiceClient | None = None,
                 devices: list[Device] | None = None):
        self.config = config
        self.client = client or ServiceClient(config.server, config.agent_token())
        self.devices = devices if devices is not None else devices_from_config(config)
        self.cache = Path(config.work_dir) / "cache"
        self._loops: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._fatal: BaseException | None = None

    # --- devices -------------------------------------------------------------------------------
    async def connect(self, device: Device) -> bool:
        """Connect, read the facts from the device and register it; False when unreachable."""
        try:
            backend = device.backend or device.make_backend()
            device.backend = backend
            device.facts = await backend.facts()
        except (DeviceError, FactsError, OSError, ValueError) as exc:
            await self._mark_offline(device, f"cannot connect: {exc}")
            log.warning("%s: %s", device.name, device.error)
            return False
        try:
            await self.register(device)
        except AuthError:
            raise
        except ServiceError as exc:
            await self._mark_offline(device, f"cannot register: {exc}")
            log.warning("%s: %s", device.name, device.error)
            return False
        log.info("%s: online as device %s (%s, %s)", device.name, device.device_id,
                 device.facts.kind, device.facts.cpu_model)
        return True

    async def register(self, device: Device) -> None:
        assert device.facts is not None
        registered = await self.client.register(p.DeviceRegistration(
            name=device.name, transport=device.transport, address=device.address,
            facts=device.facts, fingerprint=device.facts.fingerprint,
            agent_version=AGENT_VERSION))
        device.device_id = registered.device_id
        device.state, device.error = p.DeviceState.online, None

    async def discover(self) -> None:
        """Add new USB phones; connect every device that is offline."""
        if self.config.adb_usb.enabled:
            self._add_usb_devices()
        for device in self.devices:
            if device.state == p.DeviceState.offline:
                await self.connect(device)

    def _add_usb_devices(self) -> None:
        from device_agents.backends.adb import AdbBackend, load_signer

        known = {d.address for d in self.devices}
        for serial in usb_serials():
            address = f"usb:{serial}"
            if address in known:
                continue
            name = "usb-" + "".join(c if c.isalnum() or c in "_.-" else "_" for c in serial)[:60]
            self.devices.append(Device(
                name, "adb", address,
                lambda serial=serial, name=name: AdbBackend.usb(
                    serial, load_signer(self.config.adb_key), name=name,
                    work_dir=self.config.adb_usb.work_dir)))

    async def _mark_offline(self, device: Device, reason: str) -> None:
        device.state, device.error = p.DeviceState.offline, reason
        backend, device.backend = device.backend, None
        if backend is not None:
            with contextlib.suppress(Exception):
                await backend.close()

    async def lose(self, device: Device, reason: str) -> None:
        """The device disappeared: offline, its unfinished tasks released, a heartbeat sent now."""
        pending, device.tasks = list(device.tasks), []
        await self._mark_offline(device, reason)
        log.warning("%s: offline: %s", device.name, reason)
        await self._release_ids(device, pending, reason)
        await self.heartbeat()

    # --- service -------------------------------------------------------------------------------
    async def heartbeat(self) -> None:
        body = p.Heartbeat(agent_version=AGENT_VERSION, devices=[
            p.DeviceHeartbeat(device_id=d.device_id, status=d.state, task_ids=d.tasks[:64],
                              error=d.error[:p.MAX_ERROR_CHARS] if d.error else None)
            for d in self.devices if d.device_id is not None])
        try:
            reply = await self.client.heartbeat(body)
        except AuthError:
            raise
        except ServiceError as exc:
            log.warning("heartbeat failed: %s", exc)
            return
        for device in self.devices:
            if device.device_id in reply.unknown_device_ids and device.facts is not None:
                log.info("%s: the service does not know device %s; registering again",
                         device.name, device.device_id)
                try:
                    await self.register(device)
                except ServiceError as exc:
                    log.warning("%s: cannot register: %s", device.name, exc)

    async def work_once(self, device: Device) -> int:
        """Claim one batch for `device` and measure it; the number of tasks finished."""
        if device.state != p.DeviceState.online or device.device_id is None:
            return 0
        reply = await self.client.claim(p.ClaimRequest(device_id=device.device_id,
                                                       max_tasks=self.config.max_tasks))
        if not reply.tasks:
            return 0
        device.tasks = [t.task_id for t in reply.tasks]
        device.state = p.DeviceState.busy
        done = 0
        try:
            for task in reply.tasks:
                await self.process(device, task)
                device.tasks.remove(task.task_id)
                done += 1
        except DeviceLostError as exc:
            await self.lose(device, str(exc))
        except asyncio.CancelledError:
            await asyncio.shield(self._release(device, "the agent stopped"))
            raise
        except Exception as exc:
            await self._release(device, f"the agent failed: {type(exc).__name__}: {exc}")
            raise
        if device.state == p.DeviceState.busy:
            device.state = p.DeviceState.online
        return done

    async def _release(self, device: Device, reason: str) -> None:
        pending, device.tasks = list(device.tasks), []
        await self._release_ids(device, pending, reason)

    async def _release_ids(self, device: Device, task_ids: list[str], reason: str) -> None:
        if not task_ids or device.device_id is None:
            return
        try:
            await self.client.release(p.ReleaseRequest(
                device_id=device.device_id, task_ids=task_ids, reason=reason[:p.MAX_ERROR_CHARS]))
            log.info("%s: released %d task(s): %s", device.name, len(task_ids), ", ".join(task_ids))
        except AuthError:
            raise
        except ServiceError as exc:
            log.warning("%s: could not release tasks %s: %s", device.name, task_ids, exc)

    async def fetch(self, task: p.MeasurementTask) -> Artifact:
        """The task's artifact, downloaded once per sha256 and checked and extracted locally."""
        key = task.artifact_sha256 or hashlib.sha256(task.artifact_url.encode()).hexdigest()
        path = self.cache / "downloads" / f"{key}.kiln"
        if task.artifact_sha256 is None or not path.is_file():
            await self.client.download(task.artifact_url, path, task.artifact_sha256)
        return await asyncio.to_thread(open_artifact, path, self.cache / "artifacts")

    async def process(self, device: Device, task: p.MeasurementTask) -> None:
        """Measure one task on `device` and upload the result (DeviceLostError propagates)."""
        assert device.backend is not None and device.facts is not None
        assert device.device_id is not None
        base = {"task_id": task.task_id, "device_id": device.device_id,
                "emulated": device.facts.emulated}
        try:
            artifact = await self.fetch(task)
        except AuthError:
            raise
        except ServiceError as exc:
            if exc.status is None or exc.status >= 500:  # the service is unwell: try later
                log.warning("%s: task %s: %s; releasing it", device.name, task.task_id, exc)
                await self._release_ids(device, [task.task_id], str(exc))
                return
            await self.upload(device, _failed(base, exc))
            return
        except (KilnError, OSError) as exc:
            await self.upload(device, _failed(base, exc))
            return
        try:
            m = await measure(device.backend, device.facts, artifact, runs=task.runs,
                              warmup=task.warmup, repeats=task.repeats, threads=task.threads,
                              timeout_s=task.timeout_s, cache_dir=self.cache)
            result = p.ResultUpload(
                status="ok", kernels=m.kernels, totals=m.totals, runs=m.runs, warmup=m.warmup,
                threads=m.threads, runner_version=m.runner_version,
                runner_sha256=m.runner_sha256, artifact_hash=m.artifact_hash,
                bundle_id=m.bundle_id, peak_rss_bytes=m.peak_rss_bytes,
                target=artifact.manifest["target"]["name"], **base)
        except DeviceLostError:
            raise
        except (CommandTimeout, DeviceError) as exc:
            if not await device.backend.alive():
                raise DeviceLostError(f"{device.name}: stopped answering ({exc})") from exc
            result = _failed(base, exc)
        except (MeasurementError, KilnError, ValidationError, OSError) as exc:
            result = _failed(base, exc)
        if result.status == "failed":
            log.warning("%s: task %s failed: %s", device.name, task.task_id, result.error)
        else:
            log.info("%s: task %s measured %s", device.name, task.task_id, describe(m))
        await self.upload(device, result)

    async def upload(self, device: Device, result: p.ResultUpload) -> None:
        try:
            await self.client.results(result)
        except AuthError:
            raise
        except ServiceError as exc:
            log.warning("%s: result of task %s not accepted: %s", device.name, result.task_id, exc)

    # --- main loop -----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None, once: bool = False) -> None:
        """Work until `stop` is set (or one round with `once`); AuthError ends it."""
        self._stop = stop = stop or asyncio.Event()
        self._fatal = None
        try:
            await self.discover()
            await self.heartbeat()
            if once:
                await asyncio.gather(*(self._work_logged(d) for d in self.devices))
                await self.heartbeat()
                return
            self._spawn(self._heartbeat_loop())
            self._spawn(self._reconnect_loop())
            for device in self.devices:
                self._spawn(self._worker(device))
            await stop.wait()
            if self._fatal is not None:
                raise self._fatal
        finally:
            stopped_loops = [*self._loops]
            for task in stopped_loops:
                task.cancel()
            await asyncio.gather(*stopped_loops, return_exceptions=True)
            self._loops.clear()
            await self.close()

    def _spawn(self, coroutine) -> None:
        """Run a loop until the agent stops; a loop that fails (AuthError) stops the agent."""
        task = asyncio.create_task(coroutine)
        self._loops.add(task)

        def finished(t: asyncio.Task) -> None:
            self._loops.discard(t)
            if not t.cancelled() and t.exception() is not None and self._fatal is None:
                self._fatal = t.exception()
                self._stop.set()

        task.add_done_callback(finished)

    async def _work_logged(self, device: Device) -> int:
        try:
            return await self.work_once(device)
        except AuthError:
            raise
        except ServiceError as exc:
            log.warning("%s: claim failed: %s", device.name, exc)
            return 0

    async def _worker(self, device: Device) -> None:
        while True:
            if await self._work_logged(device) == 0:
                await asyncio.sleep(self.config.poll_interval)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            await self.heartbeat()

    async def _reconnect_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.reconnect_interval)
            before = {d.name for d in self.devices}
            await self.discover()
            for device in self.devices:
                if device.name not in before:  # a phone plugged in since
                    self._spawn(self._worker(device))

    async def close(self) -> None:
        for device in self.devices:
            if device.tasks:
                await self._release(device, "the agent stopped")
            if device.backend is not None:
                with contextlib.suppress(Exception):
                    await device.backend.close()
                device.backend = None
        await self.client.close()
