"""The `kiln` command line: `kiln compile` here; every other command comes from an entry point of
the group `kiln.commands` (a callable that adds its subcommands to the argparse subparsers), so
the compiler knows nothing of the packages that extend its command line."""
from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import kiln
from kiln.errors import KilnError
from kiln.plan import partitioner, partitioner_names
from kiln.target import TARGET_NAMES, target
from kiln.tune import DEFAULT_BUDGET_S, DEFAULT_MODE, TUNE_MODES, check_budget, format_tuning

COMMAND_GROUP = "kiln.commands"
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT


def _compile(args: argparse.Namespace) -> int:
    # the compiler itself is loaded only here: every other command (kiln submit, kiln admin, …)
    # starts without it
    from kiln import frontend
    from kiln.pipeline import CompileOptions, compile_artifact, compile_model
    from kiln.profile.local import default_store
    from kiln.report import format_report

    shapes = dict(frontend.parse_shape_arg(s) for s in args.shape)
    options = CompileOptions(partitioner=args.partitioner, shapes=shapes, target=args.target,
                             rewrite=not args.no_rewrite, tune=args.tune,
                             tune_budget=args.tune_budget)
    if args.tune in ("quick", "full") and not args.output:
        raise KilnError("--tune needs -o: tuning chooses the schedules of the generated code")
    store = default_store(args.profile_db)
    with progress_view() as view:
        if args.output:
            report = compile_artifact(args.model, args.output, options, store, view.stage,
                                      view.progress)
        else:
            report = compile_model(args.model, options, store, view.stage, view.progress).report
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
    cmd = commands.add_parser("compile", help="compile an ONNX model",
                              formatter_class=_LineHelpFormatter)
    cmd.add_argument("model", help="path to an .onnx file")
    cmd.add_argument("--partitioner", default="dnnfusion", choices=partitioner_names(),
                     metavar="NAME", help=partitioner_help())
    cmd.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,…",
                     help="value of an input's symbolic dimensions (repeatable)")
    cmd.add_argument("-o", "--output", metavar="MODEL.kiln",
                     help="build the artifact here (without it, stop after planning)")
    cmd.add_argument("--target", default="host", type=target_name, metavar="TARGET",
                     help=f"machine the artifact runs on: {', '.join(TARGET_NAMES)} or "
                          f"cuda-sm<NN> (default: host, this one)")
    cmd.add_argument("--no-rewrite", action="store_true",
                     help="skip the math-property graph rewriting (see `kiln rules`)")
    cmd.add_argument("--tune", default=DEFAULT_MODE, choices=TUNE_MODES,
                     help="tune kernel schedules on this CPU: quick (a few fixed candidates per "
                          "block) or full (a genetic search); measurements are kept in the "
                          "profile database and never repeated. reuse (the default) measures "
                          "nothing and takes the schedules an earlier quick or full tuning chose; "
                          "off keeps every default schedule")
    cmd.add_argument("--tune-budget", type=_seconds, metavar="SECONDS",
                     help="time limit for tuning (default: "
                          + ", ".join(f"{m} {s:g} s" for m, s in DEFAULT_BUDGET_S.items()) + ")")
    cmd.add_argument("--report-json", metavar="FILE", help="write the fusion report here")
    cmd.add_argument("--profile-db", metavar="FILE",
                     help="profile database (default $KILN_PROFILE_DB or ~/.cache/kiln)")
    cmd.set_defaults(handler=_compile)
    return cmd


def partitioner_help() -> str:
    """One line per partitioner: its name and the first line of its docstring."""
    lines = ["how the graph is cut into fused kernels (default: dnnfusion):"]
    for name in partitioner_names():
        chosen = partitioner(name)
        doc = type(chosen).__doc__ or sys.modules[type(chosen).__module__].__doc__ or ""
        summary = doc.strip().splitlines()[0] if doc.strip() else ""
        if summary.startswith("Partitioner") and ": " in summary:
            summary = summary.split(": ", 1)[1]  # "Partitioner `none`: one kernel per op"
        lines.append(f"  {name}: {summary.rstrip('.')}")
    return "\n".join(lines)


class _LineHelpFormatter(argparse.HelpFormatter):
    """Wraps each line of a help text on its own, so that a list in it stays a list."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        lines = []
        for line in text.splitlines():
            indent = line[:len(line) - len(line.lstrip())]
            lines += [indent + piece for piece in super()._split_lines(line, width - len(indent))]
        return lines


def target_name(text: str) -> str:
    """--target (of `kiln compile` and `kiln submit`): a name kiln.target knows."""
    try:
        target(text)
    except KilnError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _seconds(text: str) -> float:
    try:
        return check_budget(text)
    except KilnError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --- progress -----------------------------------------------------------------------------------

class _PlainProgress:
    """Stages and progress as lines on stderr (not a terminal: logs, pipes)."""

    EVERY_S = 5.0  # at most one line per stage this often, but every tuning measurement

    def __init__(self):
        self.last: dict[str, float] = {}

    def __enter__(self) -> "_PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def stage(self, stage: str) -> None:
        print(f"kiln: {stage}", file=sys.stderr, flush=True)

    def progress(self, stage: str, done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if stage != "tune" and now - self.last.get(stage, -self.EVERY_S) < self.EVERY_S:
            return
        self.last[stage] = now
        count = f"{done}/{total}" if total else str(done)
        noun = "measuring kernel" if stage == "tune" else "latency lookup"
        print(f"kiln: {stage}: {noun} {count}: {what}", file=sys.stderr, flush=True)


class _RichProgress:
    """Stages and progress as a rich progress bar on the terminal (stderr), gone when done."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
            TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self.task = None

    def __enter__(self) -> "_RichProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def stage(self, stage: str) -> None:
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(stage, total=None)
        self.bar.refresh()  # a stage shows when it starts, however short it is

    def progress(self, stage: str, done: int, total: int, what: str) -> None:
        if self.task is None:
            self.stage(stage)
        from rich.markup import escape

        noun = "measuring kernels" if stage == "tune" else "latency lookups"
        self.bar.update(self.task, completed=done, total=total or None,
                        description=f"{stage}: {noun} [dim]{escape(what[:60])}[/dim]",
                        refresh=stage == "tune")  # a measurement takes long: show each one


def progress_view() -> _PlainProgress | _RichProgress:
    return _RichProgress() if sys.stderr.isatty() else _PlainProgress()


# --- the parser ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln operator-fusion compiler")
    parser.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_compile_command(commands)
    add_registered_commands(commands)
    return parser


def add_registered_commands(commands) -> None:
    """The commands of every installed `kiln.commands` entry point. One whose package needs
    modules that are not installed (an extra left out) is skipped: `kiln compile` works without
    the service; a missing module of kiln itself is a bug and is raised."""
    seen: set[str] = set()
    for point in sorted(entry_points(group=COMMAND_GROUP), key=lambda p: p.name):
        if point.name in seen:
            continue
        seen.add(point.name)
        try:
            point.load()(commands)
        except ModuleNotFoundError as exc:
            if (exc.name or "kiln").split(".")[0] == "kiln":
                raise


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KilnError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kiln: interrupted{_interrupted_note(args)}", file=sys.stderr)
        return INTERRUPTED


def _interrupted_note(args: argparse.Namespace) -> str:
    if getattr(args, "handler", None) is _compile and args.output:
        return (f": {args.output} is written whole or not at all; measurements taken so far "
                f"stay in the profile database")
    return ""


if __name__ == "__main__":
    sys.exit(main())
