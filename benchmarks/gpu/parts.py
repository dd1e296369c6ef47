"""The Python checks of benchmarks/gpu_check.sh, one per subcommand; each prints JSON lines.

    python benchmarks/gpu/parts.py attention     # packed attention exact per document
    python benchmarks/gpu/parts.py sdpa          # which SDPA kernels the 1B shapes get, timed
    python benchmarks/gpu/parts.py kill-resume   # a bf16 NCCL segment SIGKILLed and resumed
    python benchmarks/gpu/parts.py tp2           # TP 2 over NCCL against one rank, per step

On CUDA they run the GPU path (bf16, NCCL); without CUDA they run the same code on CPU at
tiny sizes (fp32, gloo), which is the script's dry run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from spec import ModelConfig  # noqa: E402
from trainer import model as M  # noqa: E402
from trainer.safe_load import safe_torch_load  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def attention() -> None:
    """Each document of a packed row matches the document run alone, per kernel and dtype."""
    cfg = ModelConfig(d_model=256, n_layers=2, n_heads=8, n_kv_heads=4, seq_len=512,
                      attention="sdpa")
    torch.manual_seed(0)
    lens = [100, 37, 250, 125]
    docs = [torch.randint(0, 1000, (n,), device=DEV) for n in lens]
    idx = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n, device=DEV) for n in lens])[None]
    doc = torch.cat([torch.full((n,), i, device=DEV) for i, n in enumerate(lens)])[None]
    kernels = [("sdpa", torch.float32, 1e-4)]
    if CUDA:
        kernels.append(("sdpa", torch.bfloat16, 5e-2))
        if M.flash_attn_varlen_func is not None:
            kernels.append(("flash", torch.bfloat16, 5e-2))
    for kernel, dtype, atol in kernels:
        model = M.GPT(cfg, 1000, seed=0).to(DEV).eval()
        for b in model.blocks:
            b.attn.kernel = kernel
        with torch.no_grad(), torch.autocast(DEV.type, dtype=dtype, enabled=dtype != torch.float32):
            packed, _ = model(idx, position_ids=pos, doc_ids=doc)
            for b in model.blocks:  # reference: SDPA, each document alone
                b.attn.kernel = "sdpa"
            worst, start = 0.0, 0
            for d in docs:
                alone, _ = model(d[None])
                diff = (packed[0, start:start + d.numel()].float() - alone[0].float()).abs().max()
                worst, start = max(worst, float(diff)), start + d.numel()
        line = {"figure": "packed_attention_exact", "kernel": kernel, "dtype": str(dtype),
                "packed_mode": M.packed_mode(kernel, dtype, DEV, model.packed_sdpa),
                "max_abs_diff": worst, "atol": atol}
        emit(line)
        assert worst <= atol, line
    if CUDA and M.flash_attn_varlen_func is None:
        emit({"figure": "packed_attention_exact", "kernel": "flash",
              "skipped": "flash_attn not importable"})


def _eligible(q, k, v, mask, causal: bool, gqa: bool) -> dict:
    """Which fused SDPA backends accept these inputs (torch's own dispatch checks)."""
    out = {}
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, causal, gqa)
    except (AttributeError, TypeError) as exc:  # an older signature: say so, do not guess
        return {"error": f"{type(exc).__name__}: {exc}"}
    for name in ("flash", "efficient", "cudnn"):
        check = getattr(torch.backends.cuda, f"can_use_{name}_attention", None)
        out[name] = None if check is None else bool(check(params, False))
    return out


