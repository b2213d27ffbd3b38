"""Measured profiles against the roofline model: which plan of a model's yellow fusions is right?

Compiles one model twice with the dnnfusion partitioner: once as the service does (the workers'
DatabaseProfileStore on a fresh service database, which measures every yellow lookup it lacks on
this machine: each block built alone as a probe artifact and timed by the agents' measuring code),
once as `kiln compile` does with an empty profile database (every lookup answered by the roofline
model). Every yellow lookup of both compiles is recorded — (block + op, block, op) — so the
decisions can be compared one by one, each with the other side's estimate of the same kernels.
Then both artifacts run interleaved in this process (bench/latency.py's timing: rotating order,
a pause before every timed call) and in the runner (alternating halves), which says which plan
is faster end to end.

    python bench/yellow_plans.py [--model tests/fixtures/zoo/tinybert.onnx] [--threads 2]
                                 [--rounds 40] [--runs 200] [--keep DIR]
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.latency import bench_model, interleaved_medians, work_folder  # noqa: E402
from kiln.ecg import Graph  # noqa: E402
from kiln.pipeline import CompileOptions, compile_artifact  # noqa: E402
from kiln.profile import Estimate, ProfileStore  # noqa: E402
from kiln.profile.local import default_store  # noqa: E402
from kiln.profile.roofline import RooflineModel  # noqa: E402
from kiln.runtime.artifact import open_artifact  # noqa: E402
from kiln.runtime.execute import run_runner  # noqa: E402
from kiln.runtime.loader import CompiledModel  # noqa: E402

DEFAULT_MODEL = REPO / "tests" / "fixtures" / "zoo" / "tinybert.onnx"


@dataclass
class RecordingStore:
    """A ProfileStore that passes every call on to `inner` and keeps each latency answer."""

    inner: Any
    answers: list[tuple[tuple[str, ...], Estimate]] = field(default_factory=list)
    graph: Graph | None = None  # the graph the planner asked about (after rewriting)

    @property
    def fallback(self) -> ProfileStore | None:
        return getattr(self.inner, "fallback", None)

    def latency(self, graph: Graph, op_ids: Sequence[str]) -> Estimate:
        estimate = self.inner.latency(graph, op_ids)
        self.graph = graph
        self.answers.append((tuple(op_ids), estimate))
        return estimate

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def service_store(folder: Path):
    """The workers' store on a fresh service database in `folder` (measuring on this machine)."""
    from service.db import database
    from service.migrate import upgrade
    from service.settings import Settings
    from service.storage import Storage
    from workers.profile_store import DatabaseProfileStore

    settings = Settings(data_dir=folder / "service-data")
    upgrade(settings.database_url)
    return DatabaseProfileStore(database(settings.database_url), Storage(settings.storage_root),
                                settings, "host")


def yellow_triples(answers: list[tuple[tuple[str, ...], Estimate]]) -> list[tuple[Any, ...]]:
    """The (together, block, alone) lookups of `faster_fused`, in order: each is a latency query
    whose members are the union of the next two."""
    triples = []
    i = 0
    while i + 2 < len(answers):
        (together, t), (block, b), (alone, a) = answers[i:i + 3]
        if set(together) == set(block) | set(alone) and not set(block) & set(alone):
            triples.append((together, block, alone, t, b, a))
            i += 3
        else:
            i += 1
    return triples


