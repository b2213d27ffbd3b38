"""Peak memory of a Kiln artifact against onnxruntime: peak RSS of a fresh process that loads the
model and runs it once, measured side by side for each model (each contender in its own child
process, so neither sees the other's pages).

    python bench/peak_memory.py [--models bert-base] [--threads 2]

Prints peak RSS in MiB for the artifact (dnnfusion plan, loaded through `kiln.load`), for
onnxruntime (ORT_ENABLE_ALL, the same threads), the ratio artifact/ort, and the baseline of a
child that only imports the same Python modules (what both pay before loading anything).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys
sys.path.insert(0, {root!r})
import numpy as np
from bench.zoo import make_inputs
which, name, path, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if which == "kiln":
    import kiln
    inputs = make_inputs(name)
    model = kiln.load(path, threads=threads)
    model.run(inputs)
elif which == "ort":
    import onnxruntime as ort
    inputs = make_inputs(name)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    session.run(None, inputs)
else:
    import kiln, onnxruntime
    make_inputs(name)
# VmHWM, not ru_maxrss: the latter keeps the parent's high-water mark across fork + exec
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({{"peak_rss_kib": int(hwm.split()[1])}}))
"""


def peak_mib(which: str, name: str, path: Path, threads: int) -> float:
    script = CHILD.format(root=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script, which, name, str(path), str(threads)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{which} on {name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_kib"] / 1024


def main() -> int:
    from bench.zoo import MODELS, ensure_model
    from kiln.pipeline import CompileOptions, compile_artifact
    from kiln.profile.local import default_store

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert-base", help="comma-separated zoo names")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s): {', '.join(unknown)}")
    print(f"peak RSS (MiB) of a process that loads the model and runs it once, {args.threads} threads")
    print(f"{'model':16} {'kiln':>9} {'ort':>9} {'kiln/ort':>9} {'imports only':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            onnx_path = ensure_model(name)
            artifact = Path(tmp) / f"{name}.kiln"
            compile_artifact(onnx_path, artifact, CompileOptions(), default_store())
            kiln_mib = peak_mib("kiln", name, artifact, args.threads)
            ort_mib = peak_mib("ort", name, onnx_path, args.threads)
            base = peak_mib("base", name, onnx_path, args.threads)
            print(f"{name:16} {kiln_mib:9.1f} {ort_mib:9.1f} {kiln_mib / ort_mib:9.2f} {base:13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
