"""The distillation loss (trainer/distill.py), on literal logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.distill import distill_loss
from trainer.model import IGNORE


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor([rows], dtype=torch.float32)  # (1, T, V)


STUDENT = logits([2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [-1.0, 3.0, 0.0])
TEACHER = logits([0.0, 1.0, 0.0], [1.0, -2.0, 0.5], [0.0, 0.0, 4.0])
TARGETS = torch.tensor([[0, 2, 1]])


def kl_row(teacher: list[float], student: list[float], t: float) -> float:
    """KL(softmax(teacher/t) || softmax(student/t)) of one position, by hand."""
    pt = [math.exp(v / t) for v in teacher]
    ps = [math.exp(v / t) for v in student]
    pt = [v / sum(pt) for v in pt]
    ps = [v / sum(ps) for v in ps]
    return sum(p * math.log(p / q) for p, q in zip(pt, ps))


def test_alpha_zero_is_exactly_the_models_cross_entropy():
    ce = F.cross_entropy(STUDENT.view(-1, 3), TARGETS.view(-1), ignore_index=IGNORE)
    got = distill_loss(STUDENT, TEACHER, TARGETS, alpha=0.0, temperature=2.0)
    assert torch.equal(got, ce)


def test_alpha_one_is_t_squared_times_the_mean_kl_of_the_softened_distributions():
    t = 2.0
    s, te = STUDENT[0].tolist(), TEACHER[0].tolist()
    expected = t * t * sum(kl_row(a, b, t) for a, b in zip(te, s)) / 3
    got = distill_loss(STUDENT, TEACHER, TARGETS, alpha=1.0, temperature=t)
    assert float(got) == pytest.approx(expected, rel=1e-5)
    # T^2: the same KL at T=1 is not scaled
    at_one = sum(kl_row(a, b, 1.0) for a, b in zip(te, s)) / 3
    assert float(distill_loss(STUDENT, TEACHER, TARGETS, alpha=1.0, temperature=1.0)) == \
        pytest.approx(at_one, rel=1e-5)


def test_the_mix_is_one_minus_alpha_ce_plus_alpha_soft_term():
    ce = float(distill_loss(STUDENT, TEACHER, TARGETS, alpha=0.0, temperature=3.0))
    soft = float(distill_loss(STUDENT, TEACHER, TARGETS, alpha=1.0, temperature=3.0))
    got = float(distill_loss(STUDENT, TEACHER, TARGETS, alpha=0.25, temperature=3.0))
    assert got == pytest.approx(0.75 * ce + 0.25 * soft, rel=1e-6)


def test_masked_targets_are_excluded_from_both_terms():
    masked = torch.tensor([[0, IGNORE, 1]])
    # the scored positions alone, as if the masked one were not there
    keep = [0, 2]
    alone = distill_loss(STUDENT[:, keep], TEACHER[:, keep], TARGETS[:, keep],
                         alpha=0.5, temperature=2.0)
    got = distill_loss(STUDENT, TEACHER, masked, alpha=0.5, temperature=2.0)
    assert float(got) == pytest.approx(float(alone), rel=1e-6)
    # and the masked position's logits do not matter at all
    other = STUDENT.clone()
    other[0, 1] = torch.tensor([9.0, -9.0, 9.0])
    assert float(distill_loss(other, TEACHER, masked, alpha=0.5, temperature=2.0)) == \
        pytest.approx(float(got), rel=1e-6)


def test_a_teacher_equal_to_the_student_adds_no_kl():
    got = distill_loss(STUDENT, STUDENT.clone(), TARGETS, alpha=1.0, temperature=4.0)
    assert float(got) == pytest.approx(0.0, abs=1e-6)


def test_the_loss_is_fp32_and_the_teacher_gets_no_gradient():
    student = STUDENT.to(torch.bfloat16).requires_grad_()
    teacher = TEACHER.clone().requires_grad_()
    loss = distill_loss(student, teacher, TARGETS, alpha=0.5, temperature=2.0)
    assert loss.dtype == torch.float32
    loss.backward()
    assert student.grad is not None and teacher.grad is None
