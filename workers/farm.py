"""Tuning on the farm: kiln.tune's candidates for a target the worker cannot run, measured by an
agent's device through the measurement task queue (the one the yellow-case lookups use).

    farm = AgentFarm.for_target(db, storage, settings, target("aarch64"))   # None: no device
    tune_plan(plan, target, store, "quick", 60, farm=farm)

Each batch (candidates of one block) becomes one probe artifact (kiln.measure.probe: one probe per
candidate schedule), queued for the device class with a deadline at the tuning deadline; the
device's result lands as profile entries under its fingerprint, each filed under the candidate's
schedule plus `kernel` (the tuner's hash of its code) and `threads`. The farm waits for the task
until the deadline, then reads the entries back. A task still unclaimed at the deadline expires;
one claimed but not finished by then still files its entries for the next tuning run.
"""
from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from device_agents.facts import device_class, has_driver_for
from kiln.ecg import Graph
from kiln.measure.farm import FarmCandidate
from kiln.measure.harness import BatchResult
from kiln.signature import canonical_json, kernel_signature
from kiln.target import Target
from service.db import Database, utcnow
from service.devices import service as devices
from service.devices.tables import Device
from service.profiles import service as profiles
from service.profiles.measure import submit_probes
from service.settings import Settings
from service.storage import Storage

POLL_S = 0.2
TUNING_PRIORITY = 5  # after the planner's lookups (10): a compile waits on those


class AgentFarm:
    """kiln.measure.farm.Farm over the service's agents, for one device class."""

    def __init__(self, db: Database, storage: Storage, settings: Settings, target: Target,
                 device: Device):
        self.db, self.storage, self.settings, self.target = db, storage, settings, target
        self.fingerprint = device.fingerprint  # where its tasks go
        # where its entries are filed: for an OpenCL or CUDA target, the class of the GPU device
        self.device_class = device_class(device.fingerprint, device.facts or {}, target.name)
        self.threads: int | None = (device.facts or {}).get("logical_cores")
        self.device = f"{device.name} ({device.kind}, {device.arch}, {device.fingerprint[:12]})"

    def schedules(self, graph: Graph, op_ids: Sequence[str]) -> list[tuple[dict[str, Any], float]]:
        with self.db.read() as s:
            rows = profiles.schedules(s, self.device_class, kernel_signature(graph, op_ids))
        return [(schedule, median) for schedule, median, _source in rows]

    def measure(self, graph: Graph, op_ids: Sequence[str], candidates: Sequence[FarmCandidate],
                deadline: float) -> BatchResult:
        from kiln.measure.probe import ProbeError, build_probes, make_probe

        result = BatchResult()
        start = time.monotonic()
        probes = [make_probe(graph, op_ids, dict(c.overrides)) for c in candidates]
        key_of = {p.schedule_text: c.key for p, c in zip(probes, candidates)}
        with tempfile.TemporaryDirectory(prefix="kiln-farm-", dir=self.storage.tmp) as tmp:
            try:
                built = build_probes(probes, self.target, Path(tmp) / "candidates.kiln",
                                     dedupe=False)
            except ProbeError as exc:
                result.failed.update({c.key: str(exc) for c in candidates})
                return result
            for index, why in built.skipped:
                result.failed[candidates[index].key] = why
            result.compile_s = time.monotonic() - start
            if not built.kernels or time.monotonic() >= deadline:
                return result
            built = replace(built, kernels={
                block: {**info, "schedule": canonical_json(
                    {**json.loads(info["schedule"]), "kernel": key_of[info["schedule"]]})}
                for block, info in built.kernels.items()})
            task = submit_probes(
                self.db, self.storage, built, self.target.arch, gpu_arch=self.target.gpu_arch,
                device_fingerprint=self.fingerprint, threads=self.threads,
                runs=self.settings.measure_runs, priority=TUNING_PRIORITY, max_attempts=1,
                deadline=utcnow() + timedelta(seconds=max(deadline - time.monotonic(), 0.0)))
        status = self._wait(task, deadline)
        result.run_s = time.monotonic() - start - result.compile_s
        if status == devices.DONE:
            wanted = {json.loads(info["schedule"])["kernel"] for info in built.kernels.values()}
            for schedule, median in self.schedules(graph, op_ids):
                key = schedule.get("kernel")
                if key in wanted and schedule.get("threads") == self.threads:
                    result.samples.setdefault(key, [median])
        elif status in (devices.FAILED, devices.EXPIRED):
            error = devices.task_error(self.db, task) or status
            for info in built.kernels.values():
                result.failed[json.loads(info["schedule"])["kernel"]] = error
        return result

    def _wait(self, task: str, deadline: float) -> str | None:
        while time.monotonic() < deadline:
            status = devices.task_status(self.db, [task]).get(task)
            if status in devices.FINISHED:
                return status
            time.sleep(POLL_S)
        return None

    @classmethod
    def for_target(cls, db: Database, storage: Storage, settings: Settings,
                   target: Target) -> "AgentFarm | None":
        """A farm on the first online device that runs `target`'s artifacts; None if none does."""
        online = devices_for_target(db, target)
        return cls(db, storage, settings, target, online[0]) if online else None


def devices_for_target(db: Database, target: Target) -> list[Device]:
    """Online devices that run `target`'s artifacts: its architecture, for CUDA a GPU that runs
    its kernels, for OpenCL an OpenCL driver; most recently seen first."""
    return [d for d in devices.online_devices_for(db, target.arch, target.gpu_arch)
            if has_driver_for(d.facts or {}, target.name)]
