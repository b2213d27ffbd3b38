"""The runtimes Kiln is benchmarked against, each set up as a user would for CPU latency with a
given number of threads: onnxruntime (all graph optimizations) and OpenVINO (f32, latency hint).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort


def ort_session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def openvino_request(path: Path, inputs: dict[str, np.ndarray], threads: int,
                     perf_count: bool = False):
    """An OpenVINO infer request for the model (CPU, f32, latency hint), symbolic dimensions
    fixed to the inputs' shapes; with `perf_count`, it times every layer it runs
    (`request.profiling_info`)."""
    try:
        import openvino as ov
    except ImportError:
        raise SystemExit("OpenVINO is not installed: pip install openvino (the `bench` extra), "
                         "or leave it out with --peers ort") from None
    core = ov.Core()
    model = core.read_model(str(path))
    model.reshape({name: ov.PartialShape(list(value.shape)) for name, value in inputs.items()})
    return core.compile_model(model, "CPU", {
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": "f32",
        "PERF_COUNT": perf_count,
    }).create_infer_request()


def openvino_call(path: Path, inputs: dict[str, np.ndarray], threads: int) -> Callable:
    """One OpenVINO inference on `inputs` (`openvino_request`), returning the outputs in the
    model's order."""
    request = openvino_request(path, inputs, threads)
    outputs = request.model_outputs

    def call() -> list[np.ndarray]:
        request.infer(inputs)
        return [request.get_tensor(o).data for o in outputs]
    return call
