"""Knowledge distillation's loss, pure: a student learns from the labels and from a frozen
teacher's softened distribution (Hinton et al. 2015, "Distilling the Knowledge in a Neural
Network"; the formulation NeMo's and ModelOpt's logit distillation use):

    L = (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(p_teacher,T || p_student,T)

with p_x,T = softmax(logits_x / T). T^2 keeps the soft term's gradient on the scale of the
hard term's as T grows (the softened gradients shrink as 1/T^2). Both terms are means over
the scored targets only (targets equal to IGNORE: padding, document ends, quarantined
documents carry no loss), computed in fp32 whatever the model's precision. No host sync:
the step loop sums the loss on the device (trainer/loop.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.model import IGNORE


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                 targets: torch.Tensor, *, alpha: float, temperature: float) -> torch.Tensor:
    """The distillation loss of one micro-batch. logits: (B, T, V); targets: (B, T).

    The hard term is exactly the model's own cross-entropy (trainer/model.py GPT.forward),
    so alpha = 0 trains exactly as without a teacher."""
    vocab = student_logits.size(-1)
    s = student_logits.float().reshape(-1, vocab)
    t = teacher_logits.detach().float().reshape(-1, vocab)
    flat = targets.reshape(-1)
    ce = F.cross_entropy(s, flat, ignore_index=IGNORE)
    if alpha == 0.0:  # no soft term: not even its arithmetic (a 0 x inf would be NaN)
        return ce
    log_ps = F.log_softmax(s / temperature, dim=-1)
    log_pt = F.log_softmax(t / temperature, dim=-1)
    per_token = F.kl_div(log_ps, log_pt, log_target=True, reduction="none").sum(-1)
    scored = (flat != IGNORE).float()
    kl = (per_token * scored).sum() / scored.sum().clamp(min=1.0)
    return (1.0 - alpha) * ce + alpha * temperature * temperature * kl
