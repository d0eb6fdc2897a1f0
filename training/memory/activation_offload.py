"""Per-block checkpointing whose saved block inputs live in host RAM (policy checkpointing="blocks_cpu_offload").

Non-reentrant `torch.utils.checkpoint` keeps, per checkpointed block, only the block's inputs; it saves the
positional tensor inputs through autograd's saved-tensor mechanism, so saved-tensor hooks around the call (torch's
`save_on_cpu(pin_memory=True)`, with a fallback to pageable RAM where the driver refuses to pin: `_to_host`) move
exactly those inputs to (pinned) host RAM and bring them back when backward recomputes the block. Everything the
block saves *inside* the checkpoint is handled by the checkpoint itself (dropped, recomputed), so the hooks never
see it.

Tensors passed as keyword arguments are not saved that way (the checkpoint keeps them in its closure), and
ComfyUI calls many blocks with keywords (Flux: `block(img=..., txt=..., vec=..., pe=...)`), so the
wrapper passes every top-level tensor argument positionally and rebuilds the call inside.

Blocks that update their inputs in place (Flux) are first protected by `checkpointing.wrap_blocks(...,
inplace_inputs=True)`; the protection works through saved-tensor hooks of its own, which would override the
non-reentrant checkpoint's (nothing recomputed, nothing offloaded). Such a protected forward is therefore
checkpointed reentrantly, exactly as wrap_blocks does (`checkpointing.checkpoint_inplace_safe`): that
checkpoint saves its tensor inputs with `save_for_backward`, so the same hooks move them to host RAM.

On the CPU there is nowhere to offload to: no hooks are installed, so it is exactly plain checkpointing
(autograd's own check for inputs modified in place included, which a saved-tensor hook would bypass).
Same depth semantics as training/checkpointing.py (the trainer's plain checkpointing); a forward already
wrapped there (its in-place input protection) is wrapped once more and put back on restore.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from .checkpointing import (replaying, checkpoint_inplace_safe, modules_at_depth, protects_inplace_inputs,
                            recomputed_block_bytes)
from . import pinned_host
from .cost import FeatureCost


_refused_said = False  # a refused pin is logged once per process


def _to_host(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    """torch's save_on_cpu(pin_memory=True) pack, but where the driver refuses to pin (Windows lets a process lock
    about half of its RAM, and ComfyUI and the weight streamer pin up to 40 % of it) or ComfyUI runs with
    --disable-pinned-memory (pinned_host.py) the input waits in pageable host RAM, its copies then synchronous, instead
    of the step stopping with "CUDA error: out of memory". torch's save_on_cpu has no such fallback, hence these
    hooks."""
    global _refused_said
    pinnable = torch.cuda.is_available() and not tensor.is_sparse and tensor.numel() > 0 and pinned_host.allowed()
    packed = pinned_host.host_empty(tensor.size(), tensor.dtype, pinnable, tensor.layout)
    if pinnable and not packed.is_pinned() and not _refused_said:
        _refused_said = True
        logging.warning("Headroom: checkpointing blocks_cpu_offload: the driver refused to pin more host RAM; block "
                        "inputs wait in pageable RAM, slower")
    packed.copy_(tensor, non_blocking=packed.is_pinned())
    return tensor.device, packed


def _to_device(saved: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, packed = saved
    return packed.to(device, non_blocking=packed.is_pinned())


def pinned_or_pageable_offload() -> contextlib.AbstractContextManager:
    """Saved-tensor hooks moving what is saved to host RAM (pinned where the driver allows) and back for backward."""
    return torch.autograd.graph.saved_tensors_hooks(_to_host, _to_device)


def _default_offload_hooks(tensors: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    if all(t.device.type == "cpu" for t in tensors):
        return contextlib.nullcontext()
    return pinned_or_pageable_offload()


def offloaded_checkpoint(forward: Callable, args: tuple, kwargs: dict,
                         offload_hooks: Callable[[list[torch.Tensor]], contextlib.AbstractContextManager] = _default_offload_hooks):
    """`forward(*args, **kwargs)` checkpointed, its tensor inputs saved through `offload_hooks`."""
    tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    other_kwargs = {k: v for k, v in kwargs.items() if k not in tensor_keys}
    n_args = len(args)

    def run(*flat):
        return forward(*flat[:n_args], **dict(zip(tensor_keys, flat[n_args:])), **other_kwargs)

    flat = (*args, *(kwargs[k] for k in tensor_keys))
    with offload_hooks([t for t in flat if isinstance(t, torch.Tensor)]):
        if protects_inplace_inputs(forward):
            return checkpoint_inplace_safe(forward, args, kwargs)
        return checkpoint(replaying(run), *flat, use_reentrant=False)


def enable_offloaded_checkpointing(blocks: Iterable[torch.nn.Module], depth: int = 1,
                                   offload_hooks=_default_offload_hooks) -> Callable[[], None]:
    """Checkpoint the modules at `depth` below `blocks`, block inputs kept in host RAM; returns the undo.

    The offloading counterpart of `checkpointing.wrap_blocks(blocks, depth)` (returns the undo function too).
    `offload_hooks(tensors)` makes the saved-tensor hooks for one call (tests pass counting hooks).
    """
    wrapped = {}  # id -> (module, the instance-level forward it had before, or None)
    for module in modules_at_depth(blocks, depth):
        if id(module) in wrapped:
            continue  # a module reachable twice
        wrapped[id(module)] = (module, module.__dict__.get("forward"))
        original = module.forward

        def checkpointed(*args, _original=original, **kwargs):
            if not torch.is_grad_enabled():
                return _original(*args, **kwargs)
            return offloaded_checkpoint(_original, args, kwargs, offload_hooks)

        module.forward = checkpointed

    def restore() -> None:
        for module, previous in wrapped.values():
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        pinned_host.release_cached()  # the inputs' pinned buffers, cached by torch: unlocked for ComfyUI and the OS

    return restore


# --- what it costs (the planner adds it up: planner.estimate) ---------------------------------------------------
def activation_cost(checkpointing: str, saved: Sequence[float], copies: Sequence[int],
                    inputs: Sequence[float]) -> FeatureCost:
    """One training step's block activations with checkpointing "blocks_cpu_offload": the inputs of two blocks in
    flight (one in use, one copied), one block recomputed; every block's inputs wait in host RAM. Same per-block
    figures as checkpointing.activation_cost."""
    if checkpointing != "blocks_cpu_offload":
        return FeatureCost()
    return FeatureCost(training={"block inputs in flight (2 blocks)": int(2 * max(inputs, default=0)),
                                 "one block recomputed in backward": int(recomputed_block_bytes(saved, copies))},
                       host={"offloaded block inputs": int(sum(inputs))},
                       host_added_training={"offloaded block inputs": int(sum(inputs))})
