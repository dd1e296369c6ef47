"""`mainspring explain RUN [--incident N] [--json]`: each incident of a run told in plain
words, generated deterministically from its durable events.

An incident is a fault that was detected (with the injected fault that caused it, if one
did), a loss spike (its outlier steps, skipped updates and rollback, with an injected
cause), an operator command, or a decision that needed no fault (a hold, an OOM
adaptation, an LR change, a corrupt checkpoint). Each says what happened and when, the
evidence, what was decided and why, and what it cost: steps trained again, wall time and
accelerator-hours.

Every figure in a sentence is a `Figure` naming the event and field it came from (or,
for a derived one, the figures it was computed from), so a test can check each sentence
against the record (tests/ops/test_explain.py).
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from common.errors import BadConfig, StorageUnavailable
from common.redact import redact_value
from ops.cli_args import run_command
from ops.cli_output import printable
from ops.report import exit_code, missing_run, ordered
from ops.report_map import accelerators
from ops.store_fields import whole

SPIKE_KINDS = ("loss_spike", "batch_skipped", "spike_diagnosed", "rollback")
DECISIONS = ("needs_attention", "oom_adapted", "lr_adjusted", "checkpoint_corrupt",
             "checkpoint_failed")
# an injected fault and the fault the supervisor detected from it: at most this far apart
CAUSE_S = 2.0
# The kinds incidents are found and told from; each one MARKED in the batch names of the
# event log (storage/event_batches.py), so `explain` fetches only the batches that hold one.
TOLD_KINDS = ("fault", "recovered", *SPIKE_KINDS, "operator", *DECISIONS)
# An incident's steps trained again are priced at the run's typical step time around it:
# the train_metrics windows within this many seconds either side. A long run's throughput
# moves (nodes come and go, the batch grows), and the day around an incident is what its
# replayed steps cost; a run shorter than the window is priced at its whole median.
STEP_WINDOW_S = 12 * 3600.0


@dataclass(frozen=True)
class Figure:
    """One figure of a sentence: its text there and where it came from — `event_id` and
    `field` (a payload key, or "ts" / "step" of the event), or `derived` from other
    figures' names."""

    name: str
    value: Any
    text: str
    event_id: str = ""
    field: str = ""
    derived: tuple[str, ...] = ()


@dataclass(frozen=True)
class Incident:
    number: int
    kind: str  # fault | spike | operator | one of DECISIONS
    step: int
    ts: float
    text: str
    figures: tuple[Figure, ...]
    event_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Sentence:
    """Builds one incident's text; every figure goes through it, so none is unaccounted."""

    parts: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)

    def say(self, text: str) -> Sentence:
        self.parts.append(text)
        return self

    def fig(self, name: str, value: Any, text: str, event: dict | None = None,
            key: str = "", derived: tuple[str, ...] = ()) -> str:
        self.figures.append(Figure(name, value, text, event["event_id"] if event else "",
                                   key, derived))
        return text

    def payload(self, name: str, event: dict, key: str, spec: str = "") -> str:
        """The payload's `key` as a figure; "?" where the record lacks it (a checked
        event's field that was out of range is removed, ops/store_fields.py)."""
        value = event["payload"].get(key)
        if value is None:
            return self.fig(name, None, "?", event, key)
        return self.fig(name, value, format(value, spec) if spec and not isinstance(
            value, (str, bool, list, dict)) else str(value), event, key)

    def opt(self, template: str, name: str, event: dict, key: str, spec: str = "") -> None:
        """Say `template` with the payload's `key` in it ({}), only when the record has
        it (an older writer's event may not)."""
        if event["payload"].get(key) not in (None, ""):
            self.say(template.format(self.payload(name, event, key, spec)))

    def step(self, name: str, event: dict) -> str:
        return self.fig(name, event["step"], str(event["step"]), event, "step")

    def when(self, event: dict, key: str = "ts") -> str:
        """The moment `event` dates (its `ts`, or a payload time such as `fault_ts`)."""
        at = event[key] if key == "ts" else event["payload"][key]
        text = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
        return self.fig("time", at, text, event, key)

    def text(self) -> str:
        return "".join(self.parts)


