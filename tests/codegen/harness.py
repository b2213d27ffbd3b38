"""A test-only runner for generated kernels: compile a plan's kernels with gcc, call them in plan
order on numpy buffers (the kernel ABI of `kiln.codegen`), and compare with onnxruntime."""
from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from kiln import frontend
from kiln.codegen import Kernel, generate
from kiln.codegen.microkernel import vector_extension_source
from kiln.ecg import Graph
from kiln.plan import FusionPlan, partitioner
from kiln.profile.machine import host_machine
from kiln.profile.roofline import RooflineModel
from kiln.target import Target, host_target

CFLAGS = ("-O2", "-fopenmp-simd", "-pthread", "-shared", "-fPIC")
BUILD_DIR = Path(tempfile.gettempdir()) / "kiln-codegen-tests"
PARTITIONERS = ("none", "fixed", "dnnfusion", "graphturbo", "fusionstitching")
_STORE: list[RooflineModel] = []


PARALLEL_CALL = re.compile(r"kiln_parallel_for\((\w+), &kiln_c, (\d+), (\d+), KILN_POOL_(\w+)\);")


def parallel_loops(source: str) -> list[tuple[int, int, str]]:
    """(iterations, chunk, mode) of every parallel loop a kernel hands to the thread pool, in
    source order; mode is "DYNAMIC", "EVEN" or "CYCLIC"."""
    return [(int(total), int(chunk), mode) for _, total, chunk, mode in PARALLEL_CALL.findall(source)]


def store() -> RooflineModel:
    if not _STORE:
        _STORE.append(RooflineModel(host_machine()))
    return _STORE[0]


def plan_for(graph: Graph, name: str) -> FusionPlan:
    return partitioner(name)(graph, store())


def compile_kernels(kernels: Sequence[Kernel]) -> ctypes.CDLL:
    """All kernels in one translation unit (their helpers are guarded), cached by content hash."""
    source = "\n".join(k.source for k in kernels)
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    lib = BUILD_DIR / f"k{digest}.so"
    if not lib.exists():
        src = BUILD_DIR / f"k{digest}.c"
        src.write_text(source)
        tmp = lib.with_suffix(".tmp.so")
        subprocess.run(["gcc", *CFLAGS, *host_target().cflags, str(src), "-o", str(tmp), "-lm"],
                       check=True, capture_output=True, text=True)
        tmp.rename(lib)
    return ctypes.CDLL(str(lib))


def _filled(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """An output buffer full of a sentinel, so elements a kernel forgets to write show up."""
    if np.dtype(dtype).kind == "f":
        return np.full(shape, np.nan, dtype=dtype)
    return np.full(shape, 0x5A, dtype=dtype)


def run_kernels(plan: FusionPlan, kernels: Sequence[Kernel],
                feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the kernels in plan order; `feeds` maps graph input tensor ids to arrays."""
    graph = plan.graph
    lib = compile_kernels(kernels)
    values: dict[str, np.ndarray] = {t: np.array(v, dtype=graph.tensors[t].dtype, order="C")
                                     for t, v in feeds.items()}
    for t in graph.tensors.values():
        if t.is_constant:
            values[t.id] = np.array(t.data, order="C")
    for kernel in kernels:
        for name, array in kernel.derived_constants.items():
            values[name] = np.array(array, order="C")
        for t in kernel.outputs:
            values[t] = _filled(graph.tensors[t].shape, graph.tensors[t].dtype)
        pointers = [values[a].ctypes.data for a in kernel.args]
        scratch = None
        if kernel.scratch_bytes:
            scratch = np.empty(kernel.scratch_bytes + 64, dtype=np.uint8)
            pointers.append(scratch.ctypes.data + (-scratch.ctypes.data) % 64)
        args = (ctypes.c_void_p * max(len(pointers), 1))(*pointers)
        fn = getattr(lib, kernel.symbol)
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = None
        fn(ctypes.cast(args, ctypes.c_void_p))
    return values


def run_graph(graph: Graph, partitioner_name: str, inputs: Mapping[str, np.ndarray],
              on: Target | None = None) -> list[np.ndarray]:
    """Plan, generate for target `on` (default: this machine; built with its flags) and run;
    `inputs` are in the order of the graph's inputs (a dict keyed by the model's input names
    keeps that order)."""
    plan = plan_for(graph, partitioner_name)
    kernels = generate(plan, on or host_target())
    feeds = dict(zip(graph.inputs, inputs.values()))
    values = run_kernels(plan, kernels, feeds)
    return [values[t] for t in graph.outputs]


def reference(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in inputs.items() if k in names})


def max_error(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max |got - want|, allowed) with allowed = 1e-3·max|want| + 1e-5; NaNs must match."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.dtype.kind not in "fc":
        return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)),
                            initial=0.0)), 0.0
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    with np.errstate(invalid="ignore"):
        err = np.max(np.abs(g[finite] - w[finite]), initial=0.0)
    specials_differ = (np.isnan(g) != np.isnan(w)) | (np.isinf(w) & (g != w))
    if specials_differ.any():
        err = np.inf
    scale = np.max(np.abs(w[np.isfinite(w)]), initial=0.0)
    return float(err), 1e-3 * float(scale) + 1e-5


def assert_matches(got: Sequence[np.ndarray], want: Sequence[np.ndarray], what: str = "") -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, f"{what} output {k}: dtype {g.dtype} != {w.dtype}"
        err, allowed = max_error(g, w)
        assert err <= allowed, f"{what} output {k}: max |diff| {err} > {allowed}"


def check_model(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray],
                partitioners: Sequence[str] = PARTITIONERS, on: Target | None = None) -> None:
    """The generated kernels of every partitioner's plan (for target `on`, default this
    machine) match onnxruntime on `model`."""
    want = reference(model, inputs)
    graph = frontend.build(model, {}, "test")
    for name in partitioners:
        got = run_graph(graph, name, inputs, on)
        assert_matches(got, want, f"[{name}]")


def avx2_micro_kernel(kernel, folder: Path):
    """`kernel` (a `kiln.codegen.microkernel.MicroKernel`) built alone for AVX2 with gcc, as a
    ctypes function (a test skips where there is no gcc)."""
    import pytest

    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    path = folder / "ukr.c"
    path.write_text("#include <stdint.h>\n" + vector_extension_source(kernel).replace(
        "static __attribute__((noinline)) ", "") + "\n")
    lib = folder / "ukr.so"
    subprocess.run(["gcc", "-O2", "-mavx2", "-mfma", "-shared", "-fPIC", str(path), "-o",
                    str(lib)], check=True, capture_output=True)
    return getattr(ctypes.CDLL(str(lib)), kernel.function)


# --- building small models ------------------------------------------------------------------------
def prefetched_offsets(kernel, body: str, b_floats: int, folder: Path) -> set[int]:
    """The float offsets from `b` (`b_floats` long) of the lines a micro-kernel asks for ahead in
    `body`, C statements that declare `b` and call the kernel, built with GCC with
    `__builtin_prefetch` recording its pointer."""
    path = folder / "prefetch.c"
    path.write_text(
        "#include <stdint.h>\n#include <stdio.h>\n#include <stdlib.h>\n"
        "static const char *asked[1 << 16]; static int count;\n"
        "#define __builtin_prefetch(p) (asked[count++] = (const char *)(p))\n"
        + vector_extension_source(kernel) + f"""
