"""An upgrade in the middle of a weeks-long run: every worker of one release replaced by the
next while a faulted run is in flight, and the run ends as if it had never been upgraded.

The old release is a real one: the tree of `OLD_RELEASE` from this repository's history
(`git archive`), run by the same interpreter, its workers and their trainer children
importing only its code (common/procs.py WorkerFleet.root). The new release is this
checkout. The run is killed once under the old release (its trainer worker, SIGKILL) and
once under the new; the old workers are drained with SIGTERM after the new ones are up (a
rolling deploy), mid-segment and after a continue-as-new, so the new orchestrator replays
the old one's workflow history (the patch discipline: docs/operations.md), a new trainer
worker resumes a segment the old one committed, and both read each other's records (the
event log, the checkpoints). Its final weights are compared with a run that never met a
fault or an upgrade, bit for bit.

Soak: two runs and two releases' start-up, about three minutes. Its history (the chain
started on the old release and finished on the new) is a replay fixture of the default
suite (tests/workflows/test_replay.py): record it with MAINSPRING_RECORD_HISTORIES=<label>.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tarfile
import threading
import time
from io import BytesIO
from pathlib import Path

import pytest
import torch

from common.procs import WorkerFleet
from ops.client import connect
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.e2e.conftest import terminate_running
from tests.e2e.runs import run_in_background, run_to_end, tiny_spec, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

# The release this one replaces: main's head before the scale work (the event log's
# time-spanned batch names, the recovery's detection to the millisecond, ...).
OLD_RELEASE = "a25d6766509feb949d34625df5e3a862a3f3be9c"
REPO = Path(__file__).resolve().parents[2]
HISTORIES = REPO / "tests" / "workflows" / "histories"
RUN = {"train.total_steps": 80, "train.segment_steps": 20, "train.segments_per_run": 2,
       "train.checkpoint_every": 10, "sweep.enabled": False}
# one SIGKILL of the trainer worker under each release (first attempt of its segment)
FAULTS = [{"kind": "kill_worker", "at_step": 15}, {"kind": "kill_worker", "at_step": 65}]


@pytest.fixture(scope="module")
def old_release(tmp_path_factory) -> str:
    """The old release's tree, from git history (a clone without it cannot run this)."""
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{OLD_RELEASE}^{{commit}}"],
                           capture_output=True)
    if found.returncode != 0:
        pytest.fail(f"commit {OLD_RELEASE[:12]} is not in this clone's history: the upgrade "
                    f"test runs the old release from it (git fetch --unshallow)")
    tree = tmp_path_factory.mktemp("old-release")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD_RELEASE],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return str(tree)


class Pids:
    """Every pid each fleet's workers had (a killed worker is restarted under a new one)."""

    def __init__(self, **fleets: WorkerFleet) -> None:
        self.fleets, self.seen = fleets, {name: set() for name in fleets}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            self.look()

    def look(self) -> None:
        for name, fleet in self.fleets.items():
            self.seen[name].update((role, p.pid) for role, p in list(fleet.procs.items()))

    def add(self, name: str, fleet: WorkerFleet) -> None:
        self.fleets[name], self.seen[name] = fleet, set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.look()

    def of(self, name: str, role: str) -> set[int]:
        return {pid for r, pid in self.seen[name] if r == role}


async def chain(address: str, workflow_id: str) -> list:
    """Every run of the continue-as-new chain of `workflow_id`, in the order they started."""
    client = await connect(address)
    runs = [wf async for wf in client.list_workflows(f'WorkflowId="{workflow_id}"')]
    return [await client.get_workflow_handle(workflow_id, run_id=wf.run_id).fetch_history()
            for wf in sorted(runs, key=lambda wf: wf.start_time)]


