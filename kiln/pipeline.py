"""The compiler as a list of named stages: frontend → rewrite → plan → codegen → build."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kiln import codegen, frontend, tune
from kiln.ecg import Graph
from kiln.plan import FusionPlan, partitioner
from kiln.profile import ProfileStore
from kiln.report import fusion_report
from kiln.rewrite import RewriteResult, rewrite
from kiln.runtime.artifact import build_artifact
from kiln.target import target

StageCallback = Callable[[str], None]


@dataclass(frozen=True)
class CompileOptions:
    partitioner: str = "dnnfusion"
    shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    target: str = "host"  # see kiln.target.TARGET_NAMES
    rewrite: bool = True  # math-property graph rewriting (kiln.rewrite) before planning
    tune: str = "off"  # schedule tuning before codegen: "off", "quick" or "full" (kiln.tune)
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


def compile_model(path: str | Path, options: CompileOptions, store: ProfileStore,
                  on_stage: StageCallback | None = None) -> Compilation:
    choose = partitioner(options.partitioner)  # an unknown name fails before any work
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
                     store: ProfileStore, on_stage: StageCallback | None = None) -> dict[str, Any]:
    """Compile a model into an artifact at `out_path`; return the report (see kiln.runtime.artifact)."""
    build_target = target(options.target)  # an unknown target fails before any work
    tune.check_mode(options.tune)
    tune.check_budget(options.tune_budget)
    result = compile_model(model_path, options, store, on_stage)
    clock = _Stopwatch(on_stage)
    schedules: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    if options.tune != "off":
        tuned = clock.run("tune", tune.tune_plan, result.plan, build_target, store, options.tune,
                          options.tune_budget)
        schedules, extra = tuned.block_schedules, {"tuning": tuned.report}
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
