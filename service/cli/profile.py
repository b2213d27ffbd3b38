"""`kiln profile JOB --device SELECTOR [--wait]`: run a compiled job's model on a device of the farm
and print its per-kernel latencies (a profile job, service.profiles.runs)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_commands(subparsers) -> None:
    cmd = subparsers.add_parser("profile", help="run a job's compiled model on a farm device and "
                                "print per-kernel latencies")
    cmd.add_argument("job", help="the id of a succeeded job")
    cmd.add_argument("--device", default="", metavar="SELECTOR",
                     help="device selector, e.g. kind:phone,arch:aarch64,feature:neon "
                     "(default: any device that can run it)")
    cmd.add_argument("--runs", type=int, default=20, help="timed runs per invocation")
    cmd.add_argument("--warmup", type=int, default=3, help="untimed runs first")
    cmd.add_argument("--repeats", type=int, default=3, help="runner invocations")
    cmd.add_argument("--wait", action="store_true", help="wait for the result and print it")
    cmd.add_argument("--timeout", type=float, default=1800, help="seconds to wait at most")
    cmd.add_argument("--json", action="store_true", help="print the run as JSON")
    cmd.add_argument("--url", help="service URL (default: $KILN_URL or the local service)")
    cmd.add_argument("--api-key", help="API key (default: $KILN_API_KEY or the local service's)")
    cmd.set_defaults(handler=_profile)


def _profile(args: argparse.Namespace) -> int:
    from service.cli.jobs import client_from
    from service.client import ServiceError

    try:
        with client_from(args) as client:
            run = client.profile(args.job, args.device, args.runs, args.warmup, args.repeats)
            if args.wait:
                run = client.wait_profile(args.job, run["id"], timeout=args.timeout)
    except (ServiceError, TimeoutError) as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(run, indent=2))
    elif run["state"] == "succeeded":
        print(format_profile(run))
    elif run["state"] == "failed":
        print(f"kiln: profile run {run['id']} failed: {run['error']}", file=sys.stderr)
        return 1
    else:
        print(f"profile run {run['id']} {run['state']} (via {run['via']}); follow it with "
              f"`kiln profile {args.job} --wait` or GET /v1/jobs/{args.job}/profile/{run['id']}")
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4f}"


def format_profile(run: dict[str, Any]) -> str:
    """The run's kernels as a table (milliseconds), then the end-to-end latency and memory."""
    result = run["result"]
    device = result["device"]
    rows = [("kernel", "block", "median ms", "p10 ms", "p90 ms", "n")]
    rows += [(k["symbol"], k["block"], _ms(k["median_s"]), _ms(k["p10_s"]), _ms(k["p90_s"]),
              str(k["n"])) for k in result["kernels"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"profile run {run['id']} on {device['name']} ({device['kind']}, {device['arch']}), "
             f"{run['runs']} runs x {run['repeats']} after {run['warmup']} warm-up"]
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(r, widths))) for r in rows]
    total = result["total"]
    lines.append(f"end to end: median {_ms(total['median_s'])} ms, p10 {_ms(total['p10_s'])} ms, "
                 f"p90 {_ms(total['p90_s'])} ms")
    peak = result["memory"].get("peak_bytes")
    if peak is not None:
        lines.append(f"peak tensor memory (the artifact's memory plan): {peak / 1024:.1f} KiB")
    rss = result["memory"].get("measured_peak_rss_bytes")
    if rss is not None:
        lines.append(f"peak resident memory (measured, the runner process): {rss / 1024:.1f} KiB")
    return "\n".join(lines)