def rates_of(events: Iterable[dict]) -> list[tuple[float, float]]:
    """Pure: (ts, tokens_per_s) of each train_metrics window with a positive rate, by time."""
    return sorted((e["ts"], e["payload"]["tokens_per_s"]) for e in events
                  if e["kind"] == "train_metrics" and (e["payload"].get("tokens_per_s") or 0) > 0)


def step_tokens(spec: dict | None) -> int | None:
    """Pure: the tokens of one step of the run (its spec's micro-batch tokens, gradient
    accumulation and accelerators); None without a spec that says."""
    train = (spec or {}).get("train") or {}
    if not train.get("micro_batch_tokens"):
        return None
    accels, _ = accelerators(spec, [])
    return int(train["micro_batch_tokens"]) * int(train.get("grad_accum", 1)) * accels


def step_seconds(rates: list[tuple[float, float]], tokens_per_step: int | None,
                 at: float) -> float | None:
    """Pure: the run's typical step time around `at` — the tokens of a step over the median
    rate of the windows (`rates_of`) within STEP_WINDOW_S of it; None without either."""
    if not tokens_per_step:
        return None
    lo = bisect.bisect_left(rates, (at - STEP_WINDOW_S,))
    hi = bisect.bisect_right(rates, (at + STEP_WINDOW_S, math.inf))
    if lo >= hi:
        return None
    return tokens_per_step / statistics.median(rate for _, rate in rates[lo:hi])


def accelerator_hours(seconds: float, accels: int) -> float:
    return seconds * accels / 3600.0


@dataclass(frozen=True)
class Found:
    """An incident found and placed in the run's order, not yet told: its first event, its
    kind, its events' ids, and its story at a price (`Cost`)."""

    first: dict
    kind: str
    event_ids: tuple[str, ...]
    story: Callable[[Cost], Sentence]

    def told(self, number: int, cost: Cost) -> Incident:
        s = self.story(cost)
        return Incident(number, self.kind, self.first["step"], self.first["ts"],
                        f"Incident {number}: " + s.text(), tuple(s.figures), self.event_ids)


def found_incidents(events: Iterable[dict]) -> list[Found]:
    """Pure: the run's incidents in order of time (the n-th is incident n), from its events
    of TOLD_KINDS (others are ignored)."""
    evs = ordered(events)
    faults = [e for e in evs if e["kind"] == "fault"]
    injected = [e for e in faults if e["payload"].get("injected")]
    detected = [e for e in faults if not e["payload"].get("injected")]
    causes = {f["event_id"]: cause_of(f, injected) for f in detected}
    groups = [(g, spike_cause(g, injected)) for g in spike_groups(evs)]
    explained = {c["event_id"] for c in [*causes.values(), *(c for _, c in groups)] if c}
    # an injected fault that is neither a detected fault's cause nor a spike's: told as the
    # fault itself (a record from before detected faults had events of their own)
    told = [f for f in faults if f in detected or f["event_id"] not in explained]
    recoveries = recoveries_of(evs, told)
    found: list[Found] = []
    for f in told:
        cause, rec = causes.get(f["event_id"]), recoveries.get(f["event_id"])
        found.append(Found(f, "fault", tuple(e["event_id"] for e in (f, cause, rec) if e),
                           functools.partial(fault_story, f, cause, rec)))
    for group, cause in groups:
        found.append(Found(group[0], "spike",
                           tuple(e["event_id"] for e in ([cause] if cause else []) + group),
                           functools.partial(spike_story, group, cause)))
    for e in evs:
        if e["kind"] == "operator":
            found.append(Found(e, "operator", (e["event_id"],),
                               functools.partial(_costless, operator_story, e)))
        elif e["kind"] in DECISIONS:
            found.append(Found(e, e["kind"], (e["event_id"],),
                               functools.partial(_costless, decision_story, e)))
    found.sort(key=lambda x: (x.first["ts"], -1 if x.first["step"] is None else x.first["step"]))
    return found


