"""The driver's regions of a huge page or more (a model's weights) ask Linux for transparent
huge pages: streamed once per run, in 4 KiB pages the weights cost a TLB walk every 4 KiB."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.pipeline import CompileOptions, compile_artifact
from kiln.profile.local import default_store

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# in a process of its own: the anonymous huge pages it holds before and after loading the model
PROBE = """
import sys
import numpy as np
from kiln.runtime.artifact import open_artifact
from kiln.runtime.loader import CompiledModel

def huge_kib():
    text = open("/proc/self/smaps_rollup").read()
    return int(text.split("AnonHugePages:")[1].split()[0])

before = huge_kib()
model = CompiledModel(open_artifact(sys.argv[1]), 1)
model.run(np.ones((1, 1024), np.float32))
print(huge_kib() - before)
"""


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages on this machine")
def test_weights_of_megabytes_sit_in_huge_pages(tmp_path):
    w = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024])],
        [numpy_helper.from_array(w, "w")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    artifact = tmp_path / "m.kiln"
    compile_artifact(path, artifact, CompileOptions(), default_store(":memory:"))
    out = subprocess.run([sys.executable, "-c", PROBE, str(artifact)], check=True,
                         capture_output=True, text=True)
    assert int(re.findall(r"-?\d+", out.stdout)[-1]) >= 2048, out.stdout
