"""FusionStitching's performance library through the tuner: `--tune quick` measures a stitched
block's shortlisted schedules into the profile store, and the next plan of the model ranks them
by those measurements."""
from __future__ import annotations

from onnx import helper

from kiln import frontend
from kiln.plan import partitioner
from kiln.plan.stitch_tuning import STITCH_KEY
from kiln.profile.local import default_store
from kiln.target import host_target
from kiln.tune import tune_plan
from tests.codegen.harness import model

SPEC = {"x": ((8, 64, 64), "float32")}


def test_a_miss_is_measured_by_the_tuner_and_read_back_as_a_hit(tmp_path):
    nodes = [helper.make_node("Softmax", ["x"], ["a"], axis=2),
             helper.make_node("Softmax", ["a"], ["y"], axis=1)]
    graph = frontend.build(model(nodes, SPEC, ["y"]), {}, "test")
    store = default_store(tmp_path / "profiles.sqlite")
    plan = partitioner("fusionstitching")(graph, store)
    (block,) = plan.blocks
    planned = {plan.schedules[block.id][STITCH_KEY]} | {
        c[STITCH_KEY] for c in plan.schedule_candidates[block.id]}
    assert 0 in planned and len(planned) >= 2
    assert not store.schedules(graph, list(block.op_ids))  # nothing in the library yet

    tuned = tune_plan(plan, host_target(), store, "quick", budget_s=120)
    assert tuned.measured >= len(planned)
    threads = tuned.report["threads"]
    measured = {}
    for schedule, median in store.schedules(graph, list(block.op_ids)):
        if schedule.get("threads") == threads and set(schedule) == {STITCH_KEY, "threads", "kernel"}:
            measured[schedule[STITCH_KEY]] = min(median, measured.get(schedule[STITCH_KEY], median))
    assert planned <= set(measured)

    again = partitioner("fusionstitching")(graph, store)
    best = min(planned, key=lambda b: (measured[b], b))
    assert again.schedules.get(block.id, {STITCH_KEY: 0})[STITCH_KEY] == best