def _costless(story: Callable[[dict], Sentence], event: dict, cost: Cost) -> Sentence:
    return story(event)


def incidents(events: Iterable[dict], spec: dict | None = None) -> list[Incident]:
    """Pure: the run's incidents in order of time, numbered from 1, each priced at the
    step time around it (`step_seconds`)."""
    evs = ordered(events)
    accels, _ = accelerators(spec, [])
    rates, per_step = rates_of(evs), step_tokens(spec)
    return [f.told(n, Cost(accels, step_seconds(rates, per_step, f.first["ts"])))
            for n, f in enumerate(found_incidents(evs), 1)]


@dataclass(frozen=True)
class Cost:
    """What an incident's lost time is priced with: the run's accelerators and its typical
    step time (None: no throughput recorded, so steps trained again are counted, not timed)."""

    accels: int
    step_s: float | None


def recoveries_of(evs: list[dict], faults: list[dict]) -> dict[str, dict]:
    """Pure: fault event id -> the `recovered` event that answers it: the one naming it
    (`fault_event_id`), else — a record without the names — the first one after it that
    names no fault, as the report pairs them."""
    out: dict[str, dict] = {}
    ids = {f["event_id"] for f in faults}
    for e in evs:
        if e["kind"] != "recovered":
            continue
        named = e["payload"].get("fault_event_id")
        if named in ids:
            out.setdefault(named, e)
        elif not named:
            before = [f for f in faults if f["ts"] <= e["ts"] and f["event_id"] not in out]
            if before:
                out[before[-1]["event_id"]] = e
    return out


def cause_of(fault: dict, injected: list[dict]) -> dict | None:
    """Pure: the injected fault the supervisor detected as `fault` — the newest one at most
    CAUSE_S before the moment the fault is dated from."""
    at = fault["payload"].get("fault_ts") or fault["ts"]
    near = [i for i in injected if at - CAUSE_S <= i["ts"] <= at + CAUSE_S]
    return near[-1] if near else None


def fault_story(f: dict, cause: dict | None, rec: dict | None, cost: Cost) -> Sentence:
    p, s = f["payload"], Sentence()
    at = s.when(f, "fault_ts" if p.get("fault_ts") else "ts")
    what = "injected fault" if p.get("injected") else "fault"
    s.say(f"{what} at step {s.step('step', f)} ({at}): {s.payload('kind', f, 'kind')}")
    s.opt(" — {}", "evidence", f, "evidence")
    s.say(". ")
    if cause:
        s.say(f"Cause: an injected {s.payload('cause_kind', cause, 'kind')} fault")
        s.opt(" ({})", "cause_evidence", cause, "evidence")
        s.say(". ")
    if p.get("detected_by"):
        s.say(f"Detected by {s.payload('detected_by', f, 'detected_by')}")
        s.opt(" after {} s", "detection_s", f, "detection_s", ".1f")
        s.say(". ")
    if rec is None:
        s.say("No recovery is recorded: nothing was detected from it, or the run ended. ")
        return s
    r = rec["payload"]
    s.say("Decided: retry")
    s.opt("; attempt {}", "attempt", rec, "attempt")
    s.opt(" resumed at step {}", "resumed_step", rec, "resumed_step")
    s.opt(" from the {} tier", "tier", rec, "tier")
    s.say(". ")
    mttr, lost = r.get("mttr_s"), int(r.get("lost_steps") or 0)
    tell_cost(s, cost, rec, "mttr_s", mttr, "lost_steps", lost)
    return s


