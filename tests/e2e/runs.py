"""End-to-end helpers: a tiny real run through real Temporal, workers and DeepSpeed."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

from activities.contracts import STAGES
from ops.chaos import Chaos
from ops.cli import main
from ops.client import connect, localize, start_run
from spec import RunSpec, preset
from storage import fast_tier
from storage.checkpoints import CheckpointStore
from storage.events import read_events

# Where the session's prepared datasets live (tests/e2e/conftest.py sets it per session).
PREPARED_ROOT: str | None = None
_prepared: dict[str, str] = {}  # a data config (JSON) -> its dataset directory, prepared once


# One 60-step segment at world size 2, with steps long enough (~0.2 s on 2 CPU cores) that a
# strike lands mid-segment: the rank-fault runs' (tests/e2e/test_rank_faults.py and the
# layouts'). Only the hang floor is lowered from its 60 s, so that the default k = 10 x the
# p99 step time decides (2-6 s here, with the load of the machine) and the test stays
# short; no sweep, so the run is data -> train -> eval.
HUNG = {"train.procs_per_node": 2, "train.total_steps": 60, "train.segment_steps": 60,
        "train.segments_per_run": 1, "train.checkpoint_every": 10,
        "train.micro_batch_tokens": 4096, "sweep.enabled": False,
        "ops.hang_floor_s": 1.0, "ops.heartbeat_timeout_s": 8.0}
# strike here: the segment, its latest step (the eval: 40). From step 22 on: the step-10
# checkpoint's commit (the tiered writer's, a process of its own) is done by then, so there
# is a commit before the fault to resume from; at step 12 it could still be in flight
MID_SEGMENT = ((0, 60), (22, 32))


def tiny_spec(run_id: str, durable: str, fast: str, *, prepared: bool = True,
              **overrides) -> RunSpec:
    """The demo preset shrunk to finish in about a minute on 2 CPU cores.

    A local durable store gets the session's prepared dataset for the tiny data config (one
    data prep per session instead of one per run: its prepare_data stage is a cache hit),
    unless `prepared` is False (a test of what a refused run leaves in its store). A test
    that changes the data config, a store on S3 and the demo prepare their own; data prep
    itself is tests/dataprep/'s, and the demo's and the temporal CLI run's end to end."""
    base = {"run_id": run_id, "storage.durable": durable, "storage.fast": fast,
            "data.max_documents": 60, "data.tokenizer.vocab_size": 512,
            "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
            "model.seq_len": 64, "train.micro_batch_tokens": 512,
            "train.total_steps": 80, "train.segment_steps": 40, "train.segments_per_run": 1,
            "train.checkpoint_every": 10, "train.warmup_steps": 5, "train.eval_batches": 4,
            "sweep.trials": 2, "sweep.trial_steps": 8, "sweep.parallel": 1,
            "sweep.space": {"lr": {"low": 3e-3, "high": 1e-2, "log": True}},
            "faults": [], "ops.heartbeat_timeout_s": 8.0}
    spec = localize(preset("demo", **{**base, **overrides}))
    if prepared and PREPARED_ROOT and "://" not in durable and not any(
            k.startswith("data.") for k in overrides):
        seed_dataset(spec, durable)
    return spec


def seed_dataset(spec: RunSpec, durable_dir: str) -> None:
    """Copy the dataset of `spec.data`, prepared once this session (in a child process: no
    fork of this process and its gRPC threads), into the store at `durable_dir`."""
    key = json.dumps(spec.to_dict()["data"], sort_keys=True)
    if key not in _prepared:
        root = os.path.join(PREPARED_ROOT, str(len(_prepared)))
        code = ("import json, sys\n"
                "from dataprep.pipeline import prepare_dataset\n"
                "from spec import RunSpec\n"
                "spec = RunSpec.from_dict(json.loads(sys.argv[1]))\n"
                "prepare_dataset(spec.data, sys.argv[2], spec.seed)\n")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        subprocess.run([sys.executable, "-c", code, json.dumps(spec.to_dict()), root],
                       cwd=repo, check=True, capture_output=True, timeout=300)
        [made] = glob.glob(os.path.join(root, "datasets", "*", "MANIFEST.json"))
        _prepared[key] = os.path.dirname(made)
    source = _prepared[key]
    target = os.path.join(durable_dir, "datasets", os.path.basename(source))
    if not os.path.exists(target):
        shutil.copytree(source, target)


