"""The client of a running service: `kiln submit` (upload, queue, follow, download), `kiln jobs`,
`kiln status`, `kiln cancel` and `kiln download`. Each prints one line when the service refuses a
request or cannot be reached, and Ctrl-C while following a job says how to pick it up again."""
from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from service.cli.environment import load_settings
from service.cli.output import console, print_table

INTERRUPTED = 130  # the shell's code for a command ended by SIGINT
LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}


def add_commands(commands) -> None:
    from kiln.cli import target_name
    from kiln.plan import partitioner_names
    from kiln.tune import DEFAULT_BUDGET_S, DEFAULT_MODE, TUNE_MODES

    submit = commands.add_parser("submit", help="compile a model on a Kiln service")
    submit.add_argument("model", help="path to an .onnx file")
    submit.add_argument("--target", default="host", type=target_name,
                        help="machine the artifact runs on, as for `kiln compile` (default host)")
    submit.add_argument("--partitioner", default="dnnfusion", choices=partitioner_names(),
                        help="how ops are grouped into kernels (default dnnfusion)")
    submit.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,…",
                        help="value of an input's symbolic dimensions (repeatable)")
    submit.add_argument("--no-rewrite", action="store_true", help="skip math-property rewrites")
    submit.add_argument("--tune", default=DEFAULT_MODE, choices=TUNE_MODES,
                        help="tune kernel schedules on the worker's CPU: quick (a few fixed "
                        "candidates per block) or full (a genetic search); measurements go into "
                        "the service's profile database. reuse (the default) measures nothing and "
                        "takes the schedules an earlier tuning chose; off keeps the defaults")
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

    jobs = commands.add_parser("jobs", help="list your jobs on a Kiln service, newest first")
    jobs.add_argument("--state", choices=("queued", "running", "succeeded", "failed",
                                          "cancelled"), help="only jobs in this state")
    jobs.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    client_args(jobs)
    jobs.set_defaults(handler=_jobs)

    status = commands.add_parser("status", help="a job's state; --wait follows it to the end")
    status.add_argument("job", help="job id (from `kiln submit` or `kiln jobs`)")
    status.add_argument("--wait", action="store_true", help="follow the job with a progress bar "
                        "until it is finished; exit 0 only if it succeeded")
    client_args(status)
    status.set_defaults(handler=_status)

    cancel = commands.add_parser("cancel", help="cancel a queued or running job")
    cancel.add_argument("job", help="job id")
    client_args(cancel)
    cancel.set_defaults(handler=_cancel)

    download = commands.add_parser("download", help="download a succeeded job's artifact")
    download.add_argument("job", help="job id")
    download.add_argument("-o", "--output", metavar="MODEL.kiln",
                          help="where to put it (default: the model's name, .kiln)")
    client_args(download)
    download.set_defaults(handler=_download)


def client_args(cmd) -> None:
    cmd.add_argument("--url", help="service URL (default $KILN_URL, else the local service)")
    cmd.add_argument("--api-key", help="API key (default $KILN_API_KEY, else the local "
                     "service's default key)")


def service_url(args: argparse.Namespace) -> str:
    return args.url or os.environ.get("KILN_URL") or load_settings().api_url


def same_service(url: str, other: str) -> bool:
    """Whether two URLs name the same service: case, a trailing slash, a default port and the
    loopback's names (localhost, 127.0.0.1, ::1) aside."""
    def key(text: str):
        parts = urlsplit(text.strip())
        scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
        return scheme, "loopback" if host in LOOPBACK else host, port, parts.path.rstrip("/")

    try:
        return key(url) == key(other)
    except ValueError:  # an impossible port
        return False


def client_from(args: argparse.Namespace):
    from service.client import KilnClient

    settings = load_settings()
    url = service_url(args)
    key = args.api_key or os.environ.get("KILN_API_KEY")
    if not key and same_service(url, settings.api_url) and settings.api_key_file.is_file():
        key = settings.api_key_file.read_text().strip()  # only ever sent to the local service
    if not key:
        raise SystemExit("kiln: no API key: pass --api-key or set KILN_API_KEY (a local "
                         "`kiln serve` writes one to its data folder)")
    return KilnClient(url, key)


def calls_the_service(handler):
    """One line, not a traceback, when the service refuses, cannot be reached, or on Ctrl-C."""
    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        import httpx

        from service.client import ServiceError

        try:
            return handler(args)
        except ServiceError as exc:
            print(f"kiln: error: {exc}", file=sys.stderr)
            return 2
        except httpx.TransportError as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"kiln: error: cannot reach the Kiln service at {service_url(args)} ({reason}); "
                  "is it running? (`kiln serve --detach` starts one here; --url names another)",
                  file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("kiln: interrupted", file=sys.stderr)
            return INTERRUPTED

    return run