def tell_cost(s: Sentence, cost: Cost, event: dict, wall_key: str, wall: float | None,
              steps_key: str, steps: int, wall_what: str = "to recover") -> None:
    """The cost clause with its wall time and steps read from `event`'s payload (a wall
    time without a key: derived from the events' times)."""
    s.say("Cost: ")
    total, inputs = 0.0, []
    if wall is not None:
        source = {"event": event, "key": wall_key} if wall_key else {"derived": ("time",)}
        s.say(f"{s.fig('wall_s', wall, f'{wall:.1f}', **source)} s {wall_what}")
        total, inputs = wall, ["wall_s"]
    if steps:
        s.say(", " if inputs else "")
        s.say(f"{s.fig('steps_again', steps, str(steps), event, steps_key)} steps trained again")
        if cost.step_s:
            again = steps * cost.step_s
            step_s = s.fig("step_s", round(cost.step_s, 3), f"{cost.step_s:.3f}",
                           derived=("train_metrics.tokens_per_s", "spec.train"))
            s.say(f" (~{s.fig('again_s', again, f'{again:.1f}', derived=('steps_again', 'step_s'))}"
                  f" s at {step_s} s a step)")
            total, inputs = total + again, inputs + ["again_s"]
    if not inputs:
        s.say("nothing lost. ")
        return
    hours = accelerator_hours(total, cost.accels)
    s.say(f"; {s.fig('accelerator_hours', hours, f'{hours:.4f}', derived=(*inputs, 'accelerators'))}"
          f" accelerator-hours on {s.fig('accelerators', cost.accels, str(cost.accels), derived=('spec.train',))}"
          f" accelerator{'s' if cost.accels != 1 else ''}. ")


def spike_groups(evs: list[dict]) -> list[list[dict]]:
    """Pure: loss_spike / batch_skipped / rollback events in runs of steps. A group ends
    with its rollback, or where the next spike event is more than one step past it; a
    rollback joins the open group when its spike's onset lies in it."""
    groups: list[list[dict]] = []
    last = None
    for e in evs:
        if e["kind"] not in SPIKE_KINDS:
            continue
        open_group = bool(groups) and groups[-1][-1]["kind"] != "rollback"
        if e["kind"] in ("rollback", "spike_diagnosed"):
            onset = e["payload"].get("onset", e["step"])
            fresh = not open_group or (onset or 0) > (last or 0) + 1
        else:
            fresh = not open_group or (e["step"] or 0) > (last or 0) + 1
        if fresh:
            groups.append([])
        groups[-1].append(e)
        last = e["step"]
    return [g for g in groups if any(e["kind"] == "loss_spike" or at_commit(e) for e in g)]


def at_commit(e: dict) -> bool:
    """Pure: a rollback the ranks' copies of the weights asked for before a checkpoint
    committed (trainer/guard.py verify_before_commit), with no loss spike before it."""
    return e["kind"] == "rollback" and e["payload"].get("reason") == "replicas_disagree_at_commit"


def spike_cause(group: list[dict], injected: list[dict]) -> dict | None:
    """Pure: an injected data or LR fault whose steps cover the spike's first step."""
    first = group[0]["step"] or 0
    for i in injected:
        p = i["payload"]
        start = p.get("at_step", i["step"]) or 0  # checked: a whole step, or absent
        steps = p.get("steps") if whole(p.get("steps"), 1) else 1
        if start <= first < start + steps + 1:
            return i
    return None


def commit_story(group: list[dict], rollback: dict, cost: Cost) -> Sentence:
    """Copies of the weights that disagreed before a checkpoint committed: no loss showed
    it; the commit was not made, the segment went back to the last one."""
    s = Sentence()
    s.say(f"before the checkpoint of step {s.step('step', rollback)} ({s.when(rollback)}) "
          "committed, ")
    diagnosed = next((e for e in group if e["kind"] == "spike_diagnosed"), None)
    if diagnosed:
        tell_replicas(s, diagnosed)
    s.say(f"No loss had shown it. Decided: not to commit it; rolled back to step "
          f"{s.payload('to_step', rollback, 'to_step')}, the last commit, skipping no data. ")
    tell_cost(s, cost, rollback, "", None, "lost_steps",
              int(rollback["payload"].get("lost_steps") or 0), "")
    return s