def describe_decisions(label: str, compiled: dict, other: ProfileStore) -> None:
    graph = compiled["graph"]
    triples = yellow_triples(compiled["answers"])
    print(f"\n{label}: {compiled['kernels']} kernels, {len(triples)} yellow lookups "
          f"(sources: {dict(compiled['sources'])})")
    refused = [t for t in triples if t[3].seconds > t[4].seconds + t[5].seconds]
    print(f"  refused {len(refused)}, accepted {len(triples) - len(refused)}")
    print(f"  {'together us':>12s} {'block us':>9s} {'op us':>8s} {'verdict':>8s} | "
          f"{'other side: together':>20s} {'block':>8s} {'op':>8s} {'verdict':>8s}  op added")
    for together, block, alone, t, b, a in triples:
        ot, ob, oa = (other.latency(graph, list(ids)).seconds for ids in (together, block, alone))
        mine = "fuse" if t.seconds <= b.seconds + a.seconds else "refuse"
        theirs = "fuse" if ot <= ob + oa else "refuse"
        op = graph.op_by_id[alone[0]]
        print(f"  {t.seconds * 1e6:12.2f} {b.seconds * 1e6:9.2f} {a.seconds * 1e6:8.2f} "
              f"{mine:>8s} | {ot * 1e6:20.2f} {ob * 1e6:8.2f} {oa * 1e6:8.2f} {theirs:>8s}  "
              f"{op.op_type} (+{len(block)} ops)")


def compile_with(model, store, out: Path) -> dict:
    recording = RecordingStore(store)
    report = compile_artifact(model.path, out, CompileOptions(shapes=model.shapes), recording)
    sources: dict[str, int] = {}
    for _ids, estimate in recording.answers:
        sources[estimate.source] = sources.get(estimate.source, 0) + 1
    return {"kernels": report["compiled_kernels"], "answers": recording.answers,
            "sources": sources, "graph": recording.graph}


def runner_medians(artifacts: dict[str, Any], inputs, runs: int, threads: int) -> dict[str, float]:
    """Best of four alternating halves of the runner's median, in microseconds."""
    got: dict[str, list[float]] = {name: [] for name in artifacts}
    names = list(artifacts)
    for half in range(4):
        for name in names if half % 2 == 0 else names[::-1]:
            timing = run_runner(artifacts[name], inputs, runs, 20, threads, keep_outputs=False).timing
            got[name].append(timing["latency_ns"]["median"] / 1e3)
    return {name: min(values) for name, values in got.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40, help="in-process interleaved rounds")
    parser.add_argument("--runs", type=int, default=200, help="runs per runner call")
    parser.add_argument("--keep", type=Path, help="work in DIR and keep it")
    args = parser.parse_args(argv)
    model = bench_model(args.model)
    with work_folder(args.keep, "kiln-yellow-") as work:
        measured_store = service_store(work)
        roofline_store = default_store(":memory:")
        plans = {"measured": compile_with(model, measured_store, work / "measured.kiln"),
                 "roofline": compile_with(model, roofline_store, work / "roofline.kiln")}
        print(f"{model.name}: measuring store {measured_store.stats()}")
        describe_decisions("measured (service)", plans["measured"],
                           RooflineModel(roofline_store.machine))
        describe_decisions("roofline (kiln compile)", plans["roofline"], measured_store)
        artifacts = {name: open_artifact(work / f"{name}.kiln", work / "x" / name)
                     for name in plans}
        loaded = {name: CompiledModel(a, args.threads) for name, a in artifacts.items()}
        calls = {name: (lambda m=m: m.run(**model.inputs)) for name, m in loaded.items()}
        in_process = interleaved_medians(calls, args.rounds, 5)
        runner = runner_medians(artifacts, model.inputs, args.runs, args.threads)
        print(f"\nend to end, {args.threads} threads: in-process median of {args.rounds} "
              f"interleaved rounds; runner best of 4 alternating medians of {args.runs} runs")
        print(f"{'plan':10s} {'kernels':>7s} {'in-process us':>14s} {'runner us':>10s}")
        for name in plans:
            print(f"{name:10s} {plans[name]['kernels']:7d} {in_process[name] * 1e3:14.1f} "
                  f"{runner[name]:10.1f}")
        print(f"measured/roofline: in-process {in_process['measured'] / in_process['roofline']:.2f}, "
              f"runner {runner['measured'] / runner['roofline']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
