"""A full fine-tune's trained weights, gradients and optimizer state sharded over the ranks: torch's FSDP2
(`fully_shard`, the ZeRO-3 analogue). Headless only: the distributed launcher's `--shard-weights` (torchrun).

Each trained layer (adapters.FullLayer) is one FSDP unit holding its trained weight W' only (the frozen base layer inside it
is an ignored parameter: never wrapped, moved or sharded). A rank keeps 1/N of every W', of its gradient and
of its optimizer state; a layer's whole W' exists while its product runs (all-gathered before its forward,
freed after it, gathered again for backward) and its gradient is reduce-scattered as backward leaves the layer. The
losses are already weighted by each rank's share of the batch, so the reduce-scatter sums
(`set_force_sum_reduction_for_comms`, divide factor 1): N ranks train the 1-rank weights.

Why torchrun only, not the ComfyUI `devices` input: FSDP2's collectives run inside forward and backward, one per
layer. Inside ComfyUI, an interrupt raised in rank 0's forward leaves the other ranks in a layer's all-gather, where
the run's abort protocol (training/core/distributed.py) has no collective of its own to join. Under torchrun, no
interrupt arrives inside a step and a failed rank ends the job (torchrun's agent stops the others).

Cost (`cost`, for the planner): per rank its rows of W', its gradient and its state, plus the largest
layer's whole W' and unsharded gradient in flight. Rank 0 gathers the whole W' and state into host
RAM for each checkpoint (`full`, `gather_optimizer_state`), as the ZeRO stage 1 path does for the state. Traffic per step: every
W' all-gathered twice (forward, backward) and every gradient reduce-scattered once per backward pass.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator

import torch

from .cost import FeatureCost

# torch's own optimizers step DTensor shards; bitsandbytes' 8-bit kernels, transformers' Adafactor (row / column
# means across the sharded dimension), CAME and Prodigy read whole tensors.
SHARDABLE = ("AdamW",)


def problem(kind: str | None, optimizer: str, policy, ema: bool) -> str | None:
    """Why a run cannot shard its weights with FSDP2 (None: it can). The words name the settings to change."""
    if kind != "full":
        return (f"--shard-weights shards a full fine-tune's trained weights (LoRA Config kind full), not a {kind} "
                "run's: its adapter is small; train it without --shard-weights")
    if optimizer not in SHARDABLE:
        return (f"--shard-weights steps the shards with torch's own optimizers ({', '.join(SHARDABLE)}), not "
                f"{optimizer}: choose AdamW, or train without --shard-weights (the optimizer state is then shared "
                "out by ZeRO stage 1)")
    if policy.fused_backward or policy.optimizer_state == "cpu" or policy.trained_weights == "host":
        return ("--shard-weights keeps each rank's share of the weights, gradients and optimizer state on its device: "
                "turn fused_backward off and keep optimizer_state and trained_weights on the device")
    if ema:
        return "--shard-weights does not keep an EMA of the weights yet: set ema_decay to 0"
    return None


def shard(layers: Iterable[torch.nn.Module], device: torch.device, world_size: int) -> None:
    """Every rank, the same layers in the same order: each layer's trainable parameters become its FSDP unit's
    shards (DTensors, dim 0 split over the ranks); every other parameter (the frozen base) is ignored."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for layer in layers:
        ignored = {p for p in layer.parameters() if not p.requires_grad}
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
        # The losses carry the share / batch weights: the ranks' gradients are summed, not averaged (gloo has no
        # PREMUL_SUM, so the sum is asked for outright).
        layer.set_force_sum_reduction_for_comms(True)
        layer.set_gradient_divide_factor(1.0)


def is_sharded(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every rank calls it for the same tensors in the same order)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`param`'s shard of a whole tensor every rank holds (a checkpoint read by every rank): no communication."""
    from torch.distributed.tensor import distribute_tensor

    whole = whole.to(device=param.device_mesh.device_type, dtype=param.dtype)
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


