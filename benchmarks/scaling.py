"""Data-parallel scaling on this machine: the trainer's tokens/s at 1, 2 and 4 ranks, the
measured speed-up beside `mainspring plan`'s prediction for the same layout.

    .venv/bin/python benchmarks/scaling.py [--ranks 1 2 4] [--steps 40] [--threads 1]
                                           [--hosts 1|2] [--quick]

Each rank count is one torchrun launch of `python -m benchmarks.scaling --rank-loop`: the
trainer's GPT (`trainer.model`) in DeepSpeed's engine as the trainer builds it
(`trainer.engine.build_engine`: ZeRO-0, fp32, gloo, our AdamW), the same micro-batch per rank
(so the global batch grows with the ranks), fetch -> forward -> backward -> step with a
loss.item() per step, as benchmarks/overhead.py's bare loop. The rows are random tokens of
one document each: every rank and every step does the same work, which packed rows of
random cuts would not. One torch thread per rank (`--threads`), as overhead.py: at 4 ranks
on 2 cores the ranks share the cores, which the plan models (`ops.plan.cpu_share`).

The largest launch (4 ranks) runs on two hosts (`--hosts 2`, the default where network
namespaces can be made, as root): two torchrun nodes of 2 ranks, one in each of two Linux
network namespaces (tests/e2e/netns.py `NetnsCluster`), launched as
benchmarks/resume_hosts.py launches a segment — the supervisor's command with a gang member,
torchrun's static rendezvous on host 0's namespace address (so rank 0, which writes the
figures, is on host 0), gloo on each namespace's own interface. Its all-reduce, and so its
link probe, crosses the veth link, and the prediction uses the cross-host link it measured.
Both namespaces run on this machine's cores, so cpu_share applies to all 4 ranks on them as
before. Where namespaces cannot be made, it runs on one host and the JSON line says why
(`hosts_note`); `hosts` says which launches crossed hosts.

After its steps, each launch of 2 or more ranks measures the link: a torch.distributed
all_reduce of PROBE_BYTES of fp32 on the same gloo group, timed over repeats; the bytes each
rank sends in a ring all-reduce (`ops.plan.ring_allreduce_bytes`) over that time is the
link's bytes per second per rank at that rank count.

The cores are shared with other jobs, so while each launch's steps run this process counts
the other jobs' scheduling groups with a runnable thread (`GroupSampler`: with autogroup, a
session's threads weigh as one): the `background` the ranks share the cores with.

The prediction (`ops.plan.dp_speedup`): compute is the single-rank launch's measured step,
as CPU seconds per step (the step on a core of its own; its wall time is `step_1_s`),
stretched at each rank count by cpu_share(ranks, cores, threads, background) — the same rule
gives the one-rank step the speed-up is taken against; communication is the ring all-reduce
of the real gradient bytes (parameters x 4, fp32) at the link speed measured at that rank
count, none of it hidden (ZeRO-0 reduces after the backward pass). Measured speed-up:
tokens/s at G over tokens/s at 1, each the tokens of the timed steps over their wall time on
rank 0. `observed_share` (each rank's CPU seconds over the wall time) checks cpu_share;
`core_step_ratio` (each rank's CPU seconds per step over the lone rank's) checks the plan's
compute, which it keeps at the lone rank's for every rank count: co-running ranks on this
machine spend more (the all-reduce path's own CPU, a few percent, is in it and in the probe).
Prints one JSON line: {"figure": "scaling_speedup", "measured", "predicted", "error", ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ops.plan import cpu_share, dp_speedup, ring_allreduce_bytes

REPO = Path(__file__).resolve().parents[1]
# overhead.py's model: a step of ~0.1-0.2 s on one CPU core, ~1M parameters.
MODEL = {"model.d_model": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 4,
         "model.seq_len": 128, "train.micro_batch_tokens": 1024}
MASTER_PORT = 29500  # host 0's rendezvous store, on its namespace's own address (+ ranks)
PROBE_BYTES = 4 << 20  # 4 MiB of fp32: the size of this model's gradients
GRAD_WIRE_BYTES = 4  # ZeRO-0 fp32 all-reduces fp32 gradients


# ---- one launch (runs under torchrun) ------------------------------------------------------
def rank_loop(steps: int, warmup: int, probes: int, out: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from spec import preset
    from trainer.engine import build_engine, micro_batch_size
    from trainer.model import GPT

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")
    spec = preset("demo", **MODEL, **{"train.procs_per_node": world, "train.warmup_steps": 1})
    vocab = spec.data.tokenizer.vocab_size
    model = GPT(spec.model, vocab, seed=spec.seed)
    engine = build_engine(spec, model)
    rows, seq = micro_batch_size(spec), spec.model.seq_len
    gen = torch.Generator().manual_seed(spec.seed + rank)
    batches = [torch.randint(0, vocab, (rows, seq + 1), generator=gen) for _ in range(4)]
    for i in range(warmup + steps):
        if i == warmup:
            t0, cpu0, started = time.perf_counter(), time.process_time(), time.time()
        x = batches[i % len(batches)]
        _, loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        loss.item()  # a real loop looks at its loss
    loop_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    cpus = [cpu_s] * world
    if world > 1:
        dist.all_gather_object(cpus, cpu_s)
    link = probe_link(dist, torch, world, probes) if world > 1 else None
    if rank == 0:
        Path(out).write_text(json.dumps({
            "ranks": world, "loop_s": loop_s, "steps": steps, "tokens_per_step": rows * seq,
            "params": model.param_count(), "threads": torch.get_num_threads(),
            "allreduce_s": link, "cpu_s": cpus, "loop_window": [started, started + loop_s],
            "loss": loss.item()}))
    # All ranks leave together, as trainer/segment.py's ranks do: one tearing down its
    # process group while another is still in it dies with SIGABRT.
    dist.barrier()
    dist.destroy_process_group()


class GroupSampler:
    """Every 100 ms, the other jobs' scheduling groups with a runnable thread: Linux's CFS
    with autogroup (on here: /proc/sys/kernel/sched_autogroup_enabled) shares the cores
    evenly between sessions first, so a job's threads together weigh as one group, and each
    of torchrun's ranks, started in a session of its own, as one too. Our own process tree
    (this benchmark, torchrun and its ranks) is left out. A scan costs ~5 ms of one core."""

    def __init__(self) -> None:
        import threading

        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.samples.append((time.time(), len(other_runnable_groups(os.getpid()))))

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def other_runnable_groups(own: int) -> set[str]:
    """The autogroups (else the process ids) of runnable threads outside `own`'s tree."""
    groups = set()
    for path in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
        try:
            stat = path.read_text()
        except OSError:  # the thread ended while we looked
            continue
        if stat[stat.rindex(")") + 2] != "R":
            continue
        pid = int(path.parts[2])
        if descends(pid, own):
            continue
        groups.add(autogroup(pid) or str(pid))
    return groups


