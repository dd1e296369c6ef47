"""The run-id claim: `runs/<run_id>/RUN.json` ties a run id in a durable store to one spec.

A run id names a directory of checkpoints, events and skip ranges. A new run that reused
the id of an old one adopted all of it: its first segment reported `segment_already_done`,
it merged the old skip ranges and promoted the old weights. Now the first workflow run of
a TrainingRun claims the id before it touches anything (the `claim_run` local activity):
RUN.json is written once with `put_new` (never overwritten) and holds the spec hash.

- no claim yet: the id is claimed for this spec;
- claimed with the same spec hash: a resume of the same run (after a failure, an abort,
  a terminated workflow) — it goes on from what is committed;
- claimed with another spec hash: BadConfig on `run_id`, saying how to resume or start anew.

The hash is `RunSpec.spec_hash()` of the workflow's input spec, which the workflow passes
unchanged to each continue-as-new; sweep trials and the swept parameters never change it
(trials are runs of their own ids, the best parameters are applied to a copy). A run
directory from before claims existed (no RUN.json) counts as claimed by the spec hash its
`run_started` event recorded, or by an unknown spec when there is none.
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog

from common.errors import BadConfig, BadData, StorageUnavailable
from common.store_json import field_str, load_record
from storage.events import read_events
from storage.fs import is_unavailable, join, put_new, resolve, storage_errors

log = structlog.get_logger(__name__)

RUN_FILE = "RUN.json"
RESUME_FIX = ("to resume it, start it again with the same spec; to start a new run, "
              "pick a new run_id")
UNKNOWN = "unknown (a run from before run claims, or a sweep trial's)"


def claim_run(durable_url: str, run_id: str, spec_hash: str, spec_json: dict[str, Any]) -> str:
    """Claim `run_id` in the store for the spec with `spec_hash`: "created" when the id was
    free, "resumed" when it is already this spec's; BadConfig when another spec has it."""
    fs, root = resolve(durable_url)
    path = join(root, "runs", run_id, RUN_FILE)
    found = check_claim(durable_url, run_id, spec_hash)
    if found == "claimed":
        return "resumed"
    blob = json.dumps({"run_id": run_id, "spec_hash": spec_hash, "created": time.time(),
                       "adopted": found == "adopt", "spec": spec_json}, sort_keys=True)
    try:
        put_new(fs, path, blob.encode())
    except FileExistsError:  # another start claimed it between our read and our write
        check_claim(durable_url, run_id, spec_hash)
        return "resumed"
    except (OSError, *storage_errors()) as exc:
        raise _storage_error(durable_url, run_id, exc) from exc
    log.info("run_claimed", run_id=run_id, spec_hash=spec_hash, durable=durable_url,
             adopted=found == "adopt")
    return "resumed" if found == "adopt" else "created"


def check_claim(durable_url: str, run_id: str, spec_hash: str) -> str:
    """Read-only: "free" (no claim, no data), "claimed" (RUN.json with this hash), "adopt"
    (a pre-claim run directory of this spec: it may be claimed); BadConfig when the id
    belongs to another spec. The CLI calls this before it starts a run."""
    owner = claim_owner(durable_url, run_id)
    if owner is None:
        return "free"
    kind, old_hash = owner
    if old_hash != spec_hash:
        raise BadConfig("run_id", f"run {run_id} already exists in {durable_url} with spec "
                                  f"{old_hash}; this spec is {spec_hash}", RESUME_FIX)
    return "claimed" if kind == "claim" else "adopt"


def claim_owner(durable_url: str, run_id: str) -> tuple[str, str] | None:
    """("claim", hash) from RUN.json, ("legacy", hash) for a run directory without one,
    or None when the store has nothing under runs/<run_id>/."""
    fs, root = resolve(durable_url)
    directory = join(root, "runs", run_id)
    path = join(directory, RUN_FILE)
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raw = None
    except (OSError, *storage_errors()) as exc:
        raise _storage_error(durable_url, run_id, exc) from exc
    if raw is not None:
        return "claim", _claimed_hash(raw, path, run_id)
    try:
        entries = fs.ls(directory, detail=False)
    except FileNotFoundError:
        entries = []
    except (OSError, *storage_errors()) as exc:
        raise _storage_error(durable_url, run_id, exc) from exc
    if not entries:
        return None
    started = read_events(durable_url, run_id, ("run_started",))
    hashes = [e["payload"].get("spec_hash") for e in started if e.get("payload")]
    return "legacy", next((h for h in hashes if isinstance(h, str) and h), UNKNOWN)


def _claimed_hash(raw: bytes, path: str, run_id: str) -> str:
    try:
        value = field_str(load_record(raw, path), "spec_hash", path, max_len=256)
    except ValueError:  # StoreRecordInvalid: not an object, too deep, no string hash
        value = None
    if not value:
        raise BadData(path, "is not a run claim (no spec_hash)",
                      f"remove it if no run uses run id {run_id}, or pick a new run_id")
    return value


def _storage_error(durable_url: str, run_id: str, exc: BaseException) -> Exception:
    if is_unavailable(exc):
        return StorageUnavailable(durable_url, str(exc))
    return BadConfig("storage.durable", f"cannot claim run {run_id} in {durable_url}: {exc}",
                     "make the durable store readable and writable by every worker")


def stored_spec(durable_url: str, run_id: str) -> dict[str, Any] | None:
    """The spec the run's claim stored (RUN.json), as JSON; None for a run without one, or
    whose claim does not read (logged): a report or a check then goes on without it."""
    fs, root = resolve(durable_url)
    path = join(root, "runs", run_id, RUN_FILE)
    try:
        spec = load_record(fs.cat_file(path), path).get("spec")
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as exc:  # ValueError: StoreRecordInvalid
        log.warning("run_spec_unreadable", path=path, error=str(exc)[:200])
        return None
    return spec if isinstance(spec, dict) else None
