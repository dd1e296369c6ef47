"""Training throughput of a named model size on this device: tokens/s, step time, MFU.

    python benchmarks/throughput.py [--size tiny|small|350m|1b] [--steps N] [--peak-tflops X]
                                    [--rows packed|causal] [--compile]
    python benchmarks/throughput.py --layout dp2|tp2|pp2|all [--steps N]

`--layout`: real training segments on two ranks at data, tensor or pipeline parallelism
(`benchmarks/layouts.py`): tokens/s, the exposed communication fraction and the pipeline
bubble per layout, one JSON line {"figure": "throughput_by_layout", "layouts": [...]}.

One process, the model from `trainer.model`, AdamW (fused on CUDA), bf16 autocast on CUDA
and fp32 on CPU. `--rows packed` (the default, what training runs): several documents per
row, block-causal attention (flash-attn varlen on CUDA when importable, else SDPA with a
block mask on CUDA, per-document SDPA on CPU). `--rows causal`: one document per row, plain
causal SDPA, which on CUDA is SDPA's flash kernel. FLOPs per token and MFU come from
`trainer.throughput` (6N + 12·L·d·T, PaLM appendix B). MFU is reported against two
ceilings: `mfu` against the peak, which is, in order, --peak-tflops, the datasheet dense
bf16 figure for a known GPU, a matmul probe on this device; and `mfu_vs_measured` against
the matmul probe (square products in the training dtype), which is what this device
reaches on the one kernel the model is mostly made of. Prints one JSON line:
{"figure": "throughput", "value": tokens/s, "step_time_s", "mfu", "mfu_vs_measured", ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import structlog
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec import ModelConfig
from trainer.model import GPT, compile_blocks
from trainer.throughput import (
    flops_per_token,
    matmul_params,
    measured_peak_flops,
    mfu,
    peak_memory_bytes,
    sync,
)

VOCAB = 32_000
SIZES = {  # name: (ModelConfig fields, micro-batch rows)
    "tiny": (dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, seq_len=256), 8),
    "small": (dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, seq_len=512), 4),
    "350m": (dict(d_model=1024, n_layers=24, n_heads=16, n_kv_heads=16, seq_len=2048), 8),
    "1b": (dict(d_model=2048, n_layers=20, n_heads=16, n_kv_heads=8, seq_len=2048), 8),
}
# Dense bf16 tensor-core peaks (NVIDIA datasheets, no sparsity), TFLOP/s.
DATASHEET_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}


def peak(args: argparse.Namespace, device: torch.device, measured: float) -> tuple[float, str]:
    if args.peak_tflops > 0:
        return args.peak_tflops * 1e12, "flag:--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in DATASHEET_BF16.items():
            if key in name:
                return tflops * 1e12, f"datasheet:{key}:bf16_dense"
    return measured, "measured:matmul_probe"


def probe_ceiling(device: torch.device, dtype: torch.dtype) -> float:
    """The measured matmul ceiling: 8192² products for a second on CUDA (the size at which
    an H100/H200 reaches its steady tensor-core rate), 512² on CPU."""
    if device.type == "cuda":
        return measured_peak_flops(device, dtype, n=8192, seconds=1.0)
    return measured_peak_flops(device, dtype)


def causal_batch(rows: int, seq_len: int, device: torch.device, gen: torch.Generator):
    """Random tokens, one document per row: no positions or ids, so attention is causal."""
    x = torch.randint(0, VOCAB, (rows, seq_len + 1), generator=gen)
    return [t.to(device) for t in (x[:, :-1], x[:, 1:])] + [None, None]


def packed_batch(rows: int, seq_len: int, device: torch.device, gen: torch.Generator):
    """Random tokens in rows of 1-4 documents each, with per-document positions and ids."""
    x = torch.randint(0, VOCAB, (rows, seq_len + 1), generator=gen)
    doc = torch.zeros(rows, seq_len, dtype=torch.long)
    pos = torch.zeros(rows, seq_len, dtype=torch.long)
    for r in range(rows):
        cuts = sorted(torch.randint(1, seq_len, (int(torch.randint(0, 4, (1,), generator=gen)),),
                                    generator=gen).tolist())
        for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, seq_len])):
            doc[r, a:b], pos[r, a:b] = i, torch.arange(b - a)
    return [t.to(device) for t in (x[:, :-1], x[:, 1:], pos, doc)]


def main() -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout: JSON
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="model size (default: 1b on CUDA, tiny on CPU)")
    p.add_argument("--steps", type=int, default=0, help="timed steps (default 20 CUDA, 5 CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--rows", choices=("packed", "causal"), default="packed",
                   help="packed: documents packed per row, block-causal (training's rows); "
                        "causal: one document per row (SDPA's flash kernel on CUDA)")
    p.add_argument("--compile", action="store_true",
                   help="compile each transformer block first, as model.compile does in training "
                        "(compile time is not in the timed steps)")
    p.add_argument("--layout", choices=("dp2", "tp2", "pp2", "all"), default=None,
                   help="real segments on two ranks at this layout (benchmarks/layouts.py)")
    args = p.parse_args()
    if args.layout:
        from benchmarks.layouts import LAYOUTS, run_layouts

        names = list(LAYOUTS) if args.layout == "all" else [args.layout]
        print(json.dumps(run_layouts(names, args.steps or 40)))
        return
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    size = args.size or ("1b" if cuda else "tiny")
    fields, rows = SIZES[size]
    cfg = ModelConfig(**fields, attention="auto")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = GPT(cfg, VOCAB, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    n = model.param_count()
    fpt = flops_per_token(matmul_params(n, cfg, VOCAB), cfg.n_layers, cfg.d_model, cfg.seq_len)
    measured = probe_ceiling(device, dtype)
    peak_flops, source = peak(args, device, measured)
    if args.compile:  # what model.compile does in training: each block compiled in place
        compile_blocks(model)
    batch = packed_batch if args.rows == "packed" else causal_batch
    gen = torch.Generator().manual_seed(0)
    steps = args.steps or (20 if cuda else 5)
    times = []
    t_start = time.perf_counter()
    for i in range(args.warmup + steps):
        x, y, pos, doc = batch(rows, cfg.seq_len, device, gen)
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=cuda):
            _, loss = model(x, y, position_ids=pos, doc_ids=doc)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        elif i == args.warmup - 1:
            warmup_s = time.perf_counter() - t_start  # with --compile, mostly compile time
    step_time = sorted(times)[len(times) // 2]  # median: robust to a noisy shared machine
    tps = rows * cfg.seq_len / step_time
    print(json.dumps({
        "figure": "throughput", "value": tps, "unit": "tokens/s", "step_time_s": step_time,
        "mfu": mfu(tps, fpt, peak_flops), "peak_tflops": peak_flops / 1e12, "peak_source": source,
        "mfu_vs_measured": mfu(tps, fpt, measured), "measured_peak_tflops": measured / 1e12,
        "measured_peak_source": f"matmul_probe:{dtype}".replace("torch.", ""),
        "rows": args.rows, "compiled": args.compile,
        "warmup_s": round(warmup_s, 2) if args.warmup else None,
        "step_time_spread": [min(times), max(times)], "model": size, "params": n, "flops_per_token": fpt, "tokens_per_step": rows * cfg.seq_len,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype).replace("torch.", ""), "attention": model.blocks[0].attn.kernel,
        "peak_mem_bytes": peak_memory_bytes(device), "steps": steps, "loss": loss.item()}))


if __name__ == "__main__":
    main()
