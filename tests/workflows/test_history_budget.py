"""A multi-node run's execution history stays within its budget (workflows/gang.py
launch_fits): the workflow continues as new before a launch that would carry it past."""

from __future__ import annotations

import json

from spec import preset
from workflows.gang import (
    EVENTS_PER_MEMBER,
    FRESH_EVENTS,
    HISTORY_BYTES_BUDGET,
    HISTORY_EVENTS_BUDGET,
    launch_fits,
)

SPEC_BYTES = len(json.dumps(preset("demo").to_dict()))


def test_a_fresh_execution_launches_whatever_the_launch_costs():
    # continuing as new could not make the history any smaller
    assert launch_fits(FRESH_EVENTS, 10_000, 100_000, 10**6)


def test_a_thousand_nodes_launch_once_per_execution_and_stay_under_temporals_warning():
    events, size, members = 200, 60_000, 1024
    assert launch_fits(events, size, members, SPEC_BYTES)
    after = (events + members * EVENTS_PER_MEMBER, size + members * (SPEC_BYTES + 1024))
    assert after[0] <= 10_240 and after[1] <= 10 * 2**20, after  # Temporal's warning
    assert not launch_fits(*after, members, SPEC_BYTES)  # the next launch: a new execution


def test_small_gangs_relaunch_many_times_in_one_execution():
    events, size, launches = 200, 60_000, 0
    while launch_fits(events, size, 2, SPEC_BYTES):
        events, size = events + 2 * EVENTS_PER_MEMBER + 20, size + 2 * (SPEC_BYTES + 1024)
        launches += 1
    assert launches > 100
    assert events <= HISTORY_EVENTS_BUDGET + 40 and size <= HISTORY_BYTES_BUDGET + 20_000


def test_either_budget_alone_refuses_a_launch():
    near_events = HISTORY_EVENTS_BUDGET - 10 * EVENTS_PER_MEMBER + 1
    assert not launch_fits(near_events, 100_000, 10, 100)
    assert not launch_fits(1_000, HISTORY_BYTES_BUDGET - 10_000, 10, 1_000)
    assert launch_fits(1_000, 100_000, 10, 1_000)
