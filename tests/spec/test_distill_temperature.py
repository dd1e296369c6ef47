"""distill.temperature's floor: the coldest temperature the spec takes keeps the student's
loss finite; the value that made every loss NaN is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from common.errors import BadConfig
from spec import RunSpec
from spec.distill import MIN_TEMPERATURE
from tests.spec.helpers import demo
from trainer.distill import distill_loss


def _loss(temperature: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    student = (torch.randn(2, 8, 64, generator=gen) * 30).bfloat16()
    teacher = (torch.randn(2, 8, 64, generator=gen) * 30).bfloat16()
    targets = torch.randint(0, 64, (2, 8), generator=gen)
    return distill_loss(student, teacher, targets, alpha=0.5, temperature=temperature)


def test_the_coldest_temperature_keeps_a_bf16_students_loss_finite():
    assert torch.isfinite(_loss(MIN_TEMPERATURE))
    assert not torch.isfinite(_loss(1e-300))  # what the floor keeps out


def test_a_vanishing_temperature_is_refused_naming_the_field():
    with pytest.raises(BadConfig) as info:
        RunSpec.from_dict(demo(**{"distill.temperature": 1e-300}))
    assert info.value.field == "distill.temperature" and "0.05" in info.value.problem
    assert RunSpec.from_dict(demo(**{"distill.temperature": MIN_TEMPERATURE}))
