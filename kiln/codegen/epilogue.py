"""Forward index maps along a path of ops: which element of a fused epilogue tensor an anchor's
result element becomes (used to fuse epilogues into anchor stages)."""
from __future__ import annotations

import math

from kiln.codegen.indexing import Index
from kiln.ecg import Graph, Op

Path = list[tuple[Op, str]]  # (op, the output followed)


def find_path(graph: Graph, members: set[str], source: str, target: str) -> Path | None:
    """Ops of the block leading from tensor `source` to tensor `target` (breadth-first)."""
    frontier: list[tuple[str, Path]] = [(source, [])]
    seen = {source}
    while frontier:
        nxt = []
        for tensor, path in frontier:
            for op in graph.consumers(tensor):
                if op.id not in members:
                    continue
                for out in op.outputs:
                    if out in seen:
                        continue
                    seen.add(out)
                    if out == target:
                        return path + [(op, out)]
                    nxt.append((out, path + [(op, out)]))
        frontier = nxt
    return None


def forward_index(graph: Graph, path: Path, index: Index) -> Index | None:
    """The element of the path's last tensor that element `index` of its first tensor becomes.

    Exact for element-order-preserving ops (flat offset kept), Transpose (permutation) and ops
    whose output has the shape of the followed input; None past an op that changes the element
    count (a broadcast: one result element feeds many). The builder verifies the result.
    """
    current = index
    for op, out in path:
        out_shape = graph.tensors[out].shape
        if op.op_type == "Transpose":
            perm = op.attrs.get("perm") or list(reversed(range(len(current.shape))))
            current = Index(out_shape, dims=[current.dims[p] for p in perm])
        elif math.prod(out_shape) == math.prod(current.shape):
            current = current.reshaped(out_shape)
        else:
            return None
    return current
