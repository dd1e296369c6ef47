"""The gang's pure choices (workflows/gang.py): which nodes, how many, who is to blame."""

from __future__ import annotations

from temporalio.exceptions import (
    ApplicationError,
    TimeoutError,
    TimeoutType,
)

from activities.contracts import NodeInfo
from common.faults import Fault
from spec import RunSpec
from tests.workflows.test_adapt import activity_error
from workflows.carry import RunCarry
from workflows.gang import (
    LOST,
    OWN,
    PEER,
    MemberFailure,
    at_fault,
    blame,
    candidates,
    choose,
    member_failure,
    members,
    node_count,
    suspected,
)

NOW = 1_000_000.0


def spec(**over) -> RunSpec:
    return RunSpec.from_dict({"run_id": "r1", "train": {"nodes": 2, "procs_per_node": 1,
                                                        **over.pop("train", {})}, **over})


def node(name: str, *, seen: float = NOW, procs: int = 1, busy: str = "") -> NodeInfo:
    return NodeInfo(name=name, queue=f"q@{name}", address=f"10.0.0.{len(name)}",
                    rdzv_port=29400, procs=procs, busy=busy, seen=seen)


def node_failed(kind: str, *, peer: bool = False, fingerprint: str = "crash at step 14"):
    return activity_error(ApplicationError("node failed", {
        "node": "x", "fault_kind": kind, "evidence": f"{kind} evidence", "peer": peer,
        "fault_event_id": f"fault/{kind}", "fingerprint": fingerprint, "transient": False,
        "last_step": 14}, type="NodeFailed"))


def test_a_node_is_a_candidate_only_when_fresh_big_enough_idle_and_not_set_aside():
    s = spec(train={"procs_per_node": 2})
    nodes = [node("fresh", procs=2), node("stale", procs=2, seen=NOW - 60),
             node("small", procs=1), node("busy", procs=2, busy="other-run 0-10"),
             node("ours", procs=2, busy="r1 0-10"), node("aside", procs=2)]
    got = candidates(nodes, NOW, s, {"aside": "kept failing"})
    assert [n.name for n in got] == ["fresh", "ours"]


def test_too_few_nodes_waits_then_shrinks_to_a_divisor_only_after_the_wait_when_elastic():
    elastic = spec(train={"nodes": 4, "min_nodes": 1}).train
    rigid = spec(train={"nodes": 4}).train
    assert node_count(elastic, 4, 4, None, 300) == 4
    assert node_count(elastic, 3, 4, None, 300) is None  # not yet waited
    assert node_count(elastic, 3, 4, 299, 300) is None
    assert node_count(elastic, 3, 4, 300, 300) == 2  # 3 does not divide 4
    assert node_count(elastic, 1, 4, 300, 300) == 1
    assert node_count(rigid, 3, 4, 10_000, 300) is None  # waits for capacity forever
    assert node_count(elastic, 4, 2, None, 300) == 2  # never grows back within the run


def test_nodes_that_failed_come_last_and_node_0_is_the_first_of_the_rest_by_name():
    picked = choose([node("c"), node("a"), node("b")], 2, {"a": 1})
    assert [n.name for n in picked] == ["b", "c"]
    team = members(picked, "r1/0-10/3")
    assert [(m.node, m.node_rank, m.nnodes) for m in team] == [("b", 0, 2), ("c", 1, 2)]
    assert {m.master for m in team} == {f"{picked[0].address}:29400"}


def test_a_timed_out_member_is_blamed_before_one_that_failed_on_its_own_before_a_peer():
    lost = member_failure("h1", activity_error(TimeoutError(
        "heartbeat", type=TimeoutType.HEARTBEAT, last_heartbeat_details=[])))
    own = member_failure("h2", node_failed("crash"))
    peer = member_failure("h0", node_failed("rank_lost", peer=True))
    assert (lost.how, own.how, peer.how) == (LOST, OWN, PEER)
    assert lost.fault.kind == "worker_lost" and "HEARTBEAT" in lost.fault.evidence
    assert own.fault.kind == "crash" and own.fault.last_step == 14 and own.fault.node == "h2"
    assert at_fault([peer, own]) == [own]
    assert at_fault([peer, own, lost]) == [lost]


def failure(node_name: str, how: int, kind: str = "crash", fp: str = "crash at step 14",
            fid: str = "") -> MemberFailure:
    return MemberFailure(node=node_name, how=how, fault=Fault(
        kind, f"{kind} on {node_name}", event_id=fid or f"fault/{node_name}", fingerprint=fp,
        last_step=14, node=node_name))


def test_a_lost_node_gets_a_worker_lost_fault_and_the_next_launch_answers_it_and_the_peers_fault():
    c = RunCarry()
    verdict = blame(c, spec(), [failure("h1", LOST, "worker_lost", fid=""),
                                failure("h0", PEER, "rank_lost")], lo=0, hi=40, launch=0, now=NOW)
    [(kind, event_id, payload)] = verdict.events
    assert (kind, event_id, payload["kind"], payload["node"]) == (
        "fault", "fault/0-40/gang0/h1", "worker_lost", "h1")
    assert verdict.after_fault.event_id == "fault/0-40/gang0/h1"
    assert verdict.after_fault.also == ("fault/h0",)
    assert verdict.after_fault.detected_ts - verdict.after_fault.fault_ts == \
        spec().ops.heartbeat_timeout_s
    assert c.gang.node_failures == {"h1": 1} and not c.gang.set_aside and not verdict.hold


