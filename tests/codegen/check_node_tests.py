"""Run the ONNX backend node tests whose ops are all in `supported_ops()` through the generated
kernels (the test harness, not the runtime) and compare with their stored outputs.

    python -m tests.codegen.check_node_tests [--filter SUBSTRING] [--partitioners none,dnnfusion]

Mirrors bench/onnx_node_tests.py: a test the frontend or `check_supported` refuses counts as
unsupported; floats must be within 1e-3·max|ref| + 1e-5, integers and bools exact.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.test.case import node as node_cases

from kiln import codegen, frontend
from kiln.errors import KilnError
from tests.codegen.harness import max_error, run_graph


def op_types(model: onnx.ModelProto) -> set[str]:
    found = set()
    for node in model.graph.node:
        found.add(node.op_type if node.domain in frontend.DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}")
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            found.add("<subgraph>")
    return found


def _arrays(values) -> list[np.ndarray]:
    return [numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)
            for v in values]


def frozen(case, inputs: list[np.ndarray]) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """The model with every input but the first turned into an initializer (so values such as
    Resize scales or TopK's k are constants), and the inputs left."""
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    initializers = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    for name, value in list(zip(names, inputs))[1:]:
        model.graph.initializer.append(numpy_helper.from_array(value, name))
    return model, inputs[:1]


def run_case(case, partitioners: list[str], freeze: bool = False) -> tuple[str, str]:
    model = case.model
    missing = op_types(model) - set(codegen.supported_ops())
    if missing:
        return "unsupported", ", ".join(sorted(missing))
    if not all(v.type.HasField("tensor_type") for v in (*model.graph.input, *model.graph.output)):
        return "unsupported", "non-tensor values"
    initializers = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    for inputs, expected in case.data_sets:
        inputs, expected = _arrays(inputs), _arrays(expected)
        if freeze:
            model, inputs = frozen(case, inputs)
        feeds = dict(zip(names, inputs))
        try:
            graph = frontend.build(model, {n: a.shape for n, a in feeds.items()}, case.name)
            codegen.check_supported(graph)
        except KilnError as exc:
            return "unsupported", str(exc).splitlines()[0][:200]
        for p in partitioners:
            try:
                got = run_graph(graph, p, feeds)
            except Exception as exc:  # noqa: BLE001
                return "failed", f"[{p}] {type(exc).__name__}: {str(exc)[:300]}"
            for k, (g, w) in enumerate(zip(got, expected)):
                if g.shape != w.shape or g.dtype != w.dtype:
                    return "failed", f"[{p}] output {k}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
                err, allowed = max_error(g, w)
                if err > allowed:
                    return "failed", f"[{p}] output {k}: max|diff| {err:.3g} > {allowed:.3g}"
    return "passed", ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--filter", default="")
    parser.add_argument("--partitioners", default="none,dnnfusion")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--freeze", action="store_true",
                        help="make every input but the first a constant")
    args = parser.parse_args(argv)
    partitioners = args.partitioners.split(",")
    counts: Counter = Counter()
    for case in node_cases.collect_testcases(None):
        if args.filter not in case.name or case.kind != "node":
            continue
        try:
            status, reason = run_case(case, partitioners, args.freeze)
        except Exception:  # noqa: BLE001
            status, reason = "failed", traceback.format_exc().splitlines()[-1]
        counts[status] += 1
        if status == "failed" or (args.verbose and status == "unsupported"):
            print(f"{status.upper():11s} {case.name}: {reason}", flush=True)
    print(f"passed {counts['passed']}  failed {counts['failed']}  unsupported {counts['unsupported']}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
