"""Data prep, stages 6 and 8: the tokenizer and the token shards.

The trained tokenizer is byte-level BPE (GPT-2 style: every byte is in the base alphabet,
so any text encodes and decodes back exactly). `<|endoftext|>` is the only special token;
it ends every document in the shards. Text that merely *contains* the string
`<|endoftext|>` is encoded as ordinary bytes (`encode_special_tokens`), so a document
boundary in the shards is always a real one.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from fsspec.spec import AbstractFileSystem
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common.errors import BadData
from storage.dataset import ShardInfo, write_shard
from storage.fs import resolve
from storage.provenance import DocIndex

EOS = "<|endoftext|>"
ENCODE_BATCH = 256  # documents per encode_batch call (the Rust side parallelises within it)
# Well inside any heartbeat timeout; training on ~100 MB of text takes minutes.
TRAIN_TICK_S = 10.0
TOKENIZER_FIX = "point data.tokenizer.path at a tokenizer.json, or leave it empty to train one"


def train_tokenizer(texts: Sequence[str], vocab_size: int,
                    tick: Callable[[float], None] | None = None,
                    every_s: float | None = None) -> Tokenizer:
    """Byte-level BPE trained on `texts`; `tick(seconds so far)` every `every_s` (default
    TRAIN_TICK_S) while it trains, so a long training heartbeats. The Rust trainer releases
    the GIL, so it runs on a helper thread while this one ticks."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would not survive decode, breaking round trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    if tick is None:
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
        return tok
    start = time.monotonic()
    with ThreadPoolExecutor(1, thread_name_prefix="bpe-train") as thread:
        training = thread.submit(tok.train_from_iterator, texts, trainer=trainer,
                                 length=len(texts))
        while True:
            try:
                training.result(timeout=every_s or TRAIN_TICK_S)
                return tok
            except TimeoutError:
                tick(time.monotonic() - start)


def load_tokenizer(url: str) -> Tokenizer:
    fs, path = resolve(url)
    try:
        text = fs.cat_file(path).decode("utf-8")
    except FileNotFoundError:
        raise BadData(url, "tokenizer file not found", TOKENIZER_FIX) from None
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # the Rust parser raises plain Exception
        raise BadData(url, f"not a valid tokenizer.json ({exc})", TOKENIZER_FIX) from None


def eos_id(tok: Tokenizer, source: str) -> int:
    token_id = tok.token_to_id(EOS)
    if token_id is None:
        raise BadData(source, f"the tokenizer has no {EOS!r} token to end documents with",
                      f"add {EOS} as a special token, or leave data.tokenizer.path empty")
    return token_id


def encode_documents(tok: Tokenizer, texts: Sequence[str], eos: int,
                     dtype: str) -> Iterator[np.ndarray]:
    """Each document's token ids followed by `eos`, in order."""
    tok.encode_special_tokens = True
    # encode_batch_fast skips character offsets we never use: ~40 % faster, same ids.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    for lo in range(0, len(texts), ENCODE_BATCH):
        for enc in encode(list(texts[lo:lo + ENCODE_BATCH]), add_special_tokens=False):
            ids = np.empty(len(enc.ids) + 1, dtype=dtype)
            ids[:-1] = enc.ids
            ids[-1] = eos
            yield ids


def cut_shards(docs: Iterable[np.ndarray],
               shard_tokens: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Concatenate documents and cut every `shard_tokens` tokens.

    Yields (tokens, doc_starts): the offsets, inside this shard, of the documents that
    *begin* in it. A document may continue into the next shard; `read_split` adds the
    shard offsets back, so the whole split reads as one stream.
    """
    parts: list[np.ndarray] = []
    starts: list[int] = []
    size = 0
    for doc in docs:
        starts.append(size)
        parts.append(doc)
        size += doc.size
        while size >= shard_tokens:
            flat = np.concatenate(parts)
            yield flat[:shard_tokens], np.array(starts, np.uint64)
            # Every start is < shard_tokens here (cuts happen as soon as a shard fills),
            # so what remains is the tail of the last document, with no start of its own.
            parts, starts, size = [flat[shard_tokens:]], [], size - shard_tokens
    if size:
        yield np.concatenate(parts), np.array(starts, np.uint64)


def write_split(fs: AbstractFileSystem, directory: str, split: str,
                shards: Iterable[tuple[np.ndarray, np.ndarray]],
                on_shard: Callable[[ShardInfo], None],
                index: DocIndex | None = None) -> list[ShardInfo]:
    """Write the split's shards; with `index` (one row per document, in stream order),
    each shard gets the rows of the documents that begin in it."""
    written = []
    done = 0
    for i, (tokens, starts) in enumerate(shards):
        rows = None if index is None else index.take(done, done + starts.size).encode()
        done += starts.size
        written.append(write_shard(fs, directory, f"{split}-{i:05d}", split, tokens, starts,
                                   rows))
        on_shard(written[-1])
    if index is not None and done != len(index):
        # The index is built from the same documents the token stream is: a mismatch is a
        # bug here, and a dataset with it would blame the wrong sources, so none is made.
        raise RuntimeError(f"{split}: {done} documents in the shards, {len(index)} indexed")
    return written
