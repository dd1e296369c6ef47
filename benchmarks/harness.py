"""Shared by the run-level benchmarks (overhead, goodput): the real services on private ports,
a worker fleet, one run through the TrainingRun workflow, and what the run left behind.

Nothing here is a stand-in: the Temporal dev server and SeaweedFS are the real binaries
(ops/services.py), workers are `mainspring worker` processes (common/procs.py), trainers are
`trainer.segment` children under torchrun, as tests/e2e runs them.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import subprocess
import time

import psutil
import structlog

# Progress on stderr: stdout carries the one JSON line of the figure.
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
log = structlog.get_logger(__name__)

from common.procs import WorkerFleet
from ops.client import connect, localize, start_run
from ops.services import SeaweedS3, TemporalDevServer, free_port
from spec import RunSpec, preset

# The e2e run shape (tests/e2e/runs.py tiny_spec) with the sweep off: a small GPT on a
# slice of the standard library, sized so a few hundred steps take minutes on 2 cores.
BASE = {"data.max_documents": 120, "data.tokenizer.vocab_size": 1024,
        "model.d_model": 128, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 4,
        "model.seq_len": 128, "train.micro_batch_tokens": 1024, "train.warmup_steps": 10,
        "train.eval_every": 0, "sweep.enabled": False, "faults": []}


def private_extensions() -> str:
    """A torch-extensions directory of our own, its DeepSpeed CPU comm op built before any
    run starts (so no measured run pays for a JIT build).

    torch's JIT loader holds a lock file in the build directory on every load; a trainer
    killed inside that window leaves it behind and later trainers wait until the supervisor
    clears it after `ops.hang_timeout_s` (trainer/extensions.py). The benchmarks kill
    trainers on purpose, so they keep away from the directory that every other run of this
    Python environment (tests, the demo) shares. Only our runs use this one, so a lock that
    an earlier, interrupted benchmark left there is removed first.
    """
    path = os.environ.get("MAINSPRING_BENCH_TORCH_EXTENSIONS") or os.path.join(
        tempfile.gettempdir(), f"mainspring-bench-torch-extensions-{os.getuid()}")
    for lock in glob.glob(os.path.join(path, "*", "lock")):
        os.unlink(lock)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": path, "DS_ACCELERATOR": "cpu"}
    load = "from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder as B; B().load()"
    subprocess.run([sys.executable, "-c", load], env=env, check=True, capture_output=True,
                   timeout=900)
    return path


def nice_tree(pid: int, level: int = 19) -> None:
    """Lowest CPU priority for a service and its children: in production S3 runs on other
    machines; here it shares the training cores (benchmarks/checkpoint_stall.py does the same)."""
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, level)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass


@dataclass
class Services:
    """Temporal dev server + (optionally) SeaweedFS S3 + a restarting worker fleet."""

    root: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="mainspring-bench-"))
    s3: bool = True
    env: dict[str, str] = field(default_factory=dict)  # extra worker (and trainer) environment
    # trainer workers: the fleet's own, then each further one a restarting fleet of its own
    # (benchmarks/recovery.py: a lost worker's retry goes to another worker)
    trainers: int = 1
    temporal: TemporalDevServer | None = None
    seaweed: SeaweedS3 | None = None
    fleet: WorkerFleet | None = None
    more_trainers: list[WorkerFleet] = field(default_factory=list)

    def start(self) -> Services:
        os.environ["TORCH_EXTENSIONS_DIR"] = private_extensions()  # workers and bare loops
        self.temporal = TemporalDevServer(os.path.join(self.root, "temporal"), port=free_port(),
                                          headless=True).start()
        env = dict(self.env)
        if self.s3:
            self.seaweed = SeaweedS3(os.path.join(self.root, "weed")).start()
            nice_tree(self.seaweed.proc.pid)
            env.update(self.seaweed.env())
            os.environ.update(self.seaweed.env())  # this process reads events and checkpoints
        self.fleet = WorkerFleet(self.temporal.address, log_dir=os.path.join(self.root, "logs"),
                                 restart=True, env=env).start()
        self.more_trainers = [
            WorkerFleet(self.temporal.address, roles=("trainer",), restart=True, env=env,
                        log_dir=os.path.join(self.root, f"logs-trainer{i}")).start()
            for i in range(1, self.trainers)]
        return self

    def trainer_fleets(self) -> list[WorkerFleet]:
        """Every fleet with a trainer worker (`procs["trainer"]`, its log in `log_dir`)."""
        return [f for f in (self.fleet, *self.more_trainers) if f is not None]

    def restart_s3(self) -> None:
        """SeaweedFS back on the same S3 port and data directory (after an outage)."""
        assert self.seaweed is not None
        self.seaweed.start()
        nice_tree(self.seaweed.proc.pid)

    @property
    def durable(self) -> str:
        if self.seaweed:
            return f"s3://{self.seaweed.bucket}/bench"
        return os.path.join(self.root, "store")

    def stop(self) -> None:
        for part in (*self.more_trainers, self.fleet, self.seaweed, self.temporal):
            if part is not None:
                part.stop()

    def remove(self) -> None:
        """Delete the scratch directory, unless MAINSPRING_BENCH_KEEP=1 asks to keep it for a
        post-mortem (worker logs, every attempt's progress file, the services' data)."""
        if os.environ.get("MAINSPRING_BENCH_KEEP") == "1":
            print(f"kept: {self.root}", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


def bench_spec(run_id: str, services: Services, **overrides) -> RunSpec:
    base = {"run_id": run_id, "storage.durable": services.durable,
            "storage.fast": os.path.join(services.root, "fast"), **BASE}
    return localize(preset("demo", **{**base, **overrides}))


async def run_workflow(address: str, spec: RunSpec, timeout_s: float) -> dict:
    """Start the run and wait for its result, through Temporal server restarts (the goodput
    soak's `server_restart` fault): a wait the server broke off is taken up again on a new
    connection once the server is back (the client's own retries give up after ~10 s)."""
    from temporalio.service import RPCError

    client = await connect(address)
    await start_run(client, spec)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = await asyncio.wait_for(client.get_workflow_handle(spec.run_id).result(),
                                            max(1.0, deadline - time.monotonic()))
            return result if isinstance(result, dict) else result.__dict__
        except RPCError as exc:
            log.warning("run_result_wait_broken", run_id=spec.run_id, error=str(exc)[:200])
        client = await reconnect(address, deadline)


async def reconnect(address: str, deadline: float):
    """A new client once the server answers again (Client.connect raises RuntimeError while
    it is away); TimeoutError at `deadline` (time.monotonic)."""
    while True:
        try:
            return await connect(address)
        except RuntimeError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the Temporal server at {address} did not come back") \
                    from exc
            log.info("server_not_back", address=address, error=str(exc)[:100])
            await asyncio.sleep(1.0)


def progress_lines(spec: RunSpec) -> list[dict]:
    """Every line of every segment's progress file (all attempts), ordered by time."""
    pattern = os.path.join(spec.storage.fast, spec.run_id, "segments", "*", "progress.jsonl")
    lines: list[dict] = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            lines += [json.loads(line) for line in f if line.strip().endswith("}")]
    return sorted(lines, key=lambda line: line["ts"])


def stage_window(events: list[dict], stage: str) -> tuple[float, float]:
    """(start, end) wall-clock seconds of a workflow stage, from its stage events."""
    start = next(e["ts"] for e in events
                 if e["kind"] == "stage_started" and e["payload"].get("stage") == stage)
    end = next(e["ts"] for e in events
               if e["kind"] == "stage_finished" and e["payload"].get("stage") == stage)
    return start, end


def checkpoint_pauses(events: list[dict]) -> float:
    """Seconds the step loop spent paused for checkpoints (the checkpoint_saved events)."""
    return sum(e["payload"]["pause_s"] for e in events if e["kind"] == "checkpoint_saved")


def raw_run(args, run) -> dict:
    """What a run left: read back from `--from-raw`, or `run()` now (and written to
    `--save-raw` when given), so a report can be made again without running."""
    if args.from_raw:
        return json.loads(Path(args.from_raw).read_text())
    raw = run()
    if args.save_raw:
        Path(args.save_raw).write_text(json.dumps(raw))
    return raw


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def rounded(v, digits: int = 3):
    """Floats rounded to `digits`, inside dicts and lists too (for the JSON line)."""
    if isinstance(v, dict):
        return {k: rounded(x, digits) for k, x in v.items()}
    if isinstance(v, list):
        return [rounded(x, digits) for x in v]
    return round(v, digits) if isinstance(v, float) else v
