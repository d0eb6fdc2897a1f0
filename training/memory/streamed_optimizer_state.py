"""Optimizer state streamed with its tensor (policy optimizer_state "streamed"; needs fused backward): each trained
tensor's optimizer state lives in host RAM between steps and crosses to the card for that tensor's step inside
backward, then back; the step itself runs on the card.

    streamed = StreamedState(device, largest_elements)          # FusedBackward(..., streamed_state=streamed)
    with streamed.on_card(index, optimizer):                     # the state's tensors on the card for this step
        optimizer.step()
    streamed.finish()                                            # where the step already waits: every state landed

Between "gpu" (the state on the card: AdamW's 8 bytes per weight, 95 GB for Flux.1-dev's 11.8 B weights) and "cpu"
(the state in host RAM and the step there too: host RAM steps every weight, 6.5-11 ns per weight for the optimizer's
step alone on one thread of a 2-core VM, bench/bench_host_optimizer_step.py: over a minute per step for Flux's 11.8 B
weights), this keeps the state in host RAM and the step on the card: per step each
tensor's state crosses in once and back once (AdamW8bit: 2 bytes per weight each way, 24 GB for Flux: about 1 s at
~50 GB/s), and the card holds one tensor's state at a time. With trained_weights "host" it rides with its weight's
step on the card in the layer's backward (trained_weights_on_host.py); with the weights on the card it is stepped in
fused backward's hook. The kohya / OneTrainer peers keep the state on the card or step on the CPU; DeepSpeed
ZeRO-Offload steps on the CPU.

What crosses: every tensor of the state on the step's device (torch's exp_avg / exp_avg_sq, Adafactor's factored rows
and columns, bitsandbytes' 8-bit state with its scales); what the optimizer keeps elsewhere (torch's step count, a CPU
scalar) stays where it is. The crossings go through `Crossings`' fixed pinned staging buffers (non-blocking, an event
per buffer; trained_weights_on_host.py) in two rings each way: one buffer per tensor-shaped state entry of the
optimizer (`PARAM_SHAPED_STATE`: AdamW's two moments; 1 byte per weight for the 8-bit ones) and `SMALL_BUFFERS` small
ones for the rest (step counts, 8-bit scales and maps, factored rows and columns). A buffer is reused only after its
last copy has passed, so a ring smaller than one tensor's state would make the CPU wait for the card inside every
tensor's step, with nothing queued behind it; sized so, the CPU waits at most for the previous tensor's copies while
the card runs this one's step. Each state is landed in its host tensor at the latest where the step already waits
(FusedBackward.step / zero_grad), before anything reads it (a save, the next step). Between steps the optimizer's
state dict holds the host tensors, so checkpoints, resume and parking see the state where it lives; a loaded
checkpoint's state goes back to host RAM tensor by tensor (`park`).

Numerics: the same step on the same device in the same dtypes as with the state on the card, so the weights equal that
run's bit for bit (tests/unit/test_streamed_optimizer_state.py).

Why by hand: torch's optimizers keep their state where the parameter is and have no hook to fetch it per parameter;
swapping the state dict's tensors around each per-tensor optimizer's step (fused backward has one per tensor) is the
few lines below, over torch's copies and events.
"""
from __future__ import annotations

import contextlib
import math

import torch

from .cost import FeatureCost
from .trained_weights_on_host import STAGING_BUFFERS, Crossings, staged_bytes

# Per optimizer: its state entries the shape of the tensor, and their bytes per element (planner._optimizer_state_bytes'
# layouts; Adafactor's are factored for matrices: only a vector's second moment). Others: four fp32 entries at most.
PARAM_SHAPED_STATE = {"AdamW": (2, 4), "AdamW8bit": (2, 1), "PagedAdamW8bit": (2, 1), "Lion8bit": (1, 1),
                      "Adafactor": (1, 4), "CAME": (1, 4), "Prodigy": (4, 4)}
UNKNOWN_STATE = (4, 4)
# The smaller state entries cross through their own ring: up to this many bytes each, this many buffers each way.
SMALL_STATE_BYTES = 1 << 20
SMALL_BUFFERS = 32


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def largest_tensor_shaped(optimizer: str, shapes) -> int:
    """The elements of the largest of these tensors whose state has an entry of the tensor's shape (Adafactor factors
    a matrix's: only its vectors')."""
    return max((math.prod(shape) for shape in shapes if optimizer != "Adafactor" or len(shape) < 2), default=0)


