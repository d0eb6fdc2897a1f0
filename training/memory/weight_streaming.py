"""Streamed blocks: frozen block weights stay in host RAM and visit the device one block at a time.

    streamer = WeightStreamer(blocks, device)   # blocks in execution order
    streamer.attach()
    ... training steps (with per-block checkpointing) ...
    streamer.detach()

What happens per block i:
- forward:  just before block i runs, its frozen weights are on the device (copied ahead of time when
  block i-1 started: "prefetch"), installed into the block's modules in place of the host tensors; block
  i+1's copy starts on a side CUDA stream. After block i, the host tensors are put back; the device
  copies live on only while autograd still references them (with checkpointing: not at all).
- backward: just before block i's backward (a gradient hook on the block's outputs, which runs before
  checkpointing recomputes the block) the weights are installed again and block i-1's copy starts.
At most two blocks' weights are on the device at once (the one in use and the one in flight): double
buffering through the caching allocator rather than two fixed buffers, so a copy still referenced by
autograd is never overwritten. Copies go host->device only; frozen weights are never copied back.
Only frozen tensors (requires_grad False) that are not already on the device are streamed: trainable
adapter weights and whatever ComfyUI keeps resident ("partial" placement) stay where they are.

On a CPU device `attach` does nothing and results are bitwise those of the plain run;
`exercise_on_cpu=True` runs the whole machinery with CPU->CPU copies (for tests).

Why this is written here and not taken from a library (checked against accelerate 1.15 and diffusers 0.42):
- diffusers `apply_group_offloading(..., use_stream=True)` offloads by restoring every parameter of a group
  from the pinned snapshot taken when it was applied (`ModuleGroup._offload_to_memory`): the LoRA weights
  living inside the blocks would lose each optimizer update (or raise KeyError when attached later). It
  swaps `param.data` in place, which changes the very tensors autograd saved for backward; its prefetch
  chain follows the forward order, so backward recomputation always loads synchronously; and it rebuilds
  every argument container (`send_to_device`), which breaks ComfyUI's shared `transformer_options`.
- accelerate `cpu_offload` moves each leaf synchronously on use (no side stream, no prefetch) and parks
  weights on the meta device, which ComfyUI's ModelPatcher accounting and state_dict paths cannot read.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch
from torch.autograd.graph import register_multi_grad_hook

from .cost import FeatureCost


@dataclasses.dataclass
class _Slot:
    """One streamed tensor: where it lives on its module and its host copy."""

    module: torch.nn.Module
    name: str
    is_param: bool
    host: torch.Tensor  # the object the module held before attach (Parameter or buffer)


def _output_tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _output_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _output_tensors(item)]
    return []


class WeightStreamer:
    def __init__(self, blocks: Sequence[torch.nn.Module], device: torch.device | str, *,
                 exercise_on_cpu: bool = False, pin_host_copies: bool = False, record: bool = False):
        """`blocks` in execution order. `pin_host_copies`: pin host weights that are not pinned yet (for
        use outside ComfyUI; inside ComfyUI its partial load pins the offloaded weights itself).
        `record`: keep a log of every install and fetch (tests, bench)."""
        self.blocks = list(blocks)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # compare like with like below
        self.exercise_on_cpu = exercise_on_cpu
        self.pin_host_copies = pin_host_copies
        self.active = False
        self.slots: list[list[_Slot]] = []
        self._pending: dict[int, tuple[list[torch.Tensor], object]] = {}  # block -> (device copies, ready event)
        self._installed: dict[int, list[torch.Tensor]] = {}
        self._handles = []
        self._pinned_by_us: list[torch.Tensor] = []
        self._copy_stream = None
        # With `record`: ("forward" | "backward", block) per install, and the order of fetches.
        self.install_log: list[tuple[str, int]] | None = [] if record else None
        self.fetch_log: list[int] | None = [] if record else None
        self.max_on_device = 0  # most blocks on the device at once (installed + in flight)

    @property
    def enabled(self) -> bool:
        return self.device.type != "cpu" or self.exercise_on_cpu

    # --- attach / detach -------------------------------------------------------------------------------------
    def attach(self) -> "WeightStreamer":
        if self.active:
            raise RuntimeError("WeightStreamer is already attached; detach it first")
        self.active = True
        if not self.enabled:
            return self  # CPU: the weights already are where the compute happens
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)
        self.slots = [self._collect(block) for block in self.blocks]
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._make_pre_forward(index)))
            self._handles.append(block.register_forward_hook(self._make_post_forward(index)))
        return self

    def detach(self) -> None:
        if not self.active:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for index in list(self._installed):
            self._release(index)
        self._pending.clear()
        with torch.no_grad():
            for tensor in self._pinned_by_us:
                tensor.data = tensor.data.clone()  # back to pageable memory: no pinned RAM outlives the run
        self._pinned_by_us.clear()
        self.slots = []
        self._copy_stream = None
        self.active = False

    def __enter__(self) -> "WeightStreamer":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _collect(self, block: torch.nn.Module) -> list[_Slot]:
        slots = []
        for module in block.modules():
            for name, param in module._parameters.items():
                if param is not None and not param.requires_grad and self._needs_streaming(param):
                    slots.append(_Slot(module, name, True, param))
            for name, buffer in module._buffers.items():
                if buffer is not None and self._needs_streaming(buffer):
                    slots.append(_Slot(module, name, False, buffer))
        if self.pin_host_copies and self.device.type == "cuda":
            with torch.no_grad():
                for slot in slots:
                    if not slot.host.is_pinned():
                        slot.host.data = slot.host.data.pin_memory()
                        self._pinned_by_us.append(slot.host)
        return slots

    def _needs_streaming(self, tensor: torch.Tensor) -> bool:
        if self.device.type == "cpu":
            return True  # exercise mode: every frozen tensor takes the round trip
        return tensor.device != self.device

    # --- moving weights ----------------------------------------------------------------------------------------
    def _prefetch(self, index: int) -> None:
        """Start copying block `index` to the device (side stream on CUDA)."""
        if index < 0 or index >= len(self.blocks) or index in self._pending or index in self._installed:
            return
        if self.fetch_log is not None:
            self.fetch_log.append(index)
        hosts = [slot.host for slot in self.slots[index]]
        if self._copy_stream is None:
            copies = [h.detach().to(self.device, copy=True) for h in hosts]
            self._pending[index] = (copies, None)
        else:
            # Copies are allocated on the side stream and handed to the compute stream with record_stream,
            # so the allocator reuses their memory only after the compute stream is done with them.
            with torch.cuda.stream(self._copy_stream):
                copies = [h.detach().to(self.device, non_blocking=True) for h in hosts]
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
            self._pending[index] = (copies, ready)
        self._count_on_device()

    def _install(self, index: int, phase: str) -> None:
        if index in self._installed:
            return
        self._prefetch(index)  # no-op when the copy is already in flight
        copies, ready = self._pending.pop(index)
        if ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for copy in copies:
                copy.record_stream(stream)
        for slot, copy in zip(self.slots[index], copies):
            if slot.is_param:
                slot.module._parameters[slot.name] = torch.nn.Parameter(copy, requires_grad=False)
            else:
                slot.module._buffers[slot.name] = copy
        self._installed[index] = copies
        if self.install_log is not None:
            self.install_log.append((phase, index))
        self._count_on_device()

    def _release(self, index: int) -> None:
        """Put the host tensors back; the device copies die when autograd no longer needs them."""
        if self._installed.pop(index, None) is None:
            return
        for slot in self.slots[index]:
            if slot.is_param:
                slot.module._parameters[slot.name] = slot.host
            else:
                slot.module._buffers[slot.name] = slot.host

    def _count_on_device(self) -> None:
        self.max_on_device = max(self.max_on_device, len(self._installed) + len(self._pending))

    # --- hooks ------------------------------------------------------------------------------------------------
    def _make_pre_forward(self, index: int):
        def pre_forward(module, args):
            for other in [i for i in self._installed if i != index]:
                self._release(other)
            self._install(index, "forward")
            self._prefetch(index + 1)

        return pre_forward

    def _make_post_forward(self, index: int):
        def post_forward(module, args, output):
            self._release(index)
            tensors = _output_tensors(output)
            if tensors and torch.is_grad_enabled():
                register_multi_grad_hook(tensors, lambda grads: self._before_backward(index), mode="any")
            return output

        return post_forward

    def _before_backward(self, index: int) -> None:
        # Runs on autograd's thread before block `index` computes its gradients (and before checkpointing
        # recomputes it), while the main thread waits in backward(): no concurrent access to the state.
        for other in [i for i in self._installed if i != index]:
            self._release(other)
        self._install(index, "backward")
        self._prefetch(index - 1)

    # --- figures for the planner / bench ----------------------------------------------------------------------
    def streamed_bytes(self) -> list[int]:
        """Bytes streamed per block (0 before attach)."""
        return [sum(s.host.numel() * s.host.element_size() for s in slots) for slots in self.slots]


def stream_blocks(blocks: Iterable[torch.nn.Module], device: torch.device | str, **options) -> WeightStreamer:
    """Attach a WeightStreamer to `blocks` (execution order) and return it; call `.detach()` to undo."""
    return WeightStreamer(list(blocks), device, **options).attach()


# --- policy base_placement: decided here, carried out by the ComfyUI load and by memory_features ---------------
@dataclasses.dataclass(frozen=True)
class BasePlacement:
    """What a base_placement does to the frozen base. One decision in two halves: the bridge's load through ComfyUI
    (nodes/bridge/comfy_bridge.Placement.load) and the streamer around a run of steps (policy.memory_features)."""

    full_load: bool  # ComfyUI loads every weight onto the device (else its lowvram load may keep some in host RAM)
    blocks_to_host: bool  # after the load, every block's frozen weights go back to host RAM (ComfyUI's partial unload)
    stream_blocks: bool  # a WeightStreamer brings the blocks not on the device there, one block ahead


def base_placement(placement: str) -> BasePlacement:
    """"resident": everything loaded, nothing streams; "partial": ComfyUI keeps what fits, the rest streams;
    "streamed": only the weights outside the blocks stay on the device, every block streams."""
    return {"resident": BasePlacement(full_load=True, blocks_to_host=False, stream_blocks=False),
            "partial": BasePlacement(full_load=False, blocks_to_host=False, stream_blocks=True),
            "streamed": BasePlacement(full_load=False, blocks_to_host=True, stream_blocks=True)}[placement]


# --- what it costs (the planner adds it up: planner.estimate) ---------------------------------------------------
def resident_block_bytes(placement: str, block_weights: Sequence[int], rest_bytes: int,
                         device_budget: int | None) -> int:
    """The frozen block weights kept on the device: all ("resident", or "partial" without a budget), none
    ("streamed"), or for "partial" what the room `device_budget` leaves beside everything else (`rest_bytes`) and
    the two streaming buffers. The run's load keeps ComfyUI to this share (nodes/bridge/comfy_bridge.Placement)."""
    all_blocks = sum(block_weights)
    if placement == "resident" or (placement == "partial" and device_budget is None):
        return all_blocks
    if placement == "streamed":
        return 0
    return max(0, min(all_blocks, device_budget - rest_bytes - 2 * max(block_weights, default=0)))


