"""Work units: the parallel, resumable part of data prep.

The input files are grouped, in path order, into units of about `data.unit_bytes`.
Each unit goes through two CPU-heavy jobs, each run in a worker *process*:
- clean: read (decompress, parse) → clean → filter → sha256 + MinHash signature;
- tokenize: encode the unit's surviving train and val documents.
One pool of spawned processes (`worker_pool`: a process per core, each in its own session,
on one tokenizer thread) serves both; listing, dedup, the split, tokenizer training and
shard writing run in the parent. The parent writes every job's output into the dataset's
work directory (`datasets/<content_hash>/work/`) followed by a `.done` marker holding the
outputs' checksums. The content hash covers inputs and config, so a retry after a crash
finds the same work directory and redoes only units without a valid marker. Children only
compute: they never write to the durable tier, so a `memory://` store works too.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import structlog
from fsspec.spec import AbstractFileSystem
from tokenizers import Tokenizer

from dataprep.clean import Cleaned, clean_one
from dataprep.inputs import InputFile, read_file_documents
from dataprep.minhash import permutations, shingles, signature
from dataprep.tokens import encode_documents
from spec import DataConfig
from storage.fs import join, resolve

log = structlog.get_logger(__name__)

WORK = "work"
PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"


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


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which a container or taskset
    narrows; `os.cpu_count()` counts the whole machine)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_count(data: DataConfig, units: int, input_bytes: int, corpus_url: str) -> int:
    """Processes to use: `data.workers` (0 = every available core for a corpus of at least
    AUTO_PARALLEL_MIN_BYTES), never more than there are units.

    A `memory://` corpus lives in this process only, so it is read here.
    """
    if corpus_url.startswith("memory://"):
        return 1
    if data.workers == 0 and input_bytes < AUTO_PARALLEL_MIN_BYTES:
        return 1
    wanted = data.workers or available_cores()
    return max(1, min(wanted, units))


@contextmanager
def tokenizer_threads(enabled: bool) -> Iterator[None]:
    """`tokenizers` encodes batches and trains BPE on a thread per core unless
    TOKENIZERS_PARALLELISM is "false" (its only switch, read at every call). An explicit
    `data.workers=1` means one core, so the in-process encode and training run on one
    thread; without this the "1 worker" baseline of `benchmarks/dataprep.py` quietly used
    every core for half its work. Restores the previous value on exit.
    """
    if enabled:
        yield
        return
    before = os.environ.get(PARALLELISM_ENV)
    os.environ[PARALLELISM_ENV] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PARALLELISM_ENV, None)
        else:
            os.environ[PARALLELISM_ENV] = before


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
    """`<split>_ids` (documents + eos, concatenated) and `<split>_lens` per split, and
    `cpu_s`: CPU seconds it took (all threads of this process)."""
    start = time.process_time()
    key = hashlib.sha256(tokenizer_json.encode()).hexdigest()
    tok = _TOKENIZERS.get(key) or _TOKENIZERS.setdefault(key, Tokenizer.from_str(tokenizer_json))
    out: dict[str, np.ndarray] = {}
    for split, texts in splits.items():
        docs = list(encode_documents(tok, texts, eos, dtype))
        out[f"{split}_ids"] = np.concatenate(docs) if docs else np.empty(0, dtype=dtype)
        out[f"{split}_lens"] = np.array([d.size for d in docs], dtype=np.int64)
    out["cpu_s"] = np.float64(time.process_time() - start)
    return out


def _child_init() -> None:
    from common.procs import set_parent_death_signal

    set_parent_death_signal()  # a SIGKILLed data worker takes its pool with it
    # One tokenizer thread per child: the pool already has a process per core.
    os.environ[PARALLELISM_ENV] = "false"
    # Linux autogroup (sched_autogroup_enabled, on by default) shares the CPUs fairly
    # between *sessions*: left in the data worker's session, N children on a busy machine
    # together get one session's share and run no faster than one process (measured:
    # 1.0 vs 1.02 MB/s). Their own sessions give each a share; the parent-death signal
    # above, not the session, is what ends them with their parent.
    try:
        os.setsid()
    except OSError as exc:  # already a session leader: nothing to gain
        log.warning("dataprep_worker_setsid_failed", error=str(exc))


@contextmanager
def worker_pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """One pool of `workers` processes for every parallel phase (None: run in this
    process). Spawning an interpreter that imports numpy and tokenizers costs ~1 s of CPU
    on a loaded machine, so the clean and tokenize phases share the same children."""
    if workers <= 1:
        yield None
        return
    ctx = multiprocessing.get_context("spawn")  # never fork a threaded Temporal worker
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_child_init) as pool:
        yield pool


def run_jobs(jobs: dict[int, tuple[Callable[..., Any], tuple]],
             pool: ProcessPoolExecutor | None, on_done: Callable[[int, Any], None]) -> None:
    """Run `fn(*args)` for every job, in `pool` if there is one; `on_done(index, result)`
    runs here, in this process, as each finishes (in index order if sequential)."""
    if pool is None or len(jobs) <= 1:
        for index in sorted(jobs):
            fn, args = jobs[index]
            on_done(index, fn(*args))
        return
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
        records = [[r.source, r.text, r.sha256, r.verdict, r.normalized, r.stripped,
                    r.figures] for r in out.records]
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
