"""The tuner: per distinct block, the schedule that runs fastest on the target's device: this
CPU, or, for a target this machine cannot run, a matching device of the farm (a `Farm`,
kiln.measure.farm: the service's agents), which measures each batch and records it itself.

Blocks are grouped by kernel signature (`kiln.signature`): identical transformer layers are one
group, tuned once, and the winner applies to every block of the group. Groups are tuned heaviest
first (the profile store's latency estimate × how many blocks share it), so a tight budget goes
where the time is.

* `quick`: the fixed candidates of `space.QUICK` that change the block's code (at most
  `space.QUICK_MAX`), measured in one batch.
* `reuse` (the default of `kiln compile` and of jobs): no measuring; a group whose schedules were
  measured before (by `quick` or `full`, same machine, same generated code, same threads) gets
  the schedule that search chose, so a second compile of a tuned model costs nothing and keeps
  its tuned kernels; other groups keep the default schedule.
* `full`: a small genetic search over the block's relevant genes (DNNFusion §5.3 tunes with a
  genetic algorithm that starts from any number of chromosomes: here the default schedule, the
  quick candidates and random ones). Each generation keeps the two best (elitism), fills the
  rest by tournament selection, uniform crossover and mutation, and is measured as one batch;
  it stops when a generation brings no kernel it has not seen, after `GENERATIONS`, or when the
  group's share of the budget is spent. The random generator is seeded by the signature, so a
  rerun retraces the same search.

Every measurement is recorded in the ProfileStore under (machine, block signature, schedule),
the schedule being the overrides plus `kernel`, a hash of the generated source (so measurements
of code that has since changed are never reused) and `threads`. Before measuring, the tuner looks
the candidate up there: the same block on the same machine with the same code is never measured
twice, and a second run of the same model measures nothing. The budget is strict: compiles are
killed at the deadline and no sample starts that would end after it.
"""
from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kiln.codegen import Kernel, check_supported, generate
from kiln.errors import KilnError
from kiln.plan import Block, FusionPlan
from kiln.profile import MEASURED, ProfileStore
from kiln.measure.farm import Farm
from kiln.signature import kernel_signature
from kiln.target import Target, host_target
from kiln.tune import space
from kiln.tune.modes import DEFAULT_BUDGET_S, TuneError, check_budget, check_mode
from kiln.tune.measurers import FarmMeasurer, LocalMeasurer, StoredMeasurer
from kiln.tune.report import format_seconds

POPULATION = 8
ELITE = 2
GENERATIONS = 6
QUICK_MIN_SHARE = 0.005  # quick skips groups below this share of the model's estimated time
FULL_MIN_SHARE = 0.0005
MIN_SAMPLES = 1
MAX_FAILURES_KEPT = 5  # per group in the report: reasons, not an unbounded log

# on_progress(stage, done, total, what): kiln.pipeline's progress callback (see its docstring)
ProgressCallback = Callable[[str, int, int, str], None]


@dataclass
class Group:
    signature: str
    blocks: list[Block]
    index: int  # plan position of the first block (its kernel symbol)
    weight: float = 0.0


@dataclass
class TuneResult:
    block_schedules: dict[str, dict[str, Any]] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def measured(self) -> int:
        return self.report.get("measured", 0)

    @property
    def reused(self) -> int:
        return self.report.get("reused", 0)


class _Progress:
    """Counts the kernels measured (or failed) for `on_progress`. `total` is an estimate that
    ends exact: each batch adds its kernels before it is measured and withdraws those it ran out
    of time for; quick mode also counts QUICK_MAX kernels for every group still to come, and
    withdraws that guess as the group starts. (Generating every group's candidates first would
    make the total exact from the start, but under a tight budget that time belongs to
    measuring.)"""

    def __init__(self, on_progress: ProgressCallback | None):
        self.on_progress = on_progress
        self.done = self.total = 0

    def add(self, kernels: int) -> None:
        self.total += kernels

    def withdraw(self, kernels: int) -> None:
        self.total = max(self.done, self.total - kernels)

    def step(self, what: str) -> None:
        self.done += 1
        self.total = max(self.total, self.done)
        if self.on_progress:
            self.on_progress("tune", self.done, self.total, what)