def validation_placement(placement: str, budgeted: bool = True) -> str:
    """The placement validation plans for itself (sampling and the validation loss): no backward, so no activations,
    gradients or (parked) optimizer state beside the weights, and no WeightStreamer: ComfyUI's own per-layer cast
    brings what is not on the device. "resident" stays resident; "partial" and "streamed" keep as many blocks as the
    validation room leaves ("partial" sized for validation), which is more than training's share when sampling needs
    less than a training step (kohya sd-scripts #2056: fewer blocks swapped while sampling, a sample 40 % faster).
    Without a budget (`budgeted` False: no room to fill is known) validation is estimated on training's placement."""
    if not budgeted:
        return placement
    return "resident" if placement == "resident" else "partial"


def _phase_weights(placement: str, block_weights: Sequence[int], storage: str, rest_bytes: int,
                   device_budget: int | None) -> tuple[dict[str, int], int]:
    """The device items of the frozen block weights in one phase, and the bytes of them resident."""
    all_blocks = sum(block_weights)
    if placement == "resident":
        return {f"frozen block weights ({storage})": all_blocks}, all_blocks
    resident_part = resident_block_bytes(placement, block_weights, rest_bytes, device_budget)
    buffers = 0 if resident_part >= all_blocks else 2 * max(block_weights, default=0)
    weights = {"streamed block buffers (2 blocks)": buffers}
    if placement == "partial":
        weights[f"resident block weights ({storage}, partial)"] = resident_part
    return weights, resident_part


