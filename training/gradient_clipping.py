"""Gradient clipping: torch's clip_grad_norm_ coefficient, with the total norm added up accurately at real size. Used by
the Trainer's step (training/core/trainer.py) and fused backward's per-tensor step (training/memory/fused_backward.py)."""
from __future__ import annotations

from typing import Callable

import torch


_NORM_CHUNK = 1 << 16  # elements per partial norm on a CPU (torch's fp32 norm is within 2e-7 up to this size)


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients' summed squared norm in fp64. On a CPU a large gradient is taken over chunks: torch 2.14's fp32
    norm there adds up in one long run and loses precision (0.07 % low at 2^24 elements, 0.5 % at 2^26), and asking
    it for fp64 makes a whole fp64 copy. CUDA's reduction adds partial sums in a tree, so there each is taken whole
    (tests/unit/test_gradient_clipping.py checks both; the GPU kit runs it on CUDA). torch's grouped norm
    (_foreach_norm, as clip_grad_norm_ uses) keeps it to a few kernels for the thousands of small tensors of a LoRA."""
    pieces = [chunk for g in grads for chunk in (g.detach().reshape(-1).split(_NORM_CHUNK) if g.device.type == "cpu"
                                                  else [g.detach()]) if chunk.numel()]
    if not pieces:
        return torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    return torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float32)).double().square().sum()


def clip_gradients(params, max_norm: float, ranks_sum: Callable[[torch.Tensor], None] | None = None) -> None:
    """torch's clip_grad_norm_ (the gradients scaled by max_norm / (total norm + 1e-6), at most 1), with the total
    norm added up accurately (`_squared_norm`: one Flux / SDXL layer is past 2^24 elements). Gradients that are
    DTensor shards (FSDP2, memory/sharded_weights.py) count their local part, and `ranks_sum` adds the ranks' sums
    (an all-reduce)."""
    with torch.no_grad():
        grads = [p.grad for p in params if p.grad is not None]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        if not grads and ranks_sum is None:
            return
        total = _squared_norm(grads)
        if ranks_sum is not None:
            ranks_sum(total)
        coefficient = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
