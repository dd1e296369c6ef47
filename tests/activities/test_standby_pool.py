"""activities/standby.py's Pool with real `python -m trainer.standby` processes: the
replacement of a taken standby waits for the launch's first step, so its seconds of import
CPU do not compete with the ranks' start-up; a launch that finds none ready
gets one started at once."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from activities import standby
from activities.supervise import child_env

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)


def eventually(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_a_taken_standby_is_replaced_after_the_launch_steps_not_while_it_starts(monkeypatch):
    monkeypatch.setattr(standby, "REPLACE_AT_MOST_S", 60.0)
    pool = standby.Pool(child_env)
    monkeypatch.setattr(standby, "_POOL", pool)
    taken = []
    try:
        assert eventually(lambda: pool.current is not None and pool.current.ready.is_set(), 120)
        taken.append(pool.take(child_env(), wait_s=60))
        assert taken[0] is not None and taken[0].ready.is_set()
        time.sleep(3.0)  # the launch's start-up: nothing imports beside it
        assert pool.current is None
        standby.launch_stepping()  # the supervisor saw its first step line
        assert eventually(lambda: pool.current is not None, 10)
        assert pool.current.proc.pid != taken[0].proc.pid
        # a launch right after (a restart in place) waits for that one, not a cold start
        taken.append(pool.take(child_env(), wait_s=120))
        assert taken[1] is not None and taken[1].ready.is_set()
    finally:
        pool.close()
        for s in taken:
            if s is not None:
                s.release()


def test_a_standby_not_ready_in_time_is_let_go_to_finish_its_imports_not_killed(monkeypatch):
    """Killed mid-import it could leave DeepSpeed's JIT build lock for every later rank."""
    pool = standby.Pool(child_env)
    monkeypatch.setattr(standby, "_POOL", pool)
    try:
        assert eventually(lambda: pool.current is not None, 30)
        importing = pool.current
        assert pool.take(child_env(), wait_s=0.0) is None  # not ready yet: launch cold
        assert importing.proc.wait(120) == 0  # it finished its imports and left by itself
    finally:
        pool.close()


def test_a_standby_that_dies_while_a_launch_waits_for_it_sends_the_launch_cold_at_once(
        monkeypatch):
    pool = standby.Pool(child_env)
    monkeypatch.setattr(standby, "_POOL", pool)
    taken: list = []
    try:
        assert eventually(lambda: pool.current is not None, 30)
        importing = pool.current
        assert not importing.ready.is_set(), "ready already: the launch would not wait"
        waiter = threading.Thread(target=lambda: taken.append(pool.take(child_env(), 60)))
        waiter.start()
        assert eventually(lambda: pool.current is not importing, 5)  # the launch holds it
        importing.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        waiter.join(60)
        assert taken == [None], "a dead standby was handed a launch"
        assert time.monotonic() - killed_at < 5, "the launch waited on a dead standby"
    finally:
        pool.close()