async def run_to_end(address: str, spec: RunSpec, timeout_s: float = 600.0) -> dict:
    client = await connect(address)
    await start_run(client, spec)
    handle = client.get_workflow_handle(spec.run_id)
    result = await asyncio.wait_for(handle.result(), timeout_s)
    return result if isinstance(result, dict) else result.__dict__


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def assert_completed_five_stages(result: dict, spec: RunSpec) -> list[dict]:
    """The acceptance checks every full run must pass; returns the run's events."""
    assert result["status"] == "completed"
    assert result["stages"] == list(STAGES)
    # Clearly learned: held-out loss at least 0.5 nats (perplexity -39 %) below the
    # untrained model's; a model that does not learn stays within noise of it.
    assert result["final_val_loss"] < result["initial_val_loss"] - 0.5, result
    events = read_events(spec.storage.durable, spec.run_id)
    for stage in STAGES:
        kinds = {(e["kind"], e["payload"].get("stage")) for e in events}
        assert ("stage_started", stage) in kinds and ("stage_finished", stage) in kinds, stage
    committed = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    logged = sorted(e["step"] for e in events if e["kind"] == "checkpoint_committed")
    assert committed == logged, (committed, logged)
    expected = sorted({0, *range(spec.train.checkpoint_every, spec.train.total_steps + 1,
                                 spec.train.checkpoint_every), spec.train.total_steps})
    assert committed == expected
    assert any(e["kind"] == "promoted" for e in events)
    return events


def run_in_background(address: str, spec: RunSpec, timeout_s: float = 900
                      ) -> tuple[threading.Thread, dict]:
    """run_to_end in a thread (the test strikes meanwhile); its result lands in box, or
    the exception it ended with (a run the test terminates, one that failed) as "error"."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = asyncio.run(run_to_end(address, spec, timeout_s=timeout_s))
        except Exception as exc:  # the test asserts on the outcome, not the thread
            box["error"] = exc
    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    return runner, box


def chaos_for(fleet, spec: RunSpec) -> Chaos:
    """Chaos against the fleet's current trainer worker and the run's stores."""
    return Chaos(worker_pid=lambda: fleet.procs["trainer"].pid,
                 durable=CheckpointStore(spec.storage.durable, spec.run_id),
                 fast_root=fast_tier.run_dir(spec.storage.fast, spec.run_id))


def position(spec: RunSpec) -> tuple[int, int, int] | None:
    """(from, to, latest step) of the segment the trainer wrote progress for last."""
    newest = max(glob.glob(os.path.join(fast_tier.run_dir(spec.storage.fast, spec.run_id),
                                        "segments", "*", "progress.jsonl")),
                 key=os.path.getmtime, default=None)
    if newest is None:
        return None
    lo, hi = (int(x) for x in os.path.basename(os.path.dirname(newest)).split("-"))
    with open(newest) as f:
        steps = [json.loads(line)["step"] for line in f if line.startswith('{"type": "step"')]
    return lo, hi, max(steps, default=lo)


def strike(chaos: Chaos, spec: RunSpec, kind: str, segment: tuple[int, int],
           steps: tuple[int, int], timeout_s: float = 300) -> dict:
    """Apply `kind` while segment [lo, hi) runs and its latest step is within `steps` (a
    rank between two segments, or one about to finish, is not there to strike)."""
    def ready() -> bool:
        at = position(spec)
        return at is not None and at[:2] == segment and steps[0] <= at[2] <= steps[1]

    return wait_for(lambda: ready() and "skipped" not in (done := chaos.apply(kind)) and done,
                    timeout_s, f"segment {segment} at steps {steps} to {kind}", every_s=0.2)


def newest_commit_at_or_before(spec: RunSpec, step: int) -> int:
    """The newest checkpoint committed on either tier at or before `step`: what a retry on
    this machine resumes from (the fast tier holds a commit whose upload was cut)."""
    stores = [CheckpointStore(spec.storage.durable, spec.run_id),
              CheckpointStore.local(fast_tier.store_dir(spec.storage.fast, spec.run_id))]
    return max(s for store in stores for s in store.list_committed() if s <= step)


def first_fault(spec: RunSpec, kind: str, timeout_s: float = 120) -> dict:
    """The run's first real `fault` event of `kind`, once it is there."""
    return wait_for(lambda: next((e for e in read_events(spec.storage.durable, spec.run_id,
                                                          kinds=("fault",))
                                  if e["payload"]["kind"] == kind), None),
                    timeout_s, f"a {kind} fault event")


