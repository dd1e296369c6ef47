"""RunSpec's `model` section: the decoder trainer/model.py builds (FLOPs: trainer/throughput.py).
Stdlib only; re-exported by spec."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from spec.codec import num
from spec.codec import positive as _positive
from spec.codec import require as _require


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Llama-style decoder; vocab size comes from the dataset's tokenizer."""

    # Added fields, with the default they came with: out of spec_hash at that default
    # (spec/run.py without_added), so a run claimed before they existed keeps its hash.
    ADDED: ClassVar[dict[str, Any]] = {"compile": False}

    d_model: int = num(128, 2, 1 << 16)  # a head at least 2 wide: RoPE rotates pairs
    n_layers: int = num(4, 1, 1024)
    n_heads: int = num(4, 1, 1024)
    n_kv_heads: int = num(4, 1, 1024)
    # SwiGLU hidden = ffn_mult * d_model * 2/3, rounded up to 64
    ffn_mult: float = num(4.0, 0, 64, lo_open=True)
    seq_len: int = num(128, 1, 1 << 20)
    tie_embeddings: bool = True
    attention: str = "auto"  # auto | flash | sdpa
    activation_checkpointing: bool = False
    # torch.compile each transformer block (trainer/model.py compile_blocks): on an H200 the
    # ~1B model's MFU rises from 36 % to 56 % of dense bf16 peak; the first steps pay the
    # compile (about a minute there). Meant for CUDA; on CPU it compiles too, slowly.
    compile: bool = False

    def __post_init__(self) -> None:
        _positive(self, "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_mult", "seq_len")
        _require(self.d_model % self.n_heads == 0, "d_model",
                 f"{self.d_model} is not divisible by n_heads={self.n_heads}",
                 "choose d_model as a multiple of n_heads")
        _require(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
                 f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}",
                 "choose n_kv_heads dividing n_heads")
        _require((self.d_model // self.n_heads) % 2 == 0, "d_model",
                 "head dimension must be even for RoPE", "make d_model / n_heads even")
        _require(self.attention in ("auto", "flash", "sdpa"), "attention",
                 f"unknown attention {self.attention!r}", "use auto, flash or sdpa")


def ffn_hidden(cfg: ModelConfig) -> int:
    """SwiGLU hidden size: ffn_mult * d_model * 2/3 rounded up to a multiple of 64 (Llama)."""
    raw = cfg.ffn_mult * cfg.d_model * 2 / 3
    return int(math.ceil(raw / 64) * 64)


def param_count(cfg: ModelConfig, vocab_size: int) -> int:
    """The parameters trainer/model.py's GPT holds for `cfg` and a vocabulary (its
    `param_count`, without building it): per block the q/k/v/o projections (k and v at the
    kv heads' width), SwiGLU's three matrices and two RMSNorm gains; the embedding, the
    output head unless tied, and the final norm."""
    d, head = cfg.d_model, cfg.d_model // cfg.n_heads
    attention = 2 * d * d + 2 * d * cfg.n_kv_heads * head
    block = attention + 3 * d * ffn_hidden(cfg) + 2 * d
    embeddings = vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return cfg.n_layers * block + embeddings + d