def tune_plan(plan: FusionPlan, target: Target, store: ProfileStore, mode: str = "quick",
              budget_s: float | None = None, threads: int | None = None,
              log: Callable[[str], None] | None = None,
              on_progress: ProgressCallback | None = None, farm: Farm | None = None,
              initial: Mapping[str, dict[str, Any]] | None = None) -> TuneResult:
    """Per-block schedule overrides for `generate(..., block_schedules=...)`, and a report.
    `on_progress("tune", done, total, what)` follows each kernel measured. A target this machine
    cannot run is measured on `farm` (when given; else tuning is skipped). `initial` (block id
    → overrides) adds a starting schedule to a block's candidates (AGO's reformer layer joins
    the schedules tuned for a subgraph's parts into one, `kiln.tune.reformer`)."""
    check_mode(mode)
    budget = check_budget(budget_s) or DEFAULT_BUDGET_S.get(mode, 0.0)
    start = time.monotonic()
    report: dict[str, Any] = {"mode": mode, "budget_s": budget, "measured": 0, "reused": 0,
                              "failed": 0, "groups": [], "skipped": {}}
    if mode == "off":
        return TuneResult({}, report | {"seconds": 0.0})
    here = _runs_here(target)
    if mode == "reuse" and not here:  # nothing was asked for: no measurements of this machine apply
        return TuneResult({}, report | {"seconds": 0.0})
    if not here and farm is None:
        report["skipped"]["all"] = (f"target {target.name} ({target.arch}, "
                                    f"{'/'.join(target.isa) or target.gpu_arch or target.backend}"
                                    f") cannot be measured on this machine, and no device of the "
                                    f"farm matches it")
        return TuneResult({}, report | {"seconds": 0.0})
    check_supported(plan.graph)
    deadline = start + budget
    if here:
        threads = threads or int(os.environ.get("KILN_NUM_THREADS", 0) or 0) or os.cpu_count() or 1
    if mode == "reuse":
        schedules = _reused_schedules(plan, target, StoredMeasurer(plan.graph, store, threads),
                                      report)
        return TuneResult(schedules, report | {"seconds": round(time.monotonic() - start, 3),
                                               "threads": threads, "schedules": schedules})
    if here:
        measurer: LocalMeasurer | FarmMeasurer = LocalMeasurer(plan.graph, target, store, threads)
    else:
        measurer = FarmMeasurer(plan.graph, farm)
        threads = measurer.threads
    report["device"] = measurer.where
    groups = _groups(plan, store)
    total = sum(g.weight for g in groups) or 1.0
    min_share = QUICK_MIN_SHARE if mode == "quick" else FULL_MIN_SHARE
    schedules: dict[str, dict[str, Any]] = {}
    progress = _Progress(on_progress)
    try:
        for group in groups:
            if group.weight / total < min_share:
                report["skipped"][group.blocks[0].name] = f"under {min_share:.2%} of the estimated time"
        groups = [g for g in groups if g.weight / total >= min_share]
        remaining_weight = sum(g.weight for g in groups)
        guess = space.QUICK_MAX if mode == "quick" else 0
        progress.add(guess * len(groups))
        for group in groups:
            name = group.blocks[0].name
            progress.withdraw(guess)
            now = time.monotonic()
            if now >= deadline:
                report["skipped"][name] = "budget spent"
                continue
            share = (deadline - now) * group.weight / max(remaining_weight, 1e-30)
            remaining_weight -= group.weight
            group_deadline = deadline if mode == "quick" else min(deadline, now + max(share, 0.0))
            tuner = _GroupTuner(plan, group, target, store, measurer, group_deadline, progress,
                                dict((initial or {}).get(group.blocks[0].id) or {}))
            entry = tuner.run(mode)
            report["measured"] += tuner.measured
            report["reused"] += tuner.reused
            report["failed"] += tuner.failed
            report["groups"].append(entry)
            if log:
                log(_describe(entry))
            if entry["best"]:
                for block in group.blocks:
                    schedules[block.id] = dict(entry["best"])
    finally:
        measurer.close()
    report["seconds"] = round(time.monotonic() - start, 3)
    report["threads"] = threads
    report["schedules"] = schedules
    return TuneResult(schedules, report)


