"""Fusion plans: an acyclic partition of the ECG into blocks, each compiled as one kernel.

All partitioners share one interface (`Partitioner`) and are chosen by name with `partitioner()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from kiln.ecg import Graph
from kiln.errors import PlanError
from kiln.mapping import MappingType
from kiln.profile import ProfileStore
from kiln.target import Target


@dataclass(frozen=True)
class Edge:
    """A tensor passed between two ops of one block, with the consumer's mapping type on it."""

    tensor: str
    producer: str
    consumer: str
    mapping: MappingType


@dataclass(frozen=True)
class Block:
    id: str
    name: str  # deterministic kernel name, e.g. fused_matmul_add_gelu
    op_ids: tuple[str, ...]  # topological order
    mapping: MappingType  # mapping type of the fused op (Table 3 composition)
    anchor: str | None  # the Many-to-Many op the block is built around, if any
    inputs: tuple[str, ...]  # tensors read from outside the block (activations and constants)
    outputs: tuple[str, ...]  # tensors used after the block or returned by the model
    edges: tuple[Edge, ...]  # tensors that stay inside the block: no buffer, an index map
    is_view: bool = False  # only Reorganize ops on one tensor: its outputs alias the input's bytes


@dataclass(frozen=True)
class Decision:
    """Why two ops were or were not fused."""

    first: str
    second: str
    fused: bool
    reason: str  # e.g. "green", "red: Many-to-Many + Many-to-Many", "measured slower"


@dataclass(frozen=True)
class FusionPlan:
    graph: Graph
    blocks: tuple[Block, ...]  # topological order
    partitioner: str
    decisions: tuple[Decision, ...] = ()
    yellow_lookups: int = 0
    block_of: dict[str, str] = field(default_factory=dict, compare=False)  # op id -> block id
    # Per block id, what a partitioner decided beyond the cut (an object with `to_json()`:
    # GraphTurbo's split, instances and buffer scopes); code generation may follow it.
    stages: Mapping[str, Any] = field(default_factory=dict, compare=False)
    notes: Mapping[str, Any] = field(default_factory=dict, compare=False)  # plan-wide, for the report
    # Schedule overrides (`kiln.codegen.schedule.Schedule` fields) a partitioner chose for some
    # blocks, which code generation applies under the tuner's, and alternatives for the tuner to
    # measure (FusionStitching's satisfiable schedules): block id -> overrides.
    schedules: dict[str, dict] = field(default_factory=dict, compare=False)
    schedule_candidates: dict[str, tuple[dict, ...]] = field(default_factory=dict, compare=False)

    @property
    def kernels(self) -> int:
        """Blocks that run code; view blocks only alias a buffer."""
        return sum(1 for b in self.blocks if not b.is_view)

    @property
    def irs_bytes(self) -> int:
        """Bytes of intermediate results still materialised between blocks."""
        outs = set(self.graph.outputs)
        return sum(self.graph.tensors[t].nbytes for b in self.blocks for t in b.outputs
                   if t not in outs)


class Partitioner(Protocol):
    name: str

    def __call__(self, graph: Graph, store: ProfileStore) -> FusionPlan: ...


_PARTITIONERS: dict[str, Callable[[], Partitioner]] = {}


def register_partitioner(name: str):
    def wrap(factory: Callable[[], Partitioner]):
        _PARTITIONERS[name] = factory
        return factory
    return wrap


def partitioner_names() -> list[str]:
    _load_partitioners()
    return sorted(_PARTITIONERS)


def partitioner(name: str) -> Partitioner:
    _load_partitioners()
    if name not in _PARTITIONERS:
        raise PlanError(f"unknown partitioner {name!r}; choose one of {', '.join(sorted(_PARTITIONERS))}")
    return _PARTITIONERS[name]()


def for_target(chosen: Partitioner, target: Target) -> Partitioner:
    """`chosen` with constraints from `target`'s device, for a partitioner whose constraints
    depend on the device (it has `for_target`); any other unchanged."""
    specialise = getattr(chosen, "for_target", None)
    return specialise(target) if specialise is not None else chosen


def _load_partitioners() -> None:
    from kiln.plan import (  # noqa: F401  (each registers itself)
        ago, dnnfusion, fixed, fusionstitching, graphturbo, none, souffle)
