"""Fill the profiling database through the agent path, then time its lookups (issue 7).

    python bench/build_profile_db.py                 # build until 22,000 measured entries, report
    python bench/build_profile_db.py --phase build   # only build (resumable: run it again)
    python bench/build_profile_db.py --phase report  # only the lookup and compile figures

Build: a real Kiln service (uvicorn, SQLite in STATE/data) and a real `kiln-agent` process with
this machine's CPU as its only device. The producer enumerates kernels — the blocks of every zoo
model (tests/fixtures/zoo and bench/models) under the none, fixed and dnnfusion partitioners, the
yellow alternatives the dnnfusion planner asks about, shape variants (other image sizes, sequence
lengths and batch sizes where the exported graph allows them), each under schedule variants
(kiln.codegen.schedule.Schedule's fields halved, doubled or flipped, treated as an opaque dict;
variants that give the same code are measured once; each artifact is also run on one thread,
schedule `{"threads": 1}`, the key kiln.tune files thread counts under) — and packs them, many kernels per artifact,
into measurement tasks (kiln.measure.probe); the agent claims, runs and uploads them; the service
writes one entry per kernel. Entries already in the database or queued are skipped, so a stopped
build resumes where it was. BERT-base's yellow lookups are closed first: its compile is repeated
against the database until it asks for nothing unmeasured.

Report: yellow-lookup and schedule-lookup latency (p50/p99 over random keys, warm) on the SQLite
database, on a PostgreSQL copy, and on PostgreSQL with 1,000,000 synthetic entries; BERT-base's
compile time with an empty database against the filled one, and how many kernels each measured.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET_ENTRIES = 22_000
BERT = REPO / "bench" / "models" / "bert-base.onnx"
PG_ADMIN_URL = os.environ.get("KILN_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
ALTERNATIVES = {"dynamic": "static", "static": "dynamic", "guided": "dynamic"}
GEMM_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "MatMulInteger", "QLinearMatMul",
            "LSTM", "GRU", "RNN", "Attention"}


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


# --- candidates ---------------------------------------------------------------------------------

# Schedule fields whose changes alter the generated code of the zoo's blocks (the others rarely
# do at these shapes, and variants giving the same code are measured once anyway).
EFFECTIVE = ("split_loops", "gemm_omp_schedule", "conv_tile_cout", "conv_gemm_min_cout")


def schedule_variants(op_types: set[str]) -> list[dict]:
    """{} and one-field changes of the default Schedule: the parallel threshold, and EFFECTIVE
    fields halved, doubled or flipped (fields read at run time: the schedule stays opaque)."""
    from kiln.codegen.schedule import DEFAULT_SCHEDULE

    defaults = DEFAULT_SCHEDULE.as_dict()
    gemm = bool(op_types & GEMM_OPS)
    conv = bool(op_types & {"Conv", "ConvTranspose"})
    out = [{}]
    if "parallel_min_work" in defaults:
        out += [{"parallel_min_work": 1 << 10}, {"parallel_min_work": 1 << 20}]
    for key in EFFECTIVE:
        if key not in defaults or (key.startswith("gemm_") and not gemm) or \
                (key.startswith("conv_") and not conv):
            continue
        value = defaults[key]
        if isinstance(value, bool):
            out.append({key: not value})
        elif isinstance(value, int) and value > 0:
            out += [{key: value * 2}] + ([{key: value // 2}] if value // 2 > 0 else [])
        elif isinstance(value, str) and value in ALTERNATIVES:
            out.append({key: ALTERNATIVES[value]})
    return out


class Recorder:
    """A ProfileStore that answers from the roofline model and remembers every question."""

    def __init__(self, inner=None):
        from kiln.profile.machine import host_machine
        from kiln.profile.roofline import RooflineModel

        self.inner = inner or RooflineModel(host_machine())
        self.fallback = self.inner.fallback
        self.asked: list[tuple[str, ...]] = []

    def latency(self, graph, op_ids):
        self.asked.append(tuple(op_ids))
        return self.inner.latency(graph, op_ids)

    def record(self, *args, **kwargs) -> None:
        pass

    def schedules(self, graph, op_ids):
        return []


def with_dims(path: Path, dims: dict[str, list[int]]):
    import onnx

    model = onnx.load(str(path))
    for value in model.graph.input:
        if value.name in dims:
            for d, v in zip(value.type.tensor_type.shape.dim, dims[value.name]):
                d.Clear()
                d.dim_value = v
    del model.graph.value_info[:]
    for value in model.graph.output:
        for d in value.type.tensor_type.shape.dim:
            d.Clear()
            d.dim_param = "any"
    return model


def model_variants():
    """(label, model path, input dims or None) for every model and shape variant: the models as
    exported first (their kernels get schedule variants), then the shape variants."""
    import onnx

    tiny = sorted((REPO / "tests" / "fixtures" / "zoo").glob("*.onnx"))
    full = sorted((REPO / "bench" / "models").glob("*.onnx"))
    for path in tiny + full:
        yield f"{path.parent.name}/{path.stem}", path, None
    images = list(range(16, 257, 8))
    sequences = list(range(8, 257, 8))
    for size, scale in ((tiny, 1), (full, 4)):
        for path in size:
            inputs = onnx.load(str(path), load_external_data=False).graph.input
            shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in inputs}
            if "pixel_values" in shapes:
                for side in images:
                    side *= scale
                    if side <= 320 and side != shapes["pixel_values"][2]:
                        yield (f"{path.stem}@{side}px", path,
                               {"pixel_values": [1, 3, side, side]})
            elif path.stem == "lstm" or path.stem == "gpt2":
                name = next(iter(shapes))
                for seq in sequences:
                    dims = list(shapes[name])
                    axis = 0 if path.stem == "lstm" else 1
                    if dims[axis] != seq * scale and seq * scale <= 512:
                        dims[axis] = seq * scale
                        yield f"{path.stem}@{seq * scale}", path, {name: dims}
            for batch in (2, 3, 4, 8):
                dims = {k: [batch, *v[1:]] for k, v in shapes.items()}
                if path.stem == "lstm":
                    dims = {k: [v[0], batch, *v[2:]] for k, v in shapes.items()}
                yield f"{path.stem}@batch{batch}", path, dims


def blocks_of(path: Path, dims) -> tuple[object, list]:
    """The graph(s) and block op-id lists of a model variant, every partitioner and alternative."""
    from kiln import frontend
    from kiln.pipeline import CompileOptions, compile_model

    found = []
    graph = None
    if dims is None:
        for part in ("dnnfusion", "fixed", "none"):
            rec = Recorder()
            c = compile_model(path, CompileOptions(partitioner=part), rec)
            graph = c.graph
            found += [b.op_ids for b in c.plan.blocks if not b.is_view] + rec.asked
            yield c.graph, found
            found = []
        return
    from kiln.plan import partitioner
    from kiln.rewrite import rewrite

    model = with_dims(path, dims)
    graph = rewrite(frontend.build(model, {}, path.stem)).graph
    graph.kiln_native = False  # shape variants: the default schedule only (bench/build_profile_db)
    for part in ("dnnfusion", "fixed", "none"):
        rec = Recorder()
        plan = partitioner(part)(graph, rec)
        yield graph, [b.op_ids for b in plan.blocks if not b.is_view] + rec.asked


SHARD = (0, 1)  # (this producer, producers): each takes the signatures hashing to its number


def probes_for(graph, op_ids, known: set, seen: set, variants: bool = True) -> list:
    """Probes of one block under its schedule variants, minus what is known or already seen."""
    from kiln.measure.probe import ProbeError, make_probe

    try:
        base = make_probe(graph, op_ids)
    except (ProbeError, ValueError, TypeError):
        return []
    if base.signature in seen or int(base.signature[:8], 16) % SHARD[1] != SHARD[0]:
        return []
    seen.add(base.signature)
    types = {graph.op_by_id[i].op_type for i in op_ids}
    out = []
    for schedule in schedule_variants(types) if variants else [{}]:
        probe = make_probe(graph, op_ids, schedule)
        if (probe.signature, probe.schedule_text) not in known:
            out.append(probe)
    return out


# --- the service and the agent ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """uvicorn (the real service) and a kiln-agent process, both ended on exit."""

    def __init__(self, state: Path):
        from service.db import database
        from service.devices.service import AgentError, create_agent
        from service.migrate import upgrade
        from service.settings import Settings

        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "KILN_DATA_DIR": str(state / "data"), "PYTHONPATH": str(REPO),
                    "KILN_AGENT_LEASE_SECONDS": "900"}
        self.env.pop("KILN_DATABASE_URL", None)
        self.settings = Settings(data_dir=state / "data")
        upgrade(self.settings.database_url)
        self.db = database(self.settings.database_url)
        token_file = state / "agent-token"
        if not token_file.is_file():
            try:
                _agent, token = create_agent(self.db, f"profile-bench-{socket.gethostname()}")
            except AgentError:
                _agent, token = create_agent(self.db, f"profile-bench-{os.getpid()}")
            token_file.write_text(token + "\n")
            token_file.chmod(0o600)
        (state / "agent.toml").write_text(
            f'server = "{self.url}"\ntoken_file = "{token_file}"\nwork_dir = "{state / "agent"}"\n'
            f'poll_interval = 0.2\nheartbeat_interval = 5\nmax_tasks = 1\n')
        self.processes: list[subprocess.Popen] = []

    def start(self, producer_only: bool = False) -> None:
        if producer_only:  # another build process runs the service and the agent
            return
        api_log = (self.state / "api.log").open("ab")
        self.processes.append(subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app", "--host",
             "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
            env=self.env, cwd=REPO, stdout=api_log, stderr=api_log, start_new_session=True))
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the service did not start; see {self.state / 'api.log'}")
            time.sleep(0.2)
        agent_log = (self.state / "agent.log").open("ab")
        self.processes.append(subprocess.Popen(
            [sys.executable, "-m", "device_agents.cli", "--config", str(self.state / "agent.toml"),
             "--log-level", "WARNING"], env=self.env, cwd=REPO, stdout=agent_log,
            stderr=agent_log, start_new_session=True))

    def stop(self) -> None:
        for p in reversed(self.processes):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def outstanding(db) -> tuple[int, set]:
    """(number of queued or claimed tasks, their (signature, schedule) keys)."""
    from sqlalchemy import select

    from service.devices.tables import MeasurementTask

    with db.read() as s:
        rows = s.scalars(select(MeasurementTask).where(
            MeasurementTask.status.in_(("queued", "claimed")))).all()
    keys = {(k["signature"], k["schedule"]) for t in rows for k in t.kernels.values()}
    return len(rows), keys


def known_keys(db, fingerprint: str) -> set:
    from sqlalchemy import select

    from service.profiles.tables import ProfileEntry

    with db.read() as s:
        return set(s.execute(select(ProfileEntry.signature, ProfileEntry.schedule).where(
            ProfileEntry.device_fingerprint == fingerprint)).all())


def bert_closure(stack, fingerprint: str, runs: int) -> None:
    """Compile BERT-base against the database until its planner asks for nothing unmeasured."""
    from kiln.pipeline import CompileOptions, compile_model
    from kiln.profile.machine import host_machine
    from kiln.profile.roofline import RooflineModel
    from service.profiles.service import best

    class Missing:
        def __init__(self):
            self.fallback = RooflineModel(host_machine())
            self.missing: list = []

        def latency(self, graph, op_ids):
            from kiln.signature import kernel_signature

            with stack.db.read() as s:
                hit = best(s, fingerprint, kernel_signature(graph, op_ids))
            if hit is not None:
                return hit
            self.missing.append((graph, tuple(op_ids)))
            return self.fallback.latency(graph, op_ids)

        def record(self, *a, **k):
            pass

        def schedules(self, graph, op_ids):
            return []

    if not BERT.is_file():
        log(f"{BERT} is missing (python bench/zoo.py --size full); BERT-base closure skipped")
        return
    previous = None
    for round_ in range(8):
        store = Missing()
        c = compile_model(BERT, CompileOptions(), store)
        blocks = [b.op_ids for b in c.plan.blocks if not b.is_view]
        missing = [ids for _g, ids in store.missing]
        from kiln.signature import kernel_signature
        have = known_keys(stack.db, fingerprint)
        need = [ids for ids in dict.fromkeys(missing + blocks)
                if (kernel_signature(c.graph, ids), "{}") not in have]
        log(f"BERT-base closure round {round_}: {len(store.missing)} lookups missed, "
            f"{len(need)} kernels to measure")
        if not need and not store.missing:
            return
        if previous == need:  # what is left cannot be measured alone (views: no kernel)
            log(f"BERT-base closure: {len(need)} lookups have no kernel of their own; the cost "
                f"model answers them")
            return
        previous = need
        produce(stack, fingerprint, [(c.graph, need)], runs, batch=64, target_entries=None,
                with_variants=False)


def produce(stack, fingerprint, sources, runs: int, batch: int, target_entries: int | None,
            with_variants: bool = True, max_outstanding: int = 3) -> None:
    """Turn (graph, [op_ids]) sources into measurement tasks; wait until they are measured."""
    from kiln.measure.probe import ProbeError, build_probes, make_probe
    from kiln.runtime.toolchain import BuildCache
    from kiln.target import target
    from service.profiles.measure import submit_probes
    from service.profiles.service import count
    from service.storage import Storage

    storage = Storage(stack.settings.storage_root)
    cache = BuildCache()
    host = target("host")
    known = known_keys(stack.db, fingerprint) | outstanding(stack.db)[1]
    seen: set = set()
    pending: list = []
    tmp = stack.state / "tmp"
    tmp.mkdir(exist_ok=True)
    started, first = time.monotonic(), count(stack.db, fingerprint, "measured")

    def flush(probes) -> None:
        path = tmp / f"probes-{os.getpid()}-{time.monotonic_ns()}.kiln"
        t0 = time.monotonic()
        try:
            built = build_probes(probes, host, path, cache)
        except ProbeError as exc:
            log(f"batch of {len(probes)} refused: {exc}")
            return
        reasons = {}
        for _i, why in built.skipped:
            key = "same code" if why.startswith("same code") else why.split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
        task = submit_probes(stack.db, storage, built, host.arch, device_fingerprint=fingerprint,
                             runs=runs, warmup=1, timeout_s=1800)
        if with_variants:  # the same kernels on one thread: a run configuration of their own
            submit_probes(stack.db, storage, built, host.arch, device_fingerprint=fingerprint,
                          runs=runs, warmup=1, timeout_s=1800, threads=1)
        path.unlink(missing_ok=True)
        known.update((k["signature"], k["schedule"]) for k in built.kernels.values())
        known.update(outstanding(stack.db)[1])  # other producers' work too
        done = count(stack.db, fingerprint, "measured")
        rate = (done - first) / max(time.monotonic() - started, 1e-9) * 60
        log(f"task {task[:8]}: {len(built.kernels)} kernels built in {time.monotonic() - t0:.1f} s "
            f"(skipped {reasons or 0}); measured entries {done} ({rate:.0f}/min)")

    def wait(limit: int) -> None:
        while outstanding(stack.db)[0] > limit:
            if any(p.poll() is not None for p in stack.processes):
                raise SystemExit("the service or the agent exited; see api.log / agent.log")
            time.sleep(0.5)

    for graph, block_list in sources:
        for op_ids in block_list:
            if with_variants:
                pending += probes_for(graph, op_ids, known, seen, getattr(graph, "kiln_native", True))
            else:
                try:
                    probe = make_probe(graph, op_ids)
                except (ProbeError, ValueError, TypeError):
                    continue
                key = (probe.signature, probe.schedule_text)
                if key not in known and key not in seen:
                    seen.add(key)
                    pending.append(probe)
            while len(pending) >= batch:
                wait(max_outstanding)
                flush(pending[:batch])
                pending = pending[batch:]
        if target_entries is not None and count(stack.db, fingerprint, "measured") >= target_entries:
            break
    if pending:
        wait(max_outstanding)
        flush(pending)
    wait(0)


def build(args) -> None:
    from service.profiles.measure import local_facts
    from service.profiles.service import count

    state = Path(args.state).expanduser()
    state.mkdir(parents=True, exist_ok=True)
    stack = Stack(state)
    fingerprint = local_facts().fingerprint
    global SHARD
    SHARD = tuple(int(x) for x in args.shard.split("/"))
    stack.start(args.producer_only)
    log(f"service {stack.url}, agent started; device class {fingerprint[:12]}; "
        f"{count(stack.db, fingerprint, 'measured')} measured entries so far; shard {args.shard}")
    try:
        if not args.producer_only:
            bert_closure(stack, fingerprint, args.runs)

        def sources():
            for label, path, dims in model_variants():
                if count(stack.db, fingerprint, "measured") >= args.entries:
                    return
                try:
                    for graph, blocks in blocks_of(path, dims):
                        yield graph, blocks
                except Exception as exc:  # noqa: BLE001 - a variant the exported graph refuses
                    log(f"{label}: skipped ({type(exc).__name__}: {str(exc)[:120]})")
                    continue
                log(f"{label}: enumerated")

        produce(stack, fingerprint, sources(), args.runs, args.batch, args.entries)
        if not args.producer_only:
            bert_closure(stack, fingerprint, args.runs)
        log(f"build done: {count(stack.db, fingerprint, 'measured')} measured entries "
            f"({count(stack.db)} in all)")
    finally:
        stack.stop()


# --- the report ---------------------------------------------------------------------------------

def time_lookups(db, fingerprint: str, keys: list[str], n: int = 2000) -> dict[str, tuple]:
    """p50/p99 milliseconds of both lookups over random signatures, after a warm-up pass."""
    import numpy as np

    from service.profiles.service import best, schedules

    rng = random.Random(1)
    picks = [rng.choice(keys) for _ in range(n)]
    out = {}
    with db.read() as s:
        for name, fn in (("yellow", best), ("schedule", schedules)):
            for sig in picks[:200]:
                fn(s, fingerprint, sig)
            times = []
            for sig in picks:
                t0 = time.perf_counter()
                fn(s, fingerprint, sig)
                times.append((time.perf_counter() - t0) * 1000)
            out[name] = (float(np.percentile(times, 50)), float(np.percentile(times, 99)))
    return out


def copy_to_postgres(src, url: str) -> None:
    from sqlalchemy import select

    from service.db import database
    from service.migrate import upgrade
    from service.profiles.tables import ProfileEntry

    upgrade(url)
    dst = database(url)
    with src.read() as s:
        rows = [dict(device_fingerprint=e.device_fingerprint, signature=e.signature,
                     schedule=e.schedule, median_s=e.median_s, p10_s=e.p10_s, p90_s=e.p90_s,
                     n=e.n, source=e.source, toolchain=e.toolchain, created_at=e.created_at)
                for e in s.scalars(select(ProfileEntry))]
    with dst.write() as s:
        s.execute(ProfileEntry.__table__.delete())
        for i in range(0, len(rows), 5000):
            s.execute(ProfileEntry.__table__.insert(), rows[i:i + 5000])
    with dst.engine.connect() as c:
        c.exec_driver_sql("ANALYZE profile_entries")
        c.commit()


def synthetic_postgres(url: str, total: int, fingerprint: str) -> list[str]:
    """Fill `url` with `total` synthetic entries (server-side); return some signatures."""
    from service.db import database
    from service.migrate import upgrade

    upgrade(url)
    db = database(url)
    with db.engine.connect() as c:
        c.exec_driver_sql("TRUNCATE profile_entries")
        # 20 device classes x (total / 20 / 10) signatures x 10 schedules
        per_device = total // 20
        c.exec_driver_sql(f"""
            INSERT INTO profile_entries (device_fingerprint, signature, schedule, median_s, p10_s,
                                         p90_s, n, source, toolchain, created_at)
            SELECT CASE WHEN d = 0 THEN '{fingerprint}' ELSE md5('dev' || d) || md5('x' || d) END,
                   md5('sig' || s) || md5('sag' || s), '{{"v":' || v || '}}',
                   0.001 + random() * 0.01, 0.001, 0.02, 10, 'measured', 'synthetic', now()
            FROM generate_series(0, 19) d, generate_series(0, {per_device // 10 - 1}) s,
                 generate_series(0, 9) v""")
        c.exec_driver_sql("ANALYZE profile_entries")
        c.commit()
    return [f"{__import__('hashlib').md5(f'sig{s}'.encode()).hexdigest()}"
            f"{__import__('hashlib').md5(f'sag{s}'.encode()).hexdigest()}"
            for s in range(0, per_device // 10, max(1, per_device // 10 // 5000))]


def bert_compile(url: str, storage_root: Path, label: str) -> None:
    """Compile BERT-base through the workers' database ProfileStore; print time and counts."""
    from kiln.pipeline import CompileOptions, compile_model
    from service.db import database
    from service.migrate import upgrade
    from service.settings import Settings
    from service.storage import Storage
    from workers.profile_store import DatabaseProfileStore

    upgrade(url)
    settings = Settings(database_url=url, storage_root=storage_root)
    store = DatabaseProfileStore(database(url), Storage(storage_root), settings, "host")
    t0 = time.perf_counter()
    c = compile_model(BERT, CompileOptions(), store)
    seconds = time.perf_counter() - t0
    log(f"BERT-base compile, {label}: {seconds:.1f} s; yellow lookups {c.report['yellow_lookups']}; "
        f"store: {store.stats()}")


def report(args) -> None:
    from service.db import database
    from service.profiles.measure import local_facts
    from service.profiles.service import count
    from service.settings import Settings
    from tests.service.stack import create_database, drop_database

    state = Path(args.state).expanduser()
    settings = Settings(data_dir=state / "data")
    db = database(settings.database_url)
    fingerprint = local_facts().fingerprint
    measured, total = count(db, fingerprint, "measured"), count(db)
    log(f"profile database {settings.database_url}: {measured} measured entries "
        f"({total} in all)")
    from sqlalchemy import select

    from service.profiles.tables import ProfileEntry

    with db.read() as s:
        keys = sorted(set(s.scalars(select(ProfileEntry.signature).where(
            ProfileEntry.device_fingerprint == fingerprint))))
    if not keys:
        raise SystemExit("the database is empty; run --phase build first")
    figures = {}
    figures[f"sqlite {total}"] = time_lookups(db, fingerprint, keys)
    url = create_database(PG_ADMIN_URL)
    try:
        copy_to_postgres(db, url)
        figures[f"postgresql {total}"] = time_lookups(database(url), fingerprint, keys)
        synthetic = synthetic_postgres(url, args.synthetic, fingerprint)
        figures[f"postgresql {count(database(url))} synthetic"] = time_lookups(
            database(url), fingerprint, synthetic)
    finally:
        database(url).dispose()
        drop_database(url, PG_ADMIN_URL)
    print(f"\n{'database':<34} {'yellow p50':>11} {'yellow p99':>11} {'sched p50':>10} "
          f"{'sched p99':>10}   (ms, warm)")
    for name, f in figures.items():
        print(f"{name:<34} {f['yellow'][0]:11.3f} {f['yellow'][1]:11.3f} {f['schedule'][0]:10.3f} "
              f"{f['schedule'][1]:10.3f}")
    print(flush=True)
    if BERT.is_file() and not args.skip_bert:
        if not args.skip_empty_bert:
            bert_empty()
        bert_compile(settings.database_url, settings.storage_root, "filled database")


def bert_empty() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bert-") as tmp:
        bert_compile(f"sqlite:///{tmp}/empty.sqlite", Path(tmp) / "storage", "empty database")


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` stops the service and agent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", default="~/.cache/kiln/profile-bench",
                        help="folder of the service's database, storage and the agent")
    parser.add_argument("--phase", choices=("build", "report", "all", "bert-empty"), default="all",
                        help="bert-empty: only BERT-base's compile with an empty database")
    parser.add_argument("--entries", type=int, default=TARGET_ENTRIES,
                        help="measured entries to reach (default 22000)")
    parser.add_argument("--batch", type=int, default=160, help="kernels per measurement task")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per kernel")
    parser.add_argument("--synthetic", type=int, default=1_000_000)
    parser.add_argument("--skip-bert", action="store_true")
    parser.add_argument("--skip-empty-bert", action="store_true",
                        help="in the report, only the filled database's BERT-base compile")
    parser.add_argument("--shard", default="0/1", metavar="K/N",
                        help="produce only the kernels whose signature hashes to K modulo N")
    parser.add_argument("--producer-only", action="store_true",
                        help="queue tasks only: another build process (same --state) runs the "
                        "service and the agent")
    args = parser.parse_args(argv)
    if args.phase in ("build", "all"):
        build(args)
    if args.phase in ("report", "all"):
        report(args)
    if args.phase == "bert-empty":
        bert_empty()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
