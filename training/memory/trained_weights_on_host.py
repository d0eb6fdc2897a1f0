"""Trained weights in host RAM: a full fine-tune's trained weights W' live in host RAM and cross the card one layer at a
time (policy field `trained_weights` "host"; needs fused backward), each tensor stepped where its optimizer state is.

    policy = OffloadPolicy(trained_weights="host", fused_backward=True, optimizer_state="gpu")  # or "cpu"
    home = trained_weights_device(policy, compute_device)   # where AdapterSet makes and keeps the trained weights

What happens per trained layer (adapters.FullLayer / _CastProduct; the ZeRO-Infinity pattern), each crossing through
`Crossings` (below):
- forward: the layer's W' is copied host -> device for its one product, cast to the compute dtype, then dropped;
- backward: copied again (nothing of it is kept between forward and backward: that would be all of W' on the card)
  and the product's gradient computed on the card. A checkpointed block's recompute runs just before its backward:
  the copy the recompute made is kept for that backward (one block's W' on the card for a moment), so a weight crosses
  once for the forward and once for the recompute and backward together. Then, where the optimizer state is:
  - optimizer_state "gpu" (the fast one): the layer hands its gradient to the step there (fused_backward.py
    `step_on_device`): the tensor is stepped on the card with its state, which stays there (Adafactor's factored
    state: 0.03 GiB for SD3.5 Large's 8 B weights), and the update copied back device -> host. No gradient crosses;
  - optimizer_state "streamed": the same step on the card, its state crossing from host RAM for it and back
    (streamed_optimizer_state.py);
  - optimizer_state "cpu": the gradient is copied device -> host, where it accumulates on the host parameter, and the
    fused backward hook steps the tensor in host RAM (`state_on_host`): nothing of the update goes back to the card,
    but host RAM steps every weight, bound by its memory bandwidth (far slower than the card for billions of
    weights; time_model.optimizer_step_s predicts it, planner.Plan.slow says so).
So the card holds no trained weight and no gradient between layers: for SD3.5 Large's 8 B trained weights that is 16
GiB (bf16) or 32 GiB (fp32, the exact option) off the card. The cost is traffic: per step every trained weight crosses
host -> device twice (forward; recompute and backward) and its update (or gradient) crosses back once: the planner's
time model counts these three.

Pinned staging, not pinned weights (`Crossings`): each copy goes through one of a few fixed pinned host buffers the
size of the largest trained tensor: host memcpy into the buffer, then a non-blocking DMA on the compute stream, its
event marking the buffer free again; an update comes back the same way and is written into the host weight when its
event has passed, at the latest where the step already waits (FusedBackward.step / zero_grad). The CPU never waits
for the card except for a buffer still in use (which bounds how far it runs ahead), and every crossing runs at
pinned bandwidth. The weights themselves are not pinned: torch's pinned allocator rounds each block up to a power of
two (ATen/core/CachingHostAllocator.h in torch 2.14: PowerOf2Ceil below `pinned_max_round_threshold`, unlimited by
default; a 2432 x 7296 bf16 weight would take 64 MiB for its 35 MiB: up to 2x the planned host RAM), and registering
plain memory with the driver, as ComfyUI does for the weights it offloads, must be undone before that memory is
freed, which a run that ComfyUI may drop from its cache at any time cannot promise. The buffers cost
`STAGING_BUFFERS` x 2 x the largest tensor (rounded up) of pinned host RAM.

Numerics: the same products in the same dtypes on the same device as with the weights on the card, and the same
step (fused backward's: clipped in the gradient's dtype, an fp32 stand-in, stochastic rounding to bf16) where the
state is; so the weights equal those of the run with the weights on the card and the same optimizer_state bit for bit
(tests/unit/test_trained_weights_on_host.py on CUDA; on a CPU both placements are the host and the run is the same,
and the step on the card is checked against the step in host RAM: tests/unit/test_fused_backward.py).

Why by hand: the trained weight's product is already a custom autograd Function (adapters._CastProduct, which casts
rather than keeps a copy); moving its operand across devices there is one call to `Crossings`, and handing the
gradient to the step on the card is one call there (autograd cannot accumulate a gradient on the card into a host
leaf: it would copy it to the host first). torch gives the pinned buffers, the non-blocking copies and the events; the
staging ring is a few lines over them. Library offloaders (accelerate
cpu_offload, diffusers group offloading, DeepSpeed ZeRO-Infinity) move whole modules' parameters and assume they own
them; here the trained tensors are adapter parameters inside ComfyUI's shared MODEL (see weight_streaming.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import pinned_host
from .checkpointing import recomputing
from .cost import FeatureCost

PLACES = ("device", "host")
_HOST = torch.device("cpu")
STAGING_BUFFERS = 2  # pinned buffers each way: the CPU runs at most this many copies ahead of the card


def trained_weights_device(policy, compute_device: torch.device | str) -> torch.device:
    """Where a run's trained weights live: the compute device, or host RAM with `trained_weights` "host"."""
    return _HOST if policy.trained_weights == "host" else torch.device(compute_device)


