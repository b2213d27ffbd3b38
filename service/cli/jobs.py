"""`kiln submit`: the client of a running service (upload, queue, follow, download)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from service.cli.environment import load_settings


def add_commands(commands) -> None:
    from kiln.tune import DEFAULT_BUDGET_S, TUNE_MODES

    submit = commands.add_parser("submit", help="compile a model on a Kiln service")
    submit.add_argument("model", help="path to an .onnx file")
    submit.add_argument("--target", default="host", help="host, x86_64 or aarch64 (default host)")
    submit.add_argument("--partitioner", default="dnnfusion", help="default dnnfusion")
    submit.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,…",
                        help="value of an input's symbolic dimensions (repeatable)")
    submit.add_argument("--no-rewrite", action="store_true", help="skip math-property rewrites")
    submit.add_argument("--tune", default="off", choices=TUNE_MODES,
                        help="tune kernel schedules on the worker's CPU: quick (a few fixed "
                        "candidates per block) or full (a genetic search); measurements go into "
                        "the service's profile database (default: off)")
    submit.add_argument("--tune-budget", type=_budget, metavar="SECONDS",
                        help="time limit for tuning (default: " + ", ".join(
                            f"{m} {s:g} s" for m, s in DEFAULT_BUDGET_S.items())
                        + "; the service allows at most 3600 s)")
    submit.add_argument("--wait", action="store_true",
                        help="follow the job with a progress bar, then download the artifact "
                        "and print the report")
    submit.add_argument("-o", "--output", metavar="MODEL.kiln",
                        help="where --wait puts the artifact (default: MODEL's name, .kiln)")
    client_args(submit)
    submit.set_defaults(handler=_submit)


def client_args(cmd) -> None:
    cmd.add_argument("--url", help="service URL (default $KILN_URL, else the local service)")
    cmd.add_argument("--api-key", help="API key (default $KILN_API_KEY, else the local "
                     "service's default key)")


def client_from(args: argparse.Namespace):
    from service.client import KilnClient

    settings = load_settings()
    url = args.url or os.environ.get("KILN_URL") or settings.api_url
    key = args.api_key or os.environ.get("KILN_API_KEY")
    if not key and url == settings.api_url and settings.api_key_file.is_file():
        key = settings.api_key_file.read_text().strip()  # only ever sent to the local service
    if not key:
        raise SystemExit("kiln: no API key: pass --api-key or set KILN_API_KEY (a local "
                         "`kiln serve` writes one to its data folder)")
    return KilnClient(url, key)


class ProgressBar:
    WIDTH = 30

    def __init__(self, stream=sys.stderr):
        self.stream, self.tty, self.last = stream, stream.isatty(), None

    def __call__(self, job: dict) -> None:
        key = (job["state"], job.get("stage"), job["progress"])
        if key == self.last:
            return
        self.last = key
        filled = self.WIDTH * job["progress"] // 100
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        text = f"[{bar}] {job['progress']:3d}% {job['state']}"
        text += f" ({job['stage']})" if job.get("stage") and job["state"] == "running" else ""
        if self.tty:
            self.stream.write(f"\r{text:<70}")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and self.last is not None:
            self.stream.write("\n")
            self.stream.flush()


def _budget(text: str) -> float:
    """--tune-budget: a positive number of seconds (the service checks its upper bound)."""
    from kiln.errors import KilnError
    from kiln.tune import check_budget

    try:
        return check_budget(text)
    except KilnError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _submit(args: argparse.Namespace) -> int:
    from kiln import frontend
    from kiln.report import format_report, format_tuning
    from service.client import ServiceError

    shapes = dict(frontend.parse_shape_arg(s) for s in args.shape)
    model_path = Path(args.model)
    if not model_path.is_file():
        print(f"kiln: error: model file not found: {model_path}", file=sys.stderr)
        return 2
    with client_from(args) as client:
        try:
            model = client.upload_model(model_path)
            job = client.submit(model["id"], args.target, args.partitioner,
                                {k: list(v) for k, v in shapes.items()}, not args.no_rewrite,
                                args.tune, args.tune_budget)
            tuning = f", tune {args.tune}" if args.tune != "off" else ""
            print(f"job {job['id']} queued: {model_path.name} for {args.target} "
                  f"({args.partitioner}{tuning})", file=sys.stderr)
            if not args.wait:
                print(job["id"])
                return 0
            bar = ProgressBar()
            try:
                job = client.wait(job["id"], on_progress=bar)
            finally:
                bar.done()
            if job["state"] != "succeeded":
                print(f"kiln: job {job['id']} {job['state']}: {job.get('error') or ''}",
                      file=sys.stderr)
                return 1
            output = Path(args.output or f"{model_path.stem}.kiln")
            client.download_artifact(job["id"], output)
            report = client.report(job["id"])
        except ServiceError as exc:
            print(f"kiln: error: {exc}", file=sys.stderr)
            return 2
    print(format_report(report))
    if "tuning" in report:
        print(format_tuning(report["tuning"]))
    seconds = ", ".join(f"{k} {v:.2f}s" for k, v in job["stage_seconds"].items())
    print(f"wrote {output} ({job['artifact']['size_bytes']} bytes); job {job['id']}: {seconds}")
    return 0
