"""Integrity of what the store reads and writes: malformed manifests
and event lines fall back instead of raising, manifest file names cannot leave the restore
directory, commits are fsynced and renamed into place, and a second writer of a committed
step changes no byte of it. file:// and real SeaweedFS s3:// where both apply."""

from __future__ import annotations

import hashlib
import json
import os
import threading

import pytest

from ops.report import timeline
from storage import checkpoints
from storage.checkpoints import MANIFEST, CheckpointManifest, CheckpointStore, CorruptCheckpoint
from storage.dataset import DatasetManifest, commit_manifest
from storage.events import EventLog, merge, read_events
from storage.fs import resolve
from tests.storage.ckpt_helpers import (
    durable,
    payload,
    save,
    small_disk,
    tiered,
    write_files,
)

__all__ = ["durable", "small_disk"]  # fixtures


def committed_pair(durable: str, tmp_path) -> CheckpointStore:
    store = CheckpointStore(durable, "r")
    store.commit(1, write_files(tmp_path / "s1", payload(1)))
    store.commit(2, write_files(tmp_path / "s2", payload(2)))
    return store


def good_manifest(store: CheckpointStore, step: int) -> dict:
    return json.loads(store.fs.cat_file(store.path(step, MANIFEST)))


def with_step(raw: dict, step: int) -> dict:
    return {**raw, "step": step}


def with_entry(raw: dict, name: str, entry: object) -> dict:
    return {**raw, "files": {**raw["files"], name: entry}}


# Each turns step 2's good manifest (a dict) into bytes a reader must refuse.
BAD_MANIFESTS = {
    "empty": lambda raw: b"",
    "torn": lambda raw: json.dumps(raw).encode()[:40],
    "not_utf8": lambda raw: b"\xff\xfe{",
    "a_list": lambda raw: b"[]",
    "no_files": lambda raw: json.dumps({"step": 2}).encode(),
    "size_is_text": lambda raw: json.dumps(with_entry(raw, "train_state-rank0.pt", {
        "size": "9", "sha256": "0" * 64})).encode(),
    "entry_not_object": lambda raw: json.dumps(with_entry(raw, "train_state-rank0.pt", 7)).encode(),
    "skip_ranges_bad": lambda raw: json.dumps({**raw, "skip_ranges": [[1]]}).encode(),
    "other_step": lambda raw: json.dumps(with_step(raw, 7)).encode(),
}


@pytest.mark.parametrize("damage", sorted(BAD_MANIFESTS))
def test_malformed_manifest_is_a_corrupt_checkpoint_that_every_reader_falls_back_past(
        durable, tmp_path, damage):
    store = committed_pair(durable, tmp_path)
    store.fs.pipe_file(store.path(2, MANIFEST), BAD_MANIFESTS[damage](good_manifest(store, 2)))
    with pytest.raises(CorruptCheckpoint) as bad:
        store.manifest(2)
    assert (bad.value.step, bad.value.file) == (2, MANIFEST)
    assert [(p.step, p.file) for p in store.verify(2)] == [(2, MANIFEST)]
    with pytest.raises(CorruptCheckpoint):
        store.fetch(2, str(tmp_path / "direct"))
    seen: list[CorruptCheckpoint] = []
    assert store.fetch_latest(str(tmp_path / "restore"), on_corrupt=seen.append).step == 1
    assert [(c.step, c.file) for c in seen] == [(2, MANIFEST)]
    with pytest.raises(CorruptCheckpoint):
        store.promote(2)
    store.delete(2)  # a corrupt manifest does not stop its step from being removed
    assert store.list_committed() == [1]
    assert not any(store.fs.exists(store.path(2, n)) for n in payload(2))


def test_committing_a_step_again_over_its_corrupt_manifest_replaces_it(durable, tmp_path):
    store = committed_pair(durable, tmp_path)  # a replay after the fallback commits 2 again
    store.fs.pipe_file(store.path(2, MANIFEST), b"{")
    man = store.commit(2, write_files(tmp_path / "again", payload(2)), writer="replay")
    assert store.manifest(2) == man and man.writer == "replay"
    assert store.verify(2) == [] and store.fetch_latest(str(tmp_path / "restore")).step == 2


@pytest.mark.process
def test_tiered_resume_skips_a_step_whose_manifest_is_corrupt_on_both_tiers(tmp_path):
    durable, fast_dir = str(tmp_path / "durable"), tmp_path / "fast"
    ckpt = tiered(durable, fast_dir)
    save(ckpt, 1)
    save(ckpt, 2)
    ckpt.drain()
    ckpt.close()
    stores = [CheckpointStore(durable, "r"), CheckpointStore.local(str(fast_dir))]
    for store in stores:
        assert 2 in store.list_committed()
        store.fs.pipe_file(store.path(2, MANIFEST), b'{"step": 2, "files": ')
    corrupt: list[CorruptCheckpoint] = []
    again = tiered(durable, fast_dir)
    man, _, _ = again.resume(str(tmp_path / "restore"), None, on_corrupt=corrupt.append)
    again.close()
    assert man.step == 1
    assert [(c.step, c.file) for c in corrupt] == [(2, MANIFEST)] * 2  # fast, then durable


