"""Pinned host RAM where the user and the driver allow it, else pageable.

Host buffers a CUDA run copies from or to (the weight streamer's blocks, the staging buffers of trained weights and
streamed state, fused backward's host copies, offloaded block inputs) are pinned so the copies are DMA, asynchronous.
Two things stop that, and torch's `pin_memory=True` handles neither (it raises):
- the user: ComfyUI's `--disable-pinned-memory` is one switch for the process; the bridge mirrors it here
  (`allowing`, around comfy_bridge's attach) so Headroom pins nothing either;
- the driver: Windows lets a process lock about half of its RAM, and ComfyUI and the weight streamer pin up to 40 %
  of it; a refused buffer stays pageable, its copies then synchronous (slower, not a stopped step).
"""
from __future__ import annotations

import contextlib

import torch

_allowed = True


@contextlib.contextmanager
def allowing(allowed: bool):
    """Within the block, pin host buffers (True, the default) or never (ComfyUI started with
    --disable-pinned-memory); as it was after."""
    global _allowed
    before, _allowed = _allowed, bool(allowed)
    try:
        yield
    finally:
        _allowed = before


def allowed() -> bool:
    return _allowed


def release_cached() -> None:
    """Give the pinned buffers torch keeps cached for reuse back to the OS. torch's pinned allocator keeps a freed
    buffer locked until the process ends, rounded up to a power of two: after a run of offloaded block inputs that is
    GBs of RAM the OS cannot page and ComfyUI cannot pin (Windows: about half of the RAM in all). Buffers in use are
    kept. torch has it as a private call only (`torch._C._host_emptyCache`, which torch's own CUDA graphs use):
    skipped where a torch lacks it."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        try:
            empty()
        except RuntimeError:  # a CUDA error already pending (the run's own, being raised): nothing given back
            pass


def host_empty(size: torch.Size | tuple[int, ...] | int, dtype: torch.dtype, pinned: bool,
               layout: torch.layout = torch.strided) -> torch.Tensor:
    """An empty host tensor, pinned where asked, allowed and the driver agrees; else pageable. (The refused pin's CUDA
    error is consumed by torch's own check, which raised it.) `.is_pinned()` says which it got."""
    if pinned and _allowed:
        try:
            return torch.empty(size, dtype=dtype, layout=layout, pin_memory=True)
        except RuntimeError:  # the driver refuses to lock more host RAM
            pass
    return torch.empty(size, dtype=dtype, layout=layout)