def _reused_schedules(plan: FusionPlan, target: Target, measurer: StoredMeasurer,
                      report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per block, the best schedule measured for its group earlier (see `reuse` above)."""
    schedules: dict[str, dict[str, Any]] = {}
    for group in _groups(plan, measurer.store):
        tuner = _GroupTuner(plan, group, target, measurer.store, measurer, float("inf"),
                            _Progress(None))
        if not tuner.known:
            continue
        entry = tuner.run("reuse")
        report["reused"] += tuner.reused
        report["groups"].append(entry)
        if entry["best"]:
            for block in group.blocks:
                schedules[block.id] = dict(entry["best"])
    return schedules


def _ms(seconds: float) -> float:
    return float(f"{seconds * 1e3:.4g}")  # 4 significant digits: sub-microsecond kernels too


def _describe(entry: dict[str, Any]) -> str:
    best = entry.get("best_ms")
    default = entry.get("default_ms")
    gain = f", {default / best:.2f}x over default" if best and default else ""
    return (f"tune {entry['name']} ×{entry['blocks']}: {entry['candidates']} kernels "
            f"({entry['measured']} measured, {entry['reused']} reused); best "
            f"{json.dumps(entry['best'])}" + (f" {format_seconds(best / 1e3)}" if best else "") + gain)


def _runs_here(target: Target) -> bool:
    """Whether the harness can time the target's kernels here: it calls them as C functions, so
    a target whose kernels run on a device (OpenCL, CUDA) is measured through their runner on a
    device of the farm (a local agent's included)."""
    host = host_target()
    return target.runs_on_cpu and target.is_native and set(target.isa) <= set(host.isa)


def _groups(plan: FusionPlan, store: ProfileStore) -> list[Group]:
    groups: dict[str, Group] = {}
    for index, block in enumerate(plan.blocks):
        if block.is_view:
            continue
        signature = kernel_signature(plan.graph, block.op_ids)
        if signature not in groups:
            groups[signature] = Group(signature, [], index)
        groups[signature].blocks.append(block)
    for g in groups.values():
        g.weight = _estimate(plan, g.blocks[0], store) * len(g.blocks)
    return sorted(groups.values(), key=lambda g: (-g.weight, g.index))


def _estimate(plan: FusionPlan, block: Block, store: ProfileStore) -> float:
    model = store.fallback or store  # the model, not measurements: the same weights every run
    try:
        return float(model.latency(plan.graph, list(block.op_ids)).seconds)
    except Exception:  # a store without an answer: weigh by FLOPs and bytes
        ops = [plan.graph.op_by_id[o] for o in block.op_ids]
        return sum(op.flops for op in ops) * 1e-11 + sum(op.bytes for op in ops) * 1e-10


class _GroupTuner:
    """Tunes one group: candidates → kernels (deduplicated by source) → store or harness."""

    def __init__(self, plan: FusionPlan, group: Group, target: Target, store: ProfileStore,
                 measurer: LocalMeasurer | FarmMeasurer | StoredMeasurer, deadline: float,
                 progress: _Progress, initial: dict[str, Any] | None = None):
        self.plan, self.group, self.target = plan, group, target
        self.initial = initial or {}
        self.progress = progress
        self.store, self.measurer, self.threads = store, measurer, measurer.threads
        self.deadline = deadline
        self.block = group.blocks[0]
        self.alone = replace(plan, blocks=(self.block,))  # generate() makes just its kernel
        self.op_ids = list(self.block.op_ids)
        self.kernels: dict[str, tuple[str, Kernel] | None] = {}  # overrides key -> (hash, kernel)
        self.times: dict[str, float] = {}  # kernel hash -> median seconds
        self.first_overrides: dict[str, dict[str, Any]] = {}  # kernel hash -> overrides
        self.measured = self.reused = self.failed = 0
        self.broken: dict[str, str] = {}  # kernel hash -> why its measurement failed
        self.stored = self._stored_here()
        self.known = self._known()

    # --- kernels and the store ------------------------------------------------------------
    def kernel(self, overrides: dict[str, Any]) -> tuple[str, Kernel] | None:
        key = json.dumps(overrides, sort_keys=True)
        if key not in self.kernels:
            if time.monotonic() >= self.deadline:
                return None  # out of time (not remembered: the next run may have time for it)
            try:
                k = generate(self.alone, self.target, block_schedules={self.block.id: overrides})[0]
                self.kernels[key] = (space.kernel_hash(k), k)
            except (KilnError, ValueError, AssertionError, ZeroDivisionError):
                self.kernels[key] = None  # a combination the generator refuses
        return self.kernels[key]

    def _stored_here(self) -> list[tuple[dict[str, Any], float]]:
        """(schedule, median) of earlier measurements of this group with this thread count."""
        return [(schedule, median) for schedule, median in self.measurer.stored(self.op_ids)
                if isinstance(schedule, dict) and schedule.get("threads") == self.threads]

    def _known(self) -> dict[str, float]:
        """kernel hash -> median of earlier measurements with this thread count."""
        known: dict[str, float] = {}
        for schedule, median in self.stored:
            if schedule.get("kernel"):
                known.setdefault(schedule["kernel"], median)
        return known

    def stored_overrides(self) -> list[dict[str, Any]]:
        """The schedules measured for this group earlier with this thread count."""
        return [{k: v for k, v in schedule.items() if k not in ("kernel", "threads")}
                for schedule, _ in self.stored]

    def _record(self, overrides: dict[str, Any], h: str, samples: Sequence[float]) -> None:
        if not self.measurer.records:  # the farm filed them under its device already
            return
        schedule = {**self.plan.schedules.get(self.block.id, {}), **overrides, "kernel": h,
                    "threads": self.threads}
        try:
            self.store.record(self.plan.graph, self.op_ids, list(samples), MEASURED,
                              schedule=schedule)
        except NotImplementedError:  # a store that keeps nothing: this run keeps the time
            pass

    def evaluate(self, candidates: Sequence[dict[str, Any]]) -> None:
        """Times for every candidate's kernel: from this run, the store, or measured now."""
        batch: dict[str, tuple[dict[str, Any], Kernel]] = {}
        for overrides in candidates:
            made = self.kernel(overrides)
            if made is None:
                continue
            h, k = made
            self.first_overrides.setdefault(h, overrides)
            if h in self.times or h in self.broken or h in batch:
                continue
            if h in self.known:
                self.times[h] = self.known[h]
                self.reused += 1
                continue
            batch[h] = (overrides, k)
        if not batch or not self.measurer.measures or time.monotonic() >= self.deadline:
            return
        self.progress.add(len(batch))
        result = self.measurer.measure(self.op_ids, [(h, o, k) for h, (o, k) in batch.items()],
                                       self.deadline)
        self.progress.withdraw(sum(1 for h in batch  # out of time before their turn
                                   if h not in result.samples and h not in result.failed))
        for h, (overrides, _) in batch.items():
            samples = result.samples.get(h, [])
            if len(samples) >= MIN_SAMPLES:
                samples = sorted(samples)
                self.times[h] = samples[len(samples) // 2]
                self.measured += 1
                self._record(overrides, h, samples)
                self.progress.step(f"{self.block.name} {json.dumps(overrides)}: "
                                   f"{format_seconds(self.times[h])}")
            elif h in result.failed:
                self.broken[h] = result.failed[h]
                self.failed += 1
                self.progress.step(f"{self.block.name} {json.dumps(overrides)}: failed: "
                                   f"{result.failed[h]}")

    def failures(self) -> list[dict[str, Any]]:
        """Why measurements failed, by schedule (the first MAX_FAILURES_KEPT)."""
        return [{"schedule": self.first_overrides.get(h, {}), "reason": why}
                for h, why in list(self.broken.items())[:MAX_FAILURES_KEPT]]

    def time_of(self, overrides: dict[str, Any]) -> float:
        made = self.kernel(overrides)
        return self.times.get(made[0], float("inf")) if made else float("inf")

    # --- searches -------------------------------------------------------------------------
    def run(self, mode: str) -> dict[str, Any]:
        default = self.kernel({})
        if default is None:
            return {"name": self.block.name, "signature": self.group.signature[:16],
                    "blocks": len(self.group.blocks), "genes": [], "candidates": 0,
                    "measured": 0, "reused": 0, "failed": 0, "best": {}, "best_ms": None,
                    "default_ms": None, "failures": [], "note": self.default_problem()}
        genes = self.relevant_genes() if mode == "full" else []
        quick = self.quick_candidates()
        if mode == "reuse":
            self.evaluate([{}, *self.stored_overrides()])
        elif mode == "quick" and len(quick) > 1:
            self.evaluate(quick)
        elif mode == "full" and genes:
            self.evolve(genes, quick)
        default_s = self.times.get(default[0])
        best_h = min(self.times, key=self.times.get, default=None)
        best = self.first_overrides[best_h] if best_h else {}
        if default_s is None:  # never compare against a default we could not time
            best, best_h = {}, default[0]
        return {"name": self.block.name, "signature": self.group.signature[:16],
                "blocks": len(self.group.blocks), "genes": [g.name for g in genes],
                "candidates": len(self.times), "measured": self.measured, "reused": self.reused,
                "failed": self.failed, "best": best,
                "best_ms": _ms(self.times[best_h]) if best_h in self.times else None,
                "default_ms": _ms(default_s) if default_s else None,
                "failures": self.failures(),
                "note": "" if default_s else self.default_problem()}

    def default_problem(self) -> str:
        """Why the group kept its default schedule without a comparison."""
        made = self.kernels.get(json.dumps({}, sort_keys=True))
        if made is None:
            return ("out of time before its first kernel" if time.monotonic() >= self.deadline
                    else "the default schedule's kernel cannot be generated")
        if made[0] in self.broken:
            return f"the default kernel could not be measured: {self.broken[made[0]]}"
        return "the default kernel was not measured in time"

    def relevant_genes(self) -> list[space.Gene]:
        """Genes whose first or last alternative changes this block's code (code generation
        takes tens of ms for a large block: probing every alternative would cost seconds)."""
        base = self.kernel({})[0]
        out = []
        for gene in space.genes(self.target):
            probes = {0: gene.alternatives[1], 1: gene.alternatives[-1]}.values()
            if any((made := self.kernel(alt)) is not None and made[0] != base for alt in probes):
                out.append(gene)
        return out

    def quick_candidates(self) -> list[dict[str, Any]]:
        """The default, the partitioner's alternatives for this block, then `space.QUICK`'s."""
        seen: set[str] = set()
        out = []
        planned = self.plan.schedule_candidates.get(self.block.id, ())
        initial = (self.initial,) if self.initial else ()
        for overrides in ({}, *initial, *planned, *space.QUICK):
            made = self.kernel(dict(overrides))
            if made is None or made[0] in seen:
                continue
            seen.add(made[0])
            out.append(dict(overrides))
            if len(out) == space.QUICK_MAX:
                break
        return out

    def evolve(self, genes: list[space.Gene], seeds: list[dict[str, Any]]) -> None:
        rng = random.Random(int(self.group.signature[:12], 16))
        if not genes:
            self.evaluate(seeds)
            return

        def overrides(genome: tuple[int, ...]) -> dict[str, Any]:
            return space.merge([g.alternatives[i] for g, i in zip(genes, genome)])

        def random_genome() -> tuple[int, ...]:
            return tuple(rng.randrange(len(g.alternatives)) for g in genes)

        def mutate(genome: tuple[int, ...]) -> tuple[int, ...]:
            out = list(genome)
            positions = [i for i in range(len(genes)) if rng.random() < 1.0 / len(genes)]
            for i in positions or [rng.randrange(len(genes))]:
                out[i] = rng.randrange(len(genes[i].alternatives))
            return tuple(out)

        population = [tuple(0 for _ in genes)]
        while len(population) < POPULATION:
            population.append(random_genome())
        self.evaluate(seeds + [overrides(g) for g in population])
        for _ in range(GENERATIONS):
            if time.monotonic() >= self.deadline:
                return
            ranked = sorted(set(population), key=lambda g: self.time_of(overrides(g)))
            ranked = [g for g in ranked if self.time_of(overrides(g)) < float("inf")] or ranked
            children = ranked[:ELITE]
            seen = {self.kernel(overrides(g))[0] for g in children if self.kernel(overrides(g))}
            tries = 0
            while len(children) < POPULATION and tries < 20 * POPULATION:
                tries += 1
                a = min(rng.sample(ranked, min(2, len(ranked))), key=lambda g: self.time_of(overrides(g)))
                b = min(rng.sample(ranked, min(2, len(ranked))), key=lambda g: self.time_of(overrides(g)))
                child = mutate(tuple(x if rng.random() < 0.5 else y for x, y in zip(a, b)))
                made = self.kernel(overrides(child))
                if made is None or made[0] in seen:
                    continue
                seen.add(made[0])
                children.append(child)
            fresh = [g for g in children if self.kernel(overrides(g))
                     and self.kernel(overrides(g))[0] not in self.times]
            if not fresh:
                return  # converged: nothing new to try
            self.evaluate([overrides(g) for g in children])
            population = children
