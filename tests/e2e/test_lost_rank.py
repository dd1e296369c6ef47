"""A lost rank: one rank of a world-size-2 segment is SIGKILLed mid-segment;
the launcher stops the other, the supervisor records a `rank_lost` fault naming the rank,
and restarts the segment in place (the same attempt, the same worker, its warm
standby) from the last commit. Real Temporal dev server, real workers, real DeepSpeed
children on CPU/gloo, and the durable store on real S3 (SeaweedFS).

The run's post-incident record is checked too, from the store alone: one trace across every
process (both ranks, the checkpoint writer's uploads), the fault a span event where it was
seen, `mainspring trace` and `goodput` naming it. With the other fault tests' span checks
(test_demo.py: worker_lost, test_drain.py: preempted, test_hung_rank.py: hang), these are
the claims of test_trace.py's longer faulted run, a soak test now."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from ops.cli import main
from ops.trace_view import TRACE_EVENT_SCHEMA
from tests.e2e.runs import (
    assert_recovered_from,
    assert_restarted_in_place,
    chaos_for,
    first_fault,
    newest_commit_at_or_before,
    run_in_background,
    strike,
    tiny_spec,
)
from tests.e2e.test_hung_rank import HUNG, MID_SEGMENT
from tests.e2e.test_trace import assert_nested, assert_one_trace, fault_span_events

pytestmark = pytest.mark.e2e


def test_a_sigkilled_rank_of_two_is_restarted_in_place_from_the_last_commit_with_no_commit_lost(  # noqa: E501
        temporal_server, fleet_factory, tmp_path, s3_env, capsys):
    t0 = time.monotonic()
    spec = tiny_spec("e2e-lost-rank", "s3://mainspring/e2e-lost-rank", str(tmp_path / "fast"),
                     **HUNG)
    chaos = chaos_for(fleet_factory(env=s3_env), spec)
    runner, box = run_in_background(temporal_server.address, spec, 300)
    killed = strike(chaos, spec, "kill_rank", *MID_SEGMENT)
    assert killed["rank"] == 1, killed
    fault = first_fault(spec, "rank_lost")
    committed_at_fault = chaos.durable.list_committed()
    p = fault["payload"]
    resume_from = newest_commit_at_or_before(spec, p["last_step"])
    runner.join(300)
    result = box["result"]
    assert result["status"] == "completed"

    assert (p["kind"], p["rank"], p["injected"]) == ("rank_lost", 1, False), p
    # the evidence: torchrun stopping the others, or rank 0's own error (gloo's connection
    # reset by the dead peer) when it wrote error.json first
    assert p["evidence"] and p["log_tail"]
    assert fault["ts"] - killed["ts"] < 10.0, p  # the launcher's stop, not a timeout
    events = assert_recovered_from(spec, fault, resume_from, committed_at_fault)
    recovered = assert_restarted_in_place(spec, events, fault)
    assert recovered["lost_steps"] == p["last_step"] - resume_from

    # one trace across every process of the run, read back from the durable store
    spans, _ = assert_one_trace(spec)
    assert {"mainspring-worker-orchestrator", "mainspring-worker-data",
            "mainspring-worker-trainer", "mainspring-trainer",
            "mainspring-checkpoint-writer"} <= {s["service"] for s in spans}
    assert {s["attributes"].get("rank") for s in spans if s["name"].startswith("trainer rank")} \
        == {0, 1}
    assert any(s["name"].startswith("upload ") and s["links"] for s in spans)
    assert_nested(spans, spec.run_id)
    fault_span_events(spec, "rank_lost")  # on the span where it was seen
    # `mainspring trace` names the fault; --perfetto passes the schema; goodput counts it
    capsys.readouterr()
    assert main(["trace", spec.run_id, "--durable", spec.storage.durable]) == 0
    assert "rank_lost" in capsys.readouterr().out
    perfetto = tmp_path / "trace.json"
    assert main(["trace", spec.run_id, "--durable", spec.storage.durable,
                 "--perfetto", str(perfetto)]) == 0
    jsonschema.validate(json.loads(perfetto.read_text()), TRACE_EVENT_SCHEMA)
    capsys.readouterr()
    assert main(["goodput", spec.run_id, "--durable", spec.storage.durable, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < figures["train"]["goodput"] < 1
    assert figures["faults"]["rank_lost"]["recovered"] == figures["faults"]["rank_lost"]["count"]
    print(f"\nlost-rank e2e: {time.monotonic() - t0:.1f}s; detected "
          f"{fault['ts'] - killed['ts']:.1f}s after the kill")
