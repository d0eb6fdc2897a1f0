"""Block wrappers for the backward pass: gradient checkpointing per block (with a depth option), and
protection for blocks that update their inputs in place.

depth 1 checkpoints each of the model's blocks; depth 2 each child module of those blocks; and so on.
A module's `forward` is wrapped by setting an instance attribute, and `restore()` deletes it again, so
the class forward is used afterwards and nothing remains. Checkpointing is non-reentrant (works with
keyword arguments and with inputs that do not require grad). Later memory features (CPU offload of the
saved block inputs) wrap the same point.

In-place inputs: some blocks (ComfyUI's Flux double/single blocks: `img += ...`, `x += ...`) add into
the very tensor they received after an op saved it for backward (LayerNorm). Autograd then refuses the
backward, and a checkpoint that recomputes from the modified input gets wrong gradients silently.
`inplace_inputs=True` runs such a block on clones of its tensor inputs and clones, at save time, every
saved tensor that shares their storage: exact gradients, one extra activation per block. Checkpointed,
such a block uses the reentrant checkpoint (see `checkpoint_inplace_safe`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable, Sequence

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.checkpoint import checkpoint

from .cost import FeatureCost

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)  # no forward of their own: looked through


def modules_at_depth(blocks: Iterable[torch.nn.Module], depth: int) -> list[torch.nn.Module]:
    if depth < 1:
        raise ValueError(f"checkpoint depth must be >= 1, got {depth}")
    level = list(blocks)
    for _ in range(depth - 1):
        below = []
        for module in level:
            for child in module.children():
                below.extend(child.children() if isinstance(child, _CONTAINERS) else [child])
        # Parameter-free children (activations, dropout) are not worth a recompute boundary.
        level = [m for m in below if any(True for _ in m.parameters())]
    return level


# --- readings the recompute must repeat -------------------------------------------------------------------------
# ComfyUI's split / sub-quadratic attention chunks by the free memory read at call time; between a checkpointed
# forward and its recompute in backward free memory moves (weight streaming, other processes), and a recompute
# chunked otherwise saves other tensors (CheckpointError) or computes other values. A pinned reading is recorded
# in the forward and replayed in the recompute.
_tape = threading.local()  # the current checkpointed call's (readings, replaying, position); per thread: backward's


def replaying(run: Callable) -> Callable:
    """`run` as a checkpoint calls it (once in the forward, again to recompute): pinned readings taken on the first
    call, replayed in order on later ones."""
    readings: list = []
    calls = 0

    def replaying_run(*args, **kwargs):
        nonlocal calls
        calls += 1
        outer = getattr(_tape, "current", None)
        _tape.current = (readings, calls > 1, [0])
        try:
            return run(*args, **kwargs)
        finally:
            _tape.current = outer

    return replaying_run


def recomputing() -> bool:
    """Whether this thread is inside a checkpoint's recompute (backward is about to use what it makes): a host weight's
    copy made there can serve that backward too (trained_weights_on_host.Crossings.keep)."""
    tape = getattr(_tape, "current", None)
    return tape is not None and tape[1]


@contextlib.contextmanager
def pinned_reading(owner, name: str):
    """Within it, `owner.<name>` (a function of plain arguments reading the machine's state, e.g. ComfyUI's
    get_free_memory) returns in a checkpoint's recompute what it returned in that checkpoint's forward (same
    arguments, same order)."""
    reading = getattr(owner, name)
    if getattr(reading, "pinned", False):  # pinned already (a nested use): once is enough
        yield
        return

    def pinned(*args, **kwargs):
        tape = getattr(_tape, "current", None)
        if tape is None:
            return reading(*args, **kwargs)
        readings, again, position = tape
        if again:
            if position[0] < len(readings) and readings[position[0]][0] == (args, kwargs):
                position[0] += 1
                return readings[position[0] - 1][1]
            return reading(*args, **kwargs)  # a call the forward did not make: nothing to repeat
        value = reading(*args, **kwargs)
        readings.append(((args, kwargs), value))
        return value

    pinned.pinned = True
    setattr(owner, name, pinned)
    try:
        yield
    finally:
        setattr(owner, name, reading)


def _inplace_safe(forward: Callable) -> Callable:
    def safe_forward(*args, **kwargs):
        def fresh(value):
            if isinstance(value, (tuple, list)):  # LTX-2's blocks take their (video, audio) streams as one tuple
                return type(value)(fresh(v) for v in value)
            return value.clone() if torch.is_tensor(value) and value.is_floating_point() else value

        def tensors(values):
            for value in values:
                if isinstance(value, (tuple, list)):
                    yield from tensors(value)
                elif torch.is_tensor(value) and value.is_floating_point():
                    yield value

        args = [fresh(a) for a in args]
        kwargs = {k: fresh(v) for k, v in kwargs.items()}
        storages = {t.untyped_storage().data_ptr() for t in tensors([*args, *kwargs.values()])}

        def pack(saved: torch.Tensor) -> torch.Tensor:
            # A wrapper tensor (ComfyUI's QuantizedTensor weight, saved by its layer's backward) has no storage of
            # its own, and is never one of the block's inputs.
            if is_traceable_wrapper_subclass(saved):
                return saved
            return saved.clone() if saved.untyped_storage().data_ptr() in storages else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
            return forward(*args, **kwargs)

    safe_forward.protects_inplace_inputs = True  # activation_offload checkpoints such a forward reentrantly
    return safe_forward


def inplace_safe(forward: Callable) -> Callable:
    """`forward` made safe for a block that adds into its inputs in place (the module docstring): what the trainer
    runs for such a block, and what the planner times its backward through (planner.time_backward)."""
    return _inplace_safe(forward)


def protects_inplace_inputs(forward: Callable) -> bool:
    """Whether `forward` is a block forward made safe for in-place input updates by `wrap_blocks`."""
    return getattr(forward, "protects_inplace_inputs", False)


def checkpoint_inplace_safe(safe_forward: Callable, args: tuple, kwargs: dict):
    """`safe_forward(*args, **kwargs)` (an in-place-safe forward) checkpointed. Reentrant on purpose: the
    non-reentrant checkpoint works through saved-tensor hooks, which the in-place protection's own hooks
    would override (nothing would be recomputed); the reentrant one runs the forward without saving
    anything and recomputes under enable_grad in backward, where the protection's hooks then act alone.
    It saves its tensor inputs with `save_for_backward`, so saved-tensor hooks around this call see
    exactly those. It needs an input that requires grad to be part of the graph, hence the empty anchor;
    tensors passed by keyword go in positionally so their gradients come back."""
    tensor_names = [k for k, v in kwargs.items() if torch.is_tensor(v)]
    others = {k: v for k, v in kwargs.items() if k not in tensor_names}
    # Positional tuples of tensors (LTX-2's (video, audio) streams) go in as their tensors: the checkpoint saves,
    # offloads and returns gradients for its tensor inputs only.
    lengths = [len(a) if isinstance(a, (tuple, list)) else None for a in args]
    flat = [t for a, n in zip(args, lengths) for t in (a if n is not None else (a,))]

    def run(_anchor, *tensors):
        positional, at = [], 0
        for arg, n in zip(args, lengths):
            positional.append(type(arg)(tensors[at:at + n]) if n is not None else tensors[at])
            at += 1 if n is None else n
        return safe_forward(*positional, **dict(zip(tensor_names, tensors[at:])), **others)

    anchor = torch.empty(0, requires_grad=True)
    return checkpoint(replaying(run), anchor, *flat, *(kwargs[k] for k in tensor_names), use_reentrant=True)


def _checkpointed_inplace_safe(forward: Callable) -> Callable:
    safe = _inplace_safe(forward)

    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint_inplace_safe(safe, args, kwargs)

    return checkpointed_forward


def _checkpointed(forward: Callable) -> Callable:
    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # Tensors passed by keyword go in positionally: torch's checkpoint saves and restores the RNG state only of the
        # devices its positional tensors are on (torch.utils.checkpoint: get_device_states(*args)). A block called
        # with keywords alone (ComfyUI's Qwen-Image) would otherwise recompute LoRA dropout on a GPU with another mask
        # than its forward drew: gradients of a different network, silently (a CPU's RNG state is always restored).
        names = [k for k, v in kwargs.items() if torch.is_tensor(v)]
        others = {k: v for k, v in kwargs.items() if k not in names}
        count = len(args)

        def run(*tensors):
            return forward(*tensors[:count], **dict(zip(names, tensors[count:])), **others)

        return checkpoint(replaying(run), *args, *(kwargs[k] for k in names), use_reentrant=False)

    return checkpointed_forward


def inplace_depth_problem(inplace_inputs: bool, checkpoint_depth: int | None) -> str | None:
    """The one rule for blocks that update their inputs in place: checkpointed, then as whole blocks (depth 1)
    only. The problem with `checkpoint_depth` (None: not checkpointed) as a message, or None."""
    if inplace_inputs and checkpoint_depth is not None and checkpoint_depth > 1:
        return ("this model's blocks update their inputs in place, so gradient checkpointing must be at depth 1 "
                f"(whole blocks), not {checkpoint_depth}: a finer checkpoint would recompute from modified tensors")
    return None


def wrap_blocks(blocks: Iterable[torch.nn.Module], checkpoint_depth: int | None = None,
                inplace_inputs: bool = False, selected: Iterable[int] | None = None) -> Callable[[], None]:
    """Checkpoint the modules `checkpoint_depth` below `blocks` (None: no checkpointing) and/or make the
    blocks safe for in-place input updates. `selected`: the indices of the blocks to checkpoint (selective
    checkpointing: the planner's choice, planner.estimate); None: every block. Returns the function that undoes
    all of it."""
    blocks = list(blocks)
    problem = inplace_depth_problem(inplace_inputs, checkpoint_depth)
    if problem is not None:
        raise ValueError(problem)
    outside = sorted(i for i in (selected or ()) if not 0 <= i < len(blocks))
    if outside:  # a plan made for another model: say so rather than checkpoint something else
        raise ValueError(f"checkpoint blocks {outside} are not among this model's {len(blocks)} blocks")
    block_ids = set(map(id, blocks)) if inplace_inputs else set()
    chosen = blocks if selected is None else [blocks[i] for i in sorted(set(selected))]
    checkpointed = modules_at_depth(chosen, checkpoint_depth) if checkpoint_depth is not None else []
    checkpoint_ids = set(map(id, checkpointed))
    wrapped = []
    for module in {id(m): m for m in [*blocks, *checkpointed]}.values():
        if "forward" in module.__dict__ or id(module) not in block_ids | checkpoint_ids:
            continue  # already wrapped elsewhere, or nothing to do
        forward = module.forward
        if id(module) in block_ids and id(module) in checkpoint_ids:
            forward = _checkpointed_inplace_safe(forward)
        elif id(module) in block_ids:
            forward = _inplace_safe(forward)
        else:
            forward = _checkpointed(forward)
        module.forward = forward
        wrapped.append(module)

    def restore() -> None:
        for module in wrapped:
            module.__dict__.pop("forward", None)

    return restore


# --- what it costs (the planner adds it up: planner.estimate) ---------------------------------------------------
def recomputed_block_bytes(saved: Sequence[float], copies: Sequence[int]) -> float:
    """The largest block's saved set, weight copies included: what backward holds while it recomputes one block."""
    return max((a + c for a, c in zip(saved, copies)), default=0)


def activation_cost(checkpointing: str, saved: Sequence[float], copies: Sequence[int],
                    inputs: Sequence[float]) -> FeatureCost:
    """One training step's block activations with checkpointing "off" (every block keeps what autograd saves, and
    the weight copies it keeps: ComfyUI's manual cast) or "blocks" (only the blocks' inputs, one block recomputed).
    Per block, batch included: `saved` activations, `copies` weight copies kept, `inputs` tensor inputs.
    ("blocks_cpu_offload" is activation_offload.activation_cost.)"""
    if checkpointing == "off":
        return FeatureCost(training={"saved activations, all blocks": int(sum(saved)),
                                     "weight copies kept for backward, all blocks (manual cast)": int(sum(copies))})
    if checkpointing == "blocks":
        return FeatureCost(training={"checkpointed block inputs": int(sum(inputs)),
                                     "one block recomputed in backward": int(recomputed_block_bytes(saved, copies))})
    return FeatureCost()