def who_ran(histories: list) -> tuple[set[int], set[int]]:
    """(pids that completed workflow tasks, pids that started train_segment activities),
    from the histories' worker identities (temporalio's default: `<pid>@<host>`)."""
    tasks, segments, activity_types = set(), set(), {}
    for history in histories:
        for e in history.events:
            if e.HasField("workflow_task_completed_event_attributes"):
                tasks.add(int(e.workflow_task_completed_event_attributes.identity.split("@")[0]))
            if e.HasField("activity_task_scheduled_event_attributes"):
                activity_types[e.event_id] = \
                    e.activity_task_scheduled_event_attributes.activity_type.name
            if e.HasField("activity_task_started_event_attributes"):
                a = e.activity_task_started_event_attributes
                if activity_types.get(a.scheduled_event_id) == "train_segment":
                    segments.add(int(a.identity.split("@")[0]))
    return tasks, segments


def final_weights(spec) -> dict[str, torch.Tensor]:
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    path = store.path(spec.train.total_steps, "mp_rank_00_model_states.pt")
    return torch.load(path, map_location="cpu", weights_only=True)["module"]


def test_an_upgrade_of_every_worker_in_the_middle_of_a_faulted_run_ends_it_bitwise_as_if_never_upgraded(
        temporal_server, old_release, tmp_path):
    address = temporal_server.address
    spec = tiny_spec("e2e-upgrade", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **RUN, faults=FAULTS)
    old = WorkerFleet(address, root=old_release, log_dir=str(tmp_path / "logs-old")).start()
    pids = Pids(old=old)
    new = None
    try:
        runner, box = run_in_background(address, spec, 600)
        store = CheckpointStore(spec.storage.durable, spec.run_id)
        # the old release recovered its fault and continued as new (segments 0-20, 20-40)
        wait_for(lambda: any(s >= 40 for s in store.list_committed()), 400,
                 "step 40 committed by the old release")
        new = WorkerFleet(address, log_dir=str(tmp_path / "logs-new")).start()
        pids.add("new", new)
        wait_for(lambda: all(b"workers_started" in (tmp_path / "logs-new" / f"worker-{r}.log")
                             .read_bytes() for r in new.roles), 120, "the new release's workers")
        upgraded_at = time.time()
        old.stop()  # SIGTERM: drained, its segment committed where it stood
        runner.join(600)
        assert box.get("result", {}).get("status") == "completed", box
    except BaseException:
        asyncio.run(terminate_running(address, "the upgrade test failed"))
        if new is not None:
            new.stop()
        raise
    finally:
        pids.stop()
        old.stop()

    events = read_events(spec.storage.durable, spec.run_id)
    # each kill was a fault with its one recovery, one under each release
    faults = [e for e in events if e["kind"] == "fault" and not e["payload"].get("injected")]
    closed = {e["payload"]["fault_event_id"] for e in events if e["kind"] == "recovered"}
    assert {f["event_id"] for f in faults} <= closed, (faults, closed)
    kills = [e["ts"] for e in events if e["kind"] == "fault" and e["payload"].get("injected")]
    assert len(kills) == 2 and kills[0] < upgraded_at < kills[1], (kills, upgraded_at)
    # nothing committed was lost, every interval is there
    assert store.list_committed() == list(range(0, 81, 10))

    # both releases ran the workflow and the segments
    histories = asyncio.run(chain(address, spec.run_id))
    assert len(histories) >= 2  # continued as new at least once
    tasks, segments = who_ran(histories)
    assert tasks & pids.of("old", "orchestrator") and tasks & pids.of("new", "orchestrator"), \
        (tasks, pids.seen)
    assert segments & pids.of("old", "trainer") and segments & pids.of("new", "trainer"), \
        (segments, pids.seen)
    record(histories)

    # bit for bit the run that met no fault and no upgrade (on the new release's workers)
    clean = tiny_spec("e2e-upgrade-ref", str(tmp_path / "store"), str(tmp_path / "fast-ref"),
                      **RUN)
    try:
        assert asyncio.run(run_to_end(address, clean, 600))["status"] == "completed"
    finally:
        new.stop()
    a, b = final_weights(spec), final_weights(clean)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def record(histories: list) -> None:
    """With MAINSPRING_RECORD_HISTORIES=<label>: the chain as replay fixtures."""
    label = os.environ.get("MAINSPRING_RECORD_HISTORIES", "")
    if not label:
        return
    out = HISTORIES / label
    out.mkdir(parents=True, exist_ok=True)
    for i, history in enumerate(histories):
        (out / f"upgraded.{i}.json").write_text(history.to_json())
