"""Artifacts with hand-written kernels: build, load, call, runner, bad inputs, corruption, aarch64."""
from __future__ import annotations

import json
import subprocess
import zipfile

import numpy as np
import pytest

import kiln
from kiln.codegen import Kernel
from kiln.ecg import Graph, Op, Tensor
from kiln.errors import KilnError
from kiln.plan.blocks import build_plan
from kiln.runtime.artifact import (
    LIBRARY,
    MANIFEST,
    RUNNER,
    WEIGHTS,
    ArtifactError,
    build_artifact,
    open_artifact,
    read_manifest,
)
from kiln.runtime.execute import run_runner
from kiln.target import target
from tests.runtime.conftest import cross_toolchain_missing
from tests.runtime.handmade import Handmade, chain, mlp

X = np.random.default_rng(7).normal(size=(4, 8)).astype(np.float32)


def assert_outputs(got: list[np.ndarray], model: Handmade, x: np.ndarray) -> None:
    want = model.reference(x)
    for array, name in zip(got, ["y", "z", "x", "c", "y"]):
        np.testing.assert_allclose(array, want[name], rtol=1e-5, atol=1e-6)


def test_load_and_call_by_name_or_position(mlp_artifact, mlp_model):
    model = kiln.load(str(mlp_artifact))
    assert model.input_names == ["x"]
    by_name = model(x=X)
    assert list(by_name) == ["y", "z", "x", "c"]  # a dict: the duplicate "y" appears once
    assert_outputs(model.run(X), mlp_model, X)
    np.testing.assert_array_equal(model(X)["z"], by_name["z"])
    np.testing.assert_array_equal(model({"x": X})["z"], by_name["z"])  # a feed dict, as in ort
    with pytest.raises(KilnError, match="unknown input 'w'"):
        model({"w": X})


def test_each_call_returns_fresh_arrays(mlp_artifact):
    model = kiln.load(str(mlp_artifact))
    first = model.run(X)
    second = model.run(X + 1)
    assert not np.shares_memory(first[0], second[0])
    assert not np.array_equal(first[0], second[0])


def test_threads_come_from_the_argument(mlp_artifact, mlp_model):
    model = kiln.load(str(mlp_artifact), threads=1)
    assert model.threads == 1
    model.set_threads(2)
    assert model.threads == 2
    assert_outputs(model.run(X), mlp_model, X)


def test_manifest_plan_and_report(mlp_artifact):
    manifest = read_manifest(mlp_artifact)
    assert manifest["kiln_version"] == kiln.__version__
    assert manifest["inputs"] == [{"name": "x", "tensor": "x", "dtype": "float32", "shape": [4, 8]}]
    assert [o["name"] for o in manifest["outputs"]] == ["y", "z", "x", "c", "y"]
    assert manifest["target"]["arch"] == target("host").arch
    assert [k["symbol"] for k in manifest["kernels"]] == ["k0_matmul", "k1_fused_add_relu", "k2_add"]
    assert {WEIGHTS, LIBRARY, RUNNER, "plan.json", "report.json", "src/model.c", "src/runner.c",
            "src/kiln_model.h"} <= set(manifest["files"])
    with zipfile.ZipFile(mlp_artifact) as archive:
        plan = json.loads(archive.read("plan.json"))
        report = json.loads(archive.read("report.json"))
        assert len(archive.read(WEIGHTS)) == manifest["memory"]["weights_bytes"]
    assert plan["memory"]["arena_bytes"] == manifest["memory"]["arena_bytes"]
    assert [a["region"] for a in plan["kernels"][0]["args"]] == ["input", "weights", "arena"]
    assert report["model"] == "mlp"
    assert report["peak_memory_bytes"] == manifest["peak_memory_bytes"] > 0
    assert report["compiled_kernels"] == 3


def test_the_same_inputs_make_the_same_artifact(mlp_model, mlp_artifact, tmp_path):
    again = tmp_path / "again.kiln"
    build_artifact(mlp_model.plan, mlp_model.kernels, target("host"), {"model": "mlp"}, again)
    assert read_manifest(again)["content_hash"] == read_manifest(mlp_artifact)["content_hash"]


def test_runner_prints_timings_and_writes_the_same_outputs(mlp_artifact, mlp_model):
    artifact = open_artifact(mlp_artifact)
    result = run_runner(artifact, {"x": X}, runs=5, warmup=1, threads=1)
    timing = result.timing
    assert timing["runs"] == 5 and timing["warmup"] == 1 and timing["threads"] == 1
    latency = timing["latency_ns"]
    assert 0 < latency["min"] <= latency["p10"] <= latency["median"] <= latency["p90"] <= latency["max"]
    assert [(k["symbol"], k["block"]) for k in timing["kernels"]] == [
        ("k0_matmul", "b0"), ("k1_fused_add_relu", "b1"), ("k2_add", "b2")]
    assert all(k["median_ns"] > 0 for k in timing["kernels"])
    assert_outputs(result.outputs, mlp_model, X)
    in_process = kiln.load(str(mlp_artifact)).run(X)
    for a, b in zip(result.outputs, in_process):
        np.testing.assert_array_equal(a, b)


