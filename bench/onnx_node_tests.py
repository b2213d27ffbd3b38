"""Run the ONNX backend node tests shipped with the onnx package against Kiln.

Every test whose operators are all in `kiln.codegen.supported_ops()` is compiled (at the shapes
of its stored inputs) with each partitioner, run through the loader, and compared with its stored
outputs: floats within max|diff| <= 1e-3·max|ref| + 1e-5, integers and bools exactly. A test the
code generator's `check_supported` refuses (for example a dtype it lacks) counts as unsupported.

    python bench/onnx_node_tests.py [--partitioners none,dnnfusion] [--filter SUBSTRING] [-j 2]
                                    [--target opencl]

`--target` compiles for another target this machine runs (default: host), e.g. `opencl`: the
kernels then run on this machine's OpenCL device (PoCL on a CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.test.case import node as node_cases

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln import codegen, frontend
from kiln.errors import KilnError, ShapeError
from kiln.pipeline import CompileOptions, compile_artifact
from kiln.profile.local import default_store
from kiln.files import cache_dir
from kiln.runtime.artifact import open_artifact
from kiln.runtime.cli import compare
from kiln.runtime.loader import CompiledModel
from kiln.target import TARGET_NAMES

SHIPPED_NODE_TESTS = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
NOT_TENSORS = "NOT_TENSORS"  # marks a test whose inputs or outputs are sequences, maps, optionals
FROZEN = "integer inputs frozen"  # a pass with shape-giving inputs compiled in as constants
MARK = "OUTCOME "  # prefix of the lines a worker reports outcomes on


@dataclass(frozen=True)
class Outcome:
    test: str
    partitioner: str
    status: str  # "passed", "failed" or "unsupported"
    reason: str = ""  # unsupported: "ops: …" (not in supported_ops), "values: …" (not tensors),
    # or "refused: …" (the frontend or check_supported refused the model, e.g. run-time shapes)


def node_tests_dir() -> Path:
    """The shipped node-test data, or (wheels without it) the same data made by onnx's own test
    case generators, written once to $KILN_CACHE_DIR/onnx-node-tests/<onnx version>."""
    if SHIPPED_NODE_TESTS.is_dir():
        return SHIPPED_NODE_TESTS
    folder = cache_dir() / "onnx-node-tests" / onnx.__version__
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
        try:
            for case in node_cases.collect_testcases(None):
                _write_case(staging / case.name, case)
            os.rename(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _write_case(folder: Path, case) -> None:
    folder.mkdir()
    (folder / "model.onnx").write_bytes(case.model.SerializeToString())
    tensors_only = all(v.type.HasField("tensor_type")
                       for v in (*case.model.graph.input, *case.model.graph.output))
    if not tensors_only:
        (folder / NOT_TENSORS).touch()
        return
    for i, (inputs, outputs) in enumerate(case.data_sets):
        data_set = folder / f"test_data_set_{i}"
        data_set.mkdir()
        for prefix, values in (("input", inputs), ("output", outputs)):
            for j, value in enumerate(values):
                proto = value if isinstance(value, onnx.TensorProto) else numpy_helper.from_array(value)
                (data_set / f"{prefix}_{j}.pb").write_bytes(proto.SerializeToString())


def op_types(model: onnx.ModelProto) -> set[str]:
    found = set()
    for node in model.graph.node:
        found.add(node.op_type if node.domain in frontend.DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}")
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            found.add("<subgraph>")
    return found


def read_tensors(folder: Path, prefix: str) -> list[np.ndarray]:
    files = sorted(folder.glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[-1]))
    arrays = []
    for path in files:
        tensor = onnx.TensorProto()
        tensor.ParseFromString(path.read_bytes())
        arrays.append(numpy_helper.to_array(tensor))
    return arrays


def run_test(test_dir: Path, partitioners: tuple[str, ...], work: Path,
             target: str = "host") -> list[Outcome]:
    name = test_dir.name
    model = onnx.load(str(test_dir / "model.onnx"), load_external_data=False)
    missing = op_types(model) - set(codegen.supported_ops())
    if missing:
        return [Outcome(name, p, "unsupported", "ops: " + ", ".join(sorted(missing)))
                for p in partitioners]
    if (test_dir / NOT_TENSORS).exists():
        return [Outcome(name, p, "unsupported", "values: sequences, maps or optionals")
                for p in partitioners]
    data_sets = [(read_tensors(d, "input"), read_tensors(d, "output"))
                 for d in sorted(test_dir.glob("test_data_set_*"))]
    return [_run_with(test_dir, model, data_sets, p, work, target) for p in partitioners]


def _run_with(test_dir: Path, model: onnx.ModelProto, data_sets, partitioner: str,
              work: Path, target: str) -> Outcome:
    name = test_dir.name
    failures = []
    frozen = False
    for index, (inputs, expected) in enumerate(data_sets):
        try:
            path, feeds = _compilable(test_dir, model, inputs, work / f"{name}-{index}.onnx")
        except KilnError as exc:
            return Outcome(name, partitioner, "unsupported", f"refused: {_first_line(exc)}")
        frozen |= len(feeds) < len(inputs)
        out = work / f"{name}-{partitioner}-{index}.kiln"
        shapes = {n: a.shape for n, a in feeds.items()}
        try:
            compile_artifact(path, out, CompileOptions(partitioner=partitioner, shapes=shapes,
                                                       target=target),
                             default_store(":memory:"))
            got = CompiledModel(open_artifact(out, work / "extracted"), threads=1).run(**feeds)
        except KilnError as exc:
            return Outcome(name, partitioner, "failed", _summary(exc))
        if len(got) != len(expected):
            failures.append(f"set {index}: {len(got)} outputs, expected {len(expected)}")
        for position, (array, want) in enumerate(zip(got, expected)):
            row = compare(f"output {position}", array, want)
            if not row["ok"]:
                failures.append(f"set {index} output {position}: max|diff| {row['max_abs']:.3g} "
                                f"max|ref| {row['max_ref']:.3g} {row['note']}".strip())
    if failures:
        return Outcome(name, partitioner, "failed", "; ".join(failures[:2]))
    return Outcome(name, partitioner, "passed", FROZEN if frozen else "")


def _compilable(test_dir: Path, model: onnx.ModelProto, inputs: list[np.ndarray],
                frozen_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The model Kiln can compile for these inputs, and its inputs by name.

    Kiln compiles for static shapes. When an output's shape depends on an input's values (axes,
    shapes, pads given as inputs), the integer inputs become constants holding the test's values.
    """
    initializers = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    feeds = dict(zip(names, inputs))
    path = test_dir / "model.onnx"
    try:
        codegen.check_supported(frontend.load(path, {n: a.shape for n, a in feeds.items()}))
        return path, feeds
    except ShapeError as exc:
        if "run-time values" not in str(exc):
            raise
    fixed = {n: a for n, a in feeds.items() if a.dtype.kind in "iu"}
    specialized = onnx.ModelProto()
    specialized.CopyFrom(model)
    kept = [i for i in specialized.graph.input if i.name not in fixed]
    del specialized.graph.input[:]
    specialized.graph.input.extend(kept)
    specialized.graph.initializer.extend(numpy_helper.from_array(a, n) for n, a in fixed.items())
    onnx.save(specialized, str(frozen_path))
    feeds = {n: a for n, a in feeds.items() if n not in fixed}
    codegen.check_supported(frontend.load(frozen_path, {n: a.shape for n, a in feeds.items()}))
    return frozen_path, feeds