def spike_story(group: list[dict], cause: dict | None, cost: Cost) -> Sentence:
    spikes = [e for e in group if e["kind"] == "loss_spike"]
    if not spikes:  # spike_groups keeps such a group for its rollback at a commit
        return commit_story(group, next(e for e in group if at_commit(e)), cost)
    skips = [e for e in group if e["kind"] == "batch_skipped"]
    rollback = next((e for e in group if e["kind"] == "rollback"), None)
    first, s = spikes[0], Sentence()
    p = first["payload"]
    s.say(f"loss spike at step {s.step('step', first)} ({s.when(first)}): loss")
    s.opt(" {} →", "baseline", first, "baseline", ".3f")
    s.opt(" {}", "loss", first, "loss", ".3f")
    if p.get("spread") and p.get("baseline") is not None and p.get("loss") is not None:
        z = (p["loss"] - p["baseline"]) / p["spread"]
        s.say(f" (z {s.fig('z', round(z, 1), f'{z:.1f}', derived=('loss', 'baseline', 'spread'))}"
              f" against a spread of {s.payload('spread', first, 'spread', '.3f')})")
    s.opt("; threshold {}", "threshold", first, "threshold", ".3f")
    s.say(". ")
    if cause:
        s.say(f"Cause: an injected {s.payload('cause_kind', cause, 'kind')} fault from step "
              f"{s.step('cause_step', cause)}. ")
    if skips:
        steps = ", ".join(s.step(f"skipped_{i}", e) for i, e in enumerate(skips))
        s.say(f"Decided: skipped the update of step{'s' if len(skips) > 1 else ''} {steps} "
              "(an outlier's batch trains nothing). ")
    if rollback is None:
        s.say("The loss came back; training went on. ")
        tell_cost(s, cost, first, "", None, "", 0)
        return s
    r = rollback["payload"]
    diagnosed = next((e for e in group if e["kind"] == "spike_diagnosed"), None)
    s.say("The spike was sustained")
    if r.get("outlier_steps"):
        listed = s.fig("outliers", r["outlier_steps"], ", ".join(map(str, r["outlier_steps"])),
                       rollback, "outlier_steps")
        s.say(f" (outliers at steps {listed})")
    s.say(f": rolled back at step {s.step('rollback_step', rollback)} to step "
          f"{s.payload('to_step', rollback, 'to_step')}")
    if r.get("skip"):
        lo, hi = r["skip"]
        s.say(f", skipping data batches {s.fig('skip_from', lo, str(lo), rollback, 'skip')}"
              f"–{s.fig('skip_to', hi, str(hi), rollback, 'skip')}")
    s.say(". ")
    if diagnosed:
        tell_diagnosis(s, diagnosed, rollback)
    tell_skip(s, rollback)
    tell_cost(s, cost, rollback, "", rollback["ts"] - first["ts"], "lost_steps",
              int(r.get("lost_steps") or 0), "from the first outlier to the rollback")
    return s


