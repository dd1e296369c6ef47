"""Data-prep throughput on the standard-library corpus, with 1 and with every worker process.

    .venv/bin/python benchmarks/dataprep.py [--workers 1,0] [--corpus stdlib:**/*.py]
                                            [--max-documents 3000]

Prints one JSON line per worker count:
{"figure": "dataprep_mb_per_s", "value": input MB / wall s, "docs_in", "exact_dups",
 "near_dups", "tokens_out", "per_phase_s": {...}, "workers": N, ...}.
`workers=1` uses one core throughout (tokenizers included); `cpu_s` sums the CPU seconds
of the parallel phases over every process, and `load_avg_1m` is the machine's load
before the run (on a shared machine, Linux autogroup gives this whole benchmark one
session's share of the CPUs, however many processes it starts).
Each run writes to a fresh temporary store, so none is a cache hit; a final line times
the cache hit of the last run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import structlog

from dataprep.pipeline import prepare_dataset
from spec import DataConfig, TokenizerConfig


def run_once(data: DataConfig, store: str) -> dict:
    load = os.getloadavg()[0]  # the machine may be shared: a busy one slows every figure
    start = time.perf_counter()
    _, man, hit = prepare_dataset(data, store, seed=0)
    wall = time.perf_counter() - start
    s = man.stats
    return {"figure": "dataprep_mb_per_s", "value": round(s["bytes_in"] / wall / 1e6, 3),
            "docs_in": s["docs_in"], "exact_dups": s["exact_dups"], "near_dups": s["near_dups"],
            "docs_out": s["docs_out"], "tokens_out": man.tokens("train") + man.tokens("val"),
            "bytes_in": s["bytes_in"], "wall_s": round(wall, 3),
            "per_phase_s": {k: v for k, v in s["seconds"].items() if k != "total"},
            "cpu_s": s["cpu_seconds"], "workers": s["workers"], "units": s["resume"]["units"],
            "cache_hit": hit, "load_avg_1m": round(load, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default="stdlib:**/*.py")
    parser.add_argument("--max-documents", type=int, default=3000)
    parser.add_argument("--workers", default="1,0", help="comma list; 0 = every core")
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory(prefix="bench-dataprep-") as tmp:
        for i, workers in enumerate(int(w) for w in args.workers.split(",")):
            data = DataConfig(corpus=args.corpus, max_documents=args.max_documents,
                              workers=workers,
                              tokenizer=TokenizerConfig(vocab_size=args.vocab_size))
            store = os.path.join(tmp, f"store-{i}")
            print(json.dumps(run_once(data, store)), flush=True)
        start = time.perf_counter()
        _, _, hit = prepare_dataset(data, store, seed=0)
        print(json.dumps({"figure": "dataprep_cache_hit_s",
                          "value": round(time.perf_counter() - start, 4), "cache_hit": hit}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
