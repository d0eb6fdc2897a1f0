"""AdamW on a CUDA device (optimizers.create_optimizer): torch's fused step, with no temporary the size of the
trained weights (the GPU kit's CUDA step runs this file; on a CPU it is skipped)."""
from __future__ import annotations

import pytest
import torch

from headroom.training.core.optimizers import OptimizerConfig, create_optimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_adamw_on_cuda_steps_a_full_fine_tune_without_a_weights_sized_temporary():
    params = [torch.nn.Parameter(torch.zeros(4096, 4096, device="cuda")) for _ in range(8)]  # 512 MiB fp32
    optimizer = create_optimizer(params, OptimizerConfig(name="AdamW", lr=1e-4), device=torch.device("cuda"))
    assert optimizer.defaults.get("fused") is True
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()  # makes the state (2 x the weights)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    optimizer.step()
    torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in params)
    assert torch.cuda.max_memory_allocated() - before < 0.05 * weights  # foreach's step: + 1 x the weights