def tell_diagnosis(s: Sentence, e: dict, rollback: dict) -> None:
    """Why it spiked: the replay of its window on the restored weights (trainer/diagnosis.py)."""
    p = e["payload"]
    if p.get("source") == "replicas":  # found by comparing the ranks' weights, no replay
        tell_replicas(s, e)
        return
    s.say(f"Replayed on step {s.payload('restored_step', rollback, 'to_step')}'s weights, the "
          "spike's batches twice "
          f"({s.payload('forward_passes', e, 'forward_passes')} forward passes, "
          f"{s.payload('replay_s', e, 'replay_s', '.2f')} s): ")
    verdict = p.get("verdict")
    if verdict == "data" and p.get("documents"):
        listed = s.fig("documents", p["documents"], ", ".join(map(str, p["documents"])), e,
                       "documents")
        s.say(f"documents {listed} stand out against the window's others — the data is the "
              "cause. ")
    elif verdict == "data":
        listed = s.fig("batches", p.get("batches"), ", ".join(map(str, p.get("batches") or [])),
                       e, "batches")
        s.say(f"batches {listed} are still above the threshold on healthy weights while the "
              "rest of the window is not — the data is the cause. ")
    elif verdict == "optimisation":
        s.say("the spike's batches are normal on healthy weights — the update, not the data, "
              "was the cause. ")
    elif verdict == "numerics":
        s.say(f"the two replays disagree by "
              f"{s.payload('replay_disagreement', e, 'replay_disagreement', '.2e')}"
              f" — suspected silent data corruption on rank {s.payload('rank', e, 'rank')}. ")
    else:
        s.say("no cause stood out (unclear). ")


def tell_replicas(s: Sentence, e: dict) -> None:
    """`numerics` from the ranks' copies of the weights (trainer/replicas.py)."""
    p = e["payload"]
    ranks, nodes = p["ranks"], p["node_ranks"]
    listed = s.fig("ranks", ranks, ", ".join(map(str, ranks)), e, "ranks")
    on = s.fig("node_ranks", nodes, ", ".join(map(str, nodes)), e, "node_ranks")
    s.say(f"the ranks' copies of the weights, which must be equal, disagree: rank"
          f"{'' if len(ranks) == 1 else 's'} {listed} (node{'' if len(nodes) == 1 else 's'} "
          f"{on}) differ from the others")
    if bad := sum(p["nonfinite"][r] for r in ranks):
        s.say(f" and hold {s.fig('nonfinite', bad, str(bad), derived=('nonfinite', 'ranks'))}"
              " non-finite values")
    s.say(" — suspected silent data corruption, not the data and not the learning rate. ")
    if p.get("agree_after_restore") is not None:
        s.say("Every copy agreed again after the restore. " if p["agree_after_restore"] else
              "The copies still disagreed after the restore. ")


def tell_skip(s: Sentence, rollback: dict) -> None:
    """What the rollback skipped instead of its data window, as its diagnosis decided
    (trainer/guard.py); a window skip is said with the rollback, an older record has none."""
    r = rollback["payload"]
    if r.get("skipped") not in ("documents", "nothing") or not r.get("window"):
        return
    lo, hi = r["window"]
    window = (f"data batches {s.fig('window_from', lo, str(lo), rollback, 'window')}–"
              f"{s.fig('window_to', hi, str(hi), rollback, 'window')}")
    kept = (f"{s.payload('kept_batches', rollback, 'kept_batches')} micro-batches "
            f"({s.payload('kept_sequences', rollback, 'kept_sequences')} sequences)")
    if r["skipped"] == "documents":
        docs = r["documents"]
        listed = s.fig("skipped_documents", docs, ", ".join(map(str, docs)), rollback,
                       "documents")
        one = len(docs) == 1
        s.say(f"Decided: skip document{'' if one else 's'} {listed} wherever "
              f"{'it occurs' if one else 'they occur'} (no training target on "
              f"{'its' if one else 'their'} tokens), not {window}: {kept} that window held "
              "still train. ")
    else:
        s.say(f"Decided: skip no data, not {window}: {kept} train again. ")


def operator_story(e: dict) -> Sentence:
    p, s = e["payload"], Sentence()
    s.say(f"operator command at step {s.step('step', e)} ({s.when(e)}): "
          f"{s.payload('command', e, 'command')}")
    s.opt(" from {}", "who", e, "who")
    s.opt(" — {}", "note", e, "note")
    s.opt("; sent at step {}", "accepted_at_step", e, "accepted_at_step")
    s.opt(" (span {} of the run's trace)", "span_id", e, "span_id")
    s.say(". ")
    if p.get("why_not"):
        s.say(f"Not applied: {s.payload('why_not', e, 'why_not')}. ")
    elif p.get("applied", True):
        s.say("Applied at this step. ")
    return s


