"""Latency after idle pauses: how long the thread pool's workers spin before they sleep
(KILN_SPIN_US, `kiln/codegen/render/pool.c`) trades a quiet machine's latency for a loaded one's.

For each model and each spin time, a process of its own (the pool reads the variable when it
starts its workers) runs the artifact in-process (the loader) and times one call after each pause of
`--pause` seconds (a request arriving at an idle server), and calls back to back. With `--busy N`
it does so again while N other processes spin on the CPUs (an oversubscribed host). onnxruntime
(its own thread pool, which spins for tens of milliseconds after a call and whose parallel loops
do not wait for late threads) is measured the same way, in a process of its own, as the last row
("ort"). Prints medians in milliseconds and each row's figures against the first spin count.

    python bench/idle_latency.py [--models mobilenetv2,tinybert] [--spin-us 300,0,3000]
                                 [--pause 0.5] [--rounds 15] [--busy 4] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import BenchModel  # noqa: E402


def child(artifact: str, spec: str, shapes: dict, threads: int, pause: float, rounds: int) -> dict:
    """Medians (ms) of calls after a pause and of calls back to back, in this process: of the
    artifact, or of onnxruntime where `artifact` is "ort"."""
    from bench.latency import bench_model
    from bench.peers import ort_session
    from kiln.runtime.artifact import open_artifact
    from kiln.runtime.loader import CompiledModel

    model = bench_model(spec, shapes)
    if artifact == "ort":
        session = ort_session(model.path, threads)
        call = lambda: session.run(None, model.inputs)  # noqa: E731
    else:
        compiled = CompiledModel(open_artifact(Path(artifact), Path(artifact).with_suffix(".x")),
                                 threads)
        call = lambda: compiled.run(**model.inputs)  # noqa: E731
    for _ in range(3):
        call()
    after_pause = []
    for _ in range(rounds):
        time.sleep(pause)
        start = time.perf_counter()
        call()
        after_pause.append(time.perf_counter() - start)
    back_to_back = []
    for _ in range(rounds * 4):
        start = time.perf_counter()
        call()
        back_to_back.append(time.perf_counter() - start)
    return {"idle": statistics.median(after_pause) * 1e3,
            "steady": statistics.median(back_to_back) * 1e3}


def _spin() -> None:
    while True:
        pass


def measure(artifact: Path | str, model: BenchModel, spin_us: str,
            args: argparse.Namespace) -> dict:
    from bench import unseen
    from bench.zoo import MODELS

    spec = model.name if model.name in MODELS or model.name in unseen.MODELS else str(model.path)
    env = {**os.environ, "KILN_SPIN_US": spin_us}
    done = subprocess.run([sys.executable, __file__, "--child", str(artifact), spec,
                           json.dumps({k: list(v) for k, v in model.shapes.items()}),
                           str(args.threads), str(args.pause), str(args.rounds)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        artifact, spec, shapes, threads, pause, rounds = sys.argv[2:8]
        print(json.dumps(child(artifact, spec, json.loads(shapes), int(threads), float(pause),
                               int(rounds))))
        return 0
    from bench.latency import bench_models, kiln_artifact, work_folder, zoo_arguments

    parser = zoo_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.set_defaults(models="mobilenetv2,tinybert")
    parser.add_argument("--spin-us", default="300,0,3000",
                        help="KILN_SPIN_US values to compare (the first is the baseline)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds idle before a call")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--busy", type=int, default=0,
                        help="also measure with this many processes spinning on the CPUs")
    args = parser.parse_args(argv)
    spins = [s.strip() for s in args.spin_us.split(",") if s.strip()]
    loads = [0] + ([args.busy] if args.busy else [])
    print(f"median ms, {args.threads} threads; idle = one call after {args.pause} s idle, "
          f"steady = calls back to back; ratios against KILN_SPIN_US={spins[0]}")
    print(f"{'model':16s} {'busy':>4s} {'spin us':>8s} {'idle ms':>9s} {'steady ms':>9s} "
          f"{'idle/base':>9s} {'steady/base':>11s}")
    with work_folder(args.keep, "kiln-idle-") as work:
        for model in bench_models(args):
            artifact = kiln_artifact(model, "dnnfusion", work)
            for busy in loads:
                spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
                for p in spinners:
                    p.start()
                try:
                    base = None
                    for count in [*spins, "ort"]:
                        got = measure("ort" if count == "ort" else artifact, model, count, args)
                        base = base or got
                        print(f"{model.name:16s} {busy:4d} {count:>8s} {got['idle']:9.2f} "
                              f"{got['steady']:9.2f} {got['idle'] / base['idle']:9.2f} "
                              f"{got['steady'] / base['steady']:11.2f}", flush=True)
                finally:
                    for p in spinners:
                        p.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