def test_runner_reports_its_measured_peak_resident_memory(tmp_path):
    """The runner touches every planned byte (inputs, outputs, arena), so its peak RSS is at least
    the plan's peak, with only its code and the C runtime on top — not the Python process that
    started it (getrusage's ru_maxrss would report that one's size)."""
    model = chain(4, size=2_000_000)  # 8 MB tensors: 16 MB of input and output, 16 MB of arena
    path = tmp_path / "chain.kiln"
    build_artifact(model.plan, model.kernels, target("host"), {"model": "chain"}, path)
    artifact = open_artifact(path)
    x = np.random.default_rng(0).normal(size=2_000_000).astype(np.float32)
    result = run_runner(artifact, {"x": x}, runs=2, warmup=0, threads=1)
    np.testing.assert_array_equal(result.outputs[0], model.reference(x)["y"])
    planned = artifact.manifest["peak_memory_bytes"]
    assert planned >= 32_000_000
    assert planned <= result.timing["peak_rss_bytes"] < planned + 16 * 2**20


def test_runner_threads_default_to_the_environment(mlp_artifact, tmp_path):
    artifact = open_artifact(mlp_artifact)
    np.save(tmp_path / "x.npy", X)
    done = subprocess.run([str(artifact.runner), "-n", "1", str(artifact.weights),
                           str(tmp_path / "x.npy")], capture_output=True, text=True, check=True,
                          env={"KILN_NUM_THREADS": "1"})
    assert json.loads(done.stdout)["threads"] == 1


@pytest.mark.parametrize(("call", "message"), [
    (lambda m: m(X, X), "takes 1 input"),
    (lambda m: m(y=X), "unknown input 'y'; the model's inputs are x"),
    (lambda m: m(), r"missing input\(s\) x; expected x: float32 \[4, 8\]"),
    (lambda m: m(X, x=X), "given twice"),
    (lambda m: m(x=X[:2]), r"input 'x' must be float32 \[4, 8\], got float32 \[2, 8\]"),
    (lambda m: m(x=X.astype(np.float64)), r"input 'x' must be float32 \[4, 8\], got float64"),
    (lambda m: m(x=[[1.0] * 8] * 4), r"input 'x' must be float32 \[4, 8\], got float64"),
])
def test_bad_inputs_to_a_loaded_model_are_named(mlp_artifact, call, message):
    model = kiln.load(str(mlp_artifact))
    with pytest.raises(KilnError, match=message):
        call(model)


def test_non_contiguous_inputs_are_accepted(mlp_artifact, mlp_model):
    wide = np.asfortranarray(X)
    assert_outputs(kiln.load(str(mlp_artifact)).run(wide), mlp_model, X)


def test_bad_input_files_to_the_runner_are_clear_errors(mlp_artifact, tmp_path):
    artifact = open_artifact(mlp_artifact)

    def runner(*files: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(artifact.runner), str(artifact.weights), *files],
                              capture_output=True, text=True, check=False)

    np.save(tmp_path / "short.npy", X[:3])
    np.save(tmp_path / "f64.npy", X.astype(np.float64))
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    np.save(tmp_path / "good.npy", X)
    (tmp_path / "cut.npy").write_bytes((tmp_path / "good.npy").read_bytes()[:-4])
    cases = {
        "short.npy": "holds dtype <f4 shape (3, 8); the model expects dtype <f4 shape (4, 8)",
        "f64.npy": "holds dtype <f8 shape (4, 8)",
        "junk.npy": "is not a .npy file",
        "cut.npy": "does not hold exactly 128 bytes",
        "missing.npy": "cannot open",
    }
    for name, message in cases.items():
        done = runner(str(tmp_path / name))
        assert done.returncode == 2, name
        assert message in done.stderr, (name, done.stderr)
    assert "1 input(s) but 2 input file(s)" in runner(str(tmp_path / "good.npy"),
                                                     str(tmp_path / "good.npy")).stderr
    bad_runs = subprocess.run([str(artifact.runner), "-n", "0", str(artifact.weights),
                               str(tmp_path / "good.npy")], capture_output=True, text=True, check=False)
    assert bad_runs.returncode == 2 and "-n RUNS must be an integer >= 1" in bad_runs.stderr
    assert runner(str(tmp_path / "good.npy")).returncode == 0
    done = subprocess.run([str(artifact.runner), str(tmp_path / "good.npy"),
                           str(tmp_path / "good.npy")], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "does not hold the" in done.stderr


def test_run_runner_checks_inputs_before_running(mlp_artifact):
    with pytest.raises(KilnError, match=r"input 'x' must be float32 \[4, 8\]"):
        run_runner(open_artifact(mlp_artifact), {"x": X[:1]})


def test_integer_and_bool_inputs(tmp_path):
    tensors = {"ids": Tensor("ids", (5,), "int64", "ids"), "flags": Tensor("flags", (5,), "bool", "flags"),
               "y": Tensor("y", (5,), "int64", "y")}
    graph = Graph(tensors, [Op("op0", "Where", ("flags", "ids", "ids"), ("y",))], ["ids", "flags"],
                  ["y"])
    plan = build_plan(graph, [["op0"]], "handmade")
    source = """#include <stdint.h>
void k0_where(void *const *args) {
    const int64_t *ids = args[0];
    const _Bool *flags = args[1];
    int64_t *y = args[2];
    for (int i = 0; i < 5; i++) y[i] = flags[i] ? ids[i] : -ids[i];
}
"""
    kernel = Kernel("k0_where", "b0", source, ("ids", "flags", "y"), ("y",))
    path = tmp_path / "where.kiln"
    build_artifact(plan, [kernel], target("host"), {}, path)
    ids = np.arange(5, dtype=np.int64)
    flags = np.array([True, False, True, False, True])
    want = np.where(flags, ids, -ids)
    np.testing.assert_array_equal(kiln.load(str(path))(ids=ids, flags=flags)["y"], want)
    np.testing.assert_array_equal(run_runner(open_artifact(path), {"ids": ids, "flags": flags}
                                             ).outputs[0], want)


# ---------------------------------------------------------------------------------------------
# Broken artifacts

def test_a_truncated_artifact_is_a_clear_error(mlp_artifact, tmp_path):
    cut = tmp_path / "cut.kiln"
    cut.write_bytes(mlp_artifact.read_bytes()[:-200])
    with pytest.raises(ArtifactError, match="not a Kiln artifact"):
        kiln.load(str(cut))


def test_a_corrupted_member_is_a_clear_error(mlp_artifact, tmp_path):
    data = bytearray(mlp_artifact.read_bytes())
    with zipfile.ZipFile(mlp_artifact) as archive:
        info = archive.getinfo(WEIGHTS)
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    data[start + 10] ^= 0xFF  # a byte of the stored weights
    bad = tmp_path / "bad.kiln"
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"corrupt: cannot read {WEIGHTS}"):
        open_artifact(bad, root=tmp_path / "extract")
    assert not list((tmp_path / "extract").iterdir())  # nothing half-extracted


