"""bench/latency.py takes .onnx files as well as zoo names: valid inputs for symbolic dims, and
every contender computes what onnxruntime computes."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.latency import bench_model, contenders, max_diff

VOCAB, WIDTH = 37, 8


def _embedding_model(path: Path) -> Path:
    """ids [batch, seq] (symbolic) -> Gather from a [VOCAB, WIDTH] table -> Relu -> sum over seq."""
    table = np.random.default_rng(0).standard_normal((VOCAB, WIDTH)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("Relu", ["e"], ["r"]),
             helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        [numpy_helper.from_array(table, "table"),
         numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_onnx_path_gets_inputs_of_the_given_shape_within_the_table(tmp_path: Path) -> None:
    model = bench_model(str(_embedding_model(tmp_path / "emb.onnx")), {"ids": (2, 300)})
    ids = model.inputs["ids"]
    assert model.name == "emb" and ids.shape == (2, 300) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < VOCAB and ids.max() > VOCAB // 2  # spans the table


def test_contenders_agree_with_onnxruntime(tmp_path: Path) -> None:
    model = bench_model(str(_embedding_model(tmp_path / "emb.onnx")), {"ids": (1, 16)})
    peers = ("ort", "ov") if _has_openvino() else ("ort",)
    calls, failures = contenders(model, 1, tmp_path, peers)
    assert not failures
    assert set(calls) == {"dnnfusion", "none", *peers}
    assert calls["dnnfusion"]()[0].shape == (1, WIDTH)
    assert all(diff < 1e-5 for diff in max_diff(calls).values())


def test_unknown_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="neither a model of the zoo"):
        bench_model(str(tmp_path / "missing.onnx"))


def _has_openvino() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def test_fusion_share_counts_only_models_with_removable_time() -> None:
    from bench.fusion_ceiling import fusion_share

    # none 10 ms of which 6 ms contractions: 4 ms removable, dnnfusion removed 3 of them.
    assert fusion_share(10.0, 6.0, 7.0) == pytest.approx(0.75)
    assert fusion_share(10.0, 9.6, 9.5) is None  # 0.4 ms removable: under 5 % of none
    assert fusion_share(10.0, 9.5, 10.2) == pytest.approx(-0.4)  # fused slower: negative share


def test_kernel_split_sums_each_run_before_taking_the_median() -> None:
    """Two contractions, each slow in a different run: the median of the runs' sums counts a slow
    run (3 ms in each), the sum of the kernels' medians (2 ms) drops both; runs without samples
    fall back to the medians."""
    from bench.fusion_ceiling import kernel_split
    plan = {"blocks": [{"id": "b0", "ops": [{"type": "MatMul"}]},
                       {"id": "b1", "ops": [{"type": "MatMul"}]},
                       {"id": "b2", "ops": [{"type": "Relu"}]}]}
    ms = 1_000_000
    kernels = [{"block": "b0", "median_ns": ms, "samples_ns": [ms, 2 * ms, ms]},
               {"block": "b1", "median_ns": ms, "samples_ns": [2 * ms, ms, ms]},
               {"block": "b2", "median_ns": ms, "samples_ns": [ms, ms, ms]}]
    timing = {"latency_ns": {"median": 4 * ms}, "kernels": kernels}
    split = kernel_split(timing, plan)
    assert (split.cil, split.mil) == (3.0, 1.0)
    bare = [{k: v for k, v in kernel.items() if k != "samples_ns"} for kernel in kernels]
    split = kernel_split({**timing, "kernels": bare}, plan)
    assert (split.cil, split.mil) == (2.0, 1.0)


def test_fusion_share_of_a_measurement_comes_from_per_round_ratios_and_the_cil_fraction() -> None:
    from bench.fusion_ceiling import KernelSplit, Measurement, row

    # The runner saw none spend 6 of 10 ms in contractions; in process, the machine slowed down
    # 2x between rounds, but dnnfusion took 0.7 of none's time in every round: share 0.75.
    split = {"none": KernelSplit(10.0, 6.0, 3.5), "dnnfusion": KernelSplit(7.5, 6.2, 0.5)}
    none = [0.010, 0.020, 0.011, 0.019, 0.012, 0.015]
    m = Measurement(split, {"none": none, "dnnfusion": [0.7 * t for t in none]},
                    {"none": none, "dnnfusion": [0.7 * t for t in none]})
    assert m.share(statistics.median(m.ratios("wall"))) == pytest.approx(0.75)
    assert m.round_shares("cpu") == pytest.approx([0.75] * 6)
    assert m.kernel_sum_share() == pytest.approx((9.5 - 6.7) / 3.5)
    text, verdict = row("m", m)
    assert verdict == "yes" and "0.75..0.75" in text


def test_rounds_that_straddle_the_target_leave_the_verdict_open() -> None:
    from bench.fusion_ceiling import KernelSplit, Measurement, median_interval, row

    ordered = list(range(100))
    assert median_interval(ordered) == (39, 60)  # the 40th and 61st of 100: 95 % for the median
    assert median_interval(ordered[:5]) is None
    split = {"none": KernelSplit(10.0, 6.0, 3.5), "dnnfusion": KernelSplit(7.5, 6.2, 0.5)}
    none = [0.010] * 12
    # dnnfusion/none alternates 0.6 and 0.8 (shares 1.0 and 0.5): the median is 0.75, the
    # rounds cannot tell which side of the target it is on.
    dnnf = [0.010 * (0.6 if r % 2 else 0.8) for r in range(12)]
    m = Measurement(split, {"none": none, "dnnfusion": dnnf}, {"none": none, "dnnfusion": dnnf})
    assert row("m", m)[1] == "?"
    m = Measurement(split, {"none": none, "dnnfusion": [0.0095] * 12},
                    {"none": none, "dnnfusion": [0.0095] * 12})
    assert row("m", m)[1] == "NO"


def test_interleaved_times_time_every_call_on_both_clocks() -> None:
    from bench.latency import interleaved_times

    def busy() -> None:  # 2 ms of CPU time, however long other processes hold the CPU
        end = time.process_time() + 0.002
        while time.process_time() < end:
            pass

    times = interleaved_times({"busy": busy, "idle": lambda: time.sleep(0.002)}, 3, 1,
                              settle_s=0.0)
    assert all(len(t["wall"]) == len(t["cpu"]) == 3 for t in times.values())
    busy_times = zip(times["busy"]["wall"], times["busy"]["cpu"])
    assert all(wall >= cpu - 1e-4 and cpu >= 0.002 for wall, cpu in busy_times)
    assert max(times["idle"]["cpu"]) < 0.001 < min(times["idle"]["wall"])


def test_tenth_percentile_shows_the_quiet_rounds_a_slow_phase_hides_from_the_median() -> None:
    from bench.latency import tenth_percentile, wall_ms

    # 20 rounds, 12 of them in a phase that slows one contender by a third and the other little
    kiln = [0.050] * 12 + [0.0375] * 8
    peer = [0.040] * 12 + [0.0375] * 8
    times = {"kiln": {"wall": kiln, "cpu": kiln}, "peer": {"wall": peer, "cpu": peer}}
    median, quiet = wall_ms(times, statistics.median), wall_ms(times, tenth_percentile)
    assert median["kiln"] / median["peer"] == pytest.approx(1.25)
    assert quiet == pytest.approx({"kiln": 37.5, "peer": 37.5})
    assert tenth_percentile([3.0, 1.0, 2.0]) == 1.0  # under ten values: the fastest
    assert tenth_percentile(list(range(20, 0, -1))) == 3  # the third of twenty


def test_partitioners_table_has_a_row_per_partitioner_and_peer(tmp_path: Path) -> None:
    import argparse

    from bench.partitioners import model_rows
    from kiln.plan import partitioner_names

    model = bench_model(str(_embedding_model(tmp_path / "emb.onnx")), {"ids": (1, 16)})
    args = argparse.Namespace(threads=1, rounds=2, warmup=1)
    rows, notes, ratios = model_rows(model, partitioner_names(), ("ort",), args, tmp_path)
    assert not notes
    assert [r[1] for r in rows] == [*partitioner_names(), "onnxruntime"]
    assert all(float(r[7]) < 1e-5 for r in rows)  # every build computes what onnxruntime does
    assert set(ratios) == set(partitioner_names())
