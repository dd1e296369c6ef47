"""Two "hosts" for benchmarks/resume_exact.py `--layout tp2dp2-hosts`: a real `trainer.segment`
as two torchrun nodes in two Linux network namespaces (tests/e2e/netns.py `NetnsCluster`).

Each launch is the supervisor's (activities/supervise.py `trainer_command` with a gang
member): torchrun's static rendezvous on node 0's address (node ranks fixed, so a node's
ranks are node_rank x procs .. + procs - 1), `--nnodes 2 --session <this launch>` to the
segment, gloo over each namespace's `eth0`. Each node has its own workdir (its fast tier);
the durable store is a directory both namespaces see (they share the filesystem, not the
network), so node 1 uploads its ranks' files as a part and node 0 commits the one manifest,
and a resume reads the durable tier (trainer/checkpoint_manager.py).

`node_files` / `check_tp_inside_hosts`: which checkpoint files a node writes under
DeepSpeed's (data, tensor) mesh, tensor fastest; the benchmark asserts node 1's part
record holds exactly its ranks' files, so TP groups are inside a host and DP across.
`check_stages_across_hosts` (`--layout pp2-hosts`): each host's part holds its stage's
layer files, the stages in order across the hosts.
Needs root and iproute2 (`netns_unavailable()` says why not).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MASTER_PORT = 29500  # node 0's rendezvous store, on its namespace's own address
# per-rank file names (DeepSpeed's and trainer/state.py's): rank (dp, tp)'s ZeRO partition; tp rank t's module
# (written by data replica 0's rank of that shard)
OPTIM = re.compile(r"^(?:\w+_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
STATE = re.compile(r"^train_state-rank(\d+)\.pt$")  # each rank's own (RNGs, cursor)


def rank_of_file(name: str, tp: int) -> int | None:
    """Pure: the global rank that writes checkpoint file `name` under DeepSpeed's (data,
    tensor) mesh of TP `tp` (trainer/tensor_parallel.py `tp_ranks`: rank = dp x tp + tp
    rank); None for a file not named after a rank."""
    if m := OPTIM.match(name):
        return int(m.group(1)) * tp + int(m.group(2))
    if m := MODEL.match(name):
        return int(m.group(1))  # data replica 0's rank of shard t
    if m := STATE.match(name):
        return int(m.group(1))
    return None


def node_files(files: list[str], tp: int, procs_per_node: int, node: int) -> list[str]:
    """Pure: the rank files of `files` that node `node` writes (its ranks node x procs ..
    node x procs + procs - 1, torchrun's static rendezvous)."""
    return sorted(f for f in files if (r := rank_of_file(f, tp)) is not None
                  and r // procs_per_node == node)


def check_tp_inside_hosts(step_dir: Path, tp: int, procs_per_node: int, nnodes: int) -> dict:
    """Every node k > 0's part record of the committed step at `step_dir` lists exactly the
    rank files of node k's ranks, and each node's ranks hold whole TP groups (every shard of
    their data replicas): TP inside a host, DP across. SystemExit saying what differs."""
    files = sorted(p.name for p in step_dir.glob("*.pt"))
    out = {}
    for node in range(nnodes):
        mine = node_files(files, tp, procs_per_node, node)
        shards = {(int(m.group(1)), int(m.group(2)))
                  for f in mine if (m := OPTIM.match(f))}
        replicas = {d for d, _ in shards}
        if not shards or shards != {(d, t) for d in replicas for t in range(tp)}:
            raise SystemExit(f"node {node}'s ranks hold ZeRO partitions {sorted(shards)}: "
                             f"not whole TP {tp} groups")
        if node > 0:
            part = json.loads((step_dir / "parts" / f"node-{node}.json").read_text())
            written = sorted(f for f in part["files"] if f.endswith(".pt"))
            if written != mine:
                raise SystemExit(f"node {node} uploaded {written}, its ranks' files are {mine}")
        out[f"node{node}"] = {"data_replicas": sorted(replicas), "files": mine}
    return out


LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")  # a pipeline stage's layer file


def check_stages_across_hosts(step_dir: Path, nnodes: int) -> dict:
    """Under PP with a stage per host: every node k > 0's part record of the committed step
    at `step_dir` holds layer files, node 0 the rest, and the nodes' layers run in order
    (node k's all before node k + 1's): the pipeline's stages laid across the hosts.
    SystemExit saying what differs."""
    layers = {int(m.group(1)) for p in step_dir.glob("*.pt") if (m := LAYER.match(p.name))}
    held = {}
    for node in range(1, nnodes):
        part = json.loads((step_dir / "parts" / f"node-{node}.json").read_text())
        held[node] = sorted(int(m.group(1)) for f in part["files"] if (m := LAYER.match(f)))
    held[0] = sorted(layers - {i for node in held.values() for i in node})
    order = [held[n] for n in range(nnodes)]
    if not all(order) or any(a[-1] >= b[0] for a, b in zip(order, order[1:])):
        raise SystemExit(f"the nodes' layer files are {order}: not one stage per host, in order")
    return {f"node{n}": {"layers": held[n]} for n in range(nnodes)}


def resumed_from(node_dir: Path) -> int | str | None:
    """The step a node's segment restored (None: a fresh start; "none" without a start
    line), from its leader's progress file."""
    from common.protocol import StartLine, parse_line

    path = node_dir / "progress.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    starts = [p for p in map(parse_line, lines) if isinstance(p, StartLine)]
    return starts[-1].resumed_from if starts else "none"


def run_nodes(launches: list[tuple[list[str], dict[str, str]]], paths: list[Path],
              timeout: float = 900.0) -> tuple[int, str]:
    """Start every node's torchrun (`launches`: its argv, already inside its namespace, and
    its environment; its output to `paths`, a file: ranks outlive a killed torchrun), wait
    for all; when one fails the others get a grace and are then killed (a node whose peer
    died waits on it until gloo's timeout). The first non-zero exit and every node's log
    tail."""
    procs = []
    for (argv, env), path in zip(launches, paths):
        with open(path, "w") as log:
            procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
    deadline, failed = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed is None and any(p.poll() for p in procs):
            failed = now
        if now > deadline or (failed is not None and now > failed + 30):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    codes = [p.wait() for p in procs]
    text = "".join(f"--- node {i} (exit {c}) ---\n{path.read_text()[-3000:]}"
                   for i, (c, path) in enumerate(zip(codes, paths)))
    return next((c for c in codes if c), 0), text


@contextmanager
def namespace_hosts(nnodes: int = 2, timeout: float = 900) -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """A launcher with resume_exact's `run_segment` signature that runs the segment as
    `nnodes` torchrun nodes of `world // nnodes` ranks, one per namespace host; the
    namespaces (and whatever still runs in them) are removed on exit."""
    from activities.contracts import GangMember
    from activities.supervise import trainer_command
    from tests.e2e.netns import NetnsCluster

    ports = itertools.count(MASTER_PORT)
    with NetnsCluster(n_hosts=nnodes) as cluster:
        def launch(spec: str, dataset: str, to_step: int, workdir: Path, *, world: int,
                   attempt: int = 1) -> subprocess.CompletedProcess:
            session = f"bench-{secrets.token_hex(4)}"
            master = f"{cluster.hosts[0].address}:{next(ports)}"  # a fresh store per launch
            launches, logs = [], []
            for i, host in enumerate(cluster.hosts):
                node_dir = Path(f"{workdir}-h{i}")
                node_dir.mkdir(parents=True, exist_ok=True)
                gang = GangMember(node=f"h{i}", node_rank=i, nnodes=nnodes, master=master,
                                  session=session)
                args = ["--spec", spec, "--dataset", dataset, "--to-step", str(to_step),
                        "--workdir", str(node_dir), "--attempt", str(attempt),
                        "--nnodes", str(nnodes), "--session", session]
                # gloo advertises the address of the machine's hostname unless told an
                # interface (tests/e2e/test_netns.py)
                env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                       "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": host.ifname}
                logs.append(node_dir / "torchrun.log")
                launches.append((host.argv(trainer_command("trainer.segment", world // nnodes,
                                                           args, gang=gang)), env))
            code, text = run_nodes(launches, logs, timeout)
            # stdout: where each node's ranks started from (its leader's progress start line)
            starts = [resumed_from(Path(f"{workdir}-h{i}")) for i in range(nnodes)]
            return subprocess.CompletedProcess(launches[0][0], code,
                                               json.dumps({"resumed_from": starts}), text)

        yield launch
