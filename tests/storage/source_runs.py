"""A source run in a store, as `train.init_from` and `distill.teacher` find one: claimed with
its spec (RUN.json), its dataset under the store's `datasets/<hash>/` named by its
`dataset_ready` event, and promoted steps 4 and 8 (manifests only: the checks read no
weights). Shared by the init_from and teacher tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spec import RunSpec
from storage.events import EventLog
from storage.runs import claim_run

MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 32}
SOURCE_HASH = "0123456789abcdef"  # the source run's dataset's content hash


def dataset(root: Path, tokenizer: str, vocab: int = 512) -> str:
    """A dataset manifest (no shards) and its tokenizer file under `root`; its URI."""
    root.mkdir(parents=True)
    (root / "tokenizer.json").write_text(tokenizer)
    (root / "MANIFEST.json").write_text(json.dumps({
        "content_hash": root.name, "vocab_size": vocab, "eos_id": vocab - 1,
        "dtype": "uint16", "tokenizer": "tokenizer.json", "shards": [], "stats": {}}))
    return f"file://{root}/MANIFEST.json"


def source_store(tmp_path: Path, payload: dict[str, Any] | None = None) -> str:
    """Run `base` (MODEL, tokenizer A) with steps 4 and 8 promoted; `payload`: its
    `dataset_ready` event's (default: the content hash of its dataset in this store)."""
    url = f"file://{tmp_path}/store"
    base = RunSpec.from_dict({"run_id": "base", "model": MODEL,
                              "train": {"micro_batch_tokens": 128}})
    claim_run(url, "base", base.spec_hash(), base.to_dict())
    uri = dataset(tmp_path / "store" / "datasets" / SOURCE_HASH, "tokenizer A")
    if payload is None:
        payload = {"uri": uri, "content_hash": SOURCE_HASH}
    with EventLog(url, "base", "data") as events:
        events.emit("dataset_ready", event_id="dataset_ready/a", vocab_size=512, **payload)
    for step in (4, 8):
        promoted = tmp_path / "store" / "runs" / "base" / "promoted" / f"step-{step:09d}"
        promoted.mkdir(parents=True)
        (promoted / "MANIFEST.json").write_text("{}")
    return url
