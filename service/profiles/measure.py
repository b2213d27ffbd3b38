"""Getting kernels measured: probe artifacts as measurement tasks for agents, or on this machine.

`submit_probes` stores a probe artifact (kiln.measure.probe) under the storage root, named by its
sha256 (`probes/<sha256>.kiln`), and queues one measurement task for it; an agent's device of the
artifact's architecture (and of `device_fingerprint`, when given) claims it, and its result becomes
one profile entry per kernel. `measure_here` measures a probe artifact on this machine through the
agent's own code (device_agents.measure with the local backend) and returns the same entries.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from kiln.signature import canonical_json
from service.db import Database
from service.devices import service as devices
from service.profiles.service import NewEntry, summarize
from service.storage import Storage, file_sha256


def store_probe_artifact(storage: Storage, path: Path) -> tuple[str, str]:
    """(relative path, sha256) of the artifact's content-addressed copy in storage."""
    sha = file_sha256(path)
    rel = f"probes/{sha}.kiln"
    dest = storage.resolve(rel)
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = dest.with_name(f".{sha}.{os.getpid()}.part")
        shutil.copyfile(path, staged)
        os.replace(staged, dest)
    return rel, sha


def submit_probes(db: Database, storage: Storage, built, arch: str, *, gpu_arch: str = "",
                  device_fingerprint: str | None = None, runs: int = 10, warmup: int = 2,
                  repeats: int = 1, priority: int = 0, deadline: datetime | None = None,
                  max_attempts: int = 3, timeout_s: float = 600.0, threads: int | None = None) -> str:
    """Queue a measurement task for a kiln.measure.probe.BuiltProbes; its id.

    With `threads`, the runner runs on that many threads and every kernel's schedule gets
    `"threads": n` (the key kiln.tune files thread counts under); without, the runner's default.
    """
    rel, sha = store_probe_artifact(storage, Path(built.path))
    kernels = built.kernels
    if threads is not None:
        kernels = {block: {**info, "schedule": canonical_json(
            {**json.loads(info["schedule"]), "threads": threads})}
            for block, info in kernels.items()}
    return devices.create_task(
        db, artifact_path=rel, artifact_sha256=sha, arch=arch, gpu_arch=gpu_arch,
        kernels=kernels, threads=threads,
        device_fingerprint=device_fingerprint, toolchain=built.toolchain, runs=runs,
        warmup=warmup, repeats=repeats, priority=priority, deadline=deadline,
        max_attempts=max_attempts, timeout_s=timeout_s)


@lru_cache(maxsize=1)
def local_facts():
    """This machine's hardware facts as an agent's local backend reads them (cached)."""
    import tempfile

    from device_agents.backends.local import LocalBackend

    async def read():
        backend = LocalBackend(tempfile.gettempdir(), name="local")
        try:
            return await backend.facts()
        finally:
            await backend.close()

    return asyncio.run(read())


def measure_here(built, work_dir: Path, runs: int = 10, warmup: int = 2,
                 threads: int | None = None) -> list[NewEntry]:
    """Measure a probe artifact on this machine (the agent's measuring code, local backend)."""
    from device_agents.backends.local import LocalBackend
    from device_agents.measure import measure
    from kiln.runtime.artifact import open_artifact

    facts = local_facts()
    artifact = open_artifact(built.path, Path(work_dir) / "artifacts")

    async def run():
        backend = LocalBackend(Path(work_dir) / "device", name="local")
        try:
            return await measure(backend, facts, artifact, runs=runs, warmup=warmup, repeats=1,
                                 threads=threads, cache_dir=Path(work_dir) / "cache")
        finally:
            await backend.close()

    result = asyncio.run(run())
    entries = []
    for k in result.kernels:
        info = built.kernels[k.block]
        samples = list(k.run_samples_s) or list(k.samples_s)
        entries.append(NewEntry(info["signature"], info["schedule"], summarize(samples),
                                toolchain=built.toolchain, description=info.get("description")))
    return entries
