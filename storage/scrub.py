"""The checkpoint scrub: read back, in the background, the committed checkpoints a fallback
would need, before the day a restore needs them.

A byte flipped in a committed durable checkpoint that nobody reads again stays there until
a restore falls back to it — seen in a chaos run, where the corrupted step was the fallback
for the rest of the run. The scrub verifies every file of the checkpoints a fallback may
land on (`fallback_steps`: the newest few commits, the rollback horizon and the commit at
its edge, the newest commit at or before every pinned rollback target, the promoted steps,
and the promoted copies themselves) against its manifest's sha256 (`CheckpointStore.verify`,
read through a rate-limited view on a low-priority thread, so a scrub beside training does
not slow its steps: benchmarks/scrub.py).

What it does with a corrupt one (each problem is a `checkpoint_corrupt` event and the
step's `fault`, `storage.checkpoints.emit_corrupt`, detected by the scrub):
- an older commit verifies → the corrupt step is uncommitted (manifest first), so retention
  and every restore count only good checkpoints, and a `recovered` event closes the fault;
- none does → it stays committed and the step gets a `needs_attention` event (`held:
  false`: training goes on, its next commit a good fallback again). Uncommitting deletes
  the files too, and with no verified commit below they are the only copy of that training:
  they are not destroyed on one read's word (a read error can look like rot), and a person
  can repair them — from the trainer machine's fast-tier copy, a replica, a backup. A
  restore meanwhile skips the step, as any checkpoint that fails its checksum;
- a corrupt promoted copy is recorded, `needs_attention`, never deleted (the run's product:
  a person promotes again).

What was verified is remembered in one small durable object, `runs/<run_id>/scrub.json`
({step: manifest sha256, when}): the data worker that scrubs may be a different machine
each time, so a per-machine cache would re-read everything; one GET and one PUT per pass.
A pass reads only steps not recorded, whose manifest changed (a step committed again), or
whose verification is older than `reverify_s` (bit rot after a verification).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from common.limits import MAX_STEP
from common.store_json import StoreRecordInvalid, field_float, field_int, field_str, load_record
from storage.checkpoints import (
    MANIFEST,
    CheckpointStore,
    CorruptCheckpoint,
    corrupt_fault_id,
    emit_corrupt,
)
from storage.fs import join, pipe_durable
from storage.rollback import live_committed, pin, pinned_steps, pins_dir, unpin
from storage.throttle import on_low_priority_thread, slow_view

log = structlog.get_logger(__name__)

RECORD = "scrub.json"  # runs/<run_id>/scrub.json, beside checkpoints/
PROMOTED = "promoted"
FALLBACK_PIN = "scrub-"  # pins/scrub-<corrupt step>.json: its fallback, kept until next pass


@dataclass(frozen=True, kw_only=True)
class ScrubPolicy:
    newest: int = 2  # the newest commits a resume falls back through
    horizon: int = 0  # how far behind the newest commit a rollback may restore
    mb_per_s: float = 16.0  # read rate ceiling (10^6 bytes/s); 0 = unthrottled
    reverify_s: float = 86_400.0  # a verified checkpoint is read again after this long
    nice: int = 19  # the reading thread's niceness

    @classmethod
    def from_storage(cls, cfg, min_horizon: int = 0) -> ScrubPolicy:
        """From spec.StorageConfig; the horizon as retention sees it (storage/tiered.py
        TierPolicy.from_storage: at least the spike detector's reach, `min_horizon`)."""
        return cls(newest=cfg.scrub_newest, horizon=max(cfg.rollback_horizon, min_horizon),
                   mb_per_s=cfg.scrub_mb_per_s)


@dataclass(frozen=True, kw_only=True)
class ScrubReport:
    needed: list[int] = field(default_factory=list)  # what a fallback needs (fallback_steps)
    verified: list[int] = field(default_factory=list)  # read this pass and intact
    skipped: list[int] = field(default_factory=list)  # verified before and not yet due
    corrupt: list[int] = field(default_factory=list)
    uncommitted: list[int] = field(default_factory=list)
    needs_attention: list[int] = field(default_factory=list)  # corrupt, left committed
    promoted_corrupt: list[int] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0


# ---- pure: what a fallback needs, what is due ---------------------------------------
def fallback_steps(committed: Sequence[int], *, newest: int, horizon: int,
                   pinned: Iterable[int] = (), promoted: Iterable[int] = ()) -> list[int]:
    """The committed steps a restore may fall back to, ascending: the newest `newest`, every
    commit within `horizon` of the newest and the newest at or before that edge (what a
    rollback to the edge restores: storage/retention.py keeps the same), the newest at or
    before each pinned rollback target, and the committed promoted steps."""
    steps = sorted(committed)
    if not steps:
        return []
    top = steps[-1]
    need = set(steps[-newest:]) if newest > 0 else set()
    need |= {s for s in steps if top - s <= horizon}
    for target in [top - horizon, *pinned]:
        if (at := max((s for s in steps if s <= target), default=None)) is not None:
            need.add(at)
    need |= set(steps) & set(promoted)
    return sorted(need)


def due_steps(needed: Sequence[int], digests: Mapping[int, str],
              record: Mapping[int, tuple[str, float]], *, now: float,
              reverify_s: float) -> list[int]:
    """Those of `needed` to read this pass: never verified, verified under another manifest
    (the step was committed again), or verified `reverify_s` or longer ago."""
    return [s for s in needed if s not in record or record[s][0] != digests.get(s)
            or now - record[s][1] >= reverify_s]


# ---- the scrub --------------------------------------------------------------------
class _Pass:
    """One pass's reading: what verified (`good`), what did not (`bad`, with the manifest
    digest it was judged under), and for each bad step the older commit that verifies."""

    def __init__(self, store: CheckpointStore, view: CheckpointStore, committed: list[int],
                 digests: dict[int, str], due: list[int], record: dict, now: float) -> None:
        self.store, self.view, self.committed, self.digests = store, view, committed, digests
        self.due, self.record, self.now = due, record, now
        self.good = {s for s in digests if s not in due}
        self.bad: dict[int, tuple[str, list[CorruptCheckpoint]]] = {}

    def check(self, s: int) -> None:
        before = self.digests.get(s) or manifest_digest(self.store, s)
        if before is None:
            return  # uncommitted since the listing
        problems = self.view.verify(s)
        if not problems:
            self.good.add(s)
            self.record.setdefault("", {})[s] = (before, self.now)
        elif manifest_digest(self.store, s) == before:
            self.bad[s] = (before, problems)
        # else uncommitted or committed again while read (retention, a rollback's replay):
        # not this checkpoint's damage; the next pass reads what is there then

    def older_good(self, s: int) -> int | None:
        for c in reversed([c for c in self.committed if c < s]):
            if c not in self.good and c not in self.bad:
                self.check(c)
            if c in self.good:
                return c
        return None

    def run(self) -> dict[int, int | None]:
        """Each bad step -> the newest older commit that verifies (None: none does)."""
        for s in sorted(self.due, reverse=True):
            self.check(s)
        anchors: dict[int, int | None] = {}
        while todo := sorted(set(self.bad) - set(anchors), reverse=True):
            anchors[todo[0]] = self.older_good(todo[0])
        return anchors


def scrub(store: CheckpointStore, events, policy: ScrubPolicy, *,
          progress: Callable[[], object] | None = None) -> ScrubReport:
    """One pass over `store` (durable, one run); `events` an EventLog; `progress()` is
    called as it reads (heartbeats)."""
    began, now = time.monotonic(), time.time()
    release_fallback_pins(store)
    committed, promoted = live_committed(store), store.list_promoted()
    needed = fallback_steps(committed, newest=policy.newest, horizon=policy.horizon,
                            pinned=pinned_steps(store), promoted=promoted)
    record = read_record(store)
    digests = {s: d for s in needed if (d := manifest_digest(store, s)) is not None}
    due = due_steps(list(digests), digests, record.get("", {}), now=now,
                    reverify_s=policy.reverify_s)
    counter = [0]
    one = _Pass(store, slow_view(store, policy.mb_per_s * 1e6, counter, progress), committed,
                digests, due, record, now)
    anchors, promoted_bad = on_low_priority_thread(lambda: (one.run(), scrub_promoted(
        store, promoted, counter, policy, record, now, progress)), policy.nice)  # type: ignore
    uncommitted = act_on(store, events, one.bad, anchors, began)
    for s, exc in promoted_bad:
        emit_corrupt(events, exc, detected_by="scrub")
        attention(events, s, exc, "the promoted copy does not verify",
                  f"promote step {s} again once its committed checkpoint verifies")
    events.flush()
    write_record(store, record, keep=set(store.list_committed()), promoted=set(promoted))
    report = ScrubReport(
        needed=needed, verified=sorted(s for s in one.good if s not in digests or s in due),
        skipped=sorted(s for s in digests if s not in due), corrupt=sorted(one.bad),
        uncommitted=sorted(uncommitted),
        needs_attention=sorted(s for s, a in anchors.items() if a is None),
        promoted_corrupt=sorted(s for s, _ in promoted_bad), bytes_read=counter[0],
        seconds=round(time.monotonic() - began, 3))
    log.info("checkpoint_scrub_done", needed=needed, verified=report.verified,
             corrupt=report.corrupt, uncommitted=report.uncommitted,
             needs_attention=report.needs_attention, bytes_read=report.bytes_read,
             seconds=report.seconds)
    return report


def act_on(store: CheckpointStore, events, bad: dict[int, tuple[str, list[CorruptCheckpoint]]],
           anchors: dict[int, int | None], began: float) -> list[int]:
    """Record every corrupt step; uncommit those with an older verified commit, newest first
    and manifest first (never a hole below a survivor); `needs_attention` for the others.
    Returns the steps uncommitted."""
    for s in sorted(bad):
        for exc in bad[s][1]:
            emit_corrupt(events, exc, detected_by="scrub")
    uncommitted = []
    for s in sorted(bad, reverse=True):
        if (fallback := anchors[s]) is None:
            attention(events, s, bad[s][1][0], "no older checkpoint verifies: it stays "
                      "committed (its files are the only copy of that training; a restore "
                      "skips it meanwhile)", "training goes on and its next commit is a good "
                      "fallback; to keep this step, restore its files from a copy (the trainer "
                      "machine's fast tier, a replica); see the checkpoint_corrupt events")
            continue
        if manifest_digest(store, s) != bad[s][0]:
            continue  # committed again since it was read: not the checkpoint judged
        # retention (the writer, after its next commit) may count the corrupt step as the
        # newest at or before the horizon's edge and let its fallback go: the fallback is
        # pinned until the next pass, when the corrupt step is long gone
        pin(store.url, store.run_id, f"{FALLBACK_PIN}{s}", fallback)
        try:
            store.delete(s)
        except FileNotFoundError:  # a restore that found it too is uncommitting it
            log.info("corrupt_checkpoint_already_going", step=s, by="scrub")
            continue
        uncommitted.append(s)
        log.warning("corrupt_checkpoint_uncommitted", step=s, fallback=fallback, by="scrub")
        events.emit("recovered", step=fallback, event_id=f"recovered/{corrupt_fault_id(s)}",
                    fault_event_id=corrupt_fault_id(s), by="scrub", uncommitted=s,
                    fallback_step=fallback, resumed_step=fallback, lost_steps=0,
                    detection_s=0.0, mttr_s=round(time.monotonic() - began, 3))
    return uncommitted


def scrub_promoted(store: CheckpointStore, promoted: Sequence[int], counter: list[int],
                   policy: ScrubPolicy, record: dict, now: float,
                   progress: Callable[[], object] | None,
                   ) -> list[tuple[int, CorruptCheckpoint]]:
    """Verify each promoted copy that is due; its problems, named `promoted/<file>`."""
    copies = CheckpointStore.at(store.url, join(store.root.rsplit("/", 1)[0], PROMOTED))
    digests = {s: d for s in promoted if (d := manifest_digest(copies, s)) is not None}
    bad = []
    for s in due_steps(list(digests), digests, record.get(PROMOTED, {}), now=now,
                       reverify_s=policy.reverify_s):
        problems = slow_view(copies, policy.mb_per_s * 1e6, counter, progress).verify(s)
        if not problems:
            record.setdefault(PROMOTED, {})[s] = (digests[s], now)
        bad += [(s, CorruptCheckpoint(s, f"{PROMOTED}/{p.file}", p.expected, p.actual))
                for p in problems]
    return bad


def attention(events, step: int, exc: CorruptCheckpoint, reason: str, fix: str) -> None:
    events.emit("needs_attention", step=step, event_id=f"needs_attention/scrub/{step}/{exc.file}",
                reason=f"checkpoint step {step} is corrupt and {reason}", fix=fix,
                file=exc.file, evidence=f"{exc.file}: expected {exc.expected}, found {exc.actual}",
                detected_by="scrub", held=False)  # a look is asked for; the run goes on


def release_fallback_pins(store: CheckpointStore) -> None:
    """The pins the previous pass left on the fallbacks of what it uncommitted."""
    store.fs.invalidate_cache()
    if not store.fs.exists(pins_dir(store)):
        return
    ids = [name[:-len(".json")] for path in store.fs.ls(pins_dir(store), detail=False)
           if (name := path.rsplit("/", 1)[-1]).startswith(FALLBACK_PIN)
           and name.endswith(".json")]
    if ids:
        unpin(store.url, store.run_id, ids)


# ---- the record of verifications -----------------------------------------------------
def record_path(store: CheckpointStore) -> str:
    return join(store.root.rsplit("/", 1)[0], RECORD)


def manifest_digest(store: CheckpointStore, step: int) -> str | None:
    """sha256 of the step's manifest bytes; None once it is gone."""
    try:
        return hashlib.sha256(store.fs.cat_file(store.path(step, MANIFEST))).hexdigest()
    except FileNotFoundError:
        return None


def read_record(store: CheckpointStore) -> dict[str, dict[int, tuple[str, float]]]:
    """{"": {step: (manifest digest, when)}, "promoted": {…}}; an absent or unreadable record
    is empty (it only ever saves reads)."""
    path = record_path(store)
    try:
        return parse_record(store.fs.cat_file(path), path)
    except FileNotFoundError:
        return {}
    except ValueError as exc:  # StoreRecordInvalid
        log.warning("scrub_record_unreadable", path=path, error=str(exc)[:200])
        return {}


def parse_record(raw: bytes, path: str) -> dict[str, dict[int, tuple[str, float]]]:
    """The scrub record's verifications, every field typed; StoreRecordInvalid otherwise."""
    verified = load_record(raw, path).get("verified")
    if not isinstance(verified, dict):
        raise StoreRecordInvalid(f"{path}.verified", "is not an object")
    out: dict[str, dict[int, tuple[str, float]]] = {}
    for tier, steps in verified.items():
        if tier not in ("", PROMOTED) or not isinstance(steps, dict):
            raise StoreRecordInvalid(f"{path}.verified", f"{tier[:40]!r} is not a tier of steps")
        where = f"{path}.verified.{tier}"
        out[tier] = {field_int({"step": _step_key(s)}, "step", where, high=MAX_STEP):
                     (field_str(v, "manifest", where, max_len=64), field_float(v, "at", where))
                     for s, v in steps.items()}
    return out


def _step_key(key: str) -> int | None:
    """A step written as a JSON object's key; None unless it is one (a short decimal)."""
    return int(key) if key.isascii() and key.isdigit() and len(key) <= 13 else None


def scrubbed_steps(store: CheckpointStore) -> frozenset[int]:
    """The committed steps the scrub verified (for retention, storage/retention.py). Empty
    when the record cannot be read: it only ever makes retention keep more, and the writer
    that applies retention must not fail on it."""
    try:
        return frozenset(read_record(store).get("", {}))
    except Exception as exc:  # noqa: BLE001 - an outage: retention as without a scrub
        log.warning("scrub_record_unavailable", path=record_path(store), error=repr(exc)[:200])
        return frozenset()


def write_record(store: CheckpointStore, record: dict, *, keep: set[int],
                 promoted: set[int]) -> None:
    """Only steps still there: the record stays as small as what a fallback needs."""
    out = {tier: {str(s): {"manifest": d, "at": at} for s, (d, at) in sorted(steps.items())
                  if s in (promoted if tier == PROMOTED else keep)}
           for tier, steps in record.items()}
    pipe_durable(store.fs, record_path(store), json.dumps({"verified": out}).encode())
