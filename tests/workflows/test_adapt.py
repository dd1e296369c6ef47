"""The workflow's decisions on failures a retry as-is would repeat (workflows/adapt.py)."""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError, RetryState

from spec import RunSpec
from workflows.adapt import needs_decision, next_split, oom_adaptation, oom_floor_reason


def spec(tokens: int = 512, seq: int = 64, accum: int = 2, procs: int = 2) -> RunSpec:
    return RunSpec(run_id="r").replace(**{"train.micro_batch_tokens": tokens,
                                          "model.seq_len": seq, "train.grad_accum": accum,
                                          "train.procs_per_node": procs})


def activity_error(cause: BaseException) -> ActivityError:
    err = ActivityError("activity failed", scheduled_event_id=1, started_event_id=2,
                        identity="w", activity_type="train_segment", activity_id="1",
                        retry_state=RetryState.NON_RETRYABLE_FAILURE)
    err.__cause__ = cause
    return err


def test_each_oom_halves_the_chunk_until_one_sequence_then_stops():
    assert [next_split(8, s) for s in (1, 2, 4, 8)] == [2, 4, 8, None]


def test_a_chunk_that_no_longer_halves_evenly_is_the_floor():
    assert next_split(6, 1) == 2 and next_split(6, 2) is None  # 3 sequences: no even halves
    assert next_split(1, 1) is None


def test_the_adapted_micro_batch_keeps_the_global_batch():
    s = spec()  # 8 sequences per micro-batch, accumulation 2, world 2: 32 per step
    figures = oom_adaptation(s, 1, 2)
    assert figures["micro_batch"] == {"from": 8, "to": 4}
    assert figures["grad_accum"] == {"from": 2, "to": 4}
    assert figures["global_batch_sequences"] == 32
    after = oom_adaptation(s, 2, 4)
    assert after["micro_batch"]["to"] * after["grad_accum"]["to"] * 2 == 32


def test_the_floor_reason_names_the_size_and_the_resume_command():
    reason, fix = oom_floor_reason(spec(tokens=64), 1)
    assert "1 sequence(s)" in reason and "mainspring run resume r" in fix


def test_only_the_failures_that_need_a_decision_go_to_the_workflow():
    for kind in ("OutOfMemory", "RepeatedFailure", "DiskFull"):
        cause = ApplicationError("x", type=kind, non_retryable=True)
        assert needs_decision(activity_error(cause)) is cause
    for kind in ("BadConfig", "BadData", "Diverged"):
        assert needs_decision(activity_error(ApplicationError("x", type=kind))) is None
    assert needs_decision(ValueError("not an activity's")) is None


def test_a_decision_names_the_fault_the_next_segment_answers():
    from workflows.adapt import decide

    oom = ApplicationError("out of memory", {"evidence": "can't allocate", "fault_event_id":
                                             "fault/0-10/x/1", "fault_ts": 5.0, "last_step": 3},
                           type="OutOfMemory")
    d = decide(spec(), 1, oom)
    assert d.micro_split == 2 and d.payload["micro_batch"] == {"from": 8, "to": 4}
    a = d.after_fault
    assert (a.event_id, a.fault_ts, a.detected_ts, a.last_step) == ("fault/0-10/x/1", 5.0, 5.0, 3)
    floor = decide(spec(), 8, oom)
    assert floor.micro_split == 0 and "cannot be halved" in floor.reason
    assert floor.payload["failure"] == "OutOfMemory"
    repeated = decide(spec(), 1, ApplicationError("3 times", {"fix": "do x"},
                                                  type="RepeatedFailure"))
    assert (repeated.micro_split, repeated.reason, repeated.payload["fix"]) == (0, "3 times", "do x")
    assert repeated.after_fault is None


def test_a_decision_carries_the_fault_record_the_activity_raised_with_unchanged():
    from common.faults import Fault
    from workflows.adapt import decide

    fault = Fault("oom", "CUDA out of memory", event_id="fault/0-10/x/1", fault_ts=5.0,
                  detected_ts=5.5, last_step=3, rank=1, detected_by="supervisor")
    oom = ApplicationError("out of memory", {"evidence": "CUDA out of memory",
                                             "fault": fault.to_json()}, type="OutOfMemory")
    d = decide(spec(), 1, oom)
    assert d.after_fault == fault and d.payload["evidence"] == "CUDA out of memory"