int main(void) {{
{body}
  for (int i = 0; i < count; i++)
    if (asked[i] >= (const char *)b && asked[i] < (const char *)(b + {b_floats}))
      printf("%ld\\n", (long)((const float *)asked[i] - b));
  return 0;
}}
""")
    subprocess.run(["gcc", "-O1", "-march=native", str(path), "-o", str(folder / "prefetch")],
                   check=True, capture_output=True)
    out = subprocess.run([str(folder / "prefetch")], check=True, capture_output=True, text=True)
    return {int(line) for line in out.stdout.split()}


def model(nodes, inputs: Mapping[str, tuple[tuple[int, ...], str]],
          outputs: Sequence[str], initializers: Mapping[str, np.ndarray] | None = None,
          opset: int = 17) -> onnx.ModelProto:
    """A model from nodes; inputs map names to (shape, numpy dtype); output types are inferred."""
    graph = helper.make_graph(
        list(nodes), "test",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(d)), s)
         for n, (s, d) in inputs.items()],
        [onnx.ValueInfoProto(name=o) for o in outputs],
        [onnx.numpy_helper.from_array(np.asarray(v), n) for n, v in (initializers or {}).items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    inferred = onnx.shape_inference.infer_shapes(m)
    del m.graph.output[:]
    known = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output)
             if v.type.tensor_type.HasField("shape")}
    if any(o not in known for o in outputs):
        known = _ran_output_types(m, inputs, outputs)
    m.graph.output.extend(known[o] for o in outputs)
    return m


def _ran_output_types(m: onnx.ModelProto, inputs, outputs) -> dict[str, onnx.ValueInfoProto]:
    """Output types onnx's shape inference cannot give (function ops): run once and look."""
    probe = onnx.ModelProto()
    probe.CopyFrom(m)
    probe.graph.output.extend(onnx.ValueInfoProto(name=o) for o in outputs)
    values = reference(probe, random_inputs(inputs))
    return {o: helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for o, v in zip(outputs, values)}


def random_inputs(spec: Mapping[str, tuple[tuple[int, ...], str]],
                  seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, dtype) in spec.items():
        kind = np.dtype(dtype).kind
        if kind == "f":
            out[name] = rng.standard_normal(shape).astype(dtype)
        elif kind == "b":
            out[name] = rng.random(shape) < 0.5
        else:
            out[name] = rng.integers(-20 if kind == "i" else 0, 20, size=shape).astype(dtype)
    return out


def intensive_stages(kernels: Sequence[Kernel]) -> list[dict]:
    """The stages AGO's intensive fusion generated, as the kernels' schedules record them."""
    return [s for k in kernels for s in k.schedule["stages"] if "intensive" in str(s.get("form"))]


def check_ago_tiles(onnx_model: onnx.ModelProto, x: np.ndarray,
                    tile_bytes: int) -> tuple[Graph, FusionPlan, list[Kernel]]:
    """Plans `onnx_model` (one input) with ago, every block's intensive tile capped at
    `tile_bytes`, and checks the kernels' outputs against onnxruntime's."""
    want = reference(onnx_model, {"x": x})
    graph = frontend.build(onnx_model, {}, "test")
    plan = plan_for(graph, "ago")
    overrides = {b.id: {"intensive_tile_bytes": tile_bytes} for b in plan.blocks}
    kernels = generate(plan, host_target(), block_schedules=overrides)
    values = run_kernels(plan, kernels, {graph.inputs[0]: x})
    assert_matches([values[t] for t in graph.outputs], want, "[ago]")
    return graph, plan, kernels