def autogroup(pid: int) -> str | None:
    """`pid`'s scheduling group, "/autogroup-N", or None where there is none to read: the
    file is empty for a kernel thread, in some containers and with autogroup off, and gone
    for a process that just ended."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()
    except OSError:
        return None
    return fields[0] if fields else None


def descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
    return False


def background(samples: list[tuple[float, int]], window: list[float]) -> float:
    """Pure: the mean count of other runnable groups over the samples inside the timed
    steps' window (all samples when none falls inside)."""
    inside = [n for t, n in samples if window[0] <= t <= window[1]] or [n for _, n in samples]
    return statistics.mean(inside) if inside else 0.0


def probe_link(dist, torch, world: int, repeats: int) -> float:
    """Median seconds of an all_reduce of PROBE_BYTES of fp32 over the gloo group."""
    buf = torch.ones(PROBE_BYTES // 4)
    times = []
    for i in range(repeats + 2):  # two warm-up rounds: gloo sets up its pairs lazily
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def launch(ranks: int, rank_args: list[str], threads: int, scratch: Path,
           extensions: str, cluster=None, nodes: int = 1) -> dict:
    """One launch of `ranks` ranks: one torchrun on this node, or (`nodes` > 1) one torchrun
    node per namespace host of `cluster`; rank 0's figures and the other jobs beside them."""
    from activities.supervise import child_env, trainer_command
    from benchmarks.resume_hosts import run_nodes

    out = scratch / f"ranks-{ranks}.json"
    args = [*rank_args, "--out", str(out)]
    env = child_env({"OMP_NUM_THREADS": str(threads), "TORCH_EXTENSIONS_DIR": extensions})
    sampler = GroupSampler()
    try:
        if nodes == 1:
            proc = subprocess.run(trainer_command("benchmarks.scaling", ranks, args), cwd=REPO,
                                  env=env, capture_output=True, text=True, check=False)
            code, log = proc.returncode, proc.stderr
        else:
            launches = node_launches(ranks, cluster.hosts[:nodes], args, env,
                                     port=MASTER_PORT + ranks)
            code, log = run_nodes(launches, [scratch / f"ranks-{ranks}-node{i}.log"
                                             for i in range(nodes)])
    finally:
        sampler.stop()
    if code:
        raise RuntimeError(f"{ranks}-rank loop on {nodes} host(s) failed ({code}): {log[-3000:]}")
    run = json.loads(out.read_text())
    return {**run, "background": background(sampler.samples, run["loop_window"]),
            "hosts": nodes}


def node_launches(ranks: int, hosts: list, rank_args: list[str], env: dict[str, str],
                  port: int) -> list[tuple[list[str], dict[str, str]]]:
    """Pure: (argv, environment) of each namespace host's torchrun node for one launch of
    `ranks` ranks over `hosts`, as benchmarks/resume_hosts.py launches trainer.segment: the
    supervisor's command with a gang member (static rendezvous, node ranks fixed, so rank 0
    is on host 0), the store on host 0's namespace address, and gloo told the host's own
    interface — without it, gloo advertises the address of the machine's hostname, which no
    namespace can reach. `argv` already runs inside the host's namespace."""
    from activities.contracts import GangMember
    from activities.supervise import trainer_command

    nnodes = len(hosts)
    if ranks % nnodes:
        raise ValueError(f"{ranks} ranks do not split evenly over {nnodes} hosts")
    master = f"{hosts[0].address}:{port}"
    session = f"scaling-{ranks}"
    out = []
    for i, host in enumerate(hosts):
        gang = GangMember(node=f"h{i}", node_rank=i, nnodes=nnodes, master=master,
                          session=session)
        cmd = trainer_command("benchmarks.scaling", ranks // nnodes, rank_args, gang=gang)
        out.append((host.argv(cmd), {**env, "GLOO_SOCKET_IFNAME": host.ifname}))
    return out


def host_split(ranks: list[int], hosts: int) -> dict[int, int]:
    """Pure: how many hosts each launch runs on. The largest launch spreads over `hosts`
    (evenly: torchrun nodes have one size), so its all-reduce, and the link its probe
    measures, crosses hosts; the smaller ones stay on one host, the base the speed-up is
    taken against and the one-host step between."""
    top = max(ranks)
    # nodes of two or more ranks: a short --ranks list (1 2) keeps its launches on one host
    split = hosts if hosts > 1 and top % hosts == 0 and top > hosts else 1
    return {g: split if g == top else 1 for g in ranks}


def choose_hosts(requested: int | None, unavailable: str | None) -> tuple[int, str | None]:
    """Pure: the hosts to use and, where fewer than asked or defaulted, why. Two namespace
    hosts by default; one where namespaces cannot be made here (`unavailable`, the reason
    tests/e2e/netns.py gives), said in the JSON line rather than failing the benchmark."""
    want = 2 if requested is None else requested
    if want > 1 and unavailable:
        return 1, f"one host: network namespaces unavailable ({unavailable})"
    return want, None


# ---- the figures (pure) ----------------------------------------------------------------------
def figures(runs: dict[int, dict], cores: int, threads: int = 1) -> dict:
    """Measured and predicted speed-ups from each launch's figures (keyed by ranks; 1 is the
    base), the prediction's inputs, and the error (predicted / measured - 1)."""
    one = runs[1]
    step_1 = one["loop_s"] / one["steps"]
    core_1 = statistics.mean(one["cpu_s"]) / one["steps"]
    grad_bytes = one["params"] * GRAD_WIRE_BYTES
    tps = {g: g * r["tokens_per_step"] * r["steps"] / r["loop_s"] for g, r in runs.items()}
    measured, predicted, error, link, comm = {}, {}, {}, {}, {}
    for g, r in sorted(runs.items()):
        if g == 1:
            continue
        link[g] = ring_allreduce_bytes(PROBE_BYTES, g) / r["allreduce_s"]
        model = dp_speedup(core_1, grad_bytes, g, link[g], cores, threads,
                           background=r["background"], base_background=one["background"])
        measured[g] = tps[g] / tps[1]
        predicted[g], comm[g] = model["speedup"], model["comm_s"]
        error[g] = predicted[g] / measured[g] - 1.0
    keys = lambda d: {str(k): v for k, v in d.items()}  # noqa: E731 — JSON keys
    return {"measured": keys(measured), "predicted": keys(predicted), "error": keys(error),
            "tokens_per_s": keys(tps), "step_1_s": step_1, "core_step_1_s": core_1,
            "grad_bytes": grad_bytes,
            "link_bytes_per_s": keys(link), "predicted_comm_s": keys(comm),
            "background_groups": {str(g): r["background"] for g, r in runs.items()},
            "cpu_share": {str(g): cpu_share(g, cores, threads, r["background"])
                          for g, r in runs.items()},
            # what each rank got: its CPU seconds over the wall time (a check on cpu_share)
            "observed_share": {str(g): statistics.mean(r["cpu_s"]) / r["loop_s"]
                               for g, r in runs.items()},
            # what each rank spent: its CPU seconds per step over the lone rank's (a check on
            # the plan's compute, which stays core_step_1_s at every rank count; the
            # all-reduce's own CPU is in it too, as is co-running ranks' slower compute)
            "core_step_ratio": {str(g): statistics.mean(r["cpu_s"]) / r["steps"] / core_1
                                for g, r in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=40, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--probes", type=int, default=20, help="timed all_reduce repeats")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=None,
                   help="namespace hosts for the largest launch (default: 2 where network "
                        "namespaces can be made, else 1, said in the JSON line)")
    p.add_argument("--quick", action="store_true", help="2 steps, 1 warm-up, 3 probes")
    p.add_argument("--rank-loop", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.probes = 2, 1, 3
    if args.rank_loop:
        rank_loop(args.steps, args.warmup, args.probes, args.out)
        return 0
    from benchmarks.harness import private_extensions
    from tests.e2e.netns import NetnsCluster, netns_unavailable

    extensions = private_extensions()  # DeepSpeed's CPU comm op built before any launch
    ranks = sorted({1, *args.ranks})
    cores = os.cpu_count() or 1
    hosts, note = choose_hosts(args.hosts, None)
    if max(host_split(ranks, hosts).values()) > 1:  # a launch would span hosts: can it?
        hosts, note = choose_hosts(args.hosts, netns_unavailable())
    split = host_split(ranks, hosts)
    rank_args = ["--rank-loop", "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--probes", str(args.probes)]
    with tempfile.TemporaryDirectory(prefix="mainspring-scaling-") as scratch, \
            contextlib.ExitStack() as stack:
        # the namespaces are made only for a launch that spans them, removed on exit
        cluster = (stack.enter_context(NetnsCluster(n_hosts=max(split.values())))
                   if max(split.values()) > 1 else None)
        runs = {g: launch(g, rank_args, args.threads, Path(scratch), extensions, cluster,
                          split[g]) for g in ranks}
    out = figures(runs, cores, args.threads)
    print(json.dumps({
        "figure": "scaling_speedup", **out, "target_error": 0.2,
        "ranks": ranks, "hosts": {str(g): n for g, n in split.items()}, "cores": cores,
        "threads_per_rank": args.threads,
        "steps": args.steps, "warmup": args.warmup, "probe_bytes": PROBE_BYTES,
        "allreduce_s": {str(g): r["allreduce_s"] for g, r in runs.items() if g > 1},
        "params": runs[1]["params"], "tokens_per_step_per_rank": runs[1]["tokens_per_step"],
        "model": {k.split(".")[1]: v for k, v in MODEL.items() if k.startswith("model.")},
        "layout": layout(split), **({"hosts_note": note} if note else {}),
        "load_avg_1m": os.getloadavg()[0]}))
    return 0


def layout(split: dict[int, int]) -> str:
    """Pure: the JSON line's words for where each launch ran."""
    many = {g: n for g, n in split.items() if n > 1}
    one = " and ".join(str(g) for g in sorted(split) if g not in many)
    where = "one host" if not many else "; ".join(
        [f"{one} rank(s) on one host",
         *(f"{g} as {n} torchrun nodes of {g // n} ranks in {n} network namespace hosts "
           "(gloo over veth pairs and a bridge)" for g, n in sorted(many.items()))])
    return f"dp (ZeRO-0, fp32, gloo), {where}; all on this machine's cores"


if __name__ == "__main__":
    sys.exit(main())
