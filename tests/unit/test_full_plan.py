"""The full fine-tune planner (training/memory/full_plan.py, issue 27): each option changes the plan by its own cost."""
from __future__ import annotations

import math

import pytest

from headroom.training.memory.full_plan import FullTraining, estimate_full
from headroom.training.memory.planner import TrainableSpec
from headroom.training.memory.policy import GIB

from test_planner import SHAPE, toy_description

SHAPES = ((3072, 3072), (12288, 3072), (3072, 12288), (3072,)) * 4


def _step(optimizer="AdamW", **options):
    plan = estimate_full(toy_description(), TrainableSpec(SHAPES, optimizer), SHAPE, FullTraining(**options),
                         budget_bytes=24 * GIB)
    return plan, plan.phase("training step").items


def test_each_option_costs_what_its_feature_says():
    numel = sum(math.prod(s) for s in SHAPES)
    largest = 12288 * 3072
    _, plain = _step(weights="fp32_masters", fused_backward=False)
    assert plain["fp32 master weights"] == 4 * numel and plain["bf16 copy the model computes with"] == 2 * numel
    assert plain["gradients"] == 2 * numel and plain[f"optimizer state (AdamW)"] == 8 * numel
    _, fused = _step(weights="fp32_masters", fused_backward=True)
    assert "gradients" not in fused and fused["one parameter's gradient (fused backward)"] == 2 * largest
    _, stochastic = _step(weights="bf16_stochastic")
    assert stochastic["trained weights (bf16, stochastic rounding)"] == 2 * numel
    assert "fp32 master weights" not in stochastic
    assert stochastic["one parameter's optimizer step in flight"] == 8 * largest  # fp32 stand-in + fp32 gradient
    host_plan, on_host = _step(weights="fp32_masters", optimizer_state="cpu")
    assert "optimizer state (AdamW)" not in on_host and "fp32 master weights" not in on_host
    assert host_plan.host_bytes == {"fp32 master weights": 4 * numel, "optimizer state (AdamW)": 8 * numel}
    _, factored = _step("Adafactor")
    assert factored["optimizer state (Adafactor)"] < numel  # factored second moments: rows + columns
    totals = [plan.phase("training step").total for plan in
              (_step(weights="fp32_masters", fused_backward=False)[0], _step(weights="fp32_masters")[0], _step()[0],
               _step("Adafactor")[0])]
    assert totals == sorted(totals, reverse=True)  # each option saves memory
    assert "fused backward" in _step()[0].to_text()


def test_full_training_refuses_unknown_options():
    with pytest.raises(ValueError, match="full fine-tune weights"):
        FullTraining(weights="fp16")
    with pytest.raises(ValueError, match="optimizer_state"):
        FullTraining(optimizer_state="disk")
