"""Size of the document index (storage.provenance) per million documents.

    .venv/bin/python benchmarks/provenance_size.py [--docs 20000] [--files 20]
                                                   [--shard-tokens 1048576] [--corpus URL]

Synthesizes a jsonl corpus in a temporary directory (`--files` files of short documents:
lines of Zipf-distributed words from a 5,000-word vocabulary, now and then a repeated
line, so the quality figures vary as they do on real text) and runs the real `prepare_dataset` on it with one
worker; `--corpus` measures an existing corpus instead (e.g. `stdlib:**/*.py`, where
every file is its own document). Prints one JSON line:
{"figure": "provenance_bytes_per_million_docs", "value": index bytes / kept documents *
 1e6, "index_bytes", "docs_out", "shards", "bytes_per_doc", "token_bytes_per_doc",
 "index_vs_tokens", "column_bytes": {column: deflated bytes, summed over shards}, ...}.
The 16-byte hash does not deflate at all; the float32 figures deflate a little.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import structlog

from dataprep.pipeline import prepare_dataset
from spec import CleaningConfig, DataConfig, TokenizerConfig
from storage.dataset import dataset_dir

VOCABULARY = 5000


def synthesize(directory: str, docs: int, files: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    words = [f"w{k}{'abcdefgh'[k % 8]}" for k in range(VOCABULARY)]
    zipf = 1 / np.arange(1, VOCABULARY + 1)  # word k has frequency ~ 1/k
    zipf /= zipf.sum()
    per_file = -(-docs // files)
    for f in range(files):
        with open(os.path.join(directory, f"part-{f:04d}.jsonl"), "w") as out:
            for _ in range(min(per_file, docs - f * per_file)):
                # Zipf-distributed words, as in natural text: n-grams repeat a little, so
                # the repetition figures vary from document to document as they would.
                lines = [" ".join(words[i] for i in rng.choice(VOCABULARY, rng.integers(8, 16),
                                                                p=zipf))
                         for _ in range(rng.integers(3, 12))]
                if len(lines) >= 7 and rng.random() < 0.5:
                    lines.append(lines[0])  # one repeated line in 8..12: kept by the filters
                out.write(json.dumps({"text": "\n".join(lines)}) + "\n")


def column_bytes(directory: str, names: list[str]) -> dict[str, int]:
    """Deflated bytes of each index column, summed over the shards."""
    sizes: dict[str, int] = {}
    for name in names:
        with zipfile.ZipFile(os.path.join(directory, name)) as z:
            for info in z.infolist():
                key = info.filename.removesuffix(".npy")
                sizes[key] = sizes.get(key, 0) + info.compress_size
    return dict(sorted(sizes.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--shard-tokens", type=int, default=1 << 20)
    parser.add_argument("--corpus", default="", help="measure this corpus instead")
    parser.add_argument("--max-documents", type=int, default=0)
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory(prefix="bench-provenance-") as tmp:
        corpus = args.corpus
        if not corpus:
            corpus = os.path.join(tmp, "corpus")
            os.makedirs(corpus)
            synthesize(corpus, args.docs, args.files)
        data = DataConfig(corpus=corpus, workers=1, shard_tokens=args.shard_tokens,
                          max_documents=args.max_documents,
                          cleaning=CleaningConfig(min_chars=16),
                          tokenizer=TokenizerConfig(vocab_size=2048))
        store = os.path.join(tmp, "store")
        start = time.perf_counter()
        _, man, _ = prepare_dataset(data, "file://" + store, seed=0)
        wall = time.perf_counter() - start
        out_dir = dataset_dir(store, man.content_hash)
        index_bytes = sum(os.path.getsize(os.path.join(out_dir, s.index_path))
                          for s in man.shards)
        token_bytes = sum(os.path.getsize(os.path.join(out_dir, s.path)) for s in man.shards)
        docs = man.stats["docs_out"]
        print(json.dumps({
            "figure": "provenance_bytes_per_million_docs",
            "value": round(index_bytes / docs * 1e6), "index_bytes": index_bytes,
            "docs_in": man.stats["docs_in"], "docs_out": docs, "shards": len(man.shards),
            "shard_tokens": args.shard_tokens, "bytes_per_doc": round(index_bytes / docs, 2),
            "token_bytes_per_doc": round(token_bytes / docs, 1),
            "index_vs_tokens": round(index_bytes / token_bytes, 4),
            "column_bytes": column_bytes(out_dir, [s.index_path for s in man.shards]),
            "corpus": args.corpus or f"synthetic jsonl, {args.docs} docs in {args.files} files",
            "prepare_s": round(wall, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
