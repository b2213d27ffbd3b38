"""The compiler as a list of named stages: frontend → rewrite → plan → codegen → build.

Two optional callbacks follow a compile: `on_stage(stage)` as each stage starts, and
`on_progress(stage, done, total, what)` within the slow ones — each latency the planner looks up
(stage "plan"; `total` is 0 there, since the planner does not know in advance how many it asks)
and each kernel the tuner measures (stage "tune"). `what` is one line for a person to read.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kiln import codegen, frontend, tune
from kiln.ecg import Graph
from kiln.measure.farm import Farm
from kiln.plan import FusionPlan, for_target, partitioner
from kiln.profile import Estimate, ProfileStore, check_store
from kiln.report import fusion_report
from kiln.rewrite import RewriteResult, rewrite
from kiln.runtime.artifact import build_artifact
from kiln.target import target
from kiln.tune.search import ProgressCallback  # (stage, done, total, what)

StageCallback = Callable[[str], None]


@dataclass(frozen=True)
class CompileOptions:
    partitioner: str = "dnnfusion"
    shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    target: str = "host"  # see kiln.target.TARGET_NAMES
    rewrite: bool = True  # math-property graph rewriting (kiln.rewrite) before planning
    tune: str = tune.DEFAULT_MODE  # schedules before codegen: one of kiln.tune.TUNE_MODES
    tune_budget: float | None = None  # seconds for tuning (default kiln.tune.DEFAULT_BUDGET_S)


@dataclass
class Compilation:
    graph: Graph  # the ECG the plan partitions (after rewriting)
    plan: FusionPlan
    report: dict[str, Any]


class _Stopwatch:
    def __init__(self, on_stage: StageCallback | None):
        self.seconds: dict[str, float] = {}
        self.on_stage = on_stage

    def run(self, stage: str, fn: Callable, *args):
        if self.on_stage:
            self.on_stage(stage)
        start = time.perf_counter()
        result = fn(*args)
        self.seconds[stage] = time.perf_counter() - start
        return result


class _ReportingStore:
    """`store`, telling `on_progress` of every latency the planner looks up."""

    def __init__(self, store: ProfileStore, on_progress: ProgressCallback):
        self.store, self.on_progress = store, on_progress
        self.fallback = store.fallback
        self.lookups = 0

    def latency(self, graph: Graph, op_ids: Sequence[str]) -> Estimate:
        estimate = self.store.latency(graph, op_ids)
        self.lookups += 1
        kinds = "+".join(dict.fromkeys(graph.op_by_id[o].op_type for o in op_ids))
        self.on_progress("plan", self.lookups, 0, f"{kinds} ({len(op_ids)} ops): {estimate.source}")
        return estimate

    def record(self, *args, **kwargs) -> None:
        self.store.record(*args, **kwargs)

    def schedules(self, graph: Graph, op_ids: Sequence[str]):
        return self.store.schedules(graph, op_ids)


def compile_model(path: str | Path, options: CompileOptions, store: ProfileStore,
                  on_stage: StageCallback | None = None,
                  on_progress: ProgressCallback | None = None) -> Compilation:
    # an unknown name or target fails before any work
    choose = for_target(partitioner(options.partitioner), target(options.target))
    check_store(store)
    if on_progress:
        store = _ReportingStore(store, on_progress)
    clock = _Stopwatch(on_stage)
    model = clock.run("load", frontend.read_model, path)
    onnx_nodes = sum(1 for n in model.graph.node if n.op_type != "Constant")
    graph = clock.run("frontend", _frontend, model, options, Path(path).stem)
    rewritten = clock.run("rewrite", rewrite, graph) if options.rewrite else \
        RewriteResult.unchanged(graph)
    plan = clock.run("plan", choose, rewritten.graph, store)
    report = fusion_report(graph, plan, clock.seconds, onnx_nodes, rewritten)
    return Compilation(rewritten.graph, plan, report)


def compile_artifact(model_path: str | Path, out_path: str | Path, options: CompileOptions,
                     store: ProfileStore, on_stage: StageCallback | None = None,
                     on_progress: ProgressCallback | None = None,
                     farm: Farm | None = None) -> dict[str, Any]:
    """Compile a model into an artifact at `out_path`; return the report (see kiln.runtime.artifact).
    The artifact appears whole or not at all, also when the compile is interrupted. Tuning for
    a target this machine cannot run measures on `farm`'s device (kiln.measure.farm)."""
    build_target = target(options.target)  # an unknown target fails before any work
    tune.check_mode(options.tune)
    tune.check_budget(options.tune_budget)
    result = compile_model(model_path, options, store, on_stage, on_progress)
    clock = _Stopwatch(on_stage)
    schedules: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    if options.tune != "off":
        tuner = tune.tuner_for(partitioner(options.partitioner))
        tuned = clock.run("tune", partial(tuner, on_progress=on_progress, farm=farm),
                          result.plan,
                          build_target, store, options.tune, options.tune_budget)
        schedules = tuned.block_schedules
        if options.tune != tune.DEFAULT_MODE or schedules:  # quiet when nothing was reused
            extra = {"tuning": tuned.report}
    generate = partial(codegen.generate, block_schedules=schedules) if schedules else \
        codegen.generate
    kernels = clock.run("codegen", generate, result.plan, build_target)
    report = result.report | extra | {"seconds": result.report["seconds"] |
                                      _rounded(clock.seconds)}
    report = clock.run("build", build_artifact, result.plan, kernels, build_target, report, out_path)
    return report | {"seconds": report["seconds"] | _rounded(clock.seconds)}


def _rounded(seconds: dict[str, float]) -> dict[str, float]:
    return {stage: round(s, 4) for stage, s in seconds.items()}


def _frontend(model, options: CompileOptions, name: str) -> Graph:
    return frontend.build(model, options.shapes, name)