def test_a_node_at_fault_node_failure_limit_launches_in_a_row_is_set_aside_with_its_evidence():
    c, s = RunCarry(), spec(ops={"node_failure_limit": 2, "repeat_failure_limit": 5})
    for launch in range(2):
        verdict = blame(c, s, [failure("h1", OWN), failure("h0", PEER, "rank_lost")],
                        lo=10, hi=40, launch=launch, now=NOW)
    assert c.gang.node_failures == {"h1": 2}
    assert c.gang.set_aside == {"h1": "crash on h1"}
    [aside] = [e for e in verdict.events if e[0] == "node_set_aside"]
    assert aside[2]["node"] == "h1" and aside[2]["failures"] == 2 and "fix" in aside[2]


def test_the_same_failure_repeat_failure_limit_launches_in_a_row_holds_the_run_for_a_human():
    c, s = RunCarry(), spec(ops={"node_failure_limit": 100, "repeat_failure_limit": 3})
    holds = [blame(c, s, [failure("h1", OWN)], lo=10, hi=40, launch=i, now=NOW).hold
             for i in range(3)]
    assert holds[:2] == ["", ""] and "3 times in a row on node h1" in holds[2]
    other = blame(RunCarry.from_json({"gang_repeat": dict(c.gang.repeat)}), s,
                  [failure("h1", OWN, fp="crash at step 15")], lo=10, hi=40, launch=4, now=NOW)
    assert not other.hold  # another failure starts the count afresh


def test_a_lost_worker_is_transient_and_never_counts_towards_the_repeat_hold():
    c, s = RunCarry(), spec(ops={"node_failure_limit": 100, "repeat_failure_limit": 1})
    lost = MemberFailure(node="h1", how=LOST, fault=Fault("worker_lost", "gone", node="h1"))
    assert not blame(c, s, [lost], lo=0, hi=40, launch=0, now=NOW).hold
    assert c.gang.repeat == {}


def test_the_waiting_reason_counts_why_nodes_are_not_available_and_says_what_to_start():
    from workflows.gang import waiting_reason

    s = spec(train={"nodes": 4, "min_nodes": 2, "procs_per_node": 8})
    known = [node("ok", procs=8), node("gone", procs=8, seen=NOW - 99), node("tiny", procs=1),
             node("taken", procs=8, busy="other 0-10")]
    why = waiting_reason(s, 4, [known[0]], known, {"bad": "x"}, NOW)
    assert why.startswith("1 of 4 nodes available (ok); 4 registered: 1 silent, 1 busy")
    assert "1 with fewer than 8 procs, 1 set aside" in why
    assert "--procs 8` on 3 more node(s)" in why and "goes on with fewer" in why


def test_a_member_failure_reads_the_fault_record_its_activity_raised_with():
    fault = Fault("nccl", "Watchdog caught collective operation timeout", event_id="fault/n",
                  fault_ts=10.0, detected_ts=11.0, last_step=14, rank=1, peer=True,
                  fingerprint="nccl at step 14", detected_by="supervisor")
    err = activity_error(ApplicationError("node failed", {"node": "h0", "fault_kind": "nccl",
                                                          "fault": fault.to_json()},
                                          type="NodeFailed"))
    got = member_failure("h0", err)
    assert got.how == PEER and got.fault == Fault(**{**fault.__dict__, "node": "h0"})


def test_a_node_suspected_of_silent_data_corruption_counts_as_failing_and_is_set_aside():
    c, s = RunCarry(), spec()
    c.gang.node_failures = {"h0": 1}  # an earlier launch's failure: this one ended well
    seen = [{"step": 30, "ranks": [1], "node_ranks": [1]}]
    assert suspected(c, s, seen, ["h0", "h1"], lo=0, hi=40, launch=0) == []
    assert c.gang.node_failures == {"h1": 1} and not c.gang.set_aside
    (event,) = suspected(c, s, seen, ["h0", "h1"], lo=40, hi=80, launch=1)  # limit 2
    kind, event_id, payload = event
    assert kind == "node_set_aside" and event_id == "node_set_aside/h1/1"
    assert payload["kind"] == "numerics" and "step 30" in payload["evidence"]
    assert "h1" in c.gang.set_aside and "h0" not in c.gang.node_failures
    # a launch with no suspect ends every failure in a row; a node rank the launch did
    # not have names nobody
    assert suspected(c, s, [], ["h0", "h1"], lo=80, hi=120, launch=2) == []
    assert c.gang.node_failures == {}
    assert suspected(c, s, [{"step": 1, "ranks": [9], "node_ranks": [5]}],
                     ["h0", "h1"], lo=0, hi=40, launch=0) == [] and c.gang.node_failures == {}
