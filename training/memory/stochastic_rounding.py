"""bf16 weights trained without fp32 masters: each update is computed in fp32 and rounded to bf16 stochastically.

    weight.copy_(stochastic_round_to_bf16(updated_fp32, generator))

Rounding to nearest loses every update smaller than half a bf16 step (bf16 keeps 8 significant bits: a weight of 1.0
ignores any change under 2^-9), which is most of them at fine-tuning learning rates, so a bf16 model rounded to
nearest stops learning. Rounding up or down at random, with the probability of the distance to each neighbour, keeps
each update in expectation: the weight is an unbiased estimate of the fp32 master it replaces (Gupta et al. 2015;
kohya sd-scripts and OneTrainer fine-tune whole models in bf16 so). Headroom rounds a full fine-tune's bf16 difference
so (LoRA Config full_precision bf16_stochastic, stepped by fused_backward.py): 2 bytes per trained weight and its
gradient instead of 4; the noise is one bf16 step of the difference at most per update. fp32 remains the exact option.

Written here because neither torch nor ComfyUI has it for bf16: comfy.float.stochastic_rounding rounds bf16 to
nearest (it is stochastic for fp8 only), and torch has no stochastic-rounding cast.
"""
from __future__ import annotations

import torch


_LOW_BITS = 1 << 16  # the fp32 mantissa bits a bf16 drops


def stochastic_round_to_bf16(value: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`value` (fp32) rounded to bf16 up or down at random, unbiased: adding uniform noise below the 16 bits bf16
    drops, then truncating them, rounds the magnitude up with probability (dropped bits) / 2^16. On the sign-magnitude
    bit pattern this is the same for negative numbers. Values bf16 holds exactly are unchanged; inf and NaN stay."""
    value = value.detach().to(torch.float32)
    bits = value.view(torch.int32)
    noise = torch.randint(0, _LOW_BITS, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    rounded = ((bits + noise) & -_LOW_BITS).view(torch.float32)  # -2^16 = 0xFFFF0000: keep the top 16 bits
    # A finite value at the top of bf16's range may round up to inf (as it would in bf16 arithmetic); inf and NaN
    # themselves must not turn into something else through the added noise.
    rounded = torch.where(torch.isfinite(value), rounded, value)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero
