"""Exact resume with packing on: train 0→N in one process vs 0→N/2, kill, resume N/2→N.

Runs the real `trainer.segment` under torchrun (CPU, gloo) on a corpus of variable-length
documents, then compares every tensor of the two step-N checkpoints (weights, optimizer
state, train state; with TP every rank's shard file, with PP every layer's file).
`--layout` picks the configurations:

    dp      world size 1 / ZeRO 0 and world size 2 / ZeRO 2 (the default)
    tp2     TP 2 on two ranks (one data replica, train.layout {tp: 2}) at ZeRO 0 and ZeRO 2
    tp2dp2  TP 2 x DP 2 on four ranks of one host (two replicas of two shards), ZeRO 2
    tp2dp2-hosts  the same as two torchrun nodes of two ranks in two network namespaces
            (TP inside a host, DP across; benchmarks/resume_hosts.py; needs root)
    pp2     PP 2 on two ranks (one pipeline, train.layout {pp: 2}, 2 micro-batches a step)
            at ZeRO 0 and ZeRO 1
    pp2-hosts  the same as two torchrun nodes of one rank each in two network namespaces:
            a stage per host, activations and gradients across the hosts' link (root)

Prints one JSON line: {"figure": "resume_exact", "value": <max abs weight difference over
the configs>, ...}. The second process starts from the committed step-N/2 checkpoint only,
as after a SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage.dataset import DatasetManifest, commit_manifest, token_dtype, write_shard
from storage.fs import resolve
from tests.trainer.helpers import run_segment, tiny_spec, write_spec
from trainer.safe_load import safe_torch_load
from trainer.state import flat_tensors

STEPS = 8
VOCAB = 512
# --layout: (world size, ZeRO stage, TP degree[, PP degree]) of each configuration measured
LAYOUTS = {"dp": ((1, 0, 1), (2, 2, 1)), "tp2": ((2, 0, 2), (2, 2, 2)),
           "tp2dp2": ((4, 2, 2),), "pp2": ((2, 0, 1, 2), (2, 1, 1, 2))}
# (world, ZeRO, TP, PP, nodes): world // nodes ranks on each of `nodes` torchrun nodes, one
# per network namespace host (benchmarks/resume_hosts.py)
LAYOUTS["tp2dp2-hosts"] = ((4, 2, 2, 1, 2),)
LAYOUTS["pp2-hosts"] = ((2, 0, 1, 2, 2), (2, 1, 1, 2, 2))  # a stage per host
LAYER_FILE = "layer_"  # a pipeline's weights: one file per layer (trainer/pipeline.py)


def skewed_dataset(root: Path, seed: int = 0) -> str:
    """Documents of 4..300 tokens (75x spread) ending in EOS, so packed rows mix documents."""
    rng = np.random.default_rng(seed)
    fs, directory = resolve(str(root / "dataset"))
    fs.makedirs(directory, exist_ok=True)
    shards = []
    for split, n_docs in (("train", 300), ("val", 30)):
        lengths = np.exp(rng.uniform(np.log(4), np.log(300), n_docs)).astype(np.int64)
        docs = [np.append((np.arange(n - 1) + rng.integers(0, VOCAB - 1)) % (VOCAB - 1), VOCAB - 1)
                for n in lengths]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
        tokens = np.concatenate(docs).astype(token_dtype(VOCAB))
        shards.append(write_shard(fs, directory, f"{split}-00000", split, tokens, starts))
    commit_manifest(fs, directory, DatasetManifest(content_hash="bench", vocab_size=VOCAB,
                                                   eos_id=VOCAB - 1, dtype=token_dtype(VOCAB),
                                                   shards=tuple(shards)))
    return fs.unstrip_protocol(f"{directory}/MANIFEST.json")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max((float((a[k].detach().double() - b[k].detach().double()).abs().max()) if a[k].numel() else 0.0
                for k in a if a[k].is_floating_point()), default=0.0)


def compare(root: Path, dataset: str, world: int, zero: int, tp: int = 1, pp: int = 1,
            nodes: int = 1) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    over = {"train.procs_per_node": world // nodes, "train.zero_stage": zero,
            "train.packing": True}
    if nodes > 1:
        over["train.nodes"] = nodes
    if tp > 1 or pp > 1:
        over["train.layout"] = {"tp": tp, "pp": pp, "zero": zero}
    if pp > 1:  # 1F1B needs at least as many micro-batches as stages
        over["train.grad_accum"] = pp
    runs, hosts = {}, {}
    with launcher(nodes) as launch:
        for name in ("straight", "resumed"):
            spec = write_spec(tiny_spec(root / name, **over), root / f"{name}.json")
            plan = [(STEPS, 1)] if name == "straight" else [(STEPS // 2, 1), (STEPS, 2)]
            for to_step, attempt in plan:
                proc = launch(spec, dataset, to_step, root / f"w-{name}-{to_step}",
                              world=world, attempt=attempt)
                if proc.returncode != 0:
                    raise SystemExit(proc.stderr[-4000:])
                if nodes > 1:  # every node restored the half-way commit (a resume, not a rerun)
                    starts = json.loads(proc.stdout)["resumed_from"]
                    hosts.setdefault("resumed_from", {})[f"{name}-{to_step}"] = starts
                    if starts != [None if to_step == plan[0][0] else STEPS // 2] * nodes:
                        raise SystemExit(f"{name} to step {to_step} started from {starts}")
            runs[name] = root / name / "runs" / "t" / "checkpoints" / f"step-{STEPS:09d}"
            if nodes > 1:  # which node wrote which files: TP inside a host, DP or PP across
                from benchmarks.resume_hosts import check_stages_across_hosts, check_tp_inside_hosts
                hosts[name] = check_stages_across_hosts(runs[name], nodes) if pp > 1 else \
                    check_tp_inside_hosts(runs[name], tp, world // nodes, nodes)
    weights, other, n_weights, n_all = 0.0, 0.0, 0, 0
    load = lambda p: flat_tensors(safe_torch_load(p, map_location="cpu"))  # noqa: E731
    files = sorted(p.name for p in runs["straight"].glob("*.pt"))
    if files != sorted(p.name for p in runs["resumed"].glob("*.pt")):
        raise SystemExit(f"the two step-{STEPS} checkpoints hold different files: {files}")
    for name in files:
        a, b = load(runs["straight"] / name), load(runs["resumed"] / name)
        module = {k: v for k, v in a.items()
                  if k.startswith("/module/") or name.startswith(LAYER_FILE)}
        if module:
            weights = max(weights, max_diff(module, {k: b[k] for k in module if k in b}))
        other, n_weights, n_all = max(other, max_diff(a, b)), n_weights + len(module), n_all + len(a)
    # Control: the weights did move between the resume point and the end, so 0.0 means something.
    model = "layer_01-model_states.pt" if pp > 1 else "mp_rank_00_model_states.pt"
    weights_of = lambda p: {k: v for k, v in load(p).items()  # noqa: E731
                            if k.startswith("/module/") or p.name.startswith(LAYER_FILE)}
    moved = max_diff(weights_of(runs["straight"] / model),
                     weights_of(runs["straight"].parent / f"step-{STEPS // 2:09d}" / model))
    return {"world_size": world, "zero_stage": zero, "tp": tp, "pp": pp, "files": files,
            "max_abs_weight_diff": weights,
            "max_abs_state_diff": other, "weight_tensors": n_weights, "tensors": n_all,
            "control_weight_change_resume_to_end": moved, **({"hosts": hosts} if hosts else {})}


def launcher(nodes: int):
    """run_segment on this host, or (nodes > 1) a context of `nodes` namespace hosts."""
    if nodes == 1:
        return nullcontext(run_segment)
    from benchmarks.resume_hosts import namespace_hosts
    return namespace_hosts(nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="dp")
    layout = parser.parse_args().layout
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dataset = skewed_dataset(root)
        configs = [compare(root / f"w{w}z{z}t{t}p{p}", dataset, w, z, t, p, n)
                   for w, z, t, p, n in (c + (1,) * (5 - len(c)) for c in LAYOUTS[layout])]
    # value: weights (mp_rank_00_model_states.pt "module", a pipeline's layer files);
    # max_abs_state_diff also covers
    # the optimizer files and train_state (RNGs, cursor).
    print(json.dumps({"figure": "resume_exact",
                      "value": max(c["max_abs_weight_diff"] for c in configs),
                      "max_abs_state_diff": max(c["max_abs_state_diff"] for c in configs),
                      "layout": layout, "steps": STEPS,
                      "resume_at": STEPS // 2, "packing": True, "device": "cpu",
                      "configs": configs, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
