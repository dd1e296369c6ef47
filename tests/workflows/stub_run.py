"""The stub side of test_training_run_stubs.py: every activity and local activity of
TrainingRun (and its Sweep) under its real name (activities/contracts.py), answering with a
plausible contract result at once; three workers as ops/worker.py builds them, on the real
Temporal dev server; and the helpers the scenarios use.

A stub segment of the run (not of a sweep trial) can be told to "train" until it is
cancelled, as the real supervisor does (`Stubs.block`): it then reports the step it stopped
at (`STOP_AFTER` steps in), once `stop_gate` is open, so a test can queue several commands
for one boundary. `prepare_gate` holds prepare_data the same way.

MAINSPRING_RECORD_HISTORIES=<label> makes `Harness.record` write the histories of the runs
that call it to tests/workflows/histories/<label>/ (label: the commit of the workflow code
that ran them); test_replay.py replays every one. Its docstring says when to record.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from activities.contracts import (
    CLAIM_RUN,
    DATA_QUEUE,
    EVALUATE,
    PIN_ROLLBACK,
    PREPARE_DATA,
    PROMOTE,
    PRUNE_TRIAL,
    RECORD_EVENT,
    SCRUB_CHECKPOINTS,
    SPEC_ROOT,
    SUGGEST_TRIALS,
    TRAIN_SEGMENT,
    TRAINER_QUEUE,
    WORKFLOW_TYPE,
    ClaimRunInput,
    EvalPoint,
    EvaluateInput,
    EvaluateResult,
    PinInput,
    PrepareDataInput,
    PrepareDataResult,
    PromoteInput,
    PromoteResult,
    PruneInput,
    PruneResult,
    RecordEventInput,
    ScrubInput,
    ScrubResult,
    SuggestInput,
    SuggestResult,
    TrainSegmentInput,
    TrainSegmentResult,
)
from activities.prune import prune_trial
from ops.cli import main as mainspring
from ops.services import find_binary
from spec import preset
from workflows.sweep import Sweep
from workflows.training_run import TrainingRun

HISTORIES = Path(__file__).parent / "histories"
RECORD = os.environ.get("MAINSPRING_RECORD_HISTORIES", "")  # a label: see the docstring
STOP_AFTER = 7  # a cancelled stub segment stops this many steps after its start
SPEC_ROOT_DIR = "/stub/root"  # what the stub orchestrator anchors relative spec paths at
LOSS_AT = {0: 5.0}  # held-out loss the stub evaluator reports (default: falls with the step)
FAST = timedelta(milliseconds=100)  # heartbeat throttle: a cancel reaches a stub at once


def spec_for(run_id: str, **overrides):
    base = {"run_id": run_id, "storage.durable": "file:///stub/store",
            "storage.fast": "/stub/fast", "train.total_steps": 20, "train.segment_steps": 10,
            "train.segments_per_run": 1, "train.warmup_steps": 2, "train.checkpoint_every": 5,
            "sweep.enabled": False, "sweep.parallel": 1, "faults": [],
            "ops.heartbeat_timeout_s": 1.0}
    return preset("demo", **{**base, **overrides})


class Stubs:
    """The activities, each under its real name, and what they were asked."""

    def __init__(self) -> None:
        self.segments: list[TrainSegmentInput] = []
        self.events: list[RecordEventInput] = []
        self.pins: dict[str, int] = {}  # pin id -> pinned step (released: removed)
        self.pinned_ever: dict[str, int] = {}
        self.block = False  # the run's segments train until cancelled
        self.stop_gate = asyncio.Event()  # a cancelled segment reports its stop once set
        self.stop_gate.set()
        self.prepare_gate = asyncio.Event()  # prepare_data finishes once set
        self.prepare_gate.set()
        # the run's next segments fail with these, one each, as the real activity fails
        # when it needs a decision (activities/training.py: OutOfMemory, RepeatedFailure)
        self.fail_with: list[ApplicationError] = []
        # the run's segments starting at these steps fail their first attempt (a retryable
        # crash: Temporal retries it), and what every run segment reports it measured
        self.retry_first: set[int] = set()
        self.measured: dict = {}
        # the run's segments starting at these steps stop after `steps` steps asking for
        # this gradient accumulation, as the trainer does on an oscillation it answers with
        # a larger batch (trainer/oscillation_watch.py): from_step -> (steps, asked)
        self.ask_batch: dict[int, tuple[int, int]] = {}
        self.claims: list[ClaimRunInput] = []
        self.prepared: list[PrepareDataInput] = []
        self.roots_asked = 0
        self.scrubs: list[ScrubInput] = []  # the checkpoint scrubs asked of the data queue
        self.scrub_fails = False  # they fail (not retried: BadData), as a broken store would
        self.prunes: list[tuple[PruneInput, PruneResult]] = []  # the pruner's decisions

    @staticmethod
    async def _beat_until(gate: asyncio.Event | None) -> None:
        while gate is None or not gate.is_set():
            activity.heartbeat()
            await asyncio.sleep(0.02)

    # ---- data queue ----
    @activity.defn(name=PREPARE_DATA)
    async def prepare_data(self, inp: PrepareDataInput) -> PrepareDataResult:
        self.prepared.append(inp)
        await self._beat_until(self.prepare_gate)
        return PrepareDataResult("file:///stub/datasets/h/MANIFEST.json", False, 60, 4096,
                                 512, 512)

    @activity.defn(name=PROMOTE)
    async def promote(self, inp: PromoteInput) -> PromoteResult:
        return PromoteResult(inp.step, f"file:///stub/promoted/step-{inp.step:09d}", 1234)

    @activity.defn(name=SCRUB_CHECKPOINTS)
    async def scrub_checkpoints(self, inp: ScrubInput) -> ScrubResult:
        self.scrubs.append(inp)
        if self.scrub_fails:
            raise ApplicationError("the store is broken", type="BadData", non_retryable=True)
        return ScrubResult(needed=[10], verified=[10], bytes_read=1234, seconds=0.1)

    # ---- trainer queue ----
    @activity.defn(name=TRAIN_SEGMENT)
    async def train_segment(self, inp: TrainSegmentInput) -> TrainSegmentResult:
        trial = "-trial-" in inp.spec["run_id"]
        if not trial:
            self.segments.append(inp)
            if self.fail_with:
                raise self.fail_with.pop(0)
            if inp.from_step in self.retry_first and activity.info().attempt == 1:
                raise ApplicationError("injected crash", type="RuntimeError")
        stop, asked = inp.to_step, None
        if not trial and inp.from_step in self.ask_batch:
            steps, asked = self.ask_batch.pop(inp.from_step)
            stop = inp.from_step + steps
        if self.block and not trial:
            try:
                await self._beat_until(None)
            except asyncio.CancelledError:
                await self.stop_gate.wait()
                stop = min(inp.from_step + STOP_AFTER, inp.to_step)
        return TrainSegmentResult(
            final_step=stop, last_committed_step=stop,
            last_committed_uri=f"file:///stub/checkpoints/step-{stop:09d}",
            train_loss=3.0 - stop / 100, resumed_from=inp.from_step or None,
            attempt=activity.info().attempt, oldest_committed_step=0,
            stopped="raise_batch" if asked else "interrupted" if stop < inp.to_step else "",
            grad_accum_asked=asked, **({} if trial else self.measured))

    @activity.defn(name=EVALUATE)
    async def evaluate(self, inp: EvaluateInput) -> EvaluateResult:
        if "-trial-" in inp.spec["run_id"]:  # the sweep: lr 1e-2 is the better trial
            loss = 4.0 + abs(inp.spec["train"]["lr"] - 1e-2) * 100
            return EvaluateResult([EvalPoint(inp.steps[0], loss, 0.0)])
        return EvaluateResult([EvalPoint(s, LOSS_AT.get(s, 4.0 - s / 100), 0.0)
                               for s in inp.steps])

    # ---- local activities of the orchestrator ----
    @activity.defn(name=RECORD_EVENT)
    async def record_event(self, inp: RecordEventInput) -> None:
        self.events.append(inp)

    @activity.defn(name=PIN_ROLLBACK)
    async def pin_rollback(self, inp: PinInput) -> None:
        for pin in inp.pin_ids:
            if inp.to_step is None:
                self.pins.pop(pin, None)
            else:
                self.pins[pin] = self.pinned_ever[pin] = inp.to_step

    @activity.defn(name=CLAIM_RUN)
    async def claim_run(self, inp: ClaimRunInput) -> str:
        self.claims.append(inp)
        return "created"

    @activity.defn(name=SPEC_ROOT)
    async def spec_root(self) -> str:
        self.roots_asked += 1
        return SPEC_ROOT_DIR

    @activity.defn(name=SUGGEST_TRIALS)
    async def suggest_trials(self, inp: SuggestInput) -> SuggestResult:
        return SuggestResult([{"lr": 3e-3}, {"lr": 1e-2}][:inp.count], "initial")

    @activity.defn(name=PRUNE_TRIAL)
    async def prune_trial(self, inp: PruneInput) -> PruneResult:
        """The real pruner (optuna, sweep/prune.py): pure, so a stub would only copy it."""
        out = prune_trial(inp)
        self.prunes.append((inp, out))
        return out

    # ---- what the tests read ----
    def payloads(self, kind: str) -> list[dict]:
        return [e.payload for e in self.events if e.kind == kind]

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


class Harness:
    """Three workers as ops/worker.py builds them (orchestrator on a queue of its own)."""

    def __init__(self, client: Client, stubs: Stubs) -> None:
        self.client, self.stubs = client, stubs
        self.queue = f"stub-orchestrator-{uuid.uuid4().hex[:8]}"
        s = stubs
        self.workers = [
            Worker(client, task_queue=self.queue, workflows=[TrainingRun, Sweep],
                   activities=[s.record_event, s.pin_rollback, s.claim_run, s.suggest_trials,
                               s.prune_trial, s.spec_root]),
            Worker(client, task_queue=DATA_QUEUE,
                   activities=[s.prepare_data, s.promote, s.scrub_checkpoints],
                   max_heartbeat_throttle_interval=FAST, default_heartbeat_throttle_interval=FAST),
            Worker(client, task_queue=TRAINER_QUEUE, activities=[s.train_segment, s.evaluate],
                   max_heartbeat_throttle_interval=FAST, default_heartbeat_throttle_interval=FAST),
        ]
        self.started: list[WorkflowHandle] = []

    async def __aenter__(self) -> Harness:
        for w in self.workers:
            await w.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        self.stubs.block = False
        self.stubs.stop_gate.set()
        self.stubs.prepare_gate.set()
        for handle in self.started:  # a failed test leaves nothing running
            try:
                await handle.terminate("test over")
            except Exception:  # noqa: BLE001 - finished already
                pass
        for w in reversed(self.workers):
            await w.__aexit__(None, None, None)

    async def start(self, spec) -> WorkflowHandle:
        first = await self.client.start_workflow(
            WORKFLOW_TYPE, spec.to_dict(), id=spec.run_id, task_queue=self.queue,
            execution_timeout=timedelta(minutes=2))
        self.started.append(self.client.get_workflow_handle(spec.run_id))
        self.first_run_id = first.first_execution_run_id
        return self.client.get_workflow_handle(spec.run_id)  # follows continue-as-new

    async def status(self, handle: WorkflowHandle) -> dict:
        return await handle.query("status")

    async def until(self, handle: WorkflowHandle, what: str, predicate,
                    timeout_s: float = 20.0) -> dict:
        """The run's status once `predicate(status)` holds."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            status = await self.status(handle)
            if predicate(status):
                return status
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}; status: {status}")
            await asyncio.sleep(0.05)

    async def refused(self, handle: WorkflowHandle, name: str, args=None) -> str:
        with pytest.raises(WorkflowUpdateFailedError) as failure:
            await handle.execute_update(name, args)
        assert failure.value.cause.type == "Refused"
        return failure.value.cause.message

    async def histories(self, workflow_id: str) -> list:
        """Every run of the chain that started with this workflow id, in order."""
        out, run_id = [], self.first_run_id
        while run_id:
            history = await self.client.get_workflow_handle(workflow_id,
                                                            run_id=run_id).fetch_history()
            out.append(history)
            last = history.events[-1]
            run_id = (last.workflow_execution_continued_as_new_event_attributes
                      .new_execution_run_id if last.HasField(
                          "workflow_execution_continued_as_new_event_attributes") else "")
        return out

    async def record(self, scenario: str, workflow_id: str, *children: str) -> None:
        """With MAINSPRING_RECORD_HISTORIES=<label>: the histories as replay fixtures,
        `<scenario>.<n>.json` for the n-th run of the chain, `<scenario>.<child>.json`."""
        if not RECORD:
            return
        out = HISTORIES / RECORD
        out.mkdir(parents=True, exist_ok=True)
        for i, history in enumerate(await self.histories(workflow_id)):
            (out / f"{scenario}.{i}.json").write_text(history.to_json())
        for child in children:
            history = await self.client.get_workflow_handle(child).fetch_history()
            (out / f"{scenario}.{child.rsplit('-', 1)[-1]}.json").write_text(history.to_json())


def scenario(body):
    """Run `body(harness)` against the session's Temporal server in seconds."""
    def run(temporal_server):
        async def go():
            client = await Client.connect(temporal_server.address)
            async with Harness(client, Stubs()) as harness:
                await asyncio.wait_for(body(harness), 60)
        asyncio.run(go())
    run.__name__, run.__doc__ = body.__name__, body.__doc__
    return run


def temporal_cli(address: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([find_binary("temporal"), *argv, "--address", address],
                          capture_output=True, text=True, timeout=30)


def mainspring_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = mainspring(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err
