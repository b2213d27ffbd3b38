"""The workers' ProfileStore: the shared profiling database, measuring what it lacks.

    store = DatabaseProfileStore(db, storage, settings, target_name="host")
    estimate = store.latency(graph, op_ids)   # Estimate(seconds, source)

A lookup (`latency`) asks the database for the kernel's signature on the device class of the
compile's target — the best entry, measured before predicted. On a miss:

1. target `host` (and KILN_MEASURE_LOCAL, the default): the kernel is built alone as a probe
   artifact and measured on this machine with the agents' own code; the entry is stored under
   this machine's device fingerprint and the answer is `measured`;
2. another target: when an online agent device that runs the target's artifacts exists (its
   architecture, for CUDA a GPU that runs the kernels (device_agents.matching), for OpenCL an
   OpenCL driver), a measurement task is queued for its device class (for a GPU target, its GPU
   device's) and the lookup waits for its result up to
   KILN_MEASURE_WAIT_SECONDS (and KILN_MEASURE_BUDGET_SECONDS over the whole compile);
3. otherwise, or when that fails or times out, the roofline cost model answers (`cost-model`).

Blocks that run no kernel of their own (views) and blocks that cannot be built alone are answered
by the cost model (and not tried again by this store). `stats()` counts the answers by kind:
hit, measured-local, dispatched / measured-agent / timed-out, cost-model (why).

The tuner's side (`schedules`, `record`) uses this machine's device class: kiln.tune measures
candidates of a target that runs here on the worker's own CPU, so a tuned `x86_64` compile files
its measurements under the worker, not under an agent device of that architecture. A target that
does not run here is tuned on the farm (`farm()`, workers.farm): on the device class the lookups
go to, which files its measurements itself.
"""
from __future__ import annotations

import logging
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

from device_agents.facts import device_class
from kiln.ecg import Graph
from kiln.profile import COST_MODEL, MEASURED, Estimate
from kiln.profile.machine import host_machine
from kiln.profile.roofline import RooflineModel
from kiln.signature import canonical_json
from service.db import Database, utcnow
from service.devices import service as devices
from service.profiles import service as profiles
from service.profiles.measure import local_facts, measure_here, submit_probes
from service.settings import Settings
from service.storage import Storage
from workers.farm import AgentFarm, devices_for_target

log = logging.getLogger("kiln.worker")
POLL_S = 0.2