def problem(policy) -> str | None:
    """Why this policy cannot keep its trained weights in host RAM (None: it can, or it does not ask to)."""
    if policy.trained_weights != "host":
        return None
    if not policy.fused_backward:
        return ("trained_weights 'host' steps each trained tensor inside backward, where its optimizer state is (host "
                "RAM with optimizer_state 'cpu', the card with 'gpu' or 'streamed'): it needs fused_backward on")
    return None


def check_kind(policy, kind: str | None, to_full: str = "set kind full in the LoRA Config") -> None:
    """Only a full fine-tune's trained weights stream (an adapter's small factors stay on the card); `to_full`: how the
    node the user sees makes the run a full fine-tune."""
    if policy.trained_weights == "host" and kind != "full":
        change = f"{to_full}, or " if kind else ""
        raise ValueError(f"trained_weights 'host' keeps a full fine-tune's trained weights in host RAM; this run trains "
                         f"{'a ' + kind if kind else 'a ControlNet'}: {change}set trained_weights 'device' in the "
                         "Offload Policy")


def to_compute(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` on `like`'s device in `like`'s dtype, for one product."""
    return tensor.to(device=like.device, dtype=like.dtype)


class _Buffer:
    """One staging buffer: its bytes, the event of the copy that last used it, and (coming back) the host tensor that
    copy is for."""

    def __init__(self, nbytes: int, pinned: bool):
        self.bytes = pinned_host.host_empty(nbytes, torch.uint8, pinned)  # pageable where pinning is refused
        self.event = None
        self.destination: torch.Tensor | None = None

    def view(self, like: torch.Tensor) -> torch.Tensor:
        return self.bytes[:like.numel() * like.element_size()].view(like.dtype).view(like.shape)


class Crossings:
    """A run's trained weights in host RAM crossing to `device` and their updates crossing back, through fixed pinned
    staging buffers (module docstring), with the recompute's copy kept for its backward. Counts the bytes each way
    (`to_device_bytes`, `to_host_bytes`: tests and the GPU kit check a weight crosses twice in, once back, per step).

    On a CPU (the tests and the GPU kit's dry run: both homes are the host) the same ring runs with plain buffers and
    no events (each copy done when it returns): the same copies, numbers and counts, the updates landing as late."""

    def __init__(self, device: torch.device | str, tensors: Sequence[torch.Tensor], buffers: int = STAGING_BUFFERS,
                 buffer_bytes: int | None = None, grow: bool = False):
        """Buffers the size of the largest of `tensors`, or `buffer_bytes` (what crosses is made later: optimizer
        state, streamed_optimizer_state.py); `grow`: a larger tensor than that makes the buffers its size (after every
        crossing in flight has landed) instead of an error."""
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda" and torch.cuda.is_available()
        self.buffer_bytes = max((t.numel() * t.element_size() for t in tensors), default=0) \
            if buffer_bytes is None else int(buffer_bytes)
        self.buffers = buffers
        self.grow = grow
        self._in: list[_Buffer] = []  # made at first use: a run that never crosses pins nothing
        self._back: list[_Buffer] = []
        self._turn_in = self._turn_back = 0
        self._kept: dict[int, list[torch.Tensor]] = {}  # a recompute's copies by host tensor, for its backward
        self.to_device_bytes = self.to_host_bytes = 0

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (host RAM) copied to the device in its dtype: a copy kept for this backward by the recompute
        (`keep`) if there is one, else a crossing."""
        kept = self._kept.get(id(tensor))
        if kept:
            return kept.pop()
        self._fits(tensor)
        self.to_device_bytes += tensor.numel() * tensor.element_size()
        buffer = self._next(self._in, "_turn_in")
        if buffer.event is not None:
            buffer.event.synchronize()  # its last copy has reached the card: the CPU is that far ahead at most
        staged = buffer.view(tensor)
        staged.copy_(tensor)
        on_device = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        on_device.copy_(staged, non_blocking=True)
        buffer.event = self._event()
        return on_device

    def keep(self, tensor: torch.Tensor, on_device: torch.Tensor) -> None:
        """In a checkpointed block's recompute (checkpointing.recomputing): keep `tensor`'s copy for the backward that
        follows it (`to_device` hands it over), so the recompute and the backward share one crossing."""
        if recomputing():
            self._kept.setdefault(id(tensor), []).append(on_device)

    def to_host(self, tensor: torch.Tensor, update: torch.Tensor) -> None:
        """Write `update` (on the device) into `tensor` (host RAM, any dtype `update` converts to): a non-blocking
        copy into a staging buffer now, into `tensor` when it has landed (at the latest at `finish`)."""
        self._fits(tensor)
        self.to_host_bytes += tensor.numel() * tensor.element_size()
        buffer = self._next(self._back, "_turn_back")
        self._land(buffer)
        buffer.view(tensor).copy_(update.to(tensor.dtype), non_blocking=True)
        buffer.event = self._event()
        buffer.destination = tensor

    def _event(self):
        """An event recorded on the device's current stream (where the copy just queued runs, whichever device is
        current) after that copy (None on a CPU: the copy is done)."""
        if not self.pinned:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def finish(self) -> None:
        """Every update written into its host tensor, no recompute copy left: before anything reads the host weights
        again (the next forward, a save, EMA). Called where the step already waits (FusedBackward.step / zero_grad)."""
        for buffer in self._back:
            self._land(buffer)
        self._kept.clear()

    @staticmethod
    def _land(buffer: _Buffer) -> None:
        if buffer.destination is not None:
            if buffer.event is not None:
                buffer.event.synchronize()
            # Through .data: the host tensor is a trained parameter, written outside autograd
            buffer.destination.data.copy_(buffer.view(buffer.destination))
            buffer.destination = None

    def _fits(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= self.buffer_bytes:
            return
        if not self.grow:
            raise RuntimeError(f"a {tuple(tensor.shape)} {tensor.dtype} tensor does not fit the {self.buffer_bytes}-byte "
                               "staging buffers made for this run's largest tensor")
        self.finish()  # every update landed; and no copy into the card still reads a buffer:
        for buffer in self._in:
            if buffer.event is not None:
                buffer.event.synchronize()
        self._in, self._back, self._turn_in, self._turn_back = [], [], 0, 0
        self.buffer_bytes = nbytes

    def _next(self, ring: list[_Buffer], turn: str) -> _Buffer:
        if len(ring) < self.buffers:
            ring.append(_Buffer(self.buffer_bytes, self.pinned))
            return ring[-1]
        at = getattr(self, turn)
        setattr(self, turn, (at + 1) % self.buffers)
        return ring[at]


# --- what it costs (the planner adds it up: planner.estimate) ---------------------------------------------------
def staged_bytes(nbytes: int, pinned: bool) -> int:
    """Host RAM a staging buffer of `nbytes` takes: rounded up to a power of two when `pinned` (torch's pinned
    allocator's blocks)."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes else nbytes


def trained_weights_cost(shapes: Sequence[Sequence[int]], element_size: int, compute_element_size: int,
                         on_host: bool, updates_back: bool = True, pinned: bool = True,
                         on_card_elements: int = 0) -> FeatureCost:
    """The trained weights as the training step and validation hold them. On the device: all of them. In host RAM:
    all of them there (allocated for the run) with `Crossings`' staging buffers (one ring in, and one back for the
    updates when the optimizer state is on the device: `updates_back`; each rounded up to a power of two by torch's
    pinned allocator when `pinned`, a CUDA device's), and on the device the largest layer's copy in flight (the cast to
    the compute dtype is the planner's "one layer's weight copy in flight") and its gradient in the compute dtype
    (with checkpointing, the recompute's copies: `recompute_kept_cost`); `on_card_elements` of them (the blocks the
    policy keeps on the card: trained_weights_card_blocks) on the device instead, in training and validation."""
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
    staging = (2 if updates_back else 1) * STAGING_BUFFERS * staged_bytes(largest * element_size, pinned)
    on_card = on_card_elements * element_size
    if on_card:
        for items in (cost.training, cost.validation):
            items[f"trained weights kept on the card ({dtype}, trained weights in host RAM)"] = on_card
    for items in (cost.host, cost.host_added_training, cost.host_added_validation):
        items[f"trained weights ({dtype}, in host RAM)"] = total - on_card
        items["staging buffers (trained weights in host RAM)"] = staging
    return cost


def recompute_kept_cost(blocks: Sequence[Sequence[int]], element_size: int, alongside: int, largest: int
                        ) -> dict[str, int]:
    """The copies a checkpointed block's recompute keeps for its backward (`Crossings.keep`), beyond what the plan
    already counts for one tensor's step (`alongside`: the bytes beside the largest tensor, `largest` elements, in its
    step, its own copy included). `blocks`: per checkpointed block each trained layer's elements, in forward order.
    Backward meets the layers last to first, each copy freed after its layer: at layer k the copies of layers 1..k-1
    are still kept while layer k's step holds its share of `alongside`. The most of that over every layer and block,
    less `alongside` itself (0 when the largest tensor's step alone is more)."""
    most = 0
    for layers in blocks:
        before = 0
        for elements in layers:
            most = max(most, before * element_size + alongside * elements // max(largest, 1))
            before += elements
    extra = most - alongside
    return {"a checkpointed block's trained weights kept from its recompute to its backward": extra} if extra > 0 \
        else {}