@pytest.mark.process
def test_resume_from_the_fast_tier_uploads_what_it_can_past_an_older_corrupt_manifest(tmp_path):
    durable, fast = str(tmp_path / "durable"), CheckpointStore.local(str(tmp_path / "fast"))
    for step in (1, 2):  # both committed locally only (the durable tier never got them)
        write_files(fast.path(step), payload(step))
        fast.commit_in_place(step, parent=step - 1 or None)
    fast.fs.pipe_file(fast.path(1, MANIFEST), b"")
    ckpt = tiered(durable, tmp_path / "fast")
    man, _, tier = ckpt.resume(str(tmp_path / "restore"), None)
    ckpt.drain()
    ckpt.close()
    assert (man.step, tier) == (2, "fast")
    assert CheckpointStore(durable, "r").list_committed() == [2]


# ---- manifest file names ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["/etc/cron.d/x.pt", "../mp_rank_00_model_states.pt",
                                  "ok/../../x.pt", "a//mp_rank_00_model_states.pt",
                                  "sub\\mp_rank_00_model_states.pt", "mp_rank_00\x00.pt",
                                  MANIFEST, "run.sh", "", "./train_state-rank0.pt"])
def test_manifest_naming_a_file_the_trainer_does_not_write_is_corrupt(name):
    raw = {"step": 4, "files": {name: {"size": 1, "sha256": "a" * 64}}}
    with pytest.raises(CorruptCheckpoint) as bad:
        CheckpointManifest.from_json(json.dumps(raw), step=4)
    assert (bad.value.step, bad.value.file) == (4, MANIFEST)


def test_every_name_a_real_deepspeed_checkpoint_holds_is_allowed():
    names = ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
             "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt", "train_state-rank3.pt"]
    raw = {"step": 4, "files": {n: {"size": 1, "sha256": "a" * 64} for n in names}}
    assert sorted(CheckpointManifest.from_json(json.dumps(raw), step=4).files) == sorted(names)


@pytest.mark.parametrize("escape", ["absolute", "dotdot"])
def test_fetch_never_writes_outside_its_restore_directory(tmp_path, escape):
    store = committed_pair(str(tmp_path / "durable"), tmp_path)
    outside = tmp_path / "outside" / "mp_rank_00_model_states.pt"
    restore = tmp_path / "restore"
    # The name the bucket's owner chose, and where the old fetch wrote it:
    name = str(outside) if escape == "absolute" else "../mp_rank_00_model_states.pt"
    target = outside if escape == "absolute" else restore / "mp_rank_00_model_states.pt"
    body = b"planted"
    store.fs.makedirs(os.path.dirname(store.path(2, name)), exist_ok=True)
    store.fs.pipe_file(store.path(2, name), body)  # the object exists, so its hash matches
    raw = good_manifest(store, 2)
    raw["files"][name] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    store.fs.pipe_file(store.path(2, MANIFEST), json.dumps(raw).encode())
    seen: list[CorruptCheckpoint] = []
    assert store.fetch_latest(str(restore), on_corrupt=seen.append).step == 1
    assert [(c.step, c.file) for c in seen] == [(2, MANIFEST)]
    assert not target.exists() and not outside.exists()


# ---- durability on file:// --------------------------------------------------------------------
def fsync_trace(monkeypatch) -> list[tuple[str, str]]:
    """Record, in order, every fsync (of the path behind the fd) and every rename/link."""
    trace: list[tuple[str, str]] = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd):
        trace.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        trace.append(("rename", str(dst)))
        return real_replace(src, dst, **kw)

    def link(src, dst, **kw):
        trace.append(("link", str(dst)))
        return real_link(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    return trace


def assert_durable(trace: list[tuple[str, str]], path: str, how: str = "rename") -> None:
    """`path` came from an fsynced temporary name, and its directory was fsynced after."""
    at = trace.index((how, path))
    directory = os.path.dirname(path)
    before = [p for op, p in trace[:at] if op == "fsync"]
    assert any(os.path.dirname(p) == directory and os.path.basename(p).startswith(
        f".{os.path.basename(path)}.") for p in before), (path, trace)
    assert ("fsync", directory) in trace[at + 1:], (path, trace)


def test_commit_and_promote_on_disk_fsync_every_file_rename_it_and_fsync_the_directory(
        tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path / "durable"), "r")
    local = write_files(tmp_path / "s1", payload(1))
    trace = fsync_trace(monkeypatch)
    store.commit(1, local)
    for name in payload(1):
        assert_durable(trace, store.path(1, name))
    assert_durable(trace, store.path(1, MANIFEST), how="link")
    assert trace.index(("link", store.path(1, MANIFEST))) > max(
        trace.index(("rename", store.path(1, n))) for n in payload(1))  # manifest last
    trace.clear()
    store.promote(1)
    for name in [*payload(1)]:
        assert_durable(trace, store.promoted_path(1, name))
    assert_durable(trace, store.promoted_path(1, MANIFEST), how="link")