def decision_story(e: dict) -> Sentence:
    s = Sentence()
    s.say(f"{e['kind'].replace('_', ' ')} at step {s.step('step', e)} ({s.when(e)})")
    for key in ("reason", "evidence", "fix", "file", "failure"):
        s.opt(f"; {key}: {{}}", key, e, key)
    s.say(". ")
    return s


# ---- the command -------------------------------------------------------------------------
def explain(durable_url: str, run_id: str, number: int | None = None) -> list[Incident]:
    """The run's incidents from its record, or only the `number`-th (BadConfig naming the
    range when it has no such one), told as `incidents` tells them.

    Only what they need is fetched (storage/event_batches.py: each batch is named with its
    span and whether it holds a MARKED kind): the batches marked as holding incidents;
    then, where the spec prices a step, those whose span meets STEP_WINDOW_S around the
    incident told (around each, when all are: the whole log)."""
    from ops.store_fields import checked_events, event_problem
    from storage.event_batches import merge, select
    from storage.events import list_batches, load_batches
    from storage.runs import stored_spec

    batches = list_batches(durable_url, run_id)
    marked = select(batches, kinds=TOLD_KINDS)
    loaded = load_batches(durable_url, run_id, marked)
    events = merge(loaded)
    if not batches or (len(marked) == len(batches)  # it read them all: are any usable?
                       and not any(event_problem(e) is None for e in events)):
        raise missing_run(durable_url, run_id)
    found = found_incidents(checked_events(redact_value(
        [e for e in events if e["kind"] in TOLD_KINDS])))
    if number is not None and not 1 <= number <= len(found):
        raise BadConfig("--incident", f"run {run_id} has {len(found)} incidents, not {number}",
                        f"choose 1 to {len(found)}" if found else "leave --incident out")
    numbered = list(enumerate(found, 1))
    if number is not None:
        numbered = [numbered[number - 1]]
    spec = stored_spec(durable_url, run_id)
    per_step, rates = step_tokens(spec), []
    if per_step and numbered:
        at = numbered[0][1].first["ts"]
        window = (None, None) if number is None else (at - STEP_WINDOW_S, at + STEP_WINDOW_S)
        seen = {b.path for b in marked}
        more = [b for b in select(batches, since=window[0], until=window[1])
                if b.path not in seen]
        loaded += load_batches(durable_url, run_id, more)
        # numbers only: a rate is never scrubbed, so the windows are checked, not redacted
        rates = rates_of(checked_events(e for e in merge(loaded) if e["kind"] == "train_metrics"))
    accels, _ = accelerators(spec, [])
    return [f.told(n, Cost(accels, step_seconds(rates, per_step, f.first["ts"])))
            for n, f in numbered]


def cmd_explain(args: argparse.Namespace) -> int:
    from common import telemetry

    telemetry.configure_logging(os.environ.get("MAINSPRING_LOG_LEVEL", "warning"))
    try:
        found = explain(args.durable, args.run_id, args.incident)
    except (BadConfig, StorageUnavailable) as exc:
        print(f"mainspring explain: {exc}", file=sys.stderr)
        return exit_code(exc)
    if args.json:
        print(json.dumps([i.to_json() for i in found]))
    elif not found:
        print(f"run {args.run_id}: no incidents — no fault, spike, operator command or hold "
              "is recorded.")
    else:
        print("\n\n".join(printable(i.text) for i in found))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `explain RUN_ID [--durable URL] [--incident N] [--json]`."""
    p = run_command(sub, "explain", "each incident of a run in plain words, from its record")
    p.add_argument("--incident", type=int, default=None, help="only the N-th incident (1-based)")
    p.add_argument("--json", action="store_true", help="the incidents with their figures, as JSON")
    p.set_defaults(fn=cmd_explain)
