"""The compiler as a list of named stages: frontend → plan (→ rewrite, codegen, build later)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kiln import frontend
from kiln.ecg import Graph
from kiln.plan import FusionPlan, partitioner
from kiln.profile import ProfileStore
from kiln.report import fusion_report

StageCallback = Callable[[str], None]


@dataclass(frozen=True)
class CompileOptions:
    partitioner: str = "dnnfusion"
    shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)


@dataclass
class Compilation:
    graph: Graph
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
    plan = clock.run("plan", choose, graph, store)
    return Compilation(graph, plan, fusion_report(graph, plan, clock.seconds, onnx_nodes))


def _frontend(model, options: CompileOptions, name: str) -> Graph:
    return frontend.build(model, options.shapes, name)
