"""Full fine-tuning's engine pieces at real width (issue 27): a Flux-dev MLP (3072 -> 12288 -> 3072, each weight
37.7 M elements, past 2^24) trained in bf16 with fused backward and stochastic rounding, and a LoRA extracted from
what it changed. Tiny tensors hide what large ones break (the int32 bit trick of stochastic rounding, index ranges)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headroom.training.core.lora_extract import extract_lora
from headroom.training.core.optimizers import OptimizerConfig, create_optimizer
from headroom.training.memory.fused_backward import FusedBackward

pytestmark = pytest.mark.realsize

WIDTH, HIDDEN, STEPS = 3072, 12288, 3


def _mlp(dtype):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(HIDDEN, WIDTH))
    return mlp.to(dtype)


def _train(dtype, **options):
    mlp = _mlp(dtype)
    config = OptimizerConfig(name="AdamW", lr=1e-4)
    fused = FusedBackward(list(mlp.parameters()), lambda group: create_optimizer(group, config), **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(16, WIDTH, generator=generator)
        F.mse_loss(mlp(x.to(dtype)).float(), x).backward()
    fused.remove()
    return mlp, fused


def test_bf16_stochastic_fused_steps_and_extraction_at_flux_width():
    assert HIDDEN * WIDTH > 2 ** 24
    fp32, _ = _train(torch.float32)
    bf16, fused = _train(torch.bfloat16, bf16_stochastic=True, seed=2)
    assert fused.most_gradients_alive == 1 and all(p.grad is None for p in bf16.parameters())
    start32, start16 = _mlp(torch.float32), _mlp(torch.bfloat16)
    # The bf16 run goes the fp32 run's way (projection of its displacement on the fp32 one), weights stay finite.
    path = torch.cat([(p - q).flatten() for p, q in zip(fp32.parameters(), start32.parameters())])
    moved = torch.cat([(p.float() - q.float()).flatten() for p, q in zip(bf16.parameters(), start16.parameters())])
    along = (torch.dot(moved, path) / torch.dot(path, path)).item()
    print(f"\nFlux width MLP, {STEPS} AdamW steps: bf16 stochastic run {along:.3f} of the fp32 run's way")
    assert all(torch.isfinite(p.float()).all() for p in bf16.parameters())
    assert 0.8 < along < 1.2
    # A LoRA of the fine-tune's difference: the update of a few AdamW steps is low-rank enough that rank 64 holds
    # most of it; the stock loader's arithmetic (base + up @ down) gives it back.
    base = {k: v.float() for k, v in start32.state_dict().items()}
    trained = {k: v.float() for k, v in fp32.state_dict().items()}
    lora, report = extract_lora(base, trained, rank=64)
    up, down = lora["diffusion_model.0.lora_up.weight"], lora["diffusion_model.0.lora_down.weight"]
    assert up.shape == (HIDDEN, 64) and down.shape == (64, WIDTH) and report.whole == ["0.bias", "2.bias"]
    difference = trained["0.weight"] - base["0.weight"]
    error = ((up @ down - difference).norm() / difference.norm()).item()
    print(f"rank-64 LoRA of the first weight: {report.energy['0.weight']:.1%} of its energy, relative error {error:.3f}")
    assert abs((1 - error ** 2) - report.energy["0.weight"]) < 1e-3  # what it keeps is what the SVD says it keeps
    assert torch.equal(lora["diffusion_model.0.diff_b"], trained["0.bias"] - base["0.bias"])
