"""`python -m trainer.evaluate`: held-out loss and perplexity of committed checkpoints.

    python -m trainer.evaluate --spec SPEC.json --dataset MANIFEST_URI --steps 0,160 \
        --workdir DIR --out OUT.json

Single process, no DeepSpeed engine: ZeRO 0-2 weights come straight from DeepSpeed's
`mp_rank_00_model_states.pt` (`["module"]`) — with tensor parallelism each TP rank's
`mp_rank_RR_model_states.pt`, its shards put back together (trainer/merge.py
`merge_shards`), with pipeline parallelism each layer's `layer_NN-model_states.pt`,
named back as the GPT's (trainer/merge.py `merge_layers`); ZeRO-3 checkpoints hold only
partitions, which DeepSpeed's own `zero_to_fp32` reassembles from the optimizer shards.
Whatever the layout, the merged weights must be the model's, name for name and shape for
shape (trainer/merge.py `check_weights`). Writes `{"results": [{"step", "val_loss",
"perplexity"}]}` to OUT. Exit codes as trainer.segment: 0 done; 3 BadConfig/BadData
(error.json in DIR); 4 StorageUnavailable (error.json); anything else is a crash.

Every file is read weights-only (trainer/safe_load.py). A requested step whose checkpoint
is corrupt — a bad manifest or data file, a file the weights-only loader refuses, or
shards or layers that do not merge into the model's weights — is
not retried (it would fail the same way every time): a `checkpoint_corrupt` event is
recorded and the newest earlier committed step that verifies and loads is evaluated in
its place (its row carries its own step; OUT's `fallbacks` lists {requested, evaluated}).
Only when no step at or before it is usable does evaluation stop with BadData.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys

import structlog
import torch

from common.errors import BadConfig, BadData
from common.procs import torch_threads
from storage.checkpoints import CheckpointStore, CorruptCheckpoint, emit_corrupt, step_dir
from storage.dataset import load_manifest, read_split
from storage.events import EventLog
from trainer.child import load_spec, run_classified, write_json
from trainer.data import val_batches
from trainer.engine import micro_batch_size
from trainer.load_bounds import bytes_allowed, model_numel
from trainer.merge import (
    check_weights,
    gpt_name,
    layer_file,
    layer_files,
    merge_layers,
    merge_shards,
    tp_files,
)
from trainer.model import GPT
from trainer.safe_load import (
    UnsafeCheckpointFile,
    as_corrupt,
    force_weights_only,
    safe_torch_load,
)

log = structlog.get_logger(__name__)

MODEL_FILE = "mp_rank_00_model_states.pt"
ZERO3_PREFIX = "zero_pp_rank_"  # ZeRO-3 writes zero_pp_rank_R_mp_rank_00_model_states.pt


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> float:
    """Mean cross-entropy over the batches (each weighted by its token count), in eval mode."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        _, loss = model(x, y)
        total += float(loss) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count


def read_state_dict(local: str, step: int, max_bytes: int | None = None,
                    extra: dict | None = None, tied: bool = True) -> dict[str, torch.Tensor]:
    """The full fp32/native weights of a fetched checkpoint directory, whatever its ZeRO
    stage or layout (`extra`: its manifest's, which says how many TP shards to expect;
    `tied`: whether the model ties its embeddings, which a pipeline's files do not say).
    Every file is read by the bounded weights-only loader (`max_bytes`: what the model's
    shapes allow one file, trainer/load_bounds.py); any that fails raises
    UnsafeCheckpointFile; shards or layers that do not merge, CorruptCheckpoint."""
    return read_states(local, step, max_bytes, extra, tied)[0]


