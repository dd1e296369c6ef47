"""Checkpoint scrub cost on the training cores: step time with and without a scrub beside it.

    .venv/bin/python benchmarks/scrub.py [--mb-per-s 16] [--checkpoints 3] [--ckpt-mb 64]
                                         [--model-mb 40] [--rounds 24] [--interval-s 1.5]

A training loop (linear layers with Adam, benchmarks/checkpoint_stall.py's model) runs in
this process on every core; a scrub (storage/scrub.py, the data worker's pass, at
`--mb-per-s`, re-reading every pass) runs over a file:// store of `--checkpoints`
committed checkpoints of `--ckpt-mb` MB each, in a process of its own session — a data
worker started on its own, so Linux's autogroup gives it a full share of the CPU against
the trainer whatever its niceness: its rate ceiling is what keeps it off the training cores.
Intervals of `--interval-s` seconds alternate with the scrub stopped (SIGSTOP) and running
(SIGCONT), `--rounds` pairs, so load that other processes put on a shared machine meanwhile
falls on both sides alike. Prints one JSON line: value = the median over the pairs of step
time with ÷ without (target ≤ 1.02; a median, because on a shared machine one interval
that another job's burst lands in moves a mean by tens of percent), the ratio of the plain
means beside it, the rate the scrub read at while it ran, and the CPU time it took then
as a share of the training cores (`scrub_cpu_share_of_training_cores`: the most it can
take from training, and a figure other jobs on the machine do not move).
`--mb-per-s 0` measures an unthrottled scrub for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUN = "bench-scrub"


def make_store(url: str, checkpoints: int, ckpt_mb: int, scratch: str) -> None:
    from storage.checkpoints import CheckpointStore

    store = CheckpointStore(url, RUN)
    for step in range(1, checkpoints + 1):
        local = os.path.join(scratch, f"s{step}")
        os.makedirs(local, exist_ok=True)
        for name, share in (("mp_rank_00_model_states.pt", 1), ("train_state-rank0.pt", 0)):
            with open(os.path.join(local, name), "wb") as f:
                f.write(os.urandom(ckpt_mb * 2**20 * share + 4096))
        store.commit(step * 10, local)


def scrub_forever(url: str, mb_per_s: float, newest: int) -> None:
    """The child: pass after pass, each re-reading everything; one JSON line per pass."""
    from storage.checkpoints import CheckpointStore
    from storage.events import EventLog
    from storage.scrub import ScrubPolicy, scrub

    policy = ScrubPolicy(newest=newest, mb_per_s=mb_per_s, reverify_s=0.0)
    while True:
        with EventLog(url, RUN, "scrub") as events:
            report = scrub(CheckpointStore(url, RUN), events, policy)
        print(json.dumps({"bytes": report.bytes_read, "s": report.seconds}), flush=True)


def bytes_read(pid: int) -> int:
    """What a process has read so far (read syscalls, page cache included)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_steps(model, opt, x, seconds: float) -> float:
    """Mean step time over whole steps for about `seconds`."""
    from benchmarks.checkpoint_stall import step

    began, n = time.perf_counter(), 0
    while (elapsed := time.perf_counter() - began) < seconds or n == 0:
        step(model, opt, x)
        n += 1
    return elapsed / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb-per-s", type=float, default=16.0)
    p.add_argument("--checkpoints", type=int, default=3)
    p.add_argument("--ckpt-mb", type=int, default=64)
    p.add_argument("--model-mb", type=int, default=40)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--interval-s", type=float, default=1.5)
    p.add_argument("--child", nargs=3, metavar=("URL", "MB_PER_S", "NEWEST"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        scrub_forever(args.child[0], float(args.child[1]), int(args.child[2]))
        return 0

    import structlog
    import torch

    from benchmarks.checkpoint_stall import build

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    with tempfile.TemporaryDirectory(prefix="bench-scrub-") as scratch:
        url = os.path.join(scratch, "store")
        make_store(url, args.checkpoints, args.ckpt_mb, os.path.join(scratch, "local"))
        model, opt = build(args.model_mb, args.width)
        x = torch.randn(64, args.width)
        timed_steps(model, opt, x, 1.0)  # warm-up: allocator, Adam state
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", url, str(args.mb_per_s),
             str(args.checkpoints)], stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            time.sleep(2.0)  # its imports, so the first "on" interval is reading
            os.kill(child.pid, signal.SIGSTOP)
            off, on, on_s, read, cpu = [], [], 0.0, 0, 0.0
            for r in range(args.rounds):
                if r % 2 == 0:  # which side goes first alternates: no order bias
                    off.append(timed_steps(model, opt, x, args.interval_s))
                before, began = bytes_read(child.pid), time.perf_counter()
                cpu_before = cpu_seconds(child.pid)
                os.kill(child.pid, signal.SIGCONT)
                on.append(timed_steps(model, opt, x, args.interval_s))
                os.kill(child.pid, signal.SIGSTOP)
                on_s += time.perf_counter() - began
                read += bytes_read(child.pid) - before
                cpu += cpu_seconds(child.pid) - cpu_before
                if r % 2 == 1:
                    off.append(timed_steps(model, opt, x, args.interval_s))
        finally:
            os.kill(child.pid, signal.SIGCONT)
            child.terminate()
            out = child.communicate(timeout=30)[0]
    passes = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    print(json.dumps({
        "benchmark": "scrub", "metric": "step time with a scrub beside it / without",
        "value": round(statistics.median(a / b for a, b in zip(on, off)), 4),
        "ratio_of_means": round(statistics.mean(on) / statistics.mean(off), 4),
        "target": 1.02, "step_s_without": round(statistics.mean(off), 5),
        "step_s_with": round(statistics.mean(on), 5), "mb_per_s_limit": args.mb_per_s,
        "scrub_passes_completed": len(passes),
        "scrub_mb_per_s_while_running": round(read / on_s / 1e6, 1),
        # the CPU the scrub took while it ran, as a share of the cores the loop trains on:
        # what it can take from training at most, whatever else loads the machine
        "scrub_cpu_share_of_training_cores": round(cpu / (on_s * torch.get_num_threads()), 4),
        "rounds": args.rounds, "interval_s": args.interval_s, "checkpoints": args.checkpoints,
        "ckpt_mb": args.ckpt_mb, "model_mb": args.model_mb, "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "load_1m": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
