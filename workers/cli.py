"""`kiln worker`: a Celery worker for compile jobs (any number, on any machine)."""
from __future__ import annotations

import argparse
import os


def add_commands(commands) -> None:
    worker = commands.add_parser("worker", help="run a compile worker (Celery)")
    worker.add_argument("--compile-processes", dest="concurrency", type=int, metavar="N",
                        help="compile processes (default $KILN_WORKER_CONCURRENCY or 1)")
    worker.add_argument("--concurrency", type=int, help=argparse.SUPPRESS)  # the old spelling
    worker.add_argument("--name", metavar="NAME@HOST",
                        help="worker node name (default kiln-<pid>@<host name>)")
    worker.add_argument("--loglevel", default="INFO")
    worker.set_defaults(handler=_worker)


def _worker(args: argparse.Namespace) -> int:
    from workers.app import QUEUE, app

    argv = ["worker", "--loglevel", args.loglevel, "-Q", QUEUE, "--without-mingle",
            "--without-gossip", "--without-heartbeat", "--hostname", args.name or f"kiln-{os.getpid()}@%h"]
    if args.concurrency:
        argv += ["--concurrency", str(args.concurrency)]
    app.worker_main(argv)
    return 0