def read_states(local: str, step: int, max_bytes: int | None = None, extra: dict | None = None,
                tied: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`read_state_dict`, and the file each weight came from (what a misfit names)."""
    names = os.listdir(local)
    if layers := layer_files(names):
        # a pipeline's: one file per layer, written by its stage; named back as GPT's
        states = [(i, _layer_states(local, name, step, max_bytes)) for i, name in layers]
        merged = merge_layers(states, step, tied)  # first: it checks the names are strings
        return merged, {gpt_name(i, k): layer_file(i) for i, sd in states for k in sd}
    if os.path.exists(os.path.join(local, MODEL_FILE)):
        # one file per TP rank (one without TP), rank order; merged as AutoTP split them
        files = tp_files(names, step, extra)
        merged = merge_shards([_module_states(local, name, step, max_bytes) for name in files],
                              step)
        return merged, dict.fromkeys(merged, files[0] if len(files) == 1 else
                                     f"{files[0]} .. {files[-1]}")
    if any(n.startswith(ZERO3_PREFIX) for n in names):
        merged = _zero3_state_dict(local, max_bytes)
        return merged, dict.fromkeys(merged, f"{ZERO3_PREFIX}*")
    raise BadData(local, f"checkpoint step {step} has neither {MODEL_FILE} nor ZeRO-3 "
                  "model-state shards", "evaluate a checkpoint written by trainer.segment")


def _module_states(local: str, name: str, step: int, max_bytes: int | None
                   ) -> dict[str, torch.Tensor]:
    """Weights-only, with DeepSpeed's few plain classes allowed (trainer/safe_load.py);
    mmap: only the module's tensors are paged in."""
    sd = safe_torch_load(os.path.join(local, name), map_location="cpu", mmap=True,
                         max_bytes=max_bytes)
    if not (isinstance(sd, dict) and isinstance(sd.get("module"), dict)):
        raise CorruptCheckpoint(step, name, "a DeepSpeed model-states dict", type(sd).__name__)
    return sd["module"]


def _layer_states(local: str, name: str, step: int, max_bytes: int | None
                  ) -> dict[str, torch.Tensor]:
    """One pipeline layer's state dict (trainer/pipeline.py), weights-only, mmap."""
    sd = safe_torch_load(os.path.join(local, name), map_location="cpu", mmap=True,
                         max_bytes=max_bytes)
    if not isinstance(sd, dict):
        raise CorruptCheckpoint(step, name, "a layer's state dict", type(sd).__name__)
    return sd


def _zero3_state_dict(local: str, max_bytes: int | None) -> dict[str, torch.Tensor]:
    """DeepSpeed's zero_to_fp32 reassembles the partitions. It calls torch.load with
    weights_only=False: weights-only is forced in this process (trainer/safe_load.py), and
    every file first passes the bounded loader, which zero_to_fp32's own loads do not."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    force_weights_only()
    for name in sorted(os.listdir(local)):
        if name.endswith(".pt"):
            safe_torch_load(os.path.join(local, name), map_location="cpu", mmap=True,
                            max_bytes=max_bytes)
    parent, tag = os.path.split(local.rstrip("/"))
    try:
        return get_fp32_state_dict_from_zero_checkpoint(parent, tag=tag)
    except (MemoryError, OSError):  # this machine's state, not the files' (safe_load.py)
        raise
    except Exception as exc:  # noqa: BLE001 — the files' contents: the same on every retry
        raise UnsafeCheckpointFile(local, f"unreadable by zero_to_fp32: "
                                   f"{type(exc).__name__}: {str(exc)[:200]}") from None


def load_weights(model: torch.nn.Module, local: str, step: int, extra: dict | None = None
                 ) -> None:
    """The fetched checkpoint's weights into `model` (`extra`: its manifest's). Weights that
    are not the model's, name for name and shape for shape, are a CorruptCheckpoint naming
    the step and the file (WeightsMisfit where only shapes differ), never a RuntimeError."""
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", True)
    state, origin = read_states(local, step, bytes_allowed(model_numel(model)), extra, tied)
    files = ", ".join(sorted(set(origin.values())))[:200] or "model states"
    check_weights(state, model.state_dict(), step, origin, files)
    model.load_state_dict(state)


def parse_steps(text: str) -> list[int]:
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise BadConfig("--steps", f"{text!r} is not a comma-separated list of steps",
                        "pass e.g. --steps 0,160") from None
    if not steps or min(steps) < 0:
        raise BadConfig("--steps", f"{text!r} names no valid step", "pass e.g. --steps 0,160")
    return steps


def run_evaluate(args: argparse.Namespace) -> dict:
    spec = load_spec(args.spec)
    steps = parse_steps(args.steps)
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    committed = set(store.list_committed())
    missing = [s for s in steps if s not in committed]
    if missing:
        raise BadData(store.uri(missing[0]), f"no committed checkpoint at step(s) {missing}",
                      f"choose from the committed steps {sorted(committed)}")
    tokens, _ = read_split(args.dataset, "val")
    batches = val_batches(tokens, seq_len=spec.model.seq_len, batch_size=micro_batch_size(spec),
                          k=spec.train.eval_batches, source=args.dataset)
    # Evaluation runs here on CPU; the kernel choice does not change the weights, and a few
    # forward passes would not repay a compile.
    model_cfg = dataclasses.replace(spec.model, attention="auto", activation_checkpointing=False,
                                    compile=False)
    model = GPT(model_cfg, load_manifest(args.dataset).vocab_size, seed=spec.seed)
    results: dict[int, dict] = {}
    fallbacks = []
    with EventLog(spec.storage.durable, spec.run_id, "evaluator") as events:
        def on_corrupt(exc: CorruptCheckpoint) -> None:
            log.warning("checkpoint_corrupt", step=exc.step, file=exc.file,
                        expected=exc.expected, actual=exc.actual)
            emit_corrupt(events, exc)

        for step in steps:
            used = load_usable(store, model, step, sorted(committed), args.workdir, on_corrupt)
            if used != step:
                fallbacks.append({"requested": step, "evaluated": used})
            if used in results:
                continue
            val_loss = evaluate_model(model, batches)
            results[used] = {"step": used, "val_loss": val_loss,
                             "perplexity": math.exp(min(val_loss, 700.0))}
            log.info("evaluated", step=used, val_loss=val_loss, batches=len(batches))
    return {"results": list(results.values()), "fallbacks": fallbacks}


def load_usable(store: CheckpointStore, model: torch.nn.Module, step: int,
                committed: list[int], workdir: str, on_corrupt) -> int:
    """Load the newest committed step <= `step` that verifies and loads weights-only into
    `model`; return it. Each corrupt one on the way is passed to `on_corrupt`."""
    for cand in reversed([s for s in committed if s <= step]):
        local = os.path.join(workdir, "eval", step_dir(cand))
        shutil.rmtree(local, ignore_errors=True)
        try:
            manifest = store.fetch(cand, local)
            load_weights(model, local, cand, manifest.extra)
            return cand
        except CorruptCheckpoint as exc:
            on_corrupt(exc)
        except UnsafeCheckpointFile as exc:
            on_corrupt(as_corrupt(cand, exc))
        finally:
            shutil.rmtree(local, ignore_errors=True)
    raise BadData(store.uri(step), f"no committed checkpoint at or before step {step} verifies "
                  "and loads safely (see the checkpoint_corrupt events)",
                  "evaluate a step committed before the damage, or restore the files")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="RunSpec JSON file")
    p.add_argument("--dataset", required=True, help="dataset MANIFEST.json URI")
    p.add_argument("--steps", required=True, help="comma-separated committed steps, e.g. 0,160")
    p.add_argument("--workdir", required=True, help="local scratch directory (and error.json)")
    p.add_argument("--out", required=True, help="where to write the results JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    force_weights_only()  # zero_to_fp32's own loads too (trainer/safe_load.py)
    os.makedirs(args.workdir, exist_ok=True)
    error_path = os.path.join(args.workdir, "error.json")
    if os.path.exists(error_path):
        os.unlink(error_path)
    torch.set_num_threads(torch_threads(os.environ, os.cpu_count() or 1, ranks=1))
    return run_classified("evaluate", args.workdir,
                          lambda: write_json(args.out, run_evaluate(args)))


if __name__ == "__main__":
    sys.exit(main())