def assert_recovered_from(spec: RunSpec, fault: dict, resume_from: int,
                          committed_at_fault: list[int], kinds: tuple[str, ...]) -> list[dict]:
    """The run's faults were exactly `kinds` (in order), each closed by exactly one
    `recovered`; `fault`'s resumed from `resume_from`, and no committed checkpoint was lost
    (every one the run should have is there)."""
    events = read_events(spec.storage.durable, spec.run_id)
    faults = [e for e in events if e["kind"] == "fault"]
    assert [e["payload"]["kind"] for e in faults] == list(kinds), [e["payload"] for e in faults]
    closed = sorted(e["payload"]["fault_event_id"] for e in events if e["kind"] == "recovered")
    assert closed == sorted(e["event_id"] for e in faults), closed
    [recovered] = [e for e in events if e["kind"] == "recovered"
                   and e["payload"]["fault_event_id"] == fault["event_id"]]
    assert recovered["payload"]["resumed_step"] == resume_from, recovered["payload"]
    final = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    assert set(committed_at_fault) <= set(final)
    assert final == list(range(0, spec.train.total_steps + 1, spec.train.checkpoint_every))
    return events


def assert_restarted_in_place(spec: RunSpec, events: list[dict], fault: dict,
                              launches: int) -> dict:
    """The fault was answered by the same attempt launching again in place from the
    worker's warm standby (no cold start): no Temporal retry, no heartbeat wait. `launches`:
    how many the segment had in all, every one warm. Returns the `recovered` payload."""
    p = fault["payload"]
    [recovered] = [e for e in events if e["kind"] == "recovered"
                   and e["payload"]["fault_event_id"] == fault["event_id"]]
    r = recovered["payload"]
    assert (r["attempt"], r["restart"], r["in_place"]) == (
        p["attempt"], p.get("restart", 0) + 1, True), r
    # seen when the fault was: no heartbeat timeout in between
    assert recovered["ts"] > fault["ts"] and abs(r["detection_s"] - p["detection_s"]) < 0.01, r
    started = [e["payload"]["attempt"] for e in events if e["kind"] == "segment_started"]
    assert started == [p["attempt"]], started  # the activity was not retried
    root = pathlib.Path(fast_tier.run_dir(spec.storage.fast, spec.run_id), "segments")
    log = "".join(f.read_text(errors="replace") for f in root.glob("*/child.log"))
    assert log.count("standby launched") >= launches, "every launch should be warm"
    return r


def cli_status(capsys, run_id: str, address: str) -> dict:
    """`mainspring run status` as an operator runs it, parsed."""
    capsys.readouterr()
    assert main(["run", "status", run_id, "--address", address]) == 0
    return json.loads(capsys.readouterr().out)
