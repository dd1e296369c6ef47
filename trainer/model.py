"""Llama-style decoder-only GPT: RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases.

Built from `ModelConfig` plus the tokenizer's vocab size. Initialisation is a pure function
of the seed (its own torch.Generator), so every rank and every fresh start builds the same
weights without touching the global RNG.

Packed rows: `forward(..., position_ids=, doc_ids=)` runs several documents per row with no
attention across documents. RoPE reads the per-token positions (reset per document); SDPA
gets a block-diagonal causal boolean mask; flash-attn (CUDA, fp16/bf16) gets the same
segments as cumulative sequence lengths for `flash_attn_varlen_func`.
"""

from __future__ import annotations

import math

import structlog
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from common.errors import BadConfig
from spec import ModelConfig
from spec.model import ffn_hidden  # noqa: F401 — re-exported: trainer.export and tests read it here

log = structlog.get_logger(__name__)

try:  # optional, CUDA only (the `[gpu]` extra)
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except Exception:  # ImportError, or a CUDA/ABI mismatch raised at import time
    flash_attn_func = flash_attn_varlen_func = None

_LOGGED_CHOICE: set[str] = set()
IGNORE = -100  # target id that carries no loss (F.cross_entropy's default ignore_index)
HALF = (torch.float16, torch.bfloat16)
PACKED_MODES = ("auto", "mask", "segments")


def packed_mode(kernel: str, dtype: torch.dtype, device: torch.device, requested: str) -> str:
    """How packed rows attend: 'flash_varlen', 'segments' or 'mask'. Logged once per choice."""
    if kernel == "flash" and dtype in HALF:
        mode = "flash_varlen"
    elif requested != "auto":
        mode = requested
    else:
        mode = "segments" if device.type == "cpu" else "mask"
    if f"packed:{mode}" not in _LOGGED_CHOICE:
        _LOGGED_CHOICE.add(f"packed:{mode}")
        log.info("packed_attention", mode=mode, kernel=kernel, dtype=str(dtype))
    return mode


def choose_attention(requested: str, cuda: bool) -> str:
    """'flash' or 'sdpa'. `flash` demands flash-attn on CUDA; `auto` uses it when it can."""
    have_flash = cuda and flash_attn_func is not None
    if requested == "flash" and not have_flash:
        raise BadConfig("model.attention", "flash needs CUDA and the flash-attn package",
                        "install the [gpu] extra on a CUDA machine, or use auto or sdpa")
    choice = "flash" if requested == "flash" or (requested == "auto" and have_flash) else "sdpa"
    if choice not in _LOGGED_CHOICE:
        _LOGGED_CHOICE.add(choice)
        log.info("attention_kernel", kernel=choice, requested=requested, cuda=cuda)
    return choice


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, base: float = 10000.0) -> tuple[torch.Tensor, ...]:
    """cos, sin of shape (seq_len, head_dim // 2) — RoFormer (Su et al. 2021)."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


def rope_at(cos: torch.Tensor, sin: torch.Tensor, t: int,
            position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of each token, shaped to broadcast over (B, T, H, D/2).

    Without position_ids every row counts 0..t-1; with them (packed rows) each document
    restarts at 0, so a document rotates exactly as it would alone.
    """
    if position_ids is None:
        return cos[:t, None, :], sin[:t, None, :]
    return cos[position_ids][:, :, None, :], sin[position_ids][:, :, None, :]


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True = may attend: same document and not in the future."""
    t = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal)[:, None]


def cu_seqlens(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative segment lengths of the flattened (B*T) batch for flash_attn_varlen_func.

    A segment ends where the document id changes or a row ends, so rows never merge.
    """
    b, t = doc_ids.shape
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = new.flatten().nonzero().flatten()
    total = torch.tensor([b * t], device=doc_ids.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


@torch.compiler.disable
def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                      gqa: bool) -> torch.Tensor:
    """Causal SDPA over each segment of flattened (N, H, D) tensors: varlen attention
    without flash-attn. Costs sum(len²) instead of T² per row, and each call can use the
    fused causal kernel, which a dense boolean mask cannot (about 2x slower on CPU).
    Left eager in a compiled block: its shapes change with every batch's documents, and
    tracing them would recompile on every step."""
    out = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        # (1, H, L, D): the fused CPU kernel wants 4-D inputs (3-D falls back, ~2x slower).
        y = F.scaled_dot_product_attention(q[None, s:e].transpose(1, 2),
                                           k[None, s:e].transpose(1, 2),
                                           v[None, s:e].transpose(1, 2), is_causal=True,
                                           enable_gqa=gqa)
        out.append(y[0].transpose(0, 1))
    return torch.cat(out)