def follow(client, job_id: str) -> dict:
    """Follow a job with a progress bar until it is finished; return it. On Ctrl-C, say how to
    follow or cancel it (it keeps running on the service) and exit."""
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    from service.client import describe_progress

    progress = Progress(TextColumn(f"job {job_id[:8]}"), BarColumn(), TaskProgressColumn(),
                        TextColumn("{task.description}"), TimeElapsedColumn(),
                        console=console(stderr=True))
    try:
        with progress:
            task = progress.add_task("queued", total=100)

            def show(job: dict) -> None:
                progress.update(task, completed=job["progress"],
                                description=escape(describe_progress(job)))

            job = client.wait(job_id, on_progress=show)
            show(job)
            return job
    except KeyboardInterrupt:
        print(f"kiln: stopped following job {job_id}; it goes on on the service. Follow it again "
              f"with `kiln status {job_id} --wait`, cancel it with `kiln cancel {job_id}`, and "
              f"fetch its artifact with `kiln download {job_id}`", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None


def _budget(text: str) -> float:
    """--tune-budget: a positive number of seconds (the service checks its upper bound)."""
    from kiln.errors import KilnError
    from kiln.tune import check_budget

    try:
        return check_budget(text)
    except KilnError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@calls_the_service
def _submit(args: argparse.Namespace) -> int:
    from kiln import frontend
    from kiln.report import format_report
    from kiln.tune import format_tuning

    shapes = dict(frontend.parse_shape_arg(s) for s in args.shape)
    model_path = Path(args.model)
    if not model_path.is_file():
        print(f"kiln: error: model file not found: {model_path}", file=sys.stderr)
        return 2
    with client_from(args) as client:
        model = client.upload_model(model_path)
        job = client.submit(model["id"], args.target, args.partitioner,
                            {k: list(v) for k, v in shapes.items()}, not args.no_rewrite,
                            args.tune, args.tune_budget)
        tuning = f", tune {args.tune}" if args.tune in ("quick", "full") else ""
        print(f"job {job['id']} queued: {model_path.name} for {args.target} "
              f"({args.partitioner}{tuning})", file=sys.stderr, flush=True)
        if not args.wait:
            print(job["id"])
            return 0
        job = follow(client, job["id"])
        if job["state"] != "succeeded":
            print(f"kiln: job {job['id']} {job['state']}: {job.get('error') or ''}",
                  file=sys.stderr)
            return 1
        output = Path(args.output or f"{model_path.stem}.kiln")
        client.download_artifact(job["id"], output)
        report = client.report(job["id"])
    print(format_report(report))
    if "tuning" in report:
        print(format_tuning(report["tuning"]))
    seconds = ", ".join(f"{k} {v:.2f}s" for k, v in job["stage_seconds"].items())
    print(f"wrote {output} ({job['artifact']['size_bytes']} bytes); job {job['id']}: {seconds}")
    return 0


@calls_the_service
def _jobs(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        jobs = client.jobs(args.state, args.limit)
        names = {m["id"]: m["filename"] for m in client.models(limit=1000)}
    print_table(("job", "model", "target", "partitioner", "state", "progress", "created"), (
        (j["id"], names.get(j["model_id"], j["model_id"]), j["target"], j["partitioner"],
         j["state"] + (f" ({j['stage']})" if j["state"] == "running" and j["stage"] else ""),
         f"{j['progress']}%", j["created_at"][:19].replace("T", " ")) for j in jobs))
    return 0


@calls_the_service
def _status(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        job = follow(client, args.job) if args.wait else client.job(args.job)
    rows = [("state", job["state"]), ("stage", job["stage"]), ("progress", f"{job['progress']}%"),
            ("target", job["target"]), ("partitioner", job["partitioner"]),
            ("created", job["created_at"]), ("finished", job["finished_at"])]
    if job["error"]:
        rows.append(("error", job["error"]))
    if job["artifact"]:
        rows.append(("artifact", f"{job['artifact']['size_bytes']} bytes (kiln download "
                                 f"{job['id']})"))
    print(f"job {job['id']}: {job['state']}")
    print_table(("", ""), rows)
    return 0 if job["state"] == "succeeded" or not args.wait else 1


@calls_the_service
def _cancel(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        job = client.cancel(args.job)
    print(f"job {job['id']}: {job['state']}")
    return 0


@calls_the_service
def _download(args: argparse.Namespace) -> int:
    with client_from(args) as client:
        job = client.job(args.job)
        output = Path(args.output or f"{Path(client.model(job['model_id'])['filename']).stem}.kiln")
        client.download_artifact(args.job, output)
    print(f"wrote {output} ({output.stat().st_size} bytes) from job {args.job}")
    return 0
