"""Probe artifacts: fused blocks cut out of their models and built side by side, to be measured.

    probes = [make_probe(graph, block.op_ids, {"matmul_tile_m": 16}) for ...]
    built = build_probes(probes, target("host"), "probes.kiln")
    built.kernels  # {block id in the artifact: {"signature", "schedule", "description"}}

A probe is one block of a model (the ops of a fused kernel) with a schedule (a dict of overrides
of kiln.codegen.schedule.Schedule, kept opaque here). `build_probes` copies every probe's ops into
one graph — each probe a separate component, its tensors and ops renamed `p<i>_…` — plans each
probe as one block, generates and compiles all of them into one artifact, so one runner
invocation times every kernel (the runner's per-kernel times are the measurement).

A probe keeps its kernel signature (kiln.signature): the same op types, attributes, mapping types,
shapes, dtypes and wiring; outputs that left the block in the model leave it here (they are the
probe graph's outputs), the block's other inputs are graph inputs. Constant inputs stay constant:
integer and small constants (shapes, indices, scalars) keep their values, large float constants
(weights) are replaced by seeded random values of the same shape, shared between probes of one
artifact, since a kernel's time does not depend on its weights; the signature describes constants
by shape and dtype only. Probes whose extraction would change the signature (ops with subgraph
attributes), that form a view (no kernel), or whose kernel cannot be generated or compiled are
left out and listed in `skipped` with the reason.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kiln import codegen
from kiln.codegen.schedule import DEFAULT_SCHEDULE
from kiln.ecg import Graph, Op, Tensor
from kiln.errors import KilnError
from kiln.plan.blocks import build_plan
from kiln.runtime.artifact import build_artifact
from kiln.runtime.toolchain import ToolchainError, compiler_for
from kiln.signature import block_ops, canonical_json, describe_block, live_outputs

SHARED_CONSTANT_BYTES = 4096  # float constants larger than this get shared random values


@dataclass(frozen=True)
class Probe:
    graph: Graph
    op_ids: tuple[str, ...]
    schedule: Mapping[str, Any]
    signature: str
    description: str  # describe_block's canonical JSON

    @property
    def schedule_text(self) -> str:
        return canonical_json(dict(self.schedule))


class ProbeError(KilnError):
    """A block that cannot be measured on its own (the message says why)."""


def make_probe(graph: Graph, op_ids: Sequence[str], schedule: Mapping[str, Any] | None = None) -> Probe:
    ops = block_ops(graph, op_ids)
    for op in ops:
        if any(isinstance(v, Graph) for v in op.attrs.values()):
            raise ProbeError(f"{op.op_type} has a subgraph; it is measured with its model only")
    schedule = dict(schedule or {})
    description = canonical_json(describe_block(graph, [op.id for op in ops]))
    signature = hashlib.sha256(description.encode("ascii")).hexdigest()
    return Probe(graph, tuple(op.id for op in ops), schedule, signature, description)


@dataclass
class BuiltProbes:
    path: Path
    kernels: dict[str, dict[str, Any]]  # block id -> {"signature", "schedule", "description"}
    skipped: list[tuple[int, str]]  # (probe index, reason)
    toolchain: str


class _Merger:
    def __init__(self, seed: int = 0):
        self.tensors: dict[str, Tensor] = {}
        self.ops: list[Op] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.groups: list[list[str]] = []
        self.shared: dict[tuple, str] = {}
        self.rng = np.random.default_rng(seed)

    def shared_constant(self, tensor: Tensor, nth: int) -> str:
        key = (tensor.shape, tensor.dtype, nth)
        if key not in self.shared:
            name = f"w{len(self.shared)}"
            data = (self.rng.standard_normal(tensor.shape) * 0.05).astype(tensor.dtype)
            self.tensors[name] = Tensor(name, tuple(tensor.shape), tensor.dtype, name, data)
            self.shared[key] = name
        return self.shared[key]

    def add(self, index: int, probe: Probe) -> list[str]:
        graph = probe.graph
        ops = [graph.op_by_id[i] for i in probe.op_ids]
        live = live_outputs(graph, ops)
        produced = {t for op in ops for t in op.outputs}
        prefix = f"p{index}_"
        names: dict[str, str] = {}
        counts: dict[tuple, int] = {}
        inputs, outputs = [], []
        for op in ops:
            for t in op.present_inputs():
                if t in names or t in produced:
                    continue
                tensor = graph.tensor(t)
                if tensor.is_constant and np.dtype(tensor.dtype).kind == "f" \
                        and tensor.nbytes > SHARED_CONSTANT_BYTES:
                    key = (tensor.shape, tensor.dtype)
                    names[t] = self.shared_constant(tensor, counts.get(key, 0))
                    counts[key] = counts.get(key, 0) + 1
                    continue
                names[t] = prefix + t
                self.tensors[names[t]] = replace(tensor, id=names[t], source_name=names[t])
                if not tensor.is_constant:
                    inputs.append(names[t])
            for t in op.outputs:
                names[t] = prefix + t
                self.tensors[names[t]] = replace(graph.tensor(t), id=names[t],
                                                 source_name=names[t])
                if t in live:
                    outputs.append(names[t])
        if not outputs:
            raise ProbeError("the block has no output anything reads")
        new_ops = [replace(op, id=prefix + op.id, source_name="",
                           inputs=tuple(None if t is None else names[t] for t in op.inputs),
                           outputs=tuple(names[t] for t in op.outputs)) for op in ops]
        self.ops += new_ops
        self.inputs += inputs
        self.outputs += outputs
        return [op.id for op in new_ops]

    def graph(self, opset: int) -> Graph:
        return Graph(self.tensors, self.ops, self.inputs, self.outputs, opset, "probes")


_FAILED_KERNEL = re.compile(r"compiling kernel (k\d+_\w+) failed")


def _body_key(kernel) -> str:
    """A kernel's code without its own names: equal keys are the same machine code."""
    body = re.sub(rf"\b{re.escape(kernel.symbol)}", "K", kernel.source)
    body = re.sub(rf"\b{re.escape(kernel.symbol.split('_')[0])}_", "K_", body)
    body = re.sub(r"\(block [A-Za-z0-9_.:-]+, ", "(", body)
    body = re.sub(r"\bp\d+_", "p_", body)  # the probe's tensor prefix
    return hashlib.sha256(body.encode()).hexdigest()


