"""bf16 weights trained without fp32 masters: each update is computed in fp32 and rounded to bf16 stochastically.

    weight.copy_(stochastic_round_to_bf16(updated_fp32, generator))

Rounding to nearest loses every update smaller than half a bf16 step (bf16 keeps 8 significant bits: a weight of 1.0
ignores any change under 2^-9), which is most of them at fine-tuning learning rates, so a bf16 model rounded to
nearest stops learning. Rounding up or down at random, with the probability of the distance to each neighbour, keeps
each update in expectation: the weight is an unbiased estimate of the fp32 master it replaces (Gupta et al. 2015;
kohya sd-scripts and OneTrainer fine-tune whole models in bf16 so). Headroom rounds a full fine-tune's bf16 weights W'
so (LoRA Config full_precision bf16_stochastic, stepped by fused_backward.py), and a ControlNet's (Train ControlNet's
controlnet_precision bf16_stochastic): 2 bytes per trained weight and its
gradient instead of 4; the noise is one bf16 step of the weight at most per update. fp32 remains the exact option.

Written here because neither torch nor ComfyUI has it for bf16: comfy.float.stochastic_rounding rounds bf16 to
nearest (it is stochastic for fp8 only), and torch has no stochastic-rounding cast.
"""
from __future__ import annotations

import torch


_LOW_BITS = 1 << 16  # the fp32 mantissa bits a bf16 drops
_EXPONENT = 0x7F800000  # an fp32's exponent bits: all set for inf and NaN
_CHUNK = 1 << 20  # elements rounded at once on a CPU: the int32 buffers (4 MiB each) stay in cache
_tables: dict[int, torch.Tensor] = {}  # the hashed element indices 0 .. _CHUNK-1, made once


def stochastic_round_to_bf16(value: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`value` (fp32) rounded to bf16 up or down at random, unbiased: adding uniform noise below the 16 bits bf16
    drops, then truncating them, rounds the magnitude up with probability (dropped bits) / 2^16. On the sign-magnitude
    bit pattern this is the same for negative numbers. Values bf16 holds exactly are unchanged; inf and NaN stay.
    The noise: on CUDA the device generator (`torch.randint`); on a CPU hashed element indices and keys drawn from
    `generator` (`_round_on_cpu`), as torch's CPU randint is single-threaded (docs/benchmarks/full_finetune.md has the figures)."""
    value = value.detach().to(torch.float32)
    if value.device.type == "cpu":
        return _round_on_cpu(value, generator)
    noise = torch.randint(0, _LOW_BITS, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    return _finish(value, value.view(torch.int32) + noise)


def _finish(value: torch.Tensor, noisy_bits: torch.Tensor) -> torch.Tensor:
    rounded = noisy_bits.bitwise_and_(-_LOW_BITS).view(torch.float32)  # -2^16 = 0xFFFF0000: keep the top 16 bits
    # A finite value at the top of bf16's range may round up to inf (as it would in bf16 arithmetic); inf and NaN
    # themselves must not turn into something else through the added noise.
    return torch.where(torch.isfinite(value), rounded, value).to(torch.bfloat16)  # exact: the low 16 bits are zero


def _round_on_cpu(value: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The rounding with counter-based noise (as Philox is), a chunk at a time: a fixed table of hashed element indices
    (Chris Wellons' "lowbias32" hash of 0 .. 2^20-1, made once) XOR a 32-bit key per chunk, times an odd 32-bit
    multiplier, low 16 bits kept. The keys are drawn from `generator` once per call (its state is the run's:
    checkpoints save it). Unbiased whatever the table: for any element the XOR with a uniform key makes its low 16
    bits uniform, and multiplying by an odd number permutes them (bit k of a product depends on bits <= k only).
    Element-wise int32 ops, which torch spreads over the CPU's threads, into three buffers made once per call: a chunk
    allocates nothing (fresh temporaries per chunk cost a page fault per 4 KiB where glibc maps them anew)."""
    keys = torch.randint(-2 ** 31, 2 ** 31, (2,), dtype=torch.int64, generator=generator).tolist()
    table, multiplier = _table(), _int32(keys[1] | 1)
    flat, bits = value.reshape(-1), value.reshape(-1).view(torch.int32)
    out = torch.empty(flat.shape, dtype=torch.bfloat16)
    size = min(_CHUNK, flat.numel())
    noisy, exponent = torch.empty(size, dtype=torch.int32), torch.empty(size, dtype=torch.int32)
    special = torch.empty(size, dtype=torch.bool)
    for index, start in enumerate(range(0, flat.numel(), _CHUNK)):
        end = min(start + _CHUNK, flat.numel())
        chunk, n = bits[start:end], end - start
        noise = torch.bitwise_xor(table[:n], _int32(keys[0] + index * 0x9E3779B9), out=noisy[:n])  # chunks differ
        noise.mul_(multiplier).bitwise_and_(_LOW_BITS - 1).add_(chunk)  # int32 * wraps like uint32
        noise.bitwise_and_(-_LOW_BITS)  # -2^16 = 0xFFFF0000: keep the top 16 bits
        # inf and NaN (every exponent bit set) are kept as they are, as _finish does
        inf_or_nan = torch.eq(torch.bitwise_and(chunk, _EXPONENT, out=exponent[:n]), _EXPONENT, out=special[:n])
        if inf_or_nan.any():
            noise[inf_or_nan] = chunk[inf_or_nan]
        out[start:end].copy_(noise.view(torch.float32))  # exact: the low 16 bits are zero (or inf / NaN, kept)
    return out.view(value.shape)


def _int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _table() -> torch.Tensor:
    table = _tables.get(_CHUNK)
    if table is None:
        x = torch.arange(_CHUNK, dtype=torch.int32)
        # lowbias32; int32 >> is arithmetic, so each shift is masked to a logical one.
        x.bitwise_xor_((x >> 16) & 0xFFFF).mul_(0x7FEB352D)
        x.bitwise_xor_((x >> 15) & 0x1FFFF).mul_(_int32(0x846CA68B))
        x.bitwise_xor_((x >> 16) & 0xFFFF)
        table = _tables[_CHUNK] = x
    return table
