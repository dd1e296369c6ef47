"""`python -m trainer.export`: a committed checkpoint's weights as safetensors + config.json.

    python -m trainer.export --spec SPEC.json --dataset MANIFEST_URI --step 160 \
        --workdir DIR --out OUT_DIR

OUT_DIR gets `model.safetensors` (our parameter names; a tied LM head is stored once, as
`embed.weight`) and `config.json`, which names the architecture and every shape, so
`load_exported(OUT_DIR)` rebuilds the model without the RunSpec. RoPE rotates interleaved
pairs (x0, x1), (x2, x3)…; a converter to Hugging Face `LlamaForCausalLM` (which rotates
halves) must permute the rows of wq/wk as Meta's conversion script does, so the config does
not claim that architecture. Exit codes as trainer.evaluate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

import structlog
import torch
from safetensors.torch import load_file, save_file

from common.errors import BadData
from spec import ModelConfig
from storage.checkpoints import CheckpointStore, CorruptCheckpoint, step_dir
from storage.dataset import load_manifest
from trainer.child import load_spec, run_classified
from trainer.evaluate import read_states
from trainer.merge import check_weights
from trainer.model import GPT, ffn_hidden
from trainer.safe_load import UnsafeCheckpointFile, force_weights_only

log = structlog.get_logger(__name__)

ARCHITECTURE = "MainspringGPT"
WEIGHTS, CONFIG = "model.safetensors", "config.json"


def export_config(cfg: ModelConfig, vocab_size: int) -> dict:
    return {"architectures": [ARCHITECTURE],
            "description": "Llama-style decoder: RMSNorm (eps 1e-6), RoPE on interleaved pairs "
                           "(base 10000), SwiGLU, grouped-query attention, no biases",
            "vocab_size": vocab_size, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "ffn_mult": cfg.ffn_mult,
            "ffn_hidden": ffn_hidden(cfg), "seq_len": cfg.seq_len,
            "tie_embeddings": cfg.tie_embeddings, "rope_base": 10000.0, "rms_norm_eps": 1e-6,
            "torch_dtype": "float32"}


def save_exported(state: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int,
                  out_dir: str) -> None:
    """Write weights (fp32, contiguous, tied head dropped) and the config."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().float().contiguous().cpu() for k, v in state.items()
               if not (cfg.tie_embeddings and k == "lm_head.weight")}
    save_file(tensors, os.path.join(out_dir, WEIGHTS), metadata={"architecture": ARCHITECTURE})
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump(export_config(cfg, vocab_size), f, indent=2)


def load_exported(out_dir: str) -> GPT:
    with open(os.path.join(out_dir, CONFIG)) as f:
        conf = json.load(f)
    if conf.get("architectures") != [ARCHITECTURE]:
        raise BadData(out_dir, f"config.json names {conf.get('architectures')}",
                      f"export with trainer.export ({ARCHITECTURE})")
    fields = {k: conf[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_mult",
                                   "seq_len", "tie_embeddings")}
    model = GPT(ModelConfig(**fields, attention="auto"), conf["vocab_size"])
    missing, unexpected = model.load_state_dict(load_file(os.path.join(out_dir, WEIGHTS)),
                                                strict=False)
    allowed = {"lm_head.weight"} if conf["tie_embeddings"] else set()
    if set(missing) - allowed or unexpected:
        raise BadData(out_dir, f"weights do not fit the config (missing {missing}, "
                      f"unexpected {unexpected})", "re-export the checkpoint")
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="RunSpec JSON file")
    p.add_argument("--dataset", required=True, help="dataset MANIFEST.json URI (vocab size)")
    p.add_argument("--step", type=int, required=True, help="a committed step")
    p.add_argument("--workdir", required=True, help="local scratch directory (and error.json)")
    p.add_argument("--out", required=True, help="output directory")
    return p.parse_args(argv)


def run_export(args: argparse.Namespace) -> None:
    spec = load_spec(args.spec)
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    if args.step not in set(store.list_committed()):
        raise BadData(store.uri(args.step), f"no committed checkpoint at step {args.step}",
                      f"choose from {store.list_committed()}")
    local = os.path.join(args.workdir, "export", step_dir(args.step))
    shutil.rmtree(local, ignore_errors=True)
    vocab_size = load_manifest(args.dataset).vocab_size
    try:
        manifest = store.fetch(args.step, local)
        state, origin = read_states(local, args.step, extra=manifest.extra,
                                    tied=spec.model.tie_embeddings)
        # the weights must be the model config.json will describe, name for name and shape
        # for shape: checked against the model's shapes on the meta device (no memory)
        cfg = dataclasses.replace(spec.model, attention="auto", compile=False,
                                  activation_checkpointing=False)
        with torch.device("meta"):
            expected = GPT(cfg, vocab_size, seed=0).state_dict()
        check_weights(state, expected, args.step, origin, "model states")
    except (CorruptCheckpoint, UnsafeCheckpointFile) as exc:  # the same on every retry
        raise BadData(store.uri(args.step), str(exc), "export another committed step") from None
    save_exported(state, spec.model, vocab_size, args.out)
    shutil.rmtree(local, ignore_errors=True)
    log.info("exported", step=args.step, out=args.out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    force_weights_only()  # a person starts it, with whatever environment (trainer/safe_load.py)
    os.makedirs(args.workdir, exist_ok=True)
    return run_classified("export", args.workdir, lambda: run_export(args))


if __name__ == "__main__":
    sys.exit(main())
