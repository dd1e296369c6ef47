"""Hostile store records for the operator commands' tests (tests/ops/test_hostile_store.py):
hypothesis strategies for events, spans and quarantine lines such as someone with write
access to the bucket could leave, the writers that put them where the commands read, and
an audit hook that records every file or network access outside the allowed places."""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis import strategies as st

ESC = "\x1b"
# The characters no operator command may print: C0 controls but the newline, DEL, C1.
FORBIDDEN = {chr(c) for c in (*range(0x00, 0x0A), *range(0x0B, 0x20), *range(0x7F, 0xA0))}

HOSTILE_TEXT = st.sampled_from([
    f"{ESC}[2J{ESC}]0;owned{chr(7)}", "\x9b31m", "line\nINJECTED", "\u202eevil", "[bold]x[/]",
    "../../victim", "../x", "http://169.254.169.254/latest/meta-data", "file:///dev/zero",
    "/etc/hostname", "ok", ""]) | st.text(max_size=12)
HOSTILE_NUMBER = st.sampled_from([1e300, -1e300, float("nan"), float("inf"), float("-inf"),
                                  10**12, 10**18, -1, 2**63, 0, 0.5, 1.7e9])
DEEP = st.integers(40, 120).map(lambda n: json.loads("[" * n + "]" * n))
HOSTILE = st.one_of(HOSTILE_TEXT, HOSTILE_NUMBER, st.booleans(), st.none(), DEEP,
                    st.lists(HOSTILE_NUMBER | HOSTILE_TEXT, max_size=3),
                    st.dictionaries(HOSTILE_TEXT, HOSTILE_NUMBER, max_size=2))

KINDS = ["fault", "recovered", "rollback", "train_metrics", "eval", "operator", "sweep_trial",
         "spike_diagnosed", "dataset_ready", "stage_finished", "stage_started", "run_started",
         "run_finished", "loss_spike", "batch_skipped", "needs_attention", "lr_adjusted",
         "checkpoint_committed", "promoted", "segment_started", f"fault{ESC}[31m"]
FIELDS = ["first_step", "last_step", "loss_mean", "lost_steps", "mttr_s", "detection_s",
          "fault_ts", "kind", "evidence", "injected", "trial_run_id", "result", "round",
          "params", "rungs", "status", "source", "verdict", "uri", "content_hash", "stage",
          "val_loss", "fault_event_id", "also_answers", "skip", "discarded", "note", "who",
          "to_step", "attempt", "steps", "skipped", "reason"]


@st.composite
def events(draw) -> list[dict]:
    """A run's event batch: a few well-formed events around hostile ones."""
    out = [{"event_id": "start", "kind": "run_started", "ts": 1.7e9, "step": None,
            "payload": {}}]
    for i in range(draw(st.integers(1, 8))):
        payload = draw(st.dictionaries(st.sampled_from(FIELDS), HOSTILE, max_size=6))
        if draw(st.booleans()):  # a quarantine's evidence, with a source URL of its choice
            payload = {**payload, "verdict": "data", "sources": [
                {"document": 1, "record": -1, "sha256": "ab" * 16, "source": draw(HOSTILE)}]}
        out.append({"event_id": f"e{i}", "kind": draw(st.sampled_from(KINDS)),
                    "ts": draw(HOSTILE_NUMBER | st.just(1.7e9 + i)),
                    "step": draw(st.none() | HOSTILE_NUMBER | st.integers(0, 50)),
                    "payload": payload})
    return out


@st.composite
def spans(draw) -> list[dict]:
    """A run's span records: parents, times, attributes and events of any type."""
    out = []
    for i in range(draw(st.integers(1, 6))):
        out.append({"span_id": f"{i:016x}", "trace_id": "t" * 32, "name": draw(HOSTILE_TEXT),
                    "parent_id": draw(st.none() | st.just(f"{max(i - 1, 0):016x}") | HOSTILE),
                    "start_ns": draw(HOSTILE_NUMBER | HOSTILE_TEXT | st.just(10**18 + i)),
                    "end_ns": draw(HOSTILE_NUMBER | st.just(10**18 + 10**9)),
                    "service": draw(HOSTILE_TEXT), "status": "error",
                    "status_message": draw(HOSTILE_TEXT),
                    "attributes": draw(st.dictionaries(
                        st.sampled_from(["first_step", "last_step", "step_times_s", "goodput",
                                         "rank", "attempt", "badput", "kind"]), HOSTILE,
                        max_size=5)),
                    "events": draw(st.lists(st.fixed_dictionaries(
                        {"name": HOSTILE_TEXT, "ts_ns": HOSTILE_NUMBER | HOSTILE_TEXT,
                         "attributes": st.dictionaries(HOSTILE_TEXT, HOSTILE, max_size=3)}),
                        max_size=2))})
    return out


def put_lines(store: str, run_id: str, rel: str, records: list, raw: tuple[str, ...] = ()) -> None:
    """Write `records` (NaN and Infinity as Python's json writes them) and `raw` lines."""
    path = os.path.join(store, "runs", run_id, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.writelines(line + "\n" for line in raw)


RAW_LINES = ("[" * 5000 + "]" * 5000, '{"event_id": "x", "kind": "fault", "ts": 1e999}',
             '{"event_id": "y", "kind": "fault", "ts": ' + "9" * 5000 + "}", "\x1b[2J")


PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Accesses:
    """File and network accesses seen while `watching`, outside the allowed roots."""

    def __init__(self) -> None:
        self.allowed: tuple[str, ...] = ()
        self.active = False
        self.outside: list[str] = []
        sys.addaudithook(self._hook)  # stays for the process; inactive outside `watching`

    @contextmanager
    def watching(self, *roots: str) -> Iterator[list[str]]:
        paths = sysconfig.get_paths()
        self.allowed = tuple(os.path.realpath(r) for r in (
            *roots, PROJECT, sys.prefix, sys.base_prefix, paths["stdlib"], paths["purelib"],
            os.path.expanduser("~/.cache"), os.path.expanduser("~/.config"), "/dev/null",
            "/etc/localtime", "/usr/share/zoneinfo", "/proc/self"))
        self.outside, self.active = [], True
        try:
            yield self.outside
        finally:
            self.active = False

    def _hook(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event.startswith("socket.") and event in ("socket.connect", "socket.getaddrinfo",
                                                     "socket.sendto"):
            self.outside.append(f"{event} {args[1:2]}")
        elif event in ("open", "os.listdir", "os.scandir") and args and isinstance(
                args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if not any(path == r or path.startswith(r.rstrip("/") + "/") for r in self.allowed):
                self.outside.append(f"{event} {path}")
