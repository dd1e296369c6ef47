"""The sweep's scaling-law prior: Step Law's optimal peak learning rate for a run.

Step Law (Li et al. 2025, "Predictable Scale: Part I — Optimal Hyperparameter Scaling Law in
Large Language Model Pretraining", arXiv 2503.04715, eq. 1): η_opt = 1.79 · N^-0.713 · D^0.307,
with N the non-embedding parameters and D the training tokens; fitted on 3,700 runs, within
0.094 % of the exhaustive grid's best loss. Pure and stdlib only.
"""

from __future__ import annotations

import math

from spec import ModelConfig, RunSpec

STEP_LAW_LR = (1.79, -0.713, 0.307)  # (coefficient, exponent of N, exponent of D)


def step_law_lr(non_embedding_params: float, tokens: float) -> float:
    """η_opt = 1.79 · N^-0.713 · D^0.307 (arXiv 2503.04715)."""
    if non_embedding_params <= 0 or tokens <= 0:
        raise ValueError(f"N={non_embedding_params} and D={tokens} must be positive")
    c, a, b = STEP_LAW_LR
    return c * non_embedding_params ** a * tokens ** b


def ffn_hidden(cfg: ModelConfig) -> int:
    """SwiGLU hidden size, as trainer/model.py builds it (ffn_mult · d · 2/3, up to 64)."""
    return int(math.ceil(cfg.ffn_mult * cfg.d_model * 2 / 3 / 64) * 64)


def non_embedding_params(cfg: ModelConfig) -> int:
    """The decoder blocks' weights (attention, SwiGLU, two RMSNorm gains each) and the final
    norm: the model's parameters without the token embedding and the output head."""
    head_dim = cfg.d_model // cfg.n_heads
    attention = 2 * cfg.d_model * cfg.n_heads * head_dim + 2 * cfg.d_model * cfg.n_kv_heads * head_dim
    block = attention + 3 * cfg.d_model * ffn_hidden(cfg) + 2 * cfg.d_model
    return cfg.n_layers * block + cfg.d_model


def planned_tokens(spec: RunSpec) -> int:
    """D: the main run's planned tokens, total_steps × tokens per optimizer step."""
    t = spec.train
    return t.total_steps * t.micro_batch_tokens * t.grad_accum * t.world_size


def prior_lr(spec: RunSpec) -> float:
    """Step Law's learning rate for the run the sweep warms up."""
    return step_law_lr(non_embedding_params(spec.model), planned_tokens(spec))