def gather_optimizer_state(optimizer: torch.optim.Optimizer, is_main: bool) -> dict | None:
    """Every rank, together: the whole optimizer state in torch's one-optimizer layout (parameters by index, what an
    unsharded optimizer's state_dict gives: a run resumes from it at any number of ranks), in host RAM on rank 0;
    None on the others. One tensor gathered at a time, so a rank holds one whole tensor beside its shards."""
    saved = optimizer.state_dict()
    state = {}
    for index, entries in saved["state"].items():
        whole = {name: full(value) for name, value in entries.items()}
        if is_main:
            state[index] = {name: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
                            for name, value in whole.items()}
    return {"state": state, "param_groups": saved["param_groups"]} if is_main else None


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Every rank: its shard of a whole state dict (a checkpoint's, written at any number of ranks)."""
    by_index = [p for group in optimizer.param_groups for p in group["params"]]

    def shard_of(value, param):
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            return value  # AdamW's step counter
        if value.numel() != param.numel():  # the Trainer checked this already (a file read back is untrusted)
            raise ValueError(f"optimizer state of {list(value.shape)} for a weight of {list(param.shape)}")
        return like(value.reshape(param.shape), param)

    state = {index: {name: shard_of(value, by_index[index]) for name, value in entries.items()}
             for index, entries in saved["state"].items()}
    optimizer.load_state_dict({**saved, "state": state})


@contextlib.contextmanager
def whole(layers: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Every rank, together: inside the block each layer holds its whole W' as a plain tensor (what saving
    the difference W' - W reads); sharded again after. Writes inside the block are not kept (the shards are the weights)."""
    from torch.distributed.fsdp import FSDPModule

    units = [layer for layer in layers if isinstance(layer, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def share_rows(rows: int, ranks: int) -> int:
    """Rank 0's rows of a tensor's dim 0 (FSDP2 splits it as torch.chunk does: the first ranks get the larger parts)."""
    return -(-rows // ranks)


def _fractions(shapes, ranks: int) -> list[float]:
    return [share_rows(shape[0], ranks) / shape[0] if shape and shape[0] else 0.0 for shape in shapes]


def state_share(shapes, state_bytes, ranks: int) -> int:
    """Rank 0's optimizer state (`state_bytes[i]`: tensor i's, whole): its rows of every tensor's state."""
    return int(sum(b * fraction for b, fraction in zip(state_bytes, _fractions(shapes, ranks))))


def weights_share(shapes, element_size: int, ranks: int) -> int:
    """Rank 0's trained weights in bytes (its gradients: the same)."""
    return int(sum(math.prod(shape) * fraction for shape, fraction in zip(shapes, _fractions(shapes, ranks)))
               ) * element_size


def local_bytes(tensor: torch.Tensor) -> int:
    """What this rank holds of a tensor: its shard's bytes, or the whole tensor's."""
    local = tensor.to_local() if is_sharded(tensor) else tensor
    return local.numel() * local.element_size()


def cost(shapes, element_size: int, state_bytes, ranks: int, optimizer: str) -> FeatureCost:
    """One rank's trained weights, gradients and optimizer state (rank 0's shares, the largest), the largest
    layer's whole W' and gradient while its product runs, and rank 0's gathered copy for checkpoints."""
    dtype = {4: "fp32", 2: "bf16"}.get(element_size, f"{element_size}-byte")
    weights = weights_share(shapes, element_size, ranks)
    share = f"rank's share of {ranks}, FSDP2"
    result = FeatureCost(
        training={f"trainable weights ({dtype}, {share})": weights, f"gradients ({dtype}, {share})": weights,
                  f"optimizer state ({optimizer}, {share})": state_share(shapes, state_bytes, ranks),
                  "one layer's whole weight + gradient in flight (FSDP2 all-gather / reduce-scatter)":
                      2 * max((math.prod(shape) for shape in shapes), default=0) * element_size},
        validation={f"adapter weights ({dtype}, {share})": weights})
    gathered = "whole trained weights + optimizer state gathered on rank 0 for checkpoints"
    whole = sum(math.prod(shape) for shape in shapes) * element_size + sum(state_bytes)
    result.host[gathered] = result.host_added_validation[gathered] = whole
    return result
