"""Where a spec's relative paths point: one place for every process that reads the spec.

A spec names local paths (`storage.durable` when it is not a URL, `storage.fast`,
`data.corpus`, `data.tokenizer.path`, `data.quarantine[]`, `faults[].path`). Read as
written, a relative one resolves against the working directory of whichever process opens
it — the data worker, a trainer worker, a trainer child running in its segment's
directory — so one spec meant several places (seen: a run started with `temporal workflow
start` and the docs' example prepared its dataset under the data worker's directory and
failed in the sweep's first trial, whose trainer child looked under its own). `anchor`
makes every such path absolute under one root, once, before any of them reads it:

- `mainspring run start` anchors at the client's working directory (ops/client.py:localize);
- a spec that reaches TrainingRun still relative (the Temporal CLI or UI, any SDK client)
  is anchored by the workflow at the orchestrator worker's root
  (`mainspring worker --spec-root DIR`, default the directory the worker was started in),
  read through a local activity so the choice is in the run's history
  (workflows/start.py:anchor_paths);
- `~` means the home of whichever process expands it: the client expands it, the workflow
  refuses it (BadConfig naming the fix).

A bare `storage.durable` becomes a `file://` URL and a URL loses a trailing `/`, as
storage/fs.py:normalize_url reads them, so a spec anchored by either path has one hash
(spec_hash, RUN.json). Pure and stdlib only (posixpath): the workflow sandbox imports it.
"""

from __future__ import annotations

import posixpath
from typing import Any

from common.errors import BadConfig
from spec.codec import deep_merge
from spec.run import RunSpec

STDLIB_PREFIX = "stdlib:"


def anchor(spec: RunSpec, root: str, home: str = "") -> RunSpec:
    """`spec` with every local path absolute: relative ones under `root` (absolute), `~`
    under `home` (refused when home is empty). URLs and `stdlib:` corpora are left."""
    changes = _changes(spec, root, home)
    return RunSpec.from_dict(deep_merge(spec.to_dict(), changes)) if changes else spec


def anchor_raw(raw: dict[str, Any], spec: RunSpec, root: str, home: str = "") -> dict[str, Any]:
    """The same change on the JSON object `spec` was read from (RunSpec.from_dict(raw)),
    keeping the rest of it as it was written."""
    changes = _changes(spec, root, home)
    if "faults" in changes:  # the entries as written, each with its path anchored
        changes["faults"] = [{**entry, "path": f["path"]} for entry, f
                             in zip(raw.get("faults") or [], changes["faults"])]
    return deep_merge(raw, changes)


def unanchored(spec: RunSpec) -> list[str]:
    """The fields `anchor` would change (relative or `~` paths, a bare or `/`-ended
    durable location), in spec order; empty when the spec is anchored already."""
    fields = []
    for name, value, kind in _paths(spec):
        try:
            if _anchored(value, kind, "/", "/", name) != value:
                fields.append(name)
        except BadConfig:
            fields.append(name)
    return fields


def needs_root(spec: RunSpec) -> bool:
    """True when a path is relative, so that `anchor`'s result depends on its root."""
    return any(_is_relative(value, kind) for _, value, kind in _paths(spec))


def _paths(spec: RunSpec) -> list[tuple[str, str, str]]:
    """(dotted field, value, kind) of every path field; kind: durable | local | input."""
    out = [("storage.durable", spec.storage.durable, "durable"),
           ("storage.fast", spec.storage.fast, "local"),
           ("data.corpus", spec.data.corpus, "input"),
           ("data.tokenizer.path", spec.data.tokenizer.path, "input")]
    out += [(f"data.quarantine[{i}]", q, "input") for i, q in enumerate(spec.data.quarantine)]
    out += [(f"faults[{i}].path", f.path, "local") for i, f in enumerate(spec.faults)]
    return out


def _changes(spec: RunSpec, root: str, home: str) -> dict[str, Any]:
    if not posixpath.isabs(root):
        raise ValueError(f"the root relative paths are anchored at must be absolute: {root!r}")
    new = {name: _anchored(value, kind, root, home, name) for name, value, kind in _paths(spec)}
    changes: dict[str, Any] = {}
    for section, key in (("storage", "durable"), ("storage", "fast"), ("data", "corpus")):
        if new[f"{section}.{key}"] != getattr(getattr(spec, section), key):
            changes.setdefault(section, {})[key] = new[f"{section}.{key}"]
    if new["data.tokenizer.path"] != spec.data.tokenizer.path:
        changes.setdefault("data", {})["tokenizer"] = {"path": new["data.tokenizer.path"]}
    quarantine = [new[f"data.quarantine[{i}]"] for i in range(len(spec.data.quarantine))]
    if quarantine != list(spec.data.quarantine):
        changes.setdefault("data", {})["quarantine"] = quarantine
    faults = [new[f"faults[{i}].path"] for i in range(len(spec.faults))]
    if faults != [f.path for f in spec.faults]:
        changes["faults"] = [{**f, "path": p} for f, p in zip(spec.to_dict()["faults"], faults)]
    return changes


def _is_relative(value: str, kind: str) -> bool:
    if not value or "://" in value or (kind == "input" and value.startswith(STDLIB_PREFIX)):
        return False
    return not posixpath.isabs(value)


def _anchored(value: str, kind: str, root: str, home: str, name: str) -> str:
    if kind == "durable" and "://" in value:
        return value.rstrip("/")  # as storage/fs.py:normalize_url reads it
    if not _is_relative(value, kind):  # absolute (or empty, a URL, stdlib:)
        if kind == "input" or not value:
            return value
        path = posixpath.normpath(value)  # as os.path.abspath did for these two
        return "file://" + path if kind == "durable" else path
    if value.startswith("~"):
        if not home or not (value == "~" or value.startswith("~/")):
            raise BadConfig(name, f"{value!r} starts with '~', the home directory of "
                                  "whichever process reads it",
                            "give an absolute path, or start the run with `mainspring run "
                            "start`, which expands '~/' where you type it")
        value = home + value[1:]
    path = posixpath.normpath(posixpath.join(root, value))
    return "file://" + path if kind == "durable" else path
