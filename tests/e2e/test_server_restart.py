"""A Temporal server restart mid-segment: the dev server is stopped while
a segment trains and started again on the same database 20 s later. The trainer trains on
through the outage, the workers reconnect by themselves, the attempt that was running
completes the segment (no retry, no step trained twice, nothing committed lost), and the
outage is a `server_unavailable` fault with its `recovered` in the run's durable log.

The test has a Temporal server of its own (own directory, own port): stopping the session's
server would break every other test."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import psutil
import pytest

from activities.server_watch import EVERY_S, KIND, MISSES
from activities.training import segment_workdir
from common.procs import WorkerFleet
from ops.client import connect, start_run
from ops.services import TemporalDevServer, free_port
from storage.checkpoints import CheckpointStore
from tests.e2e.runs import assert_completed_five_stages, tiny_spec, wait_for

pytestmark = pytest.mark.e2e

OUTAGE_S = 20.0
# One segment of 500 steps, the server stopped at its first commit past step 0. Where the
# segment ends depends on the machine: on 2 busy cores (3-12 steps/s) it trains on past the
# restart, and its heartbeats land on the same attempt again; on idle ones (up to 80
# steps/s) it ends while the server is away, and its result waits for the server instead
# of being dropped (activities/server_watch.py). The claims hold either way.
# heartbeat_timeout_s outlasts the outage with room for the SDK's heartbeat throttle: the
# server checks the timeout as soon as it is back, and the worker's heartbeats reach it at
# most every min(0.8 x timeout, 60 s) (sdk-core activity_heartbeat_manager.rs), one of
# them dropped after ~10 s of retries while it is away, so the running attempt survives an
# outage D only if the timeout exceeds about D + 2 x 60 s - 10 s. With a shorter one (8 s,
# measured) the server times the attempt out at once on restart; the worker learns it from
# its next heartbeat (NotFound), the trainer stops at a commit of its current step and the
# retry resumes there: no step redone either, but the segment restarts its child and the
# log carries a `worker_lost` for an attempt whose worker was never lost.
RESTART = {"train.total_steps": 500, "train.segment_steps": 500, "train.checkpoint_every": 20,
           "sweep.enabled": False, "ops.heartbeat_timeout_s": 150.0}


@pytest.fixture
def own_server(tmp_path):
    server = TemporalDevServer(str(tmp_path / "temporal"), port=free_port(), headless=True).start()
    yield server
    server.stop()


def progress_lines(spec) -> list[dict]:
    path = f"{segment_workdir(spec, 0, spec.train.total_steps)}/progress.jsonl"
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def trainer_children(fleet: WorkerFleet) -> set[int]:
    alive = set()
    for p in psutil.Process(fleet.procs["trainer"].pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


async def start(address: str, spec) -> None:
    await start_run(await connect(address), spec)


async def result(address: str, spec, timeout_s: float = 300) -> dict:
    client = await connect(address)  # a new connection: the old one saw the server go
    out = await asyncio.wait_for(client.get_workflow_handle(spec.run_id).result(), timeout_s)
    return out if isinstance(out, dict) else out.__dict__


def test_a_temporal_server_restart_mid_segment_loses_no_step_and_the_run_completes(
        own_server, tmp_path):
    spec = tiny_spec("e2e-server-restart", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **RESTART)
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    # no restarts: the workers that were there before the outage must be the ones after it
    fleet = WorkerFleet(own_server.address, log_dir=str(tmp_path / "logs"), restart=False).start()
    try:
        asyncio.run(start(own_server.address, spec))
        wait_for(lambda: (store.latest_committed() or 0) >= 20, 180, "a commit mid-segment")
        committed_before = store.list_committed()
        workers = {role: p.pid for role, p in fleet.procs.items()}
        children = trainer_children(fleet)
        assert children, "the trainer worker should be supervising a child"

        down_ts = time.time()
        own_server.stop()
        time.sleep(OUTAGE_S)
        # the heartbeats failed all along; the child is still there (or finished its segment)
        child_alive = children <= trainer_children(fleet)
        up_ts = time.time()
        own_server.start()
        out = asyncio.run(result(own_server.address, spec))
        assert {role: p.pid for role, p in fleet.procs.items() if p.poll() is None} == workers
    finally:
        fleet.stop()

    events = assert_completed_five_stages(out, spec)
    assert set(committed_before) <= set(store.list_committed()), "a committed step was lost"
    # the attempt that was running finished the segment: one start, one child, every step once
    lines = progress_lines(spec)
    starts = [ln for ln in lines if ln["type"] == "start"]
    assert [(s["attempt"], s["resumed_from"]) for s in starts] == [(1, None)], starts
    steps = [ln for ln in lines if ln["type"] == "step"]
    assert [s["step"] for s in steps] == list(range(1, spec.train.total_steps + 1)), \
        [k for k, n in Counter(s["step"] for s in steps).items() if n > 1]
    assert [(e["kind"], e["attempt"]) for e in events if e["kind"].startswith("segment_")] == \
        [("segment_started", 1), ("segment_finished", 1)]
    # it trained while the server was away; then either it trained on after the restart
    # (its heartbeats reached the same attempt again) or, done before, its result waited
    during = [s["step"] for s in steps if down_ts < s["ts"] < up_ts]
    assert len(during) >= 20, during
    finished = next(e for e in events if e["kind"] == "segment_finished")
    trained_on = steps[-1]["ts"] > up_ts
    assert child_alive if trained_on else finished["ts"] < up_ts, (child_alive, trained_on)
    # the workers reconnected: evaluate and promote were handed out after the restart
    later = [e for e in events if e["kind"] == "stage_started"
             and e["payload"]["stage"] in ("evaluate", "promote")]
    assert len(later) == 2 and all(e["ts"] > up_ts for e in later), later

    faults = [e for e in events if e["kind"] == "fault"]
    assert [f["payload"]["kind"] for f in faults] == [KIND], [f["payload"] for f in faults]
    fault = faults[0]["payload"]
    assert fault["injected"] is False and fault["detected_by"] == "server_watch"
    # last seen answering: before the stop, or while it shut down (SIGTERM, then 5 s grace)
    assert down_ts - EVERY_S - 1 <= fault["fault_ts"] <= down_ts + 6, (fault, down_ts)
    assert 0 < fault["detection_s"] <= (MISSES + 1) * EVERY_S + 2, fault
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert len(recovered) == 1, [e["payload"] for e in recovered]
    rec = recovered[0]["payload"]
    assert rec["fault_event_id"] == faults[0]["event_id"]
    assert OUTAGE_S <= rec["outage_s"] <= up_ts - down_ts + EVERY_S + 5, (rec, up_ts - down_ts)
    assert rec["detection_s"] == fault["detection_s"] and rec["mttr_s"] == rec["outage_s"]
    # the outage cost no step: the same child trained on through it, and the watcher counted
    # the steps it saw between its fault and its recovery
    assert rec["lost_steps"] == 0 and rec["child_restarted"] is False, rec

    def step_at(ts: float) -> int:
        return max((s["step"] for s in steps if s["ts"] <= ts), default=0)
    seen = step_at(recovered[0]["ts"]) - step_at(faults[0]["ts"])
    assert abs(rec["steps_during_outage"] - seen) <= 10, (rec, seen)
    assert rec["resumed_step"] >= faults[0]["step"] >= max(committed_before), (rec, faults[0])
    print(f"server away {rec['outage_s']}s (seen after {rec['detection_s']}s), stop to start "
          f"{up_ts - down_ts:.1f}s, {len(during)} steps trained meanwhile, "
          f"{'trained on after the restart' if trained_on else 'segment ended during it'}")
