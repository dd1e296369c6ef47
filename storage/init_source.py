"""A run that starts from another run's promoted checkpoint (`train.init_from`): where that
checkpoint is, and whether this run's model and vocabulary fit it — decided from the
durable store alone. The data worker checks it once the dataset is ready, before any
accelerator is used (activities/data.py); the trainer that loads the weights reads the
same source (trainer/init_from.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from common.errors import BadConfig, BadData
from common.store_json import StoreRecordInvalid, field_str
from spec import RunSpec
from spec.train import init_source
from storage.checkpoints import CheckpointStore
from storage.dataset import DatasetManifest, load_manifest, manifest_url
from storage.events import events_root, read_events
from storage.fs import join, resolve, sha256_file
from storage.runs import stored_spec

FIELD = "train.init_from"
# what the weights' shapes and meaning depend on (seq_len does not: RoPE is computed)
ARCHITECTURE = ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_mult", "tie_embeddings")
# A dataset's content hash as data prep makes it (dataprep/inputs.py: sha256 hex, cut to 16);
# up to a whole digest, and nothing else: it becomes a directory name in the store.
CONTENT_HASH = re.compile(r"[0-9a-f]{16,64}")


@dataclass(frozen=True)
class InitSource:
    """The promoted checkpoint a run starts from: its run, step and store."""

    run_id: str
    step: int
    store: CheckpointStore  # promoted/ of the source run: its step directories and manifests

    @property
    def uri(self) -> str:
        return self.store.fs.unstrip_protocol(self.store.path(self.step))

    def lineage(self) -> dict[str, Any]:
        """The `initialized_from` event's payload: which run and step, and where."""
        return {"source_run": self.run_id, "source_step": self.step, "uri": self.uri}


def promoted_source(durable_url: str, init_from: str) -> InitSource:
    """The promoted checkpoint `init_from` names in this durable store; BadConfig when the
    run has none, or not that step."""
    run_id, step = init_source(init_from)
    runs = CheckpointStore(durable_url, run_id)
    store = CheckpointStore.at(durable_url, runs.promoted_path(0).rsplit("/", 1)[0])
    promoted = store.list_committed()  # a promoted step's manifest is written last
    if not promoted:
        raise BadConfig(FIELD, f"run {run_id} has no promoted checkpoint in {durable_url}",
                        "name a run that finished (it promotes its best checkpoint), or "
                        "leave init_from empty to start from scratch")
    if step is None:
        step = promoted[-1]
    elif step not in promoted:
        raise BadConfig(FIELD, f"run {run_id} has no promoted checkpoint at step {step}",
                        f"choose one of its promoted steps: {promoted}")
    return InitSource(run_id, step, store)


def source_dataset(durable_url: str, run_id: str, field: str = FIELD,
                   who: str = "the source") -> tuple[str, DatasetManifest] | None:
    """The dataset run `run_id` trained on: the content hash its newest `dataset_ready` event
    names, read from this store's `datasets/<hash>/` (storage/dataset.py) — never from the
    event's `uri`. The event is store data, not an address: a `uri` there could name an
    internal endpoint or `/dev/zero`, and the worker would open it. None for a run with no
    recorded dataset; BadData naming the run and the event's field when the event is not
    one data prep writes (the same on every retry)."""
    ready = read_events(durable_url, run_id, ("dataset_ready",))
    if not ready:
        return None
    content_hash = dataset_hash(ready[-1].get("payload"), durable_url, run_id, field, who)
    url = manifest_url(durable_url, content_hash)
    try:
        return url, load_manifest(url)
    except BadData as exc:
        raise BadData(url, f"run {run_id}, {who} ({field}), trained on dataset {content_hash}, "
                      f"which cannot be read: {exc.problem}", "prepare that run's data again "
                      f"(the same data section in this store), or name another run in {field}"
                      ) from None


def dataset_hash(payload: Any, durable_url: str, run_id: str, field: str, who: str) -> str:
    """Pure: the content hash a `dataset_ready` event's payload names, checked as a hash
    (it becomes a path in the store); BadData naming run, event and field otherwise."""
    try:
        content_hash = field_str(payload if isinstance(payload, dict) else {}, "content_hash",
                                 "dataset_ready.payload", max_len=64)
        if not CONTENT_HASH.fullmatch(content_hash):
            raise StoreRecordInvalid("dataset_ready.payload.content_hash",
                                     f"{content_hash[:80]!r} is not a dataset's content hash")
    except StoreRecordInvalid as exc:
        raise BadData(events_root(durable_url, run_id), f"run {run_id}, {who} ({field}): its "
                      f"dataset_ready event is malformed: {exc}", "name a run whose data this "
                      "store prepared, or leave the field empty") from None
    return content_hash


def tokenizer_sha(manifest_uri: str, manifest: DatasetManifest) -> str:
    """The dataset's tokenizer file's sha256 ('' for a dataset without one)."""
    fs, path = resolve(manifest_uri)
    try:
        return sha256_file(fs, join(path.rsplit("/", 1)[0], manifest.tokenizer))[0]
    except FileNotFoundError:
        return ""


def architecture_problem(source: dict[str, Any], ours: dict[str, Any]) -> str:
    """Pure: how this run's model section differs from the source's in what the weights
    depend on ('' when it does not)."""
    diffs = [f"{k} {source.get(k)!r} there, {ours.get(k)!r} here" for k in ARCHITECTURE
             if source.get(k) != ours.get(k)]
    return "; ".join(diffs)


def check_fit(spec: RunSpec, manifest_uri: str, manifest: DatasetManifest) -> InitSource:
    """This run's model and dataset against its `init_from` source: BadConfig naming both
    when the model's shape or the vocabulary (size and tokenizer) differs."""
    durable = spec.storage.durable
    source = promoted_source(durable, spec.train.init_from)
    theirs = stored_spec(durable, source.run_id)
    if theirs is not None:
        problem = architecture_problem(theirs.get("model") or {}, spec.to_dict()["model"])
        if problem:
            raise BadConfig(FIELD, f"run {source.run_id}'s model does not fit this run's: "
                            f"{problem}", f"set model.* as run {source.run_id} has them, or "
                            "start from scratch")
    check_tokenizer(durable, source.run_id, manifest_uri, manifest, FIELD, "the source")
    return source


def check_tokenizer(durable: str, run_id: str, manifest_uri: str, manifest: DatasetManifest,
                    field: str, who: str) -> None:
    """BadConfig naming `field` and both vocabularies when run `run_id` (`who`: the source,
    the teacher) trained with another tokenizer than this dataset's: the same size is not
    enough, the same ids must mean the same text. Nothing to check for a run with no
    recorded dataset."""
    data = source_dataset(durable, run_id, field, who)
    if data is None:
        return
    their_uri, their_manifest = data
    if their_manifest.vocab_size != manifest.vocab_size or \
            tokenizer_sha(their_uri, their_manifest) != tokenizer_sha(manifest_uri, manifest):
        tokenizer = join(their_uri.rsplit("/", 1)[0], their_manifest.tokenizer)
        raise BadConfig(field, f"run {run_id}, {who}, was trained with another tokenizer "
                        f"(vocabulary {their_manifest.vocab_size} there, "
                        f"{manifest.vocab_size} here)",
                        f"set data.tokenizer.path to {tokenizer}, {who}'s tokenizer")
