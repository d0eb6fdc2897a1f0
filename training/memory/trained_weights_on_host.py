"""Trained weights in host RAM: a full fine-tune's trained weights W' live in host RAM and cross the card one layer at a
time (policy field `trained_weights` "host"; needs fused backward), each tensor stepped where its optimizer state is.

    policy = OffloadPolicy(trained_weights="host", fused_backward=True, optimizer_state="gpu")  # or "cpu"
    home = trained_weights_device(policy, compute_device)   # where AdapterSet makes and keeps the trained weights

What happens per trained layer (adapters.FullLayer / _CastProduct; the ZeRO-Infinity pattern):
- forward: the layer's W' is copied host -> device in the compute dtype for its one product, then dropped;
- backward: copied again (nothing of it is kept between forward and backward) and the product's gradient computed on
  the card; then, where the optimizer state is:
  - optimizer_state "gpu" (the fast one): the layer hands its gradient to the step there (fused_backward.py
    `step_on_device`): the tensor is stepped on the card with its state, which stays there (Adafactor's factored
    state: 0.03 GiB for SD3.5 Large's 8 B weights), and the update copied back device -> host. No gradient crosses;
  - optimizer_state "cpu": the gradient is copied device -> host, where it accumulates on the host parameter, and the
    fused backward hook steps the tensor in host RAM (`state_on_host`): nothing of the update goes back to the card,
    but host RAM steps every weight, bound by its memory bandwidth (far slower than the card for billions of
    weights; time_model.optimizer_step_s predicts it, planner.Plan.slow says so).
So the card holds no trained weight and no gradient between layers: for SD3.5 Large's 8 B trained weights that is 16
GiB (bf16) or 32 GiB (fp32, the exact option) off the card. The cost is traffic: per step every trained weight crosses
host -> device once per forward (twice with checkpointing: the recompute) and once in backward, and its update (or
gradient) crosses back once.

Not pinned: torch's pinned allocator rounds each block up to a power of two (ATen/core/CachingHostAllocator.h in
torch 2.14: PowerOf2Ceil below `pinned_max_round_threshold`, unlimited by default; a 2432 x 7296 bf16 difference
would take 64 MiB for its 35 MiB: up to 2x the planned host RAM), and registering plain memory with the driver,
as ComfyUI does for the weights it offloads, must be undone before that memory is freed, which a run that ComfyUI may
drop from its cache at any time cannot promise. Pageable copies are staged by the driver at a lower bandwidth; the GPU
kit measures the step (`full-16GB-host`).

Numerics: the same products in the same dtypes on the same device as with the weights on the card, and the same
step (fused backward's: clipped in the gradient's dtype, an fp32 stand-in, stochastic rounding to bf16) where the
state is; so the weights equal those of the run with the weights on the card and the same optimizer_state bit for bit
(tests/unit/test_trained_weights_on_host.py on CUDA; on a CPU both placements are the host and the run is the same,
and the step on the card is checked against the step in host RAM: tests/unit/test_fused_backward.py).

Why by hand: the trained weight's product is already a custom autograd Function (adapters._CastProduct, which casts
rather than keeps a copy); moving its operand across devices there is two `.to` calls, and handing the gradient to
the step on the card is one call there (autograd cannot accumulate a gradient on the card into a host leaf: it would
copy it to the host first). Library offloaders (accelerate
cpu_offload, diffusers group offloading, DeepSpeed ZeRO-Infinity) move whole modules' parameters and assume they own
them; here the trained tensors are adapter parameters inside ComfyUI's shared MODEL (see weight_streaming.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .cost import FeatureCost

PLACES = ("device", "host")
_HOST = torch.device("cpu")


def trained_weights_device(policy, compute_device: torch.device | str) -> torch.device:
    """Where a run's trained weights live: the compute device, or host RAM with `trained_weights` "host"."""
    return _HOST if policy.trained_weights == "host" else torch.device(compute_device)


def problem(policy) -> str | None:
    """Why this policy cannot keep its trained weights in host RAM (None: it can, or it does not ask to)."""
    if policy.trained_weights != "host":
        return None
    if not policy.fused_backward:
        return ("trained_weights 'host' steps each trained tensor inside backward, where its optimizer state is (host "
                "RAM with optimizer_state 'cpu', the card with 'gpu'): it needs fused_backward on")
    return None


def check_kind(policy, kind: str | None) -> None:
    """Only a full fine-tune's differences stream (an adapter's small factors stay on the card)."""
    if policy.trained_weights == "host" and kind != "full":
        change = "set kind full in the LoRA Config, or " if kind else ""
        raise ValueError(f"trained_weights 'host' keeps a full fine-tune's trained weights in host RAM; this run trains "
                         f"{'a ' + kind if kind else 'a ControlNet'}: {change}set trained_weights 'device' in the "
                         "Offload Policy")


def to_compute(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` on `like`'s device in `like`'s dtype, for one product (a host difference crosses to the card here)."""
    return tensor.to(device=like.device, dtype=like.dtype)


# --- what it costs (the planner adds it up: planner.estimate) ---------------------------------------------------
def trained_weights_cost(shapes: Sequence[Sequence[int]], element_size: int, compute_element_size: int,
                         on_host: bool) -> FeatureCost:
    """The trained weights as the training step and validation hold them. On the device: all of them. In host RAM:
    all of them there (allocated for the run), and on the device the largest layer's difference in flight
    (its copy as it crosses; the cast to the compute dtype is the planner's "one layer's weight copy in flight") and
    its gradient in the compute dtype before it crosses back."""
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    dtype = {4: "fp32", 2: "bf16"}.get(element_size, f"{element_size}-byte")
    total = sum(sizes) * element_size
    if not on_host:
        return FeatureCost(training={f"trainable weights ({dtype})": total},
                           validation={f"adapter weights ({dtype})": total})
    largest = max(sizes, default=0)
    cost = FeatureCost(
        training={"one layer's trained weights + gradient in flight (trained weights in host RAM)":
                  largest * (element_size + compute_element_size)},
        validation={"one layer's trained weights in flight (trained weights in host RAM)":
                    largest * (element_size + compute_element_size)})
    name = f"trained weights ({dtype}, in host RAM)"
    for items in (cost.host, cost.host_added_training, cost.host_added_validation):
        items[name] = total
    return cost