def _summary(exc: Exception) -> str:
    """The first line, and the compiler's first error line when there is one."""
    lines = str(exc).strip().splitlines()
    error = next((line.strip() for line in lines[1:] if "error:" in line), "")
    return " ".join([_first_line(exc), error]).strip()


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def drive(tests: list[Path], partitioners: tuple[str, ...], work: Path,
          target: str = "host") -> list[Outcome]:
    """Run `tests` in worker processes, one after another; a test that kills its worker fails."""
    outcomes: list[Outcome] = []
    remaining = list(tests)
    while remaining:
        done = subprocess.run([sys.executable, __file__, "--worker", str(work),
                               "--partitioners", ",".join(partitioners), "--target", target,
                               *map(str, remaining)],
                              capture_output=True, text=True, check=False)
        finished = [Outcome(*json.loads(line[len(MARK):])) for line in done.stdout.splitlines()
                    if line.startswith(MARK)]
        outcomes += finished
        names = {o.test for o in finished}
        remaining = [d for d in remaining if d.name not in names]
        if remaining and done.returncode != 0:
            crashed = remaining.pop(0)
            outcomes += [Outcome(crashed.name, p, "failed", f"the process died (exit status "
                                 f"{done.returncode})") for p in partitioners]
    return outcomes


def worker(tests: list[Path], partitioners: tuple[str, ...], work: Path, target: str) -> None:
    for test_dir in tests:
        try:
            outcomes = run_test(test_dir, partitioners, work, target)
        except Exception as exc:  # noqa: BLE001 (a bug in one test must not stop the others)
            outcomes = [Outcome(test_dir.name, p, "failed", f"{type(exc).__name__}: "
                                f"{_first_line(exc)}") for p in partitioners]
        for o in outcomes:
            print(MARK + json.dumps([o.test, o.partitioner, o.status, o.reason]), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitioners", default="none,dnnfusion")
    parser.add_argument("--filter", default="", help="only tests whose name contains this")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("-v", "--verbose", action="store_true", help="list unsupported tests too")
    parser.add_argument("--target", default="host", choices=TARGET_NAMES,
                        help="compile for this target; it must run on this machine (default: host)")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("tests", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    partitioners = tuple(args.partitioners.split(","))
    if args.worker:
        worker(args.tests, partitioners, Path(args.worker), args.target)
        return 0
    tests = sorted(d for d in node_tests_dir().iterdir()
                   if args.filter in d.name and (d / "model.onnx").is_file())
    with tempfile.TemporaryDirectory(prefix="kiln-node-tests-") as tmp:
        shares = [tests[i::args.jobs] for i in range(args.jobs)]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            batches = pool.map(lambda share: drive(share, partitioners, Path(tmp), args.target),
                               shares)
            outcomes = sorted((o for batch in batches for o in batch),
                              key=lambda o: (o.test, o.partitioner))
    report(outcomes, partitioners, args.verbose)
    return 1 if any(o.status == "failed" for o in outcomes) else 0


def report(outcomes: list[Outcome], partitioners: tuple[str, ...], verbose: bool) -> None:
    print(f"ONNX backend node tests from {node_tests_dir()} (onnx {onnx.__version__})")
    for p in partitioners:
        counts = Counter(o.status for o in outcomes if o.partitioner == p)
        mine = [o for o in outcomes if o.partitioner == p]
        why = Counter(o.reason.split(":")[0] for o in mine if o.status == "unsupported")
        frozen = sum(o.status == "passed" and o.reason == FROZEN for o in mine)
        print(f"partitioner {p:10s} passed {counts['passed']:4d} ({frozen} with {FROZEN})  "
              f"failed {counts['failed']:4d}  unsupported {counts['unsupported']:4d} ("
              + ", ".join(f"{kind} {n}" for kind, n in sorted(why.items())) + ")")
    for o in outcomes:
        if o.status == "failed" or (verbose and o.status == "unsupported"):
            print(f"  {o.status.upper():11s} [{o.partitioner}] {o.test}: {o.reason}")


if __name__ == "__main__":
    sys.exit(main())