def _timed(fn, iters: int) -> float:
    """Median seconds of fn() (forward and backward), after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if CUDA:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def sdpa() -> None:
    """The 1B model's attention (B=8, T=2048, 16 query heads, 8 KV heads, head dim 128) in
    bf16 the ways the model can call it: causal rows (no mask), packed rows with the block
    mask and grouped KV heads (what `mask` mode does), the same mask with the KV heads
    repeated, and per-document calls (`segments` mode). Reports each one's eligible fused
    kernels and its forward+backward time, so the packed path's cost on this GPU is known."""
    b, t, h, kv, d = (8, 2048, 16, 8, 128) if CUDA else (2, 256, 4, 2, 32)
    dtype = torch.bfloat16 if CUDA else torch.float32
    gen = torch.Generator(device=DEV).manual_seed(0)

    def qkv(heads: int) -> torch.Tensor:
        return torch.randn(b, heads, t, d, device=DEV, dtype=dtype, generator=gen,
                           requires_grad=True)

    q, k, v = qkv(h), qkv(kv), qkv(kv)
    lens = [t // 2, t // 4, t // 8, t - t // 2 - t // 4 - t // 8]  # four documents per row
    doc = torch.cat([torch.full((n,), i, device=DEV) for i, n in enumerate(lens)])
    mask = M.block_causal_mask(doc.expand(b, t))
    k_rep, v_rep = (x.detach().repeat_interleave(h // kv, dim=1).requires_grad_() for x in (k, v))
    cu, _ = M.cu_seqlens(doc.expand(b, t))
    flat = [x.detach().transpose(1, 2).reshape(b * t, x.shape[1], d).requires_grad_()
            for x in (q, k, v)]

    def run(out_fn):
        def go():
            out_fn().float().sum().backward()
        return go

    F = torch.nn.functional.scaled_dot_product_attention
    variants = {
        "causal_gqa": (lambda: F(q, k, v, is_causal=True, enable_gqa=True),
                       (q, k, v, None, True, True)),
        "mask_gqa": (lambda: F(q, k, v, attn_mask=mask, enable_gqa=True),
                     (q, k, v, mask, False, True)),
        "mask_repeated_kv": (lambda: F(q, k_rep, v_rep, attn_mask=mask),
                             (q, k_rep, v_rep, mask, False, False)),
        "segments": (lambda: M.segment_attention(*flat, cu, True), None),
    }
    iters = 10 if CUDA else 2
    line = {"figure": "sdpa_variants", "shape": {"B": b, "T": t, "H": h, "KV": kv, "D": d},
            "dtype": str(dtype), "docs_per_row": len(lens), "device": DEV.type}
    for name, (fn, args) in variants.items():
        entry: dict = {"ms": round(_timed(run(fn), iters) * 1e3, 3)}
        if CUDA and args is not None:
            entry["eligible"] = _eligible(*args)
        line[name] = entry
    emit(line)


def _segment(spec: str, dataset: str, to_step: int, workdir: Path, attempt: int = 1,
             wait: bool = True, ranks: int = 1):
    # The environment as it is: PYTHONPATH holds the repository and, on a device image,
    # the carried wheels (gpu_check.sh); DS_ACCELERATOR only where the dry run set it.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(ranks), "-m", "trainer.segment", "--spec", spec, "--dataset", dataset, "--to-step",
           str(to_step), "--workdir", str(workdir), "--attempt", str(attempt)]
    if wait:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    return subprocess.Popen(cmd, cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _weights(store: Path, step: int) -> dict[str, torch.Tensor]:
    ck = store / f"runs/t/checkpoints/step-{step:09d}/mp_rank_00_model_states.pt"
    return safe_torch_load(str(ck), map_location="cpu")["module"]


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


NOISE_FACTOR = 4  # a resumed run may differ from an uninterrupted one by this x run-to-run


def resume_verdict(diff: float, noise: float) -> str:
    """'bitwise' when the resumed run equals the uninterrupted one; 'within_tolerance' when
    it differs no more than NOISE_FACTOR x what two uninterrupted runs differ by (kernels
    that are not deterministic, such as atomics in a backward pass); else 'FAILED'. With
    deterministic kernels (noise 0) only bitwise passes."""
    if diff == 0.0:
        return "bitwise"
    return "within_tolerance" if diff <= NOISE_FACTOR * noise else "FAILED"


def commits(progress: Path) -> list[int]:
    """Steps the segment reported committed (its progress lines of type commit)."""
    if not progress.exists():
        return []
    lines = (json.loads(ln) for ln in progress.read_text().splitlines() if ln.endswith("}"))
    return [ln["step"] for ln in lines if ln.get("type") == "commit"]


def kill_resume() -> None:
    """A bf16 ZeRO-2 segment on NCCL SIGKILLed once it has committed step 4 or later, then
    resumed by a second launch to 8 steps past its last commit; against an uninterrupted
    run to the same step, and a second uninterrupted run for the run-to-run noise of this
    GPU's kernels; the verdict is `resume_verdict`'s."""
    from tests.trainer.helpers import make_dataset, tiny_spec, write_spec

    root = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ds = make_dataset(root / "data")
    over = {"train.precision": "bf16" if CUDA else "fp32", "train.zero_stage": 2,
            "train.checkpoint_every": 4, "model.d_model": 256, "model.n_heads": 8,
            "model.n_kv_heads": 4, "model.seq_len": 128, "train.micro_batch_tokens": 1024,
            "train.total_steps": 400, "train.segment_steps": 400}
    specs = {name: write_spec(tiny_spec(root / name, **over), root / f"{name}.json")
             for name in ("a", "a2", "b")}
    # The run to kill goes for all 400 steps, so the kill always lands mid-run.
    proc = _segment(specs["b"], ds, 400, root / "wb", wait=False)
    progress, deadline = root / "wb" / "progress.jsonl", time.time() + 150
    while not any(c >= 4 for c in commits(progress)):
        assert time.time() < deadline and proc.poll() is None, "segment never committed step 4"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    last = max(commits(progress))
    to_step = last + 8
    p = _segment(specs["b"], ds, to_step, root / "wb2", attempt=2)
    assert p.returncode == 0, p.stderr[-4000:]
    resumed = json.loads((root / "wb2" / "result.json").read_text())
    results = {}
    for name in ("a", "a2"):
        p = _segment(specs[name], ds, to_step, root / f"w{name}")
        assert p.returncode == 0, p.stderr[-4000:]
        results[name] = json.loads((root / f"w{name}" / "result.json").read_text())
    wa, wa2, wb = (_weights(root / n, to_step) for n in ("a", "a2", "b"))
    noise, diff = _max_diff(wa, wa2), _max_diff(wa, wb)
    scale = max(float(w.float().abs().max()) for w in wa.values())
    thr = resumed["throughput"]
    line = {"figure": "gpu_kill_resume", "value": diff, "run_to_run_diff": noise,
            "tolerance": NOISE_FACTOR * noise, "bitwise": diff == 0.0,
            "verdict": resume_verdict(diff, noise),
            "relative_diff": diff / scale if scale else None,
            "resumed_from": resumed["resumed_from"], "killed_after_commit": last,
            "to_step": to_step, "precision": over["train.precision"], "zero_stage": 2,
            "backend": "nccl" if CUDA else "gloo", "world_size": 1,
            "tokens_per_s": thr.get("tokens_per_s"), "mfu": thr.get("mfu"),
            "peak_source": thr.get("peak_source"),
            "peak_mem_bytes_per_rank": thr.get("peak_mem_bytes"),
            "peak_mem_bytes_uninterrupted": results["a"]["throughput"].get("peak_mem_bytes")}
    emit(line)
    assert resumed["resumed_from"] == last, line
    assert line["verdict"] != "FAILED", line


def step_losses(progress: Path) -> dict[int, float]:
    """Step -> training loss, from a segment's progress lines of type step."""
    lines = (json.loads(ln) for ln in progress.read_text().splitlines() if ln.endswith("}"))
    return {ln["step"]: ln["loss"] for ln in lines if ln.get("type") == "step"}


TP_STEPS = 8
# bf16 matmuls split across two devices sum in another order than on one: the losses
# agree to this (relative); fp32 on CPU (the dry run) to the 1e-4 of the CPU trajectory test
TP_RTOL = {True: 2e-2, False: 1e-4}


def tp2() -> None:
    """Tensor parallelism over NCCL: a TP 2 segment on two GPUs (one rank per device, as
    NCCL requires) against one rank holding the whole model, same batches, TP_STEPS steps;
    the largest relative loss difference per step against TP_RTOL. On a machine with one
    GPU it says so and is skipped (two ranks cannot share a device under NCCL)."""
    from tests.trainer.helpers import make_dataset, tiny_spec, write_spec

    if CUDA and torch.cuda.device_count() < 2:
        emit({"figure": "gpu_tp2", "skipped": f"{torch.cuda.device_count()} GPU: NCCL runs one "
              "rank per device, TP 2 needs two"})
        return
    root = Path(tempfile.mkdtemp(prefix="gpu_check_tp_"))
    ds = make_dataset(root / "data")
    over = {"train.precision": "bf16" if CUDA else "fp32", "model.d_model": 256,
            "model.n_heads": 8, "model.n_kv_heads": 4, "model.seq_len": 128,
            "train.micro_batch_tokens": 1024, "train.total_steps": TP_STEPS,
            "train.segment_steps": TP_STEPS, "train.checkpoint_every": TP_STEPS}
    runs = {"tp2": (2, {"train.procs_per_node": 2,
                        "train.layout": {"tp": 2, "pp": 1, "zero": 0}}), "one": (1, {})}
    losses = {}
    for name, (ranks, extra) in runs.items():
        spec = write_spec(tiny_spec(root / name, **over, **extra), root / f"{name}.json")
        p = _segment(spec, ds, TP_STEPS, root / f"w{name}", ranks=ranks)
        assert p.returncode == 0, p.stderr[-4000:]
        losses[name] = step_losses(root / f"w{name}" / "progress.jsonl")
    worst = max(abs(losses["tp2"][s] - losses["one"][s]) / abs(losses["one"][s])
                for s in losses["one"])
    line = {"figure": "gpu_tp2", "value": worst, "tolerance": TP_RTOL[CUDA],
            "steps": TP_STEPS, "losses_tp2": losses["tp2"], "losses_one_rank": losses["one"],
            "precision": over["train.precision"], "backend": "nccl" if CUDA else "gloo"}
    emit(line)
    assert worst <= TP_RTOL[CUDA], line


PARTS = {"attention": attention, "sdpa": sdpa, "kill-resume": kill_resume, "tp2": tp2}

if __name__ == "__main__":
    # Log lines to stderr: stdout carries the JSON lines alone.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if len(sys.argv) != 2 or sys.argv[1] not in PARTS:
        sys.exit(f"usage: parts.py {{{','.join(PARTS)}}}")
    PARTS[sys.argv[1]]()