def staging_layout(optimizer: str, largest_elements: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((buffers, bytes each) of the large ring, the same of the small ring), each way, for `optimizer`'s state of
    tensors of at most `largest_elements` elements."""
    count, element_bytes = PARAM_SHAPED_STATE.get(optimizer, UNKNOWN_STATE)
    return ((max(STAGING_BUFFERS, count), max(element_bytes * int(largest_elements), SMALL_STATE_BYTES)),
            (SMALL_BUFFERS, SMALL_STATE_BYTES))


class StreamedState:
    """Each fused-backward optimizer's state in host RAM between its steps (module docstring); `largest_elements`: the
    largest trained tensor's elements and `optimizer` its name (what the staging buffers are sized for: a larger state
    entry than expected makes its ring's buffers that size, after the copies in flight)."""

    def __init__(self, device: torch.device | str, largest_elements: int, optimizer: str = "AdamW"):
        self.device = torch.device(device)
        (large, large_bytes), (small, small_bytes) = staging_layout(optimizer, largest_elements)
        self.large = Crossings(self.device, (), buffers=large, buffer_bytes=large_bytes, grow=True)
        self.small = Crossings(self.device, (), buffers=small, buffer_bytes=small_bytes)
        self._homes: dict[int, dict[str, torch.Tensor]] = {}  # optimizer index -> {state key: its host tensor}

    def _ring(self, tensor: torch.Tensor) -> Crossings:
        return self.small if tensor.numel() * tensor.element_size() <= SMALL_STATE_BYTES else self.large

    @contextlib.contextmanager
    def on_card(self, index: int, optimizer: torch.optim.Optimizer):
        """Optimizer `index`'s state on the card for the body (its step), parked back in host RAM after it."""
        homes = self._homes.get(index, {})
        state = _state(optimizer)
        if state is not None:
            for name, home in homes.items():
                state[name] = self._ring(home).to_device(home)
        try:
            yield
        finally:
            self._park(index, optimizer, now=False)

    def park(self, index: int, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer `index`'s state to host RAM now (after loading a checkpoint, which puts it on the card)."""
        self._park(index, optimizer, now=True)

    def _park(self, index: int, optimizer: torch.optim.Optimizer, now: bool) -> None:
        state = _state(optimizer)
        if state is None:  # not stepped yet (or a step that failed before making its state)
            return
        homes = self._homes.setdefault(index, {})
        for name, value in list(state.items()):
            if not isinstance(value, torch.Tensor) or not _same_device(value.device, self.device):
                continue  # a number, or a tensor the optimizer keeps in host RAM itself (torch's step count)
            home = homes.get(name)
            if home is None or home.shape != value.shape or home.dtype != value.dtype:
                home = homes[name] = torch.empty(value.shape, dtype=value.dtype)
            if now:
                home.copy_(value)
            else:  # landed by finish(), before anything reads it
                self._ring(home).to_host(home, value)
            state[name] = home

    def finish(self) -> None:
        """Every state crossing back landed in its host tensor (FusedBackward.step / zero_grad)."""
        self.large.finish()
        self.small.finish()

    @property
    def bytes_each_way(self) -> tuple[int, int]:
        """(to the card, back to host RAM) bytes of state crossed so far (tests and the GPU kit)."""
        return (self.large.to_device_bytes + self.small.to_device_bytes,
                self.large.to_host_bytes + self.small.to_host_bytes)

    @property
    def pinned(self) -> bool:
        return self.large.pinned


def _state(optimizer: torch.optim.Optimizer) -> dict | None:
    """The state dict of a fused-backward optimizer's one tensor (None before its first step)."""
    return optimizer.state.get(optimizer.param_groups[0]["params"][0])


# --- what it costs (the planner adds it up: planner.estimate) ---------------------------------------------------
def streamed_state_cost(optimizer: str, state_bytes: int, largest_state_bytes: int, largest_elements: int,
                        pinned: bool) -> FeatureCost:
    """optimizer_state "streamed": all of the state (`state_bytes`) in host RAM with its staging rings each way
    (`staging_layout`, for tensors of at most `largest_elements` elements with tensor-shaped state; each buffer rounded
    up to a power of two when `pinned`, a CUDA device's: torch's pinned allocator), and on the card the largest
    tensor's state (`largest_state_bytes`) during its step."""
    staging = sum(count * staged_bytes(size, pinned) for count, size in staging_layout(optimizer, largest_elements))
    cost = FeatureCost(training={f"one tensor's optimizer state in its step ({optimizer}, streamed)":
                                 largest_state_bytes})
    for items in (cost.host, cost.host_added_training, cost.host_added_validation):
        items[f"optimizer state ({optimizer}, streamed from host RAM)"] = state_bytes
        items["staging buffers (optimizer state streamed)"] = 2 * staging
    return cost
