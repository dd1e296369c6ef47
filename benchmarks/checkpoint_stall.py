"""Checkpoint stall: training pause per checkpoint, tiered async vs synchronous save to S3.

    .venv/bin/python benchmarks/checkpoint_stall.py [--mb 120] [--checkpoints 4] [--every 60]
                                                    [--device cpu|cuda] [--width 1024]

Trains a stack of linear layers with Adam whose model + optimizer state is `--mb` MB, and
checkpoints it every `--every` steps to SeaweedFS S3 (a private `weed server -s3`, or the
endpoint in AWS_ENDPOINT_URL). Synchronous: the loop writes the state to local disk, hashes,
uploads and commits (manifest last) before the next step. Tiered: the loop copies the state
to CPU memory (or, `--snapshot disk`, writes local disk) and hands over to
`storage.tiered.TieredCheckpointer`, whose writer process hashes, uploads and commits while
training goes on.
Prints one JSON line (DESIGN §8): value = mean async pause ÷ mean sync pause, and the step
time while an upload runs ÷ the step time with none, paired per checkpoint interval (the
upload's steps against the same interval's steps after it finished), so load that other
processes put on a shared machine while the run goes on cancels out; the first interval,
while the writer process starts, is not compared. `slowdown_unpaired` is the plain ratio of
means over the whole tiered run, as earlier versions reported it.
`--device cuda` keeps the model, its optimizer state and the batch on the GPU, so each
pause includes the device-to-host copy of the state, as a GPU trainer's does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil
import structlog
import torch

from storage.checkpoints import CheckpointStore
from storage.tiered import TieredCheckpointer, TierPolicy


def build(mb: int, width: int = 1024, device: str = "cpu"
          ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers sized so that params + Adam's two moments (3 x 4 bytes/param) ≈ mb MB."""
    layers = max(1, round(mb * 2**20 / 12 / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def step(model, opt, x) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    if x.is_cuda:  # the step's kernels end inside its timing
        torch.cuda.synchronize(x.device)


# A name DeepSpeed writes (the store accepts only those: storage/manifest.py:FILE_PATTERNS).
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def write_state(model, opt, directory: str) -> None:
    """What DeepSpeed's save_checkpoint does on the fast tier: torch.save to local files."""
    torch.save(model.state_dict(), os.path.join(directory, "mp_rank_00_model_states.pt"))
    torch.save(opt.state_dict(), os.path.join(directory, OPTIM))


def cpu_copy(obj):
    """A snapshot the loop can hand over: every tensor copied, so training may go on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def snapshot_writer(model, opt):
    model_sd, opt_sd = cpu_copy(model.state_dict()), cpu_copy(opt.state_dict())

    def write(directory: str) -> None:
        torch.save(model_sd, os.path.join(directory, "mp_rank_00_model_states.pt"))
        torch.save(opt_sd, os.path.join(directory, OPTIM))
    return write


def run(mode: str, args, url: str, scratch: str) -> dict:
    model, opt = build(args.mb, args.width, args.device)
    x = torch.randn(args.batch, args.width, device=args.device)
    durable = CheckpointStore(url, f"bench-{mode}-{uuid.uuid4().hex[:6]}")
    fast = CheckpointStore.local(os.path.join(scratch, mode, "fast"))
    ckpt = TieredCheckpointer(durable, fast, TierPolicy(max_in_flight=2)) if mode == "async" else None
    pauses, steps = [], []  # steps: (checkpoint interval, uploading?, seconds)
    total = args.every * (args.checkpoints + 1)
    for i in range(1, total + 1):
        uploading = bool(ckpt and ckpt.in_flight())
        t0 = time.perf_counter()
        step(model, opt, x)
        steps.append(((i - 1) // args.every, uploading, time.perf_counter() - t0))
        if i % args.every or i == total:
            continue
        t0 = time.perf_counter()
        if ckpt and args.snapshot == "memory":
            ckpt.submit(i, write=snapshot_writer(model, opt))
        elif ckpt:
            write_state(model, opt, ckpt.prepare(i))
            ckpt.submit(i)
        else:
            local = os.path.join(scratch, mode, f"step-{i}")
            os.makedirs(local, exist_ok=True)
            write_state(model, opt, local)
            durable.commit(i, local)
            shutil.rmtree(local)
        pauses.append(time.perf_counter() - t0)
    if ckpt:
        ckpt.drain()
        ckpt.close()
    sizes = durable.manifest(durable.latest_committed()).total_bytes
    return {"pauses": pauses, "steps": steps, "bytes": sizes,
            "committed": durable.list_committed()}


def paired_slowdown(steps: list[tuple[int, bool, float]], min_steps: int = 3) -> dict:
    """Mean over checkpoint intervals of (mean step time during the upload ÷ mean step time
    after it, same interval); intervals without `min_steps` of each are skipped."""
    ratios, busy, quiet = [], [], []
    for k in sorted({k for k, _, _ in steps} - {0}):
        during = [t for i, up, t in steps if i == k and up]
        after = [t for i, up, t in steps if i == k and not up]
        if len(during) >= min_steps and len(after) >= min_steps:
            ratios.append(statistics.mean(during) / statistics.mean(after))
            busy += during
            quiet += after
    return {"slowdown": statistics.mean(ratios) if ratios else None, "ratios": ratios,
            "busy": busy, "quiet": quiet}


def main(argv: list[str] | None = None) -> int:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout: JSON
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=120, help="model + optimizer state size (MB)")
    p.add_argument("--checkpoints", type=int, default=4)
    p.add_argument("--every", type=int, default=60,
                   help="steps between checkpoints (long enough for quiet steps after each upload)")
    p.add_argument("--snapshot", choices=("memory", "disk"), default="memory",
                   help="tiered hand-over: copy state to CPU memory (a background thread "
                        "saves it), or torch.save to the fast tier in the loop (as DeepSpeed does)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=1024, help="features of each linear layer")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model, optimizer state and batch live")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="torch threads (one core is left for I/O, as for a data loader)")
    p.add_argument("--durable", default="", help="durable URL (default: a private SeaweedFS)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    scratch = tempfile.mkdtemp(prefix="ckpt-stall-")
    s3 = None
    if not os.environ.get("AWS_ENDPOINT_URL") and not args.durable:
        from ops.services import SeaweedS3

        s3 = SeaweedS3(os.path.join(scratch, "weed")).start()
        os.environ.update(s3.env())
        # In production the S3 servers are other machines; here they share our cores, so
        # they run at the lowest priority to keep their CPU out of the step times.
        os.setpriority(os.PRIO_PROCESS, s3.proc.pid, 19)
        for child in psutil.Process(s3.proc.pid).children(recursive=True):
            os.setpriority(os.PRIO_PROCESS, child.pid, 19)
    bucket = s3.bucket if s3 else os.environ.get("MAINSPRING_BENCH_BUCKET", "mainspring")
    url = args.durable or f"s3://{bucket}/bench"
    try:
        sync = run("sync", args, url, scratch)
        tiered = run("async", args, url, scratch)
    finally:
        if s3:
            s3.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    sync_pause, async_pause = statistics.mean(sync["pauses"]), statistics.mean(tiered["pauses"])
    paired = paired_slowdown(tiered["steps"])
    all_busy = [t for _, up, t in tiered["steps"] if up]
    all_quiet = [t for _, up, t in tiered["steps"][2:] if not up]
    unpaired = statistics.mean(all_busy) / statistics.mean(all_quiet) if all_busy else 1.0
    slowdown = paired["slowdown"]
    print(json.dumps({
        "figure": "checkpoint_stall_ratio", "value": round(async_pause / sync_pause, 4),
        "sync_pause_s": round(sync_pause, 4), "async_pause_s": round(async_pause, 4),
        "step_time_slowdown_during_upload": None if slowdown is None else round(slowdown, 4),
        "slowdown_per_interval": [round(r, 3) for r in paired["ratios"]],
        "slowdown_unpaired": round(unpaired, 4),
        "step_s_quiet": round(statistics.mean(paired["quiet"] or all_quiet), 4),
        "step_s_during_upload": round(statistics.mean(paired["busy"] or all_busy or [0]), 4),
        "steps_during_upload": len(all_busy), "checkpoint_bytes": tiered["bytes"],
        "checkpoints": args.checkpoints, "every_steps": args.every, "batch": args.batch,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "width": args.width,
        "torch_threads": args.threads, "durable": url.split("://")[0] if "://" in url else "file", "fast": "local disk",
        "snapshot": args.snapshot, "load_avg_1m": round(os.getloadavg()[0], 2),
        "target_value": 0.10, "target_slowdown": 1.25,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