def test_dataset_manifest_write_is_fsynced_and_renamed_into_place(tmp_path, monkeypatch):
    fs, directory = resolve(str(tmp_path / "dataset"))
    fs.makedirs(directory, exist_ok=True)
    trace = fsync_trace(monkeypatch)
    commit_manifest(fs, directory, DatasetManifest(content_hash="h", vocab_size=8, eos_id=7,
                                                   dtype="uint16"))
    assert_durable(trace, os.path.join(directory, "MANIFEST.json"))


@pytest.mark.process
def test_dataset_manifest_write_cut_short_by_a_full_disk_leaves_no_manifest(small_disk):
    fs, directory = resolve(str(small_disk / "dataset"))
    fs.makedirs(directory, exist_ok=True)
    with open(small_disk / "filler", "wb") as f:  # leave less room than the manifest needs
        try:
            f.write(b"\0" * (2 << 20))
        except OSError:
            pass
    big = DatasetManifest(content_hash="h", vocab_size=8, eos_id=7, dtype="uint16",
                          stats={"notes": "x" * (256 << 10)})
    with pytest.raises(OSError):
        commit_manifest(fs, directory, big)
    # A zero-length or torn MANIFEST.json here would be read as a cache hit forever after.
    assert os.listdir(directory) == []


# ---- a second writer of a committed step -------------------------------------------------------
def test_a_second_writer_racing_a_commit_never_changes_a_committed_byte(
        durable, tmp_path, monkeypatch):
    """B has uploaded one file of step 3 when A commits step 3 whole; B then goes on. On disk
    B holds the step's commit lock (A waits, then finds B's commit); on S3 B sees A's
    manifest before its next PUT. Either way the committed manifest matches the bytes."""
    store = CheckpointStore(durable, "r")
    mine_a = write_files(tmp_path / "a", payload(3))
    theirs_b = write_files(tmp_path / "b", {n: b"B" + d for n, d in payload(3).items()})
    b_started, a_done = threading.Event(), threading.Event()
    real_put = checkpoints.put_file_durable

    def put(fs, local, dest):
        real_put(fs, local, dest)
        if threading.current_thread().name == "writer-b" and not b_started.is_set():
            b_started.set()
            a_done.wait(timeout=3)  # on disk A is blocked behind B's lock: go on after 3 s

    monkeypatch.setattr(checkpoints, "put_file_durable", put)
    got: dict[str, CheckpointManifest] = {}
    b = threading.Thread(target=lambda: got.update(b=store.commit(3, theirs_b, writer="b")),
                         name="writer-b")
    b.start()
    assert b_started.wait(timeout=30)
    got["a"] = store.commit(3, mine_a, writer="a")
    a_done.set()
    b.join(timeout=30)
    assert got["a"] == got["b"]  # one commit; the other writer got it back, untouched
    assert store.manifest(3) == got["a"] and store.verify(3) == []


# ---- the event log ------------------------------------------------------------------------------
def test_event_lines_that_are_not_events_are_skipped_and_reported_once_as_damage(tmp_path):
    url = str(tmp_path / "store")
    with EventLog(url, "r", "w") as log:
        log.emit("fault", step=3, event_id="f3", kind_of="kill")
    fs, root = resolve(url)
    good = json.loads(fs.cat_file(fs.ls(f"{root}/runs/r/events")[0]).decode())
    bad_lines = [json.dumps({k: v for k, v in good.items() if k != "event_id"}),
                 json.dumps([1, 2]), json.dumps({**good, "event_id": "x", "ts": None}),
                 json.dumps({**good, "event_id": "y", "payload": "text"}), '{"event_id": "z", ']
    body = "\n".join([json.dumps({**good, "event_id": "ok2", "ts": good["ts"] + 1}),
                      *bad_lines]) + "\n"
    fs.pipe_file(f"{root}/runs/r/events/old-writer-000000.jsonl", body.encode() + b"\xff\n")
    events = read_events(url, "r")
    assert sorted(e["event_id"] for e in events) == [
        "event_log_damaged/old-writer-000000.jsonl", "f3", "ok2"]
    damage = next(e for e in events if e["kind"] == "event_log_damaged")
    assert damage["kind"] == "event_log_damaged" and damage["ts"] == good["ts"] + 1
    assert damage["payload"]["lines_skipped"] == len(bad_lines) + 1
    assert damage["payload"]["example"] == bad_lines[0][:200]
    assert read_events(url, "r") == events  # the same answer on every read
    assert sorted(r["kind"] for r in timeline(events)) == ["event_log_damaged", "fault", "fault"]
    assert merge([events, events]) == events