def test_a_tampered_manifest_is_a_clear_error(mlp_artifact, tmp_path):
    forged = tmp_path / "forged.kiln"
    with zipfile.ZipFile(mlp_artifact) as src, zipfile.ZipFile(forged, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == MANIFEST:
                manifest = json.loads(data)
                manifest["files"][WEIGHTS] = "0" * 64
                data = json.dumps(manifest).encode()
            dst.writestr(item, data)
    with pytest.raises(ArtifactError, match="does not match its content hash"):
        open_artifact(forged, root=tmp_path / "extract")


def test_a_member_that_does_not_match_its_hash_is_a_clear_error(mlp_artifact, tmp_path):
    swapped = tmp_path / "swapped.kiln"
    with zipfile.ZipFile(mlp_artifact) as src, zipfile.ZipFile(swapped, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            dst.writestr(item, data[::-1] if item.filename == "plan.json" else data)
    with pytest.raises(ArtifactError, match="plan.json does not match its hash"):
        open_artifact(swapped, root=tmp_path / "extract")


def test_other_files_are_not_artifacts(tmp_path):
    with pytest.raises(ArtifactError, match="artifact not found"):
        kiln.load(str(tmp_path / "nothing.kiln"))
    text = tmp_path / "text.kiln"
    text.write_text("hello")
    with pytest.raises(ArtifactError, match="not a Kiln artifact"):
        kiln.load(str(text))
    empty_zip = tmp_path / "empty.kiln"
    zipfile.ZipFile(empty_zip, "w").close()
    with pytest.raises(ArtifactError, match="has no manifest.json"):
        kiln.load(str(empty_zip))


# ---------------------------------------------------------------------------------------------
# aarch64

@pytest.fixture(scope="module")
def aarch64_artifact(tmp_path_factory):
    reason = cross_toolchain_missing()
    if reason:
        pytest.skip(f"cannot cross-build for aarch64: {reason}")
    model = mlp()
    path = tmp_path_factory.mktemp("a64") / "mlp-aarch64.kiln"
    build_artifact(model.plan, model.kernels, target("aarch64"), {"model": "mlp"}, path)
    return model, path


def test_an_aarch64_artifact_runs_under_qemu_and_matches(aarch64_artifact):
    model, path = aarch64_artifact
    artifact = open_artifact(path)
    assert artifact.arch == "aarch64"
    result = run_runner(artifact, {"x": X}, runs=2, threads=2)
    assert result.timing["threads"] == 2
    assert_outputs(result.outputs, model, X)


def test_loading_an_artifact_for_another_architecture_is_refused(aarch64_artifact):
    _, path = aarch64_artifact
    if open_artifact(path).arch == target("host").arch:
        pytest.skip("this machine is aarch64")
    with pytest.raises(ArtifactError, match="built for aarch64 .* under qemu"):
        kiln.load(str(path))
