"""A roofline cost model of fused kernels: the ProfileStore answer when nothing was measured.

For a block B run as one fused kernel on a machine with measured peak P (FLOP/s, float32 matmul),
bandwidth W (bytes/s, streaming add), and L2 size L2:

    seconds = max(T_compute, T_memory) + T_redundant + LAUNCH

    T_compute   = F_ci / P + F_other / (P · E)
    T_memory    = (bytes_in + bytes_out + bytes_penalty) / W
    T_redundant = F_redundant / (P · E)

* F_ci: FLOPs (`op.flops`) of compute-intensive ops (`op.compute_intensive`: Conv, MatMul, …),
  assumed to run at the measured peak. F_other: all other FLOPs, at efficiency E = 0.25 of peak
  (elementwise and reduction loops get no FMA pairing, about half the peak, and share issue slots
  with their loads and stores, about half again).
* bytes_in: every tensor read from outside the block (activations and constants), once.
  bytes_out: every tensor the block produces that is a model output or read after the block, once.
  Intermediates stay in registers/cache and cost nothing: this is the saving that fusion buys.
* LAUNCH = 2 µs: the fixed cost of one kernel — the call and its parallel loops' hand-offs to
  the threads, with the caches the next kernel finds (calibrated when each loop was an OpenMP
  parallel region, a fork/join of a few µs; Kiln's pool hands a loop off in about 0.2 µs).
  Fusing two kernels saves one LAUNCH.

Two charges model what makes yellow fusions (DNNFusion §3.2) unprofitable:

(a) Redundant computation. When a One-to-Many op C in the block broadcasts a tensor that an op P in
    the block computed, and P is not a Many-to-Many op (a reduction or anchor, whose result the
    kernel keeps and reuses), the fused kernel recomputes P's producer chain for every output
    element of C that reads the same value: F_redundant += F_chain · (R − 1), where the chain is P
    and its ancestors inside the block reached without crossing a Many-to-Many op, and R is the
    broadcast factor numel(C.out) / numel(P.out) less the part a loop nest hoists: with shapes
    aligned from the right and v the innermost axis along which P.out varies (extent > 1),
    replication along axes inner to v reuses one value held in a register (a per-row statistic
    broadcast along a row, a computed scalar), so R = numel(C.out) / numel(P.out) / ∏ C.out[v+1:].
    Exp on [1,1,N] broadcast to [1,M,N] gives R = M; Sqrt on [1,M,1] broadcast to [1,M,N], R = 1.
    The recomputed work sits in every output element's dependency chain (the value cannot be
    hoisted out of the loop), so it is added, not overlapped with memory time.
(b) Non-contiguous access. A Shuffle op (Transpose, DepthToSpace, …) in a block that contains a
    Many-to-Many op, or whose result feeds (within the block) a One-to-Many op, makes the fused loop
    walk its data input T in a permuted order. When T is larger than the L2 cache (or 1 MiB when
    the L2 size is unknown), T's traffic costs SHUFFLE_PENALTY = 4× its bytes (a strided walk uses
    a fraction of each cache line and defeats the prefetchers); T read from outside the block was
    already counted once, so (penalty − 1)·bytes(T) is added, and penalty·bytes(T) for T computed
    in the block. Compute-bound anchors (large MatMul/Conv) hide this under T_compute, as real
    GEMMs hide a transposed operand in their packing.
    One case pays more, whatever T's size: a transposition that moves the channel axis of a
    depthwise conv's result (computed in the block) to the innermost position. Kiln computes a
    depthwise conv one channel plane per parallel task (`kiln.codegen.ops.conv`), so the fused
    kernel stores every result element C floats away from the last one, and the threads'
    neighbouring channels share each cache line they write: every element costs a cache line
    (CACHE_LINE_BYTES) of traffic. Measured on a Zen 4 with 2 threads, ConvNeXt-T's 28×28×192
    block (T 0.6 MB, inside the L2) ran 1.5 ms fused against 0.3 ms for the conv and the
    transposition apart. The same transposition of a GEMM-form conv's result is not charged:
    its micro-tiles store runs of channels per pixel.

Everything is deterministic: the same block and machine facts give the same seconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from kiln.ecg import Graph, Op
from kiln.mapping import MappingType
from kiln.profile import COST_MODEL, MEASURED, Estimate
from kiln.profile.machine import MachineFacts
from kiln.signature import block_ops, live_outputs

LAUNCH_OVERHEAD_S = 2e-6
ELEMENTWISE_EFFICIENCY = 0.25
SHUFFLE_PENALTY = 4.0
DEFAULT_L2_BYTES = 1 << 20
CACHE_LINE_BYTES = 64


@dataclass(frozen=True)
class Breakdown:
    """The terms of one roofline estimate, for reports and tests."""

    compute_flops: int  # on compute-intensive ops, at peak
    other_flops: int  # at ELEMENTWISE_EFFICIENCY
    redundant_flops: float
    bytes_in: int
    bytes_out: int
    penalty_bytes: float
    compute_s: float
    memory_s: float
    redundant_s: float
    launch_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.redundant_s + self.launch_s


class RooflineModel:
    """ProfileStore that predicts block latency from FLOPs, bytes and measured machine figures.

    It only answers `latency`; `record` raises, because a formula cannot learn: measurements go to
    a store that keeps them (`SQLiteProfileStore`, which uses this model for its misses).
    """

    def __init__(self, machine: MachineFacts, *, launch_overhead_s: float = LAUNCH_OVERHEAD_S,
                 elementwise_efficiency: float = ELEMENTWISE_EFFICIENCY,
                 shuffle_penalty: float = SHUFFLE_PENALTY):
        if not (machine.peak_gflops > 0 and machine.bandwidth_gbs > 0):
            raise ValueError("machine facts need positive peak_gflops and bandwidth_gbs")
        if not 0 < elementwise_efficiency <= 1:
            raise ValueError("elementwise_efficiency must be in (0, 1]")
        if launch_overhead_s < 0 or shuffle_penalty < 1:
            raise ValueError("launch_overhead_s must be >= 0 and shuffle_penalty >= 1")
        self.machine = machine
        self.launch_overhead_s = launch_overhead_s
        self.elementwise_efficiency = elementwise_efficiency
        self.shuffle_penalty = shuffle_penalty
        self.cache_threshold_bytes = machine.l2_bytes or DEFAULT_L2_BYTES

    def latency(self, graph: Graph, op_ids: Sequence[str]) -> Estimate:
        return Estimate(self.breakdown(graph, op_ids).seconds, COST_MODEL)

    fallback = None  # the model itself is what other stores fall back on

    def record(self, graph: Graph, op_ids: Sequence[str], seconds: float | Sequence[float],
               source: str = MEASURED, schedule: dict[str, Any] | None = None,
               toolchain: str = "") -> None:
        raise NotImplementedError(
            "RooflineModel is a cost model and keeps no measurements; record them in a "
            "SQLiteProfileStore (kiln.profile.local.default_store())")

    def schedules(self, graph: Graph, op_ids: Sequence[str]) -> list[tuple[dict[str, Any], float]]:
        return []  # a formula has measured no schedule

    def breakdown(self, graph: Graph, op_ids: Sequence[str]) -> Breakdown:
        ops = block_ops(graph, op_ids)
        inside = {op.id for op in ops}
        produced = {t: op for op in ops for t in op.outputs}

        external = {t for op in ops for t in op.present_inputs() if t not in produced}
        bytes_in = sum(graph.tensor(t).nbytes for t in external)
        bytes_out = sum(graph.tensor(t).nbytes for t in live_outputs(graph, ops))
        compute_flops = sum(op.flops for op in ops if op.compute_intensive)
        other_flops = sum(op.flops for op in ops if not op.compute_intensive)

        redundant = self._redundant_flops(graph, ops, produced)
        penalty = self._shuffle_penalty_bytes(graph, ops, produced, inside)

        peak, bw = self.machine.peak_flops, self.machine.bandwidth_bytes
        slow = peak * self.elementwise_efficiency
        return Breakdown(
            compute_flops=compute_flops, other_flops=other_flops, redundant_flops=redundant,
            bytes_in=bytes_in, bytes_out=bytes_out, penalty_bytes=penalty,
            compute_s=compute_flops / peak + other_flops / slow,
            memory_s=(bytes_in + bytes_out + penalty) / bw,
            redundant_s=redundant / slow,
            launch_s=self.launch_overhead_s,
        )

    # (a) -------------------------------------------------------------------------------------
    def _redundant_flops(self, graph: Graph, ops: list[Op], produced: dict[str, Op]) -> float:
        total = 0.0
        for consumer in ops:
            if consumer.mapping != MappingType.ONE_TO_MANY:
                continue
            if not consumer.outputs:
                continue
            out_shape = max((graph.tensor(t).shape for t in consumer.outputs), key=math.prod)
            for t in dict.fromkeys(consumer.present_inputs()):
                producer = produced.get(t)
                if producer is None or producer.mapping == MappingType.MANY_TO_MANY:
                    continue
                factor = _recompute_factor(out_shape, graph.tensor(t).shape)
                if factor > 1.0:
                    total += _chain_flops(producer, produced) * (factor - 1.0)
        return total

    # (b) -------------------------------------------------------------------------------------
    def _shuffle_penalty_bytes(self, graph: Graph, ops: list[Op], produced: dict[str, Op],
                               inside: set[str]) -> float:
        has_m2m = any(op.mapping == MappingType.MANY_TO_MANY for op in ops)
        extra = 0.0
        for op in ops:
            if op.mapping != MappingType.SHUFFLE or not op.present_inputs():
                continue
            if not (has_m2m or _feeds_one_to_many(graph, op, inside)):
                continue
            data = op.present_inputs()[0]
            nbytes = graph.tensor(data).nbytes
            if _scatters_planes(graph, op, produced):
                extra += graph.tensor(data).numel * CACHE_LINE_BYTES
                continue
            if nbytes <= self.cache_threshold_bytes:
                continue
            already_counted = 0 if data in produced else nbytes
            extra += self.shuffle_penalty * nbytes - already_counted
        return extra


def _scatters_planes(graph: Graph, shuffle: Op, produced: dict[str, Op]) -> bool:
    """Does `shuffle` move the channel axis of a depthwise conv's result, computed in the block
    plane by plane, to the innermost position (so that the planes are stored with a stride)?"""
    conv = produced.get(shuffle.present_inputs()[0])
    if conv is None or conv.op_type != "Conv" or shuffle.op_type != "Transpose":
        return False
    x, out = graph.tensor(conv.inputs[0]).shape, graph.tensor(conv.outputs[0]).shape
    group = conv.attrs.get("group", 1)
    if len(out) < 3 or group <= 1 or x[1] != group:  # depthwise: one input channel per group
        return False
    perm = list(shuffle.attrs.get("perm") or reversed(range(len(out))))
    return perm[-1] == 1 and math.prod(out[2:]) > 1


def _recompute_factor(out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> float:
    """How many times each element of `in_shape` is recomputed to fill `out_shape` (see (a))."""
    in_numel, out_numel = math.prod(in_shape), math.prod(out_shape)
    if in_numel == 0 or out_numel <= in_numel:
        return 1.0
    factor = out_numel / in_numel
    if len(in_shape) <= len(out_shape):
        offset = len(out_shape) - len(in_shape)
        varying = [offset + k for k, d in enumerate(in_shape) if d > 1]
        inner = varying[-1] + 1 if varying else 0
        factor /= math.prod(out_shape[inner:])  # replication inside the innermost varying axis
    return max(factor, 1.0)


def _chain_flops(producer: Op, produced: dict[str, Op]) -> int:
    """FLOPs of `producer` and its in-block ancestors reached without crossing a Many-to-Many op."""
    seen: set[str] = set()
    stack = [producer]
    flops = 0
    while stack:
        op = stack.pop()
        if op.id in seen:
            continue
        seen.add(op.id)
        flops += op.flops
        for t in op.present_inputs():
            parent = produced.get(t)
            if parent is not None and parent.mapping != MappingType.MANY_TO_MANY:
                stack.append(parent)
    return flops


def _feeds_one_to_many(graph: Graph, shuffle: Op, inside: set[str]) -> bool:
    """Whether the shuffle's result reaches a One-to-Many op of the block through the block."""
    seen: set[str] = set()
    stack = [shuffle]
    while stack:
        op = stack.pop()
        for succ in graph.successors(op):
            if succ.id not in inside or succ.id in seen:
                continue
            if succ.mapping == MappingType.ONE_TO_MANY:
                return True
            seen.add(succ.id)
            stack.append(succ)
    return False
