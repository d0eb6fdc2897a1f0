"""Optimizer state sharded over the ranks of a data-parallel full fine-tune: ZeRO stage 1, torch's
ZeroRedundancyOptimizer.

Each rank keeps the optimizer state of its share of the trained tensors only, steps those, and broadcasts them to
the other ranks after the step (the gradients are summed on every rank first, as without sharding:
training/core/distributed.py). The optimizers whose step of one tensor reads only that tensor's state (AdamW, the
8-bit ones, Adafactor, CAME) give the weights of the unsharded step; Prodigy estimates its step size from every
tensor at once, so its state stays whole on every rank (SHARDABLE).

Cost (`state_share`, `gathered_copy_cost`): a rank's state is that of its share, torch partitioning whole tensors
largest first onto the rank with the fewest elements so far; rank 0 alone writes the run folder (also while the
other ranks wait: after validation, on cancel), so at the end of each training call every rank sends its state to
rank 0, which keeps it gathered in host RAM, the whole state, until the next one. Traffic: one broadcast of every
trained tensor per step.

Why ZeRO stage 1 here and FSDP2 (sharded_weights.py: weights and gradients sharded too) only headless: FSDP2's
all-gathers and reduce-scatters run inside forward and backward, one per layer; the run's way of stopping every rank
together inside ComfyUI (a rank that leaves a step midway, ComfyUI's interrupt inside rank 0's forward, joins the
collective the others wait in with an abort flag: DataParallel.abort_step) has no collective of its own there to
join, so the others would wait out the group's timeout. Stage 1 keeps every collective of a step where that
protocol has one: the loss and gradient all-reduces, the step-end agreement, and this module's broadcasts.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .cost import FeatureCost

# The optimizers whose per-tensor step reads only that tensor's state: sharding them changes no weight.
SHARDABLE = ("AdamW", "AdamW8bit", "PagedAdamW8bit", "Lion8bit", "Adafactor", "CAME")


def state_ranks(ranks: int, kind: str, optimizer: str) -> int:
    """Over how many ranks a run's optimizer state is sharded when its policy keeps the state on the device
    (`applies`): a full fine-tune's, with an optimizer of SHARDABLE; 1 (whole) otherwise. A LoRA's state is small."""
    return ranks if kind == "full" and optimizer in SHARDABLE else 1


def applies(policy) -> bool:
    """Whether a policy shards the state: not when it is in host RAM, nor with fused backward (one rank)."""
    return policy.optimizer_state != "cpu" and not policy.fused_backward


def sharded(params: Sequence[torch.nn.Parameter], make_optimizer: Callable[[list], torch.optim.Optimizer]):
    """The ranks' shared optimizer over `params` (each rank's `make_optimizer` gets its own share). Every rank of the
    running process group calls it with the same tensors in the same order."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(list(params), optimizer_class=lambda share, **_: make_optimizer(share))


def is_sharded(optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def local_optimizer(optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state (the optimizer itself when not sharded): what parking moves."""
    return optimizer.optim if is_sharded(optimizer) else optimizer


def gather(optimizer, is_main: bool) -> dict | None:
    """Every rank, together (a collective): each sends its state to rank 0, which gets the whole state dict in
    torch's one-optimizer layout, in host RAM (what an unsharded optimizer's state_dict gives: a run resumes from
    it at any number of ranks); None on the other ranks."""
    optimizer.consolidate_state_dict(to=0)
    if not is_main:
        return None
    return optimizer.state_dict()  # the same tensors torch keeps from consolidate_state_dict: no second copy


def load(optimizer, state: dict) -> None:
    """Every rank: its share of a whole state dict (a checkpoint's, from any number of ranks). torch's
    load_state_dict writes None over the other ranks' entries of the dict it is given (the caller's is left whole:
    rank 0 writes it out again when it saves before training on), and torch's Optimizer.load_state_dict keeps a
    second copy of this rank's share, on its device, in the wrapper's own `state`, which nothing reads (the local
    optimizer steps its own): dropped."""
    optimizer.load_state_dict({**state, "state": dict(state["state"])})
    optimizer.state.clear()


def partition(numels: Sequence[int], ranks: int) -> list[list[int]]:
    """The tensor indices each rank owns: torch's partition (ZeroRedundancyOptimizer._partition_parameters), largest
    first, ties in order, each onto the first rank with the fewest elements so far. Mirrored because torch's needs a
    running process group, and the planner plans before one exists."""
    owned: list[list[int]] = [[] for _ in range(ranks)]
    sizes = [0] * ranks
    for index in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        rank = sizes.index(min(sizes))
        owned[rank].append(index)
        sizes[rank] += numels[index]
    return owned


def state_share(numels: Sequence[int], state_bytes: Sequence[int], ranks: int) -> int:
    """The largest rank's optimizer state in bytes (`state_bytes[i]`: tensor i's state, unsharded)."""
    if ranks <= 1:
        return sum(state_bytes)
    return max(sum(state_bytes[i] for i in owned) for owned in partition(numels, ranks))


def gathered_copy_cost(cost: FeatureCost, optimizer: str, state_bytes: int) -> None:
    """Rank 0's host RAM: the whole state, gathered at the end of each training call for its checkpoints."""
    name = f"optimizer state ({optimizer}) gathered on rank 0 for checkpoints"
    cost.host[name] = state_bytes
    cost.host_added_validation[name] = state_bytes
