"""The `kiln` command line. Each package adds its own subcommands through `add_commands`."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from kiln import frontend
from kiln.errors import KilnError
from kiln.pipeline import CompileOptions, compile_artifact, compile_model
from kiln.plan import partitioner_names
from kiln.report import format_report
from kiln.target import TARGET_NAMES
from kiln.tune import DEFAULT_BUDGET_S, TUNE_MODES, check_budget

# Modules defining `add_commands(subparsers)`; each registers its subcommands.
COMMAND_MODULES: tuple[str, ...] = ("kiln.runtime.cli", "service.cli", "workers.cli",
                                    "kiln.rewrite.cli", "service.profile_cli")


def _compile(args: argparse.Namespace) -> int:
    from kiln.profile.local import default_store

    shapes = dict(frontend.parse_shape_arg(s) for s in args.shape)
    options = CompileOptions(partitioner=args.partitioner, shapes=shapes, target=args.target,
                             rewrite=not args.no_rewrite, tune=args.tune,
                             tune_budget=args.tune_budget)
    if args.tune != "off" and not args.output:
        raise KilnError("--tune needs -o: tuning chooses the schedules of the generated code")
    store = default_store(args.profile_db)
    if args.output:
        report = compile_artifact(args.model, args.output, options, store)
    else:
        report = compile_model(args.model, options, store).report
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(report, indent=2))
    print(format_report(report))
    if "tuning" in report:
        print(format_tuning(report["tuning"]))
    if args.output:
        peak = report["peak_memory_bytes"]
        print(f"wrote {args.output}: {report['compiled_kernels']} kernels, peak memory "
              f"{peak} bytes ({peak / (1 << 20):.1f} MiB)")
    return 0


def add_compile_command(commands) -> argparse.ArgumentParser:
    cmd = commands.add_parser("compile", help="compile an ONNX model")
    cmd.add_argument("model", help="path to an .onnx file")
    cmd.add_argument("--partitioner", default="dnnfusion", choices=partitioner_names())
    cmd.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,…",
                     help="value of an input's symbolic dimensions (repeatable)")
    cmd.add_argument("-o", "--output", metavar="MODEL.kiln",
                     help="build the artifact here (without it, stop after planning)")
    cmd.add_argument("--target", default="host", choices=TARGET_NAMES,
                     help="machine the artifact runs on (default: this one)")
    cmd.add_argument("--no-rewrite", action="store_true",
                     help="skip the math-property graph rewriting (see `kiln rules`)")
    cmd.add_argument("--tune", default="off", choices=TUNE_MODES,
                     help="tune kernel schedules on this CPU: quick (a few fixed candidates per "
                          "block) or full (a genetic search); measurements are kept in the "
                          "profile database and never repeated (default: off)")
    cmd.add_argument("--tune-budget", type=_seconds, metavar="SECONDS",
                     help="time limit for tuning (default: "
                          + ", ".join(f"{m} {s:g} s" for m, s in DEFAULT_BUDGET_S.items()) + ")")
    cmd.add_argument("--report-json", metavar="FILE", help="write the fusion report here")
    cmd.add_argument("--profile-db", metavar="FILE",
                     help="profile database (default $KILN_PROFILE_DB or ~/.cache/kiln)")
    cmd.set_defaults(handler=_compile)
    return cmd


def _seconds(text: str) -> float:
    try:
        return check_budget(text)
    except KilnError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_tuning(t: dict) -> str:
    if "all" in t.get("skipped", {}):
        return f"tuning ({t['mode']}): skipped: {t['skipped']['all']}"
    lines = [f"tuning ({t['mode']}, {t['threads']} threads): {len(t['groups'])} distinct blocks, "
             f"{t['measured']} kernels measured, {t['reused']} reused from the profile database, "
             f"{t['failed']} failed; {t['seconds']:.1f} s of {t['budget_s']:g} s; "
             f"{len(t['schedules'])} blocks with a non-default schedule"]
    for g in t["groups"]:
        if g["best_ms"] and g["default_ms"]:
            lines.append(f"  {g['name'][:48]:48s} x{g['blocks']:<3d} {g['default_ms']:9.3f} ms -> "
                         f"{g['best_ms']:9.3f} ms  {json.dumps(g['best'])}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln operator-fusion compiler")
    commands = parser.add_subparsers(dest="command", required=True)
    add_compile_command(commands)
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KilnError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
