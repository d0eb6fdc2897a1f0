"""Gradient clipping (training/gradient_clipping.py): torch's clip coefficient, the total norm added up accurately."""
from __future__ import annotations

import pytest
import torch

from headroom.training.gradient_clipping import clip_gradients


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_gradient_clipping_adds_up_the_norm_of_a_real_size_gradient_accurately(device):
    """A gradient past 2^24 elements (one Flux / SDXL layer): the clip coefficient is max_norm over the exact norm
    (fp64 reference) within 1e-6 (torch 2.14's fp32 norm on a CPU is 0.07 % low at 2^24 elements, 0.5 % at 2^26);
    below max_norm nothing changes; several tensors clip together, as torch's clip_grad_norm_ does."""
    grad = (torch.randn(1 << 25, generator=torch.Generator().manual_seed(0)) * 1e-3).to(device)
    exact = grad.double().norm().item()
    params = [torch.nn.Parameter(torch.zeros(1 << 25, device=device)),
              torch.nn.Parameter(torch.zeros(3, device=device))]
    params[0].grad, params[1].grad = grad.clone(), torch.zeros(3, device=device)
    clip_gradients(params, 0.5 * exact)
    assert abs(params[0].grad.double().norm().item() / (0.5 * exact) - 1) < 1e-6
    params[0].grad = grad.clone()
    clip_gradients(params, 2 * exact)
    assert torch.equal(params[0].grad, grad)
    small = [torch.nn.Parameter(torch.zeros(2, device=device)) for _ in range(2)]
    small[0].grad, small[1].grad = torch.tensor([3.0, 0.0], device=device), torch.tensor([0.0, 4.0], device=device)
    clip_gradients(small, 1.0)  # total norm 5
    assert torch.allclose(torch.cat([p.grad for p in small]).cpu(), torch.tensor([0.6, 0.0, 0.0, 0.8]), atol=1e-6)


def test_bf16_and_fp32_gradients_clip_together_with_the_norm_taken_in_fp32():
    """A bf16 difference's gradients (fused backward clips each alone; mixed lists clip together): the norm is taken in
    fp32 (a bf16 norm keeps three digits), so the coefficient is the fp64 one within 1e-6."""
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(70_000, generator=g).bfloat16(), torch.randn(5, generator=g)]
    exact = torch.cat([x.double() for x in grads]).norm().item()
    params = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    clip_gradients(params, 1.0)
    assert abs(params[1].grad[0].double().item() / grads[1][0].double().item() - 1.0 / (exact + 1e-6)) < 1e-6