def placement_cost(placement: str, block_weights: Sequence[int], storage: str, rest_bytes: int,
                   device_budget: int | None, validation_rest_bytes: int | None = None) -> FeatureCost:
    """Where the frozen block weights (`block_weights`, as stored) are during a run (policy base_placement):
    "resident" all on the device; "streamed" two blocks' buffers (the one in use and the one in flight), the rest in
    host RAM; "partial" as many as fit the room `device_budget` (the budget less the allocator's share) leaves beside
    everything else a training step holds (`rest_bytes`) and the buffers, the rest streamed. Validation is placed on
    its own (`validation_placement`) in the room it leaves beside what it holds (`validation_rest_bytes`; None: the
    training figure)."""
    all_blocks = sum(block_weights)
    notes = []
    if placement == "partial" and device_budget is None:
        notes.append("partial placement without a budget: estimated as fully resident")
    training, resident_part = _phase_weights(placement, block_weights, storage, rest_bytes, device_budget)
    validation, _ = _phase_weights(validation_placement(placement, device_budget is not None), block_weights, storage,
                                   rest_bytes if validation_rest_bytes is None else validation_rest_bytes,
                                   device_budget)
    # What the training step streams from host RAM (the figure the plan's summary names).
    host = {"streamed block weights": all_blocks - resident_part} if all_blocks > resident_part else {}
    return FeatureCost(training=training, validation=validation, host=host, training_notes=notes)
