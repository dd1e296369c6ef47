"""Token-budget packing vs fixed-size padded batches on a length-skewed corpus of real documents.

Documents: Python standard-library source files of 64..4096 bytes (a 64x length spread),
tokenized as bytes (+ EOS). The same GPT (same init), the same micro-batch shape
(ROWS x SEQ_LEN) and one epoch each, so both see exactly the same real tokens:
- padded: each document split into SEQ_LEN chunks, one chunk per row, rest padded
  (plain causal attention; padding never influences real tokens);
- packed: `trainer.data.PackedBatches` rows with per-document positions and the
  block-causal mask (the SDPA path `trainer.segment` uses on CPU).
Each mode runs REPEATS epochs, interleaved micro-batch by micro-batch with the other; an
epoch's time is the sum of each micro-batch's fastest run (the machine is shared). Prints one JSON line: {"figure": "packing_speedup", "value": packed
tokens/s ÷ padded tokens/s, "padding_waste_padded", "padding_waste_packed", ...}.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec import ModelConfig
from trainer.data import IGNORE, PackedBatches
from trainer.model import GPT

SEQ_LEN, ROWS, REPEATS, EOS, VOCAB = 1024, 2, 3, 256, 257
MIN_BYTES, MAX_BYTES, TARGET_TOKENS = 64, 4096, 60_000
MODEL = ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, seq_len=SEQ_LEN)


def documents() -> list[np.ndarray]:
    """Every k-th stdlib .py file (path order) of MIN..MAX bytes, as byte tokens + EOS."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [p for p in sorted(root.rglob("*.py")) if MIN_BYTES <= p.stat().st_size <= MAX_BYTES]
    total = sum(p.stat().st_size for p in paths)
    step = max(1, total // TARGET_TOKENS)
    return [np.append(np.frombuffer(p.read_bytes(), dtype=np.uint8), EOS).astype(np.int64)
            for p in paths[::step]]


def padded_batches(docs: list[np.ndarray]) -> tuple[list[tuple[torch.Tensor, ...]], int]:
    """(x, y) micro-batches with one document chunk per row; returns them and the slot count."""
    rows = []
    for d in docs:
        for s in range(0, d.size, SEQ_LEN):
            chunk = d[s:s + SEQ_LEN]
            nxt = d[s + 1:s + 1 + SEQ_LEN]  # a document's last token predicts nothing
            x = np.zeros(SEQ_LEN, np.int64)
            y = np.full(SEQ_LEN, IGNORE, np.int64)
            x[:chunk.size], y[:nxt.size] = chunk, nxt
            rows.append((x, y))
    rows += [(np.zeros(SEQ_LEN, np.int64), np.full(SEQ_LEN, IGNORE, np.int64))] * (-len(rows) % ROWS)
    batches = [tuple(torch.from_numpy(np.stack(col)) for col in zip(*rows[i:i + ROWS]))
               for i in range(0, len(rows), ROWS)]
    return batches, len(rows) * SEQ_LEN


def packed_batches(docs: list[np.ndarray]) -> tuple[list[tuple[torch.Tensor, ...]], int]:
    tokens = np.concatenate(docs)
    starts = np.concatenate([[0], np.cumsum([d.size for d in docs])[:-1]])
    p = PackedBatches(tokens, starts, seq_len=SEQ_LEN, batch_size=ROWS, seed=0)
    n = -(-p.n // ROWS)  # micro-batches covering epoch 0 (the last one may reach into epoch 1)
    batches = [p.get(c) for c in range(n)]
    return batches, p.n * SEQ_LEN


def step_seconds(model: GPT, opt: torch.optim.Optimizer, batch) -> float:
    x, y, *packed = batch
    t0 = time.perf_counter()
    _, loss = model(x, y, **dict(zip(("position_ids", "doc_ids"), packed)))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def main() -> None:
    docs = documents()
    lengths = np.array([d.size for d in docs])
    real = int(lengths.sum())
    modes = {"padded": padded_batches(docs), "packed": packed_batches(docs)}
    # The packed epoch's last micro-batch may hold rows of the next epoch; count only
    # epoch 0's slots for waste, and real tokens are the same corpus in both modes.
    models = {m: GPT(MODEL, VOCAB, seed=0) for m in modes}
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-3) for m in modes}
    # The machine is shared: alternate the modes micro-batch by micro-batch so both see the
    # same load, and keep each micro-batch's fastest time over the repeats (an epoch's time
    # is the sum). Every repeat trains both models on every micro-batch.
    best = {m: [float("inf")] * len(b) for m, (b, _) in modes.items()}
    for _ in range(REPEATS):
        for i in range(max(len(b) for b, _ in modes.values())):
            for m, (batches, _) in modes.items():
                if i < len(batches):
                    best[m][i] = min(best[m][i], step_seconds(models[m], opts[m], batches[i]))
    best = {m: sum(times) for m, times in best.items()}
    tps = {m: real / best[m] for m in modes}
    waste = {m: 1 - real / slots for m, (_, slots) in modes.items()}
    print(json.dumps({
        "figure": "packing_speedup", "value": tps["packed"] / tps["padded"],
        "padding_waste_padded": waste["padded"], "padding_waste_packed": waste["packed"],
        "tokens_per_s_padded": tps["padded"], "tokens_per_s_packed": tps["packed"],
        "real_tokens": real, "documents": len(docs), "doc_len_min": int(lengths.min()),
        "doc_len_max": int(lengths.max()), "doc_len_spread": float(lengths.max() / lengths.min()),
        "micro_batches": {m: len(b) for m, (b, _) in modes.items()},
        "seq_len": SEQ_LEN, "rows_per_micro_batch": ROWS, "repeats": REPEATS,
        "model": {"d_model": MODEL.d_model, "n_layers": MODEL.n_layers,
                  "params": models["packed"].param_count()},
        "device": "cpu", "threads": torch.get_num_threads(),
        "corpus": f"stdlib *.py files of {MIN_BYTES}..{MAX_BYTES} bytes, byte tokens + EOS"}))


if __name__ == "__main__":
    main()
