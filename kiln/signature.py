"""Kernel signatures: a content hash of a fused block that names the kernel, not the model.

Two blocks get the same signature exactly when they would compile to the same kernel and run in the
same time: the same op types with the same attributes and mapping types, in the same (topological)
order, on tensors of the same shapes and dtypes, wired the same way. The description uses
block-local positions only — "input k of op i is output j of op m" or "external input #n" — so
Kiln's tensor/op ids and the model's names never enter it, and the same block found in two models
hashes the same. Constant inputs (weights) are described by shape and dtype, not by value: a
kernel's latency does not depend on the weights. Attribute values, in contrast, are part of the
kernel, so numpy arrays in attributes are described by shape, dtype and a hash of their content.

`describe_block` returns the canonical JSON-able description (stored next to profile entries, so a
database row can be read without the model); `kernel_signature` is the sha256 of its canonical JSON.
"""
from __future__ import annotations

import enum
import hashlib
import json
import math
from typing import Any, Sequence

import numpy as np

from kiln.ecg import Graph, Op, Tensor

SIGNATURE_VERSION = 1


def canonical_json(value: Any) -> str:
    """Deterministic JSON text: sorted keys, no whitespace, ASCII only, no NaN/Infinity tokens."""
    return json.dumps(_canonical(value, "value"), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False)


def kernel_signature(graph: Graph, op_ids: Sequence[str]) -> str:
    """sha256 hex of the canonical description of the block `op_ids` of `graph`."""
    return signed_description(graph, op_ids)[0]


def signed_description(graph: Graph, op_ids: Sequence[str]) -> tuple[str, str]:
    """(`kernel_signature`, the canonical JSON it hashes) of the block `op_ids` of `graph`."""
    text = canonical_json(describe_block(graph, op_ids))
    return hashlib.sha256(text.encode("ascii")).hexdigest(), text


def block_ops(graph: Graph, op_ids: Sequence[str]) -> list[Op]:
    """The block's ops in graph topological order, duplicates dropped; unknown ids are an error."""
    if isinstance(op_ids, str):
        raise TypeError("op_ids must be a sequence of op ids, not a single string")
    ids = list(dict.fromkeys(op_ids))
    if not ids:
        raise ValueError("a block needs at least one op")
    unknown = [i for i in ids if i not in graph.op_by_id]
    if unknown:
        raise ValueError(f"ops not in graph {graph.name!r}: {', '.join(map(str, unknown[:5]))}")
    order = graph.order
    return [graph.op_by_id[i] for i in sorted(ids, key=order.__getitem__)]


def live_outputs(graph: Graph, ops: Sequence[Op]) -> set[str]:
    """Tensors produced by `ops` that are model outputs or read by an op outside the block."""
    inside = {op.id for op in ops}
    model_outputs = set(graph.outputs)
    return {t for op in ops for t in op.outputs
            if t in model_outputs or any(c.id not in inside for c in graph.consumers(t))}


def describe_block(graph: Graph, op_ids: Sequence[str]) -> dict[str, Any]:
    """The canonical, JSON-able description of a block that `kernel_signature` hashes.

    {"version": 1,
     "externals": [{"shape", "dtype", "constant"}, ...],          # numbered by first use
     "ops": [{"op_type", "attrs", "mapping",
              "inputs": [{"shape", "dtype", "from": ["ext", n] | ["op", m, j]} | null, ...],
              "outputs": [{"shape", "dtype", "live": bool}, ...]}, ...]}

    `live` says whether an output leaves the block (read after it or a model output): a fused
    kernel writes those and keeps the others in registers, so it changes the kernel.
    """
    ops = block_ops(graph, op_ids)
    produced: dict[str, tuple[int, int]] = {}  # tensor id -> (op position, output position)
    externals: dict[str, int] = {}
    external_desc: list[dict[str, Any]] = []
    live = live_outputs(graph, ops)
    described = []
    for i, op in enumerate(ops):
        inputs: list[dict[str, Any] | None] = []
        for t in op.inputs:
            if t is None:
                inputs.append(None)
                continue
            tensor = graph.tensor(t)
            if t in produced:
                source: list[Any] = ["op", *produced[t]]
            else:
                if t not in externals:
                    externals[t] = len(externals)
                    external_desc.append({**_tensor_type(tensor), "constant": tensor.is_constant})
                source = ["ext", externals[t]]
            inputs.append({**_tensor_type(tensor), "from": source})
        outputs = []
        for j, t in enumerate(op.outputs):
            produced[t] = (i, j)
            outputs.append({**_tensor_type(graph.tensor(t)), "live": t in live})
        described.append({
            "op_type": op.op_type,
            "attrs": _canonical(op.attrs, f"attribute of {op.op_type} op {op.id}"),
            "mapping": op.mapping.name,
            "inputs": inputs,
            "outputs": outputs,
        })
    return {"version": SIGNATURE_VERSION, "externals": external_desc, "ops": described}


def _tensor_type(tensor: Tensor) -> dict[str, Any]:
    return {"shape": [int(d) for d in tensor.shape], "dtype": np.dtype(tensor.dtype).name}


def _array_desc(array: np.ndarray) -> dict[str, Any]:
    if array.dtype.hasobject:
        content = canonical_json(array.tolist()).encode("ascii")
    else:
        content = np.ascontiguousarray(array).tobytes()
    return {"shape": [int(d) for d in array.shape], "dtype": array.dtype.str,
            "sha256": hashlib.sha256(content).hexdigest()}


def _canonical(value: Any, where: str) -> Any:
    """Turn attribute values into plain JSON values, deterministically."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return {"__enum__": f"{type(value).__name__}.{value.name}"}
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else {"__float__": repr(f)}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": bytes(value).hex()}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": _array_desc(value)}
    if isinstance(value, Tensor):
        desc = _tensor_type(value)
        if value.data is not None:
            desc["data"] = _array_desc(np.asarray(value.data))
        return {"__tensor__": desc}
    if isinstance(value, Graph):
        return {"__graph__": {
            "inputs": [_tensor_type(value.tensor(t)) for t in value.inputs],
            "outputs": [_tensor_type(value.tensor(t)) for t in value.outputs],
            "body": describe_block(value, [op.id for op in value.ops]) if value.ops else None,
        }}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: dictionary key {k!r} is not a string")
            out[k] = _canonical(v, where)
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v, where) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [_canonical(v, where) for v in value]
        return {"__set__": sorted(items, key=lambda v: json.dumps(v, sort_keys=True))}
    raise TypeError(f"{where}: cannot describe a value of type {type(value).__name__} canonically")