def apply_rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); c, s from `rope_at`. Rotates interleaved pairs (x0, x1), (x2, x3), ..."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.kernel = "sdpa"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, cu: torch.Tensor | None = None,
                max_len: int = 0) -> torch.Tensor:
        """mask: block-causal (SDPA); cu/max_len: the same segments for flash varlen."""
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, self.n_kv, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, self.n_kv, self.head_dim)
        flash = self.kernel == "flash" and q.dtype in HALF
        if cu is not None and flash:  # packed: (B*T, H, D) with segment boundaries
            y = flash_attn_varlen_func(q.reshape(b * t, self.n_heads, -1),
                                       k.reshape(b * t, self.n_kv, -1),
                                       v.reshape(b * t, self.n_kv, -1),
                                       cu, cu, max_len, max_len, causal=True)
        elif cu is not None:
            y = segment_attention(q.reshape(b * t, self.n_heads, -1),
                                  k.reshape(b * t, self.n_kv, -1),
                                  v.reshape(b * t, self.n_kv, -1), cu, self.n_kv != self.n_heads)
        elif flash and mask is None:
            y = flash_attn_func(q, k, v, causal=True)  # (B, T, H, D), GQA native
        else:
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads).transpose(1, 2)
        return self.wo(y.reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = ffn_hidden(cfg)
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.d_model), Attention(cfg)
        self.ffn_norm, self.ffn = RMSNorm(cfg.d_model), SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, cu: torch.Tensor | None = None,
                max_len: int = 0) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cu, max_len)
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, *, seed: int = 0,
                 cuda: bool | None = None) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        # torch's default layer init draws from the global RNG; fork it so building a model
        # leaves the training RNG streams untouched (our own init below is what counts).
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(vocab_size, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.d_model // cfg.n_heads, cfg.seq_len)
        # Non-persistent: derived from the config, so they stay out of checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        kernel = choose_attention(cfg.attention, torch.cuda.is_available() if cuda is None else cuda)
        for block in self.blocks:
            block.attn.kernel = kernel
        # Packed rows without flash: "segments" (per-document causal SDPA) on CPU, where it is
        # faster; "mask" (one block-diagonal boolean mask) on CUDA, where per-segment calls
        # would cost a kernel launch each. "auto" picks by device.
        self.packed_sdpa = "auto"
        self.reset_parameters(seed)
        if cfg.compile:
            compile_blocks(self)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers)."""
        gen = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():  # named_parameters dedups the tied weight
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm gains
            else:
                std = resid_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std, generator=gen)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weight counted once

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) token ids. Returns logits (B, T, V) and mean CE loss or None.

        Packed rows pass position_ids and doc_ids (B, T): tokens attend only within their
        document. Targets equal to IGNORE (-100: padding, document ends) carry no loss.
        """
        x = self.embed(idx)
        cos, sin = rope_at(self.rope_cos, self.rope_sin, idx.shape[1], position_ids)
        mask, cu, max_len = None, None, 0
        if doc_ids is not None:
            dtype = (torch.get_autocast_dtype(x.device.type)  # what q, k, v will be
                     if torch.is_autocast_enabled(x.device.type) else x.dtype)
            mode = packed_mode(self.blocks[0].attn.kernel, dtype, x.device, self.packed_sdpa)
            if mode == "mask":
                mask = block_causal_mask(doc_ids)
            else:  # flash varlen, or SDPA per segment
                cu, max_len = cu_seqlens(doc_ids)
                # With model.compile, a batch's segment count and longest segment must not
                # be guarded on, or each new value recompiles: the count is a dynamic size,
                # and only flash varlen reads the longest segment.
                torch._dynamo.maybe_mark_dynamic(cu, 0)
                max_len = max_len if mode == "flash_varlen" else 0
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, mask, cu, max_len, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, cu, max_len)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=IGNORE)
        return logits, loss


def compile_blocks(model: GPT) -> None:
    """torch.compile each transformer block in place, as torchtitan does: the blocks are
    alike, so one compiled graph serves them all (one compile, not n_layers), and the loop
    between them, activation checkpointing around a block, and DeepSpeed's hooks stay
    eager. In place (`Module.compile`, no wrapper module), so parameter names and
    checkpoints are the same compiled or not."""
    for block in model.blocks:
        block.compile()


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never norm gains (nanoGPT / Llama practice)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]
