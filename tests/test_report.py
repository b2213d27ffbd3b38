"""`kiln compile` and its fusion report, on the tiny zoo models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cli import main

ZOO = Path(__file__).parent / "fixtures" / "zoo"
REPORT_KEYS = {"ops_before", "cil_before", "mil_before", "kernels", "fusion_rate", "irs_bytes_before",
               "irs_bytes_after", "yellow_lookups", "seconds"}


def compile_report(tmp_path, model: Path, *args: str) -> dict:
    out = tmp_path / f"{model.stem}.json"
    code = main(["compile", str(model), "--report-json", str(out), "--profile-db",
                 str(tmp_path / "profiles.sqlite"), *args])
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("model", sorted(ZOO.glob("*.onnx")), ids=lambda p: p.stem)
def test_report_keys_and_consistency(tmp_path, model):
    reports = {p: compile_report(tmp_path, model, "--partitioner", p) for p in ("none", "fixed", "dnnfusion")}
    for name, report in reports.items():
        assert REPORT_KEYS <= report.keys()
        assert report["partitioner"] == name
        assert report["cil_before"] + report["mil_before"] == report["ops_before"]
        assert report["fusion_rate"] == pytest.approx(report["ops_before"] / report["kernels"], rel=1e-3)
        assert 0 <= report["irs_bytes_after"] <= report["irs_bytes_before"]
        assert {"load", "frontend", "plan"} <= report["seconds"].keys()
    assert reports["none"]["kernels"] <= reports["none"]["ops_before"]
    assert reports["dnnfusion"]["kernels"] <= reports["fixed"]["kernels"] <= reports["none"]["kernels"]
    assert reports["none"]["yellow_lookups"] == 0


def test_fusion_reduces_intermediate_results_on_bert(tmp_path):
    report = compile_report(tmp_path, ZOO / "tinybert.onnx")
    assert report["kernels"] * 3 < report["ops_before"]
    assert report["irs_bytes_after"] * 2 < report["irs_bytes_before"]
    assert report["cil_before"] > 0 and report["yellow_lookups"] > 0


def test_cli_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx at all")
    assert main(["compile", str(bad), "--profile-db", str(tmp_path / "p.sqlite")]) == 2
    assert "bad.onnx is not a valid ONNX model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compile", str(bad), "--partitioner", "magic"])
    assert "invalid choice: 'magic'" in capsys.readouterr().err
