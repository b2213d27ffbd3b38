"""Where the unfused time goes, and how much of what fusion could remove dnnfusion removes.

For each full-size zoo model, the artifacts built with partitioner none and with dnnfusion run in
the runner (a process of their own) with per-kernel timing. Every kernel is counted as
compute-intensive (CIL) when its block holds a contraction (MatMul, Gemm, Conv, Einsum,
LSTM/GRU/RNN: the ops Table 5 of DNNFusion calls CIL) and as memory-intensive (MIL) otherwise.
Fusion removes memory-intensive kernels by folding them into others; it does not make a
contraction cheaper (a fused contraction does the same multiply-adds plus its epilogue). So the
unfused build's compute-intensive time is a floor for any fused build, and

    ceiling = none / none's CIL time

bounds none/dnnfusion for that model on this machine.

Issue 13's fusion target: where the removable time, none − none's CIL time, is at least 5 % of
none,

    share = (none − dnnfusion) / (none − none's CIL time)

must reach 0.75. Below 5 % the share is noise over a small difference and is shown as "-".

How, so that drift on a shared machine (±20 % within minutes) cancels:
- none and dnnfusion run end to end in this process (the loader), interleaved, a pause before
  each timed call (`bench.latency.interleaved_times`); each round gives a ratio dnnfusion/none
  of two calls moments apart. The share is taken from the median of those ratios, with a 95 %
  confidence interval of that median (distribution-free: order statistics of the per-round
  shares). The verdict is "yes" or "NO" only where the whole interval lies on one side of the
  target, and "?" where the rounds cannot tell. The clock is the process's CPU time by default
  (all its threads: a call whose threads other processes descheduled loses wall time, not CPU
  time; on a loaded 2-core host wall times of the same call vary 2–5×); `--clock wall` takes
  wall time, and the share by the other clock is printed too.
- none's CIL time is a *fraction* of none, from the runner's per-kernel timing (the median over
  runs of the CIL kernels' sum in a run, over the run's median latency: a ratio within one
  process, which drift hardly moves), times none's in-process median.
  The fraction is of wall time (the runner times kernels by the clock), applied to either clock:
  on a quiet machine `--clock wall` is the issue's measure itself; on a loaded one the CPU-time
  ratio is the steadier one, and the fraction the weaker part (short parallel kernels lose more
  wall time to preemption than long ones, so the removable time tends to be over-counted).
- "ksum" is the share from the runner's per-kernel sums alone (both builds in separate runner
  processes: exposed to drift between them; shown for comparison).

    python bench/fusion_ceiling.py [--models bert-base,resnet50] [--rounds 15] [--runs 20]
                                   [--clock cpu|wall] [--threads 2] [--keep DIR]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import (BenchModel, bench_models, interleaved_times,  # noqa: E402
                           kiln_artifact, work_folder, zoo_arguments)
from kiln.ops import op_info  # noqa: E402
from kiln.runtime.artifact import Artifact, open_artifact  # noqa: E402
from kiln.runtime.cli import compare  # noqa: E402
from kiln.runtime.execute import run_runner  # noqa: E402
from kiln.runtime.loader import CompiledModel  # noqa: E402

PARTITIONERS = ("none", "dnnfusion")
MIN_REMOVABLE = 0.05  # of none's time: below it, the share is not counted
TARGET_SHARE = 0.75


def fusion_share(none: float, none_cil: float, dnnfusion: float) -> float | None:
    """(none − dnnfusion) / (none − none's CIL time), or None where that removable time is
    under `MIN_REMOVABLE` of none."""
    removable = none - none_cil
    if removable < MIN_REMOVABLE * none:
        return None
    return (none - dnnfusion) / removable


@dataclass(frozen=True)
class KernelSplit:
    """One runner run's medians, in ms: end to end, and the kernels with and without a
    contraction."""

    latency: float
    cil: float
    mil: float

    @property
    def cil_fraction(self) -> float:
        """The CIL kernels' share of the end-to-end time (the rest, MIL kernels and the gaps
        between kernels, is what fusion can remove)."""
        return self.cil / self.latency


def kernel_split(timing: dict, plan: dict) -> KernelSplit:
    """The CIL and MIL kernels' time in a run: the median over runs of each run's sums where the
    runner lists every kernel's runs (`samples_ns`), else the sums of the kernels' medians. A
    sum of medians falls short of a run's sum (each kernel's median drops its own slow runs): by
    1-2 % of the latency on a VM, over a hundred kernels or more, all of it counted as removable
    (ViT-base's none build: 156.40 ms of contractions by the medians, 157.72 by the runs' sums,
    whose median over all kernels was the latency's to 0.02 ms)."""
    contracting = {b["id"] for b in plan["blocks"]
                   if any(op_info(o["type"]).compute_intensive for o in b["ops"])}
    kernels = timing["kernels"]
    if kernels and all("samples_ns" in k for k in kernels):
        runs = range(len(kernels[0]["samples_ns"]))
        cil = statistics.median(sum(k["samples_ns"][r] for k in kernels
                                    if k["block"] in contracting) for r in runs)
        every = statistics.median(sum(k["samples_ns"][r] for k in kernels) for r in runs)
        mil = every - cil
    else:
        cil = sum(k["median_ns"] for k in kernels if k["block"] in contracting)
        mil = sum(k["median_ns"] for k in kernels if k["block"] not in contracting)
    return KernelSplit(timing["latency_ns"]["median"] / 1e6, cil / 1e6, mil / 1e6)


@dataclass(frozen=True)
class Measurement:
    """One model's figures: per-kernel splits from the runner, in-process per-round times (s)."""

    split: dict[str, KernelSplit]
    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def median_ms(self, partitioner: str, clock: str) -> float:
        return statistics.median(self.times(clock)[partitioner]) * 1e3

    def times(self, clock: str) -> dict[str, list[float]]:
        return self.wall if clock == "wall" else self.cpu

    def ratios(self, clock: str) -> list[float]:
        """dnnfusion / none in every round."""
        times = self.times(clock)
        return [d / n for d, n in zip(times["dnnfusion"], times["none"])]

    def share(self, ratio: float) -> float | None:
        """The fusion share where dnnfusion takes `ratio` of none's time."""
        return fusion_share(1.0, self.split["none"].cil_fraction, ratio)

    def round_shares(self, clock: str) -> list[float]:
        shares = [self.share(r) for r in self.ratios(clock)]
        return [s for s in shares if s is not None]

    def kernel_sum_share(self) -> float | None:
        none, dnnf = self.split["none"], self.split["dnnfusion"]
        return fusion_share(none.cil + none.mil, none.cil, dnnf.cil + dnnf.mil)


def measure(model: BenchModel, work: Path, rounds: int, runs: int, threads: int) -> Measurement:
    artifacts: dict[str, Artifact] = {}
    for partitioner in PARTITIONERS:
        out = kiln_artifact(model, partitioner, work)
        artifacts[partitioner] = open_artifact(out, work / "extracted" / out.stem)
    split = {p: kernel_split(run_runner(a, model.inputs, runs, 3, threads,
                                        keep_outputs=False).timing, a.plan)
             for p, a in artifacts.items()}
    compiled = {p: CompiledModel(a, threads) for p, a in artifacts.items()}
    _check_same_outputs(compiled, model.inputs)
    calls = {p: (lambda c=c: c.run(**model.inputs)) for p, c in compiled.items()}
    times = interleaved_times(calls, rounds, warmup=2)
    for c in compiled.values():
        c.close()
    return Measurement(split, {p: t["wall"] for p, t in times.items()},
                       {p: t["cpu"] for p, t in times.items()})


def _check_same_outputs(compiled: dict[str, CompiledModel], inputs: dict) -> None:
    """Both builds must compute the same thing (within `kiln verify`'s tolerance), or their times
    say nothing about fusion."""
    none, dnnf = (compiled[p].run(**inputs) for p in PARTITIONERS)
    for n, (a, b) in enumerate(zip(none, dnnf)):
        found = compare(f"output {n}", b, a)
        if not found["ok"]:
            raise SystemExit(f"none and dnnfusion disagree on {found['output']}: max |diff| "
                             f"{found['max_abs']:.3g} {found['note']}".rstrip())


def median_interval(values: list[float], z: float = 1.96) -> tuple[float, float] | None:
    """A confidence interval (normal quantile `z`, 95 % by default) of the median of `values`,
    from their order statistics (no assumption on their distribution); None for fewer than 6
    values, which give none at 95 %."""
    n = len(values)
    if n < 6:
        return None
    ordered = sorted(values)
    half_width = z * math.sqrt(n) / 2
    low = max(0, math.floor(n / 2 - half_width) - 1)
    high = min(n - 1, math.ceil(n / 2 + half_width))
    return ordered[low], ordered[high]


def _verdict(share: float | None, interval: tuple[float, float] | None) -> str:
    if share is None:
        return "-"
    low, high = interval or (share, share)
    return "yes" if low >= TARGET_SHARE else "NO" if high < TARGET_SHARE else "?"


def _share_text(share: float | None) -> str:
    return "-" if share is None else f"{share:.2f}"


def row(name: str, m: Measurement, clock: str = "cpu") -> tuple[str, str]:
    """The model's table row by `clock` and its verdict ("yes", "NO", "?" or "-")."""
    none, dnnf = m.median_ms("none", clock), m.median_ms("dnnfusion", clock)
    f_none, f_dnnf = m.split["none"].cil_fraction, m.split["dnnfusion"].cil_fraction
    ratio = statistics.median(m.ratios(clock))
    share = m.share(ratio)
    interval = None if share is None else median_interval(m.round_shares(clock))
    spread_text = "-" if interval is None else f"{interval[0]:.2f}..{interval[1]:.2f}"
    other_share = m.share(statistics.median(m.ratios(_OTHER[clock])))
    verdict = _verdict(share, interval)
    text = (f"{name:16s} {none:8.2f} {none * f_none:8.2f} {none * (1 - f_none):8.2f} "
            f"{100 * (1 - f_none):4.0f}% | {dnnf:8.2f} {dnnf * f_dnnf:8.2f} "
            f"{dnnf * (1 - f_dnnf):8.2f} | {1 / ratio:9.2f} {1 / f_none:8.2f} "
            f"{_share_text(share):>6s} {spread_text:>11s} {_share_text(other_share):>6s} "
            f"{_share_text(m.kernel_sum_share()):>6s} {verdict:>6s}")
    return text, verdict


_OTHER = {"cpu": "wall", "wall": "cpu"}


def header(clock: str) -> str:
    return (f"{'model':16s} {'none ms':>8s} {'CIL ms':>8s} {'MIL ms':>8s} {'MIL%':>5s} | "
          f"{'dnnf ms':>8s} {'CIL ms':>8s} {'MIL ms':>8s} | {'none/dnnf':>9s} {'ceiling':>8s} "
          f"{'share':>6s} {'95% CI':>11s} {_OTHER[clock]:>6s} {'ksum':>6s} "
            f"{'>=' + format(TARGET_SHARE, 'g'):>6s}")


def main(argv: list[str] | None = None) -> int:
    parser = zoo_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--rounds", type=int, default=15,
                        help="interleaved in-process rounds (one call of each build per round)")
    parser.add_argument("--runs", type=int, default=20,
                        help="runner runs per build for the per-kernel split")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="time calls by the process's CPU time (default) or wall time")
    args = parser.parse_args(argv)
    rows, measured, ceilings, verdicts = [], [], [], []
    with work_folder(args.keep, "kiln-ceiling-") as work:
        for model in bench_models(args):
            m = measure(model, work, args.rounds, args.runs, args.threads)
            text, verdict = row(model.name, m, args.clock)
            measured.append(1 / statistics.median(m.ratios(args.clock)))
            ceilings.append(1 / m.split["none"].cil_fraction)
            rows.append(text)
            verdicts.append(verdict)
            print(text, file=sys.stderr)
    print(f"{args.threads} threads; none, dnnfusion: in-process medians of {args.clock} time "
          f"over {args.rounds} interleaved rounds; CIL/MIL split: fractions from the runner's "
          f"per-kernel medians ({args.runs} runs) times those medians. CIL = kernels holding a "
          f"contraction, MIL = the rest (with the gaps between kernels). share: from the median "
          f"per-round ratio; 95% CI: of that median; {_OTHER[args.clock]}: the share by "
          f"{_OTHER[args.clock]} time; ksum: from the runner's kernel sums")
    print(header(args.clock))
    print("\n".join(rows))
    print(f"geomean none/dnnfusion measured {statistics.geometric_mean(measured):.2f}, "
          f"ceiling (none / its CIL time) {statistics.geometric_mean(ceilings):.2f}")
    counted = [v for v in verdicts if v != "-"]
    print(f"fusion share >= {TARGET_SHARE:g} on {counted.count('yes')} of {len(counted)} model(s) "
          f"whose removable time is >= {MIN_REMOVABLE:.0%} of none, below it on "
          f"{counted.count('NO')}, undecided by the rounds on {counted.count('?')} "
          f"({len(verdicts) - len(counted)} model(s) with less removable time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
