"""Work units: the parallel, resumable part of data prep.

The input files are grouped, in path order, into units of about `data.unit_bytes`.
Each unit goes through two CPU-heavy jobs, each run in a worker *process*:
- clean: read (decompress, parse) → clean → filter → sha256 + MinHash signature;
- tokenize: encode the unit's surviving train and val documents.
The parent process writes every job's output into the dataset's work directory
(`datasets/<content_hash>/work/`) followed by a `.done` marker holding the outputs'
checksums. The content hash covers inputs and config, so a retry after a crash finds the
same work directory and redoes only units without a valid marker. Children only compute:
they never write to the durable tier, so a `memory://` store works too.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import structlog
from fsspec.spec import AbstractFileSystem
from tokenizers import Tokenizer

from ops.spec import DataConfig
from storage.dataprep_inputs import InputFile, read_file_documents
from storage.dataprep_minhash import permutations, shingles, signature
from storage.dataprep_text import Cleaned, clean_one
from storage.dataprep_tokens import encode_documents
from storage.fs import join, resolve

log = structlog.get_logger(__name__)

WORK = "work"


def plan_units(files: Sequence[InputFile], unit_bytes: int) -> list[tuple[InputFile, ...]]:
    """Consecutive groups of files of about `unit_bytes` each (a big file is its own unit)."""
    units: list[tuple[InputFile, ...]] = []
    current: list[InputFile] = []
    size = 0
    for f in files:
        if current and size + f.size > unit_bytes:
            units.append(tuple(current))
            current, size = [], 0
        current.append(f)
        size += f.size
    if current:
        units.append(tuple(current))
    return units


# Below this much input, `workers=0` (auto) stays in one process: starting a pool of
# spawned interpreters (~1 s each on a loaded 2-core machine) costs more than it saves.
AUTO_PARALLEL_MIN_BYTES = 8 << 20


def worker_count(data: DataConfig, units: int, input_bytes: int, corpus_url: str) -> int:
    """Processes to use: `data.workers` (0 = every core for a corpus of at least
    AUTO_PARALLEL_MIN_BYTES), never more than there are units.

    A `memory://` corpus lives in this process only, so it is read here.
    """
    if corpus_url.startswith("memory://"):
        return 1
    if data.workers == 0 and input_bytes < AUTO_PARALLEL_MIN_BYTES:
        return 1
    wanted = data.workers or os.cpu_count() or 1
    return max(1, min(wanted, units))


# ---- jobs (run in worker processes; pure computation) ------------------------------------

@dataclass(frozen=True, kw_only=True)
class CleanOutput:
    records: list[Cleaned]
    signatures: np.ndarray  # (kept records, num_perm) uint32
    counts: dict[str, int]
    cpu_s: dict[str, float]


def clean_unit(files: tuple[InputFile, ...], data: DataConfig,
               fs: AbstractFileSystem | None = None) -> CleanOutput:
    """Read, clean, filter and MinHash one unit (at most `max_documents` raw documents)."""
    t0 = time.process_time()
    counts: dict[str, int] = {"undecodable_files": 0}
    cap = data.max_documents or None
    raw = []
    for f in files:
        raw += read_file_documents(fs or resolve(f.url)[0], f, data, counts,
                                   cap and cap - len(raw))
        if cap and len(raw) >= cap:
            break
    t1 = time.process_time()
    records = [clean_one(doc, data.cleaning) for doc in raw]
    t2 = time.process_time()
    a, b = permutations(data.dedup.num_perm)
    kept = [r for r in records if r.verdict is None]
    sigs = np.zeros((len(kept), data.dedup.num_perm if data.dedup.near else 0), dtype=np.uint32)
    if data.dedup.near:
        for i, rec in enumerate(kept):
            sigs[i] = signature(shingles(rec.text, data.dedup.ngram), a, b)
    t3 = time.process_time()
    return CleanOutput(records=records, signatures=sigs, counts=counts,
                       cpu_s={"read": t1 - t0, "clean": t2 - t1, "hash": t3 - t2})


_TOKENIZERS: dict[str, Tokenizer] = {}


def tokenize_unit(tokenizer_json: str, eos: int, dtype: str,
                  splits: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """`<split>_ids` (documents + eos, concatenated) and `<split>_lens` per split."""
    key = hashlib.sha256(tokenizer_json.encode()).hexdigest()
    tok = _TOKENIZERS.get(key) or _TOKENIZERS.setdefault(key, Tokenizer.from_str(tokenizer_json))
    out: dict[str, np.ndarray] = {}
    for split, texts in splits.items():
        docs = list(encode_documents(tok, texts, eos, dtype))
        out[f"{split}_ids"] = np.concatenate(docs) if docs else np.empty(0, dtype=dtype)
        out[f"{split}_lens"] = np.array([d.size for d in docs], dtype=np.int64)
    return out


def _child_init() -> None:
    from ops.procs import set_parent_death_signal

    set_parent_death_signal()  # a SIGKILLed data worker takes its pool with it
    # One tokenizer thread per child: the pool already has a process per core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def run_jobs(jobs: dict[int, tuple[Callable[..., Any], tuple]], workers: int,
             on_done: Callable[[int, Any], None]) -> None:
    """Run `fn(*args)` for every job, in processes when `workers` > 1; `on_done(index,
    result)` runs here, in this process, as each finishes (in index order if sequential)."""
    if workers <= 1 or len(jobs) <= 1:
        for index in sorted(jobs):
            fn, args = jobs[index]
            on_done(index, fn(*args))
        return
    ctx = multiprocessing.get_context("spawn")  # never fork a threaded Temporal worker
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_child_init) as pool:
        pending = {pool.submit(fn, *args): index for index, (fn, args) in sorted(jobs.items())}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                on_done(pending.pop(future), future.result())


# ---- persistence in the work directory (parent process only) -----------------------------

def _sha(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def _put(fs: AbstractFileSystem, path: str, blob: bytes) -> str:
    with fs.open(path, "wb") as f:
        f.write(blob)
    return _sha(blob)


def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


class WorkDir:
    """`<dataset>/work/`: job outputs, each committed by a `.done` marker written last."""

    def __init__(self, fs: AbstractFileSystem, dataset_dir: str) -> None:
        self.fs, self.dir = fs, join(dataset_dir, WORK)

    def _path(self, name: str) -> str:
        return join(self.dir, name)

    def commit(self, name: str, blobs: dict[str, bytes]) -> None:
        self.fs.makedirs(self.dir, exist_ok=True)
        sums = {suffix: _put(self.fs, self._path(name + suffix), blob)
                for suffix, blob in blobs.items()}
        with self.fs.open(self._path(name + ".done"), "w") as f:
            f.write(json.dumps(sums, sort_keys=True))

    def load(self, name: str) -> dict[str, bytes] | None:
        """The committed blobs of `name`, or None if unfinished or any checksum differs."""
        try:
            with self.fs.open(self._path(name + ".done"), "r") as f:
                sums = json.loads(f.read())
            blobs = {s: self.fs.cat_file(self._path(name + s)) for s in sums}
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        if any(_sha(blobs[s]) != sums[s] for s in sums):
            log.warning("work_unit_corrupt_redoing", unit=name, dir=self.dir)
            return None
        return blobs

    def remove(self) -> None:
        if self.fs.exists(self.dir):
            self.fs.rm(self.dir, recursive=True)

    # clean outputs ------------------------------------------------------------------
    def save_clean(self, index: int, out: CleanOutput) -> None:
        records = [[r.source, r.text, r.sha256, r.verdict, r.normalized, r.stripped]
                   for r in out.records]
        meta = json.dumps({"records": records, "counts": out.counts, "cpu_s": out.cpu_s})
        self.commit(f"clean-{index:05d}", {".json": meta.encode(),
                                           ".npz": _npz({"signatures": out.signatures})})

    def load_clean(self, index: int) -> CleanOutput | None:
        blobs = self.load(f"clean-{index:05d}")
        if blobs is None:
            return None
        meta = json.loads(blobs[".json"])
        sigs = np.load(io.BytesIO(blobs[".npz"]))["signatures"]
        return CleanOutput(records=[Cleaned(*r) for r in meta["records"]], signatures=sigs,
                           counts=meta["counts"], cpu_s=meta["cpu_s"])

    # tokenize outputs ---------------------------------------------------------------
    def save_tokens(self, index: int, arrays: dict[str, np.ndarray]) -> None:
        self.commit(f"tokens-{index:05d}", {".npz": _npz(arrays)})

    def load_tokens(self, index: int) -> dict[str, np.ndarray] | None:
        blobs = self.load(f"tokens-{index:05d}")
        if blobs is None:
            return None
        with np.load(io.BytesIO(blobs[".npz"])) as z:
            return {k: z[k] for k in z.files}