def build_probes(probes: Sequence[Probe], build_target, out_path: str | Path,
                 cache=None, max_retries: int = 20, dedupe: bool = True) -> BuiltProbes:
    """Build one artifact measuring every probe that can be built (see the module docstring).

    With `dedupe`, probes of one signature whose schedules give the same code are measured once:
    the first is kept, the others are skipped ("same code as probe i").
    """
    skipped: list[tuple[int, str]] = []
    alive = []
    for i, pr in enumerate(probes):
        try:
            DEFAULT_SCHEDULE.merged(pr.schedule)
            alive.append(i)
        except (ValueError, TypeError) as exc:
            skipped.append((i, f"schedule: {exc}"))
    compiler = compiler_for(build_target)
    toolchain = f"{compiler.version} {' '.join(compiler.flags)}"[:200]
    for _attempt in range(max_retries):
        if not alive:
            raise ProbeError("no probe can be built: " + "; ".join(r for _, r in skipped[:3]))
        merger = _Merger()
        groups, kept = [], []
        for i in alive:
            try:
                groups.append(merger.add(i, probes[i]))
                kept.append(i)
            except ProbeError as exc:
                skipped.append((i, str(exc)))
        alive = kept
        if not alive:
            continue
        graph = merger.graph(max(p.graph.opset for p in probes))
        plan = build_plan(graph, groups, "probe")
        block_of = {i: plan.block_of[g[0]] for i, g in zip(alive, groups)}
        views = {b.id for b in plan.blocks if b.is_view}
        for i in [i for i in alive if block_of[i] in views]:
            skipped.append((i, "a view: no kernel runs"))
        alive = [i for i in alive if block_of[i] not in views]
        if not alive:
            continue
        try:
            kernels = codegen.generate(plan, build_target, block_schedules={
                block_of[i]: dict(probes[i].schedule) for i in alive})
        except (KilnError, ValueError, NotImplementedError, KeyError, AssertionError) as exc:
            bad = _failing_probes(probes, alive, build_target)
            if not bad:
                raise ProbeError(f"generating the probe kernels failed: {exc}") from exc
            skipped += [(i, f"codegen: {why}") for i, why in bad.items()]
            alive = [i for i in alive if i not in bad]
            continue
        symbol_of = {k.symbol: k.block_id for k in kernels}
        if dedupe:
            probe_of = {block_of[i]: i for i in alive}
            first: dict[tuple[str, str], int] = {}
            dupes = {}
            for k in kernels:
                i = probe_of.get(k.block_id)
                if i is None:
                    continue
                key = (probes[i].signature, _body_key(k))
                if key in first:
                    dupes[i] = f"same code as probe {first[key]}"
                else:
                    first[key] = i
            if dupes:
                skipped += list(dupes.items())
                alive = [i for i in alive if i not in dupes]
                continue
        try:
            build_artifact(plan, kernels, build_target, {"model": "probes"}, out_path, cache)
        except ToolchainError as exc:
            found = _FAILED_KERNEL.search(str(exc))
            block = symbol_of.get(found.group(1)) if found else None
            bad = [i for i in alive if block_of[i] == block]
            if not bad:
                raise
            skipped += [(i, f"build: {str(exc).splitlines()[0][:300]}") for i in bad]
            alive = [i for i in alive if i not in bad]
            continue
        built = {block_of[i]: {"signature": probes[i].signature,
                               "schedule": probes[i].schedule_text,
                               "description": probes[i].description} for i in alive}
        for i in alive:  # the copy must describe the same kernel as the original
            copied = describe_block(plan.graph, plan.blocks[int(block_of[i][1:])].op_ids)
            if canonical_json(copied) != probes[i].description:
                raise ProbeError(f"probe {i}: its copy has another signature than the block")
        return BuiltProbes(Path(out_path), built, skipped, toolchain)
    raise ProbeError(f"gave up after {max_retries} build attempts")


def _failing_probes(probes: Sequence[Probe], alive: Sequence[int], build_target) -> dict[int, str]:
    """Probes whose kernel cannot be generated on its own, with the reason."""
    bad = {}
    for i in alive:
        merger = _Merger()
        try:
            group = merger.add(i, probes[i])
            plan = build_plan(merger.graph(probes[i].graph.opset), [group], "probe")
            codegen.generate(plan, build_target, block_schedules={
                plan.blocks[0].id: dict(probes[i].schedule)})
        except Exception as exc:  # noqa: BLE001 - any lowering failure leaves that probe out
            bad[i] = f"{type(exc).__name__}: {exc}"[:300]
    return bad
