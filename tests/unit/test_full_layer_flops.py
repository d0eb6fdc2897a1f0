"""A full fine-tune's layer (training/core/adapters.FullLayer) costs what training the layer in place costs (issue 42):
one training step's FLOPs (forward + backward, counted by torch's FlopCounterMode) of a FullLayer on a Linear against
the plain Linear with its weight trained. The old layout (the base's output plus x D^T for a trained difference D)
took 5 products per step instead of 3: 1.667x."""
from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from headroom.training.core.adapters import AdapterConfig, AdapterSet


def _step_flops(module: torch.nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        module(x).square().sum().backward()
    return counter.get_total_flops()


def test_a_full_layers_training_step_costs_the_plain_layers():
    torch.manual_seed(0)
    root = torch.nn.Sequential(torch.nn.Linear(256, 1024)).requires_grad_(False)
    plain = torch.nn.Linear(256, 1024)
    adapters = AdapterSet(root, ["0"], AdapterConfig(kind="full", targets="all_layers"))
    adapters.attach(root)
    x = torch.randn(64, 256, requires_grad=True)  # a layer inside a network: its input needs a gradient too
    full, reference = _step_flops(root, x), _step_flops(plain, x)
    print(f"training step FLOPs: FullLayer {full}, plain Linear {reference} ({full / reference:.3f}x)")
    assert reference >= 3 * 2 * 64 * 256 * 1024  # forward, input gradient and weight gradient
    assert full <= 1.05 * reference
    layer = root[0]
    assert layer.full_trained_weight.grad is not None and layer.base_layer.weight.grad is None
