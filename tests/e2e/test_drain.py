"""A trainer worker drained with SIGTERM — a pod eviction, a spot preemption notice — hands
its segment to another worker at once, not after a heartbeat timeout: the segment commits
at its current step,
the activity fails with a retryable Preempted, the other worker resumes from that commit
without waiting for a heartbeat timeout, and the drained worker exits."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ops.chaos import Chaos
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.e2e.runs import run_to_end, strike, tiny_spec, wait_for
from tests.e2e.test_trace import fault_span_events

pytestmark = pytest.mark.e2e


def test_sigterm_to_the_trainer_worker_moves_the_segment_to_another_worker_within_10s_with_no_lost_step(
        temporal_server, fleet_factory, tmp_path):
    # a heartbeat timeout far above the 10 s the handover may take: a move that waited for
    # it could not pass
    spec = tiny_spec("e2e-drain", str(tmp_path / "store"), str(tmp_path / "fast"),
                     # 4096 tokens a micro-batch: ~0.2 s steps, so the drain lands mid-segment;
                     # 60 steps: the strike's window (12-40) with room after it for the other
                     # worker to train on past a scheduled commit (50)
                     **{"train.total_steps": 60, "train.segment_steps": 60,
                        "train.checkpoint_every": 50, "train.micro_batch_tokens": 4096,
                        "sweep.enabled": False, "ops.heartbeat_timeout_s": 60.0})
    first = fleet_factory()
    chaos = Chaos(worker_pid=lambda: first.procs["trainer"].pid,
                  durable=CheckpointStore(spec.storage.durable, spec.run_id),
                  fast_root=str(tmp_path / "fast" / spec.run_id))
    box: dict = {}

    def run() -> None:
        box["result"] = asyncio.run(run_to_end(temporal_server.address, spec, timeout_s=600))

    runner = threading.Thread(target=run)
    runner.start()
    wait_for(lambda: chaos.ranks()[0], 300, "the segment's trainer on the first worker")
    second = fleet_factory(roles=("trainer",), log_dir="logs-second")
    wait_for(lambda: b"workers_started" in open(tmp_path / "logs-second" / "worker-trainer.log",
                                                 "rb").read(), 60, "the second trainer worker")
    # SIGTERM to the first worker while its segment is well inside (steps 12-40 of 60)
    sigterm_at = strike(chaos, spec, "drain_worker", (0, 60), (12, 40))["ts"]
    # the drained worker exits once its child has stopped at a commit
    first.procs["trainer"].wait(60)
    exited_s = time.time() - sigterm_at
    committed_at_drain = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    runner.join(600)
    assert box["result"]["status"] == "completed"
    assert second.procs["trainer"].poll() is None  # the run finished on the other worker

    events = read_events(spec.storage.durable, spec.run_id)
    fault = next(e for e in events if e["kind"] == "fault"
                 and e["payload"]["kind"] == "preempted")
    stopped_at = fault["step"]
    recovered = next(e["payload"] for e in events if e["kind"] == "recovered"
                     and e["payload"]["fault_event_id"] == fault["event_id"])
    assert recovered["lost_steps"] == 0 and recovered["resumed_step"] == stopped_at
    assert stopped_at is not None and stopped_at >= 12
    started = [e for e in events if e["kind"] == "segment_started" and e["payload"]["attempt"] == 2]
    assert started and started[0]["ts"] - sigterm_at < 10, (started, sigterm_at)
    assert exited_s < 30
    committed = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    assert stopped_at in committed_at_drain and committed[-1] == spec.train.total_steps
    assert set(committed_at_drain) <= set(committed)  # nothing committed was lost
    fault_span_events(spec, "preempted")  # a span event where it was seen, in the store