class DatabaseProfileStore:
    def __init__(self, db: Database, storage: Storage, settings: Settings, target_name: str = "host"):
        from kiln.target import target

        self.db, self.storage, self.settings = db, storage, settings
        self.target = target(target_name)
        self.local = target_name == "host"
        self.fallback = RooflineModel(host_machine())
        self.counts: Counter[str] = Counter()
        self.wait_budget = settings.measure_budget_seconds
        self._unmeasurable: set[str] = set()
        # the key its entries are filed under, and the device that measures for it
        self.fingerprint, self.route = self._device_class()

    def _device_class(self) -> tuple[str | None, str | None]:
        """(device class, device fingerprint) of a device that runs the target's artifacts: this
        machine for `host`; else an online agent device with the target's architecture and driver
        (the class of an OpenCL target is the OpenCL device's: device_agents.facts.device_class)."""
        if self.local:
            return self._here(), None
        online = devices_for_target(self.db, self.target)
        if not online:
            return None, None
        device = online[0]
        return device_class(device.fingerprint, device.facts or {}, self.target.name), \
            device.fingerprint

    def _here(self) -> str:
        """This machine's device class, where the tuner's measurements belong."""
        return local_facts().fingerprint

    def farm(self):
        """The farm that tunes this compile's target, when it does not run here and an online
        device runs it (a workers.farm.AgentFarm); else None."""
        if self.local:
            return None
        return AgentFarm.for_target(self.db, self.storage, self.settings, self.target)

    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    # --- ProfileStore ---------------------------------------------------------------------------
    def latency(self, graph: Graph, op_ids: Sequence[str]) -> Estimate:
        from kiln.measure.probe import ProbeError, make_probe

        try:
            probe = make_probe(graph, op_ids)
        except (ProbeError, ValueError, TypeError):
            return self._cost_model(graph, op_ids, "unmeasurable")
        if self.fingerprint is not None:
            with self.db.read() as s:
                hit = profiles.best(s, self.fingerprint, probe.signature)
            if hit is not None:
                self.counts["hit"] += 1
                return hit
        if self.fingerprint is None:
            return self._cost_model(graph, op_ids, "no device")
        if probe.signature in self._unmeasurable:
            return self._cost_model(graph, op_ids, "unmeasurable")
        if self.local and not self.settings.measure_local:
            return self._cost_model(graph, op_ids, "measuring off")
        try:
            measured = self._measure_local(probe) if self.local else self._measure_remote(probe)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot be measured: cost model
            log.info("kernel %s cannot be measured (%s: %s); the cost model answers",
                     probe.signature[:12], type(exc).__name__, exc)
            self._unmeasurable.add(probe.signature)
            return self._cost_model(graph, op_ids, "unmeasurable")
        if measured is None:
            return self._cost_model(graph, op_ids, "fallback")
        return measured

    def schedules(self, graph: Graph, op_ids: Sequence[str]) -> list[tuple[dict[str, Any], float]]:
        """The schedule-tuning lookup: every schedule of this kernel on this machine, with its
        median, best first (kiln.tune reads it)."""
        from kiln.signature import kernel_signature

        with self.db.read() as s:
            rows = profiles.schedules(s, self._here(), kernel_signature(graph, op_ids))
        return [(schedule, median) for schedule, median, _source in rows]

    def record(self, graph: Graph, op_ids: Sequence[str], seconds: Sequence[float],
               source: str = MEASURED, schedule: dict[str, Any] | None = None,
               toolchain: str = "") -> None:
        from kiln.signature import signed_description

        samples = [seconds] if isinstance(seconds, (int, float)) else list(seconds)
        signature, description = signed_description(graph, op_ids)
        profiles.record(self.db, self._here(), [profiles.NewEntry(
            signature, canonical_json(schedule or {}), profiles.summarize(samples),
            source=source, toolchain=toolchain, description=description)])

    # --- measuring ------------------------------------------------------------------------------
    def _cost_model(self, graph: Graph, op_ids: Sequence[str], why: str) -> Estimate:
        self.counts[f"cost-model ({why})"] += 1
        estimate = self.fallback.latency(graph, op_ids)
        return Estimate(estimate.seconds, COST_MODEL)

    def _build(self, probe, folder: Path):
        from kiln.measure.probe import build_probes

        built = build_probes([probe], self.target, folder / "probe.kiln")
        if not built.kernels:
            reason = built.skipped[0][1] if built.skipped else "nothing to build"
            raise RuntimeError(reason)
        return built

    def _measure_local(self, probe) -> Estimate:
        with tempfile.TemporaryDirectory(prefix="kiln-measure-", dir=self.storage.tmp) as tmp:
            built = self._build(probe, Path(tmp))
            entries = measure_here(built, Path(tmp), runs=self.settings.measure_runs)
        profiles.record(self.db, self.fingerprint, entries)
        self.counts["measured-local"] += 1
        summary = next(e.summary for e in entries if e.signature == probe.signature)
        return Estimate(summary.median_s, MEASURED, summary.p10_s, summary.p90_s)

    def _measure_remote(self, probe) -> Estimate | None:
        if self.wait_budget <= 0:
            return None
        with tempfile.TemporaryDirectory(prefix="kiln-measure-", dir=self.storage.tmp) as tmp:
            built = self._build(probe, Path(tmp))
            wait = min(self.settings.measure_wait_seconds, self.wait_budget)
            task = submit_probes(
                self.db, self.storage, built, self.target.arch, gpu_arch=self.target.gpu_arch,
                device_fingerprint=self.route, runs=self.settings.measure_runs,
                priority=10, max_attempts=self.settings.measure_max_attempts,
                deadline=utcnow() + timedelta(seconds=self.settings.measure_task_ttl_seconds))
        self.counts["dispatched"] += 1
        started = time.monotonic()
        try:
            while time.monotonic() - started < wait:
                status = devices.task_status(self.db, [task]).get(task)
                if status == devices.DONE:
                    with self.db.read() as s:
                        hit = profiles.best(s, self.fingerprint, probe.signature)
                    if hit is not None:
                        self.counts["measured-agent"] += 1
                    return hit
                if status in (devices.FAILED, devices.EXPIRED):
                    return None
                time.sleep(POLL_S)
            self.counts["timed-out"] += 1
            return None  # the task stays queued: its result fills the database for later compiles
        finally:
            self.wait_budget -= time.monotonic() - started
