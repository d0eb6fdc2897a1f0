"""Streamed blocks: a ring of fixed device slots through which frozen block weights visit the device.

    streamer = WeightStreamer(blocks, device, slots=2)   # blocks in execution order
    streamer.attach()
    ... training steps (with per-block checkpointing) ...
    streamer.detach()

The pieces, all made once at `attach` (no allocation in a steady-state step):
- a packed host buffer per streamed block: the block's frozen tensors (those requires_grad False, not on the device
  already, not in a `resident` block) laid out at 256-byte aligned offsets in one flat byte buffer, pinned on CUDA
  (cudaHostRegister in place, as ComfyUI pins; undone at detach, so no pinned RAM outlives the run; within
  `pin_limit_bytes`, the rest pageable; a refused pin's CUDA error cleared). The modules'
  host tensors become views of it (same objects, `.data` swapped: host RAM is not doubled); a later attach finds
  the block packed already and copies nothing. A block crosses in ONE copy per pass. A wrapper tensor subclass
  (ComfyUI's QuantizedTensor: a scaled fp8 / int8 / nvfp4 file) is packed as its inner plain tensors
  (`__tensor_flatten__`: the quantized data and its scales) and rebuilt around views of the slot at install
  (`__tensor_unflatten__`); the host object goes back after, as for a plain tensor.
- `slots` device slots, each one flat byte buffer the size of the largest packed block. An installed block's
  weights are dtype/shape views of its slot (Parameter objects cached per slot and block), put in place of the host
  tensors on the modules; after the block they are put back.
- a copy stream (CUDA) ordered by two events per slot: "free" (recorded on the compute stream when the slot's last
  block is done with it; the copy waits for it on the device) and "ready" (recorded on the copy stream after the
  copy; compute waits for it before the block runs). The CPU waits for neither: the device keeps the order, and a
  wait on the CPU before a refill left the device idle at each block boundary until the CPU queued the next
  block (the step's own end, which reads the loss, bounds the CPU's lead to one step; the caching allocator is
  stream-ordered, and nothing in a slot is allocated).

Order: forward runs blocks 0..n-1 and keeps the next `slots - 1` streamed blocks in flight (their copies started
after each block's kernels are queued: a copy from pageable memory, which holds the CPU, then overlaps that block);
backward (a gradient hook on each block's outputs, before checkpointing recomputes the block) runs n-1..0 likewise,
but starts its copies before queueing its block, so with 3 or more slots a pageable block is fetched one block later
than a pinned one (its slot would free only when the block running then ends, the device idle through the copy). A block still in a
slot is installed without a copy: at the forward -> backward turn the last blocks are still there (backward starts
with no fetch), and at the next step's forward the first ones. Backward fetches only the blocks it runs (those whose
outputs needed a gradient in forward; autograd skips the ones no trained weight precedes, SDXL's first five with
attention targets), then the next step's first blocks in their place. A block run out of order (not in a slot) is
fetched synchronously into a free slot: correct rather than fast. Copies go host->device only; frozen weights are never
copied back; trainable tensors (adapter weights) and what is resident are left where they are.

A full fine-tune's trained layers compute with their trained copy alone (adapters.FullLayer): their base layers are
`unread`, their weights neither streamed nor kept, so the card holds one copy of each trained weight and a streamed
block carries only what the step reads (its untrained layers, norms).

Blocks not checkpointed: autograd then saves views of the slot (a Linear saves its weight) for backward, and a slot
overwritten before that backward would give wrong gradients. The streamer watches what autograd saves while a block
runs (a saved-tensors hook; inside a checkpoint the checkpoint's own hook takes them, so nothing is seen): a slot a
saved tensor views stays PINNED until that block's backward has run (the next block's backward hook, or the next
forward). With every slot pinned a block goes to a one-off device buffer (`fallback_fetches`, an allocation):
correct, slow and memory-hungry, which is why the policy streams only checkpointed blocks (policy.memory_features).

On a CPU device `attach` does nothing and results are bitwise those of the plain run; `exercise_on_cpu=True` runs
the whole machinery with CPU->CPU copies (for tests), `resident` (block indices) keeps blocks out of the ring there.

Why this is written here and not taken from a library (checked against accelerate 1.15 and diffusers 0.42):
- diffusers `apply_group_offloading(..., use_stream=True)` offloads by restoring every parameter of a group
  from the pinned snapshot taken when it was applied (`ModuleGroup._offload_to_memory`): the LoRA weights
  living inside the blocks would lose each optimizer update (or raise KeyError when attached later). It
  swaps `param.data` in place, which changes the very tensors autograd saved for backward; its prefetch
  chain follows the forward order, so backward recomputation always loads synchronously; and it rebuilds
  every argument container (`send_to_device`), which breaks ComfyUI's shared `transformer_options`.
- accelerate `cpu_offload` moves each leaf synchronously on use (no side stream, no prefetch) and parks
  weights on the meta device, which ComfyUI's ModelPatcher accounting and state_dict paths cannot read.
- the ring swappers of musubi-tuner, OneTrainer and ai-toolkit are built into their own model classes (a block's
  weights swapped whole, LoRA applied outside the block); here the adapter lives inside the block and must stay.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Iterable, Sequence

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import pinned_host
from .. import os_compat
from .cost import FeatureCost

ALIGN = 256  # bytes: each tensor's offset in a packed block (kernels' vector loads want aligned weights)
DEFAULT_SLOTS = 2


@dataclasses.dataclass
class _Tensor:
    """One streamed tensor: where it lives on its module, its host object and its place in the packed block."""

    module: torch.nn.Module
    name: str
    is_param: bool
    host: torch.Tensor  # the object the module held before attach (Parameter or buffer); stays that object
    offset: int  # bytes into the packed block / the slot
    span: int  # bytes its storage span covers (numel * element size when contiguous)
    nbytes: int  # numel * element size
    # A wrapper tensor subclass (ComfyUI's QuantizedTensor): its inner plain tensors (__tensor_flatten__'s names ->
    # their places in the packed block) and the flatten context; offset / span unused, nbytes their sum.
    parts: dict[str, "_Tensor"] | None = None
    context: object = None

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor as a view of a flat byte `buffer` laid out like the packed block (same dtype, shape, strides);
        a wrapper subclass rebuilt around views of its inner tensors."""
        host = self.host
        if self.parts is not None:
            inner = {name: part.view(buffer) for name, part in self.parts.items()}
            return type(host).__tensor_unflatten__(inner, self.context, host.size(), host.stride())
        raw = buffer[self.offset:self.offset + self.span]
        if self.span == 0:
            return torch.empty(host.shape, dtype=host.dtype, device=buffer.device)
        return raw.view(host.dtype).as_strided(host.shape, host.stride())


@dataclasses.dataclass
class _Block:
    tensors: list[_Tensor]
    nbytes: int  # the packed block, padding included
    packed: torch.Tensor | None = None  # flat uint8 host buffer (None: nothing streamed)
    registered: bool = False  # pinned in place by us (cudaHostRegister)
    pinned: bool = False  # by us or by someone else: its copies are asynchronous (read at attach, not per step)


class _Slot:
    """A fixed device buffer of the ring, with the block whose weights it holds."""

    def __init__(self, buffer: torch.Tensor, cuda: bool):
        self.buffer = buffer
        self.block: int | None = None  # whose weights are (or will be, once `ready` passes) in it
        self.installed = False
        self.pins = 0  # saved tensors autograd holds that view it (a block not checkpointed)
        self.used = 0  # tick of the last install or fetch (least recently used goes first)
        self.ready = torch.cuda.Event() if cuda else None  # copy done (recorded on the copy stream)
        self.free = torch.cuda.Event() if cuda else None  # last user done (recorded on the compute stream)
        self.free_recorded = False
        self.free_stale = False  # unpinned by autograd: its free event must be recorded before reuse
        self.params: dict[int, list[torch.Tensor]] = {}  # block -> its tensors as views of this slot (cached)


class _Held:
    """What autograd keeps for a saved tensor that views a slot: the slot stays pinned while it lives."""

    __slots__ = ("tensor", "slot")

    def __init__(self, tensor: torch.Tensor, slot: _Slot):
        self.tensor, self.slot = tensor, slot
        slot.pins += 1

    def __del__(self):
        self.slot.pins -= 1
        if self.slot.pins == 0:
            self.slot.free_stale = True


def _output_tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _output_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _output_tensors(item)]
    return []


def _device_object(t: _Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """`t` as a view of `buffer`, a frozen Parameter where the host one was (as comfy.ops._quantized_apply re-wraps a
    QuantizedTensor)."""
    view = t.view(buffer)
    if not t.is_param:
        return view
    if t.parts is None:
        return torch.nn.Parameter(view, requires_grad=False)
    # torch.nn.Parameter's own path for a tensor subclass less its detach(), which a QuantizedTensor makes by cloning
    # its scales (off the slot: a device copy kept per cached install). A fresh unflatten has no autograd history.
    view.requires_grad_(False)
    view._is_param = True
    return view


def _storage_pointers(tensor: torch.Tensor) -> list[int]:
    """The storages a tensor's data lives in: its own, or (a wrapper subclass: no storage of its own) its inner
    tensors'."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return [p for name in names for p in _storage_pointers(getattr(tensor, name))]
    try:
        return [tensor.untyped_storage().data_ptr()]
    except (RuntimeError, NotImplementedError):  # other tensor subclasses without a plain storage
        return []


def _span_bytes(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return span * tensor.element_size()


def _raw_bytes(tensor: torch.Tensor, span: int) -> torch.Tensor:
    """The bytes `tensor`'s storage span covers, as a flat uint8 tensor (its layout kept: strides, gaps)."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage(),
                                                  tensor.storage_offset() * tensor.element_size(), (span,))


def indexed_device(device: torch.device | str) -> torch.device:
    """`device` as tensors on it name theirs: "cuda" becomes "cuda:N" (the current one), so they compare equal."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _register(buffer: torch.Tensor, device: torch.device) -> bool:
    """Pin a host buffer in place (as ComfyUI pins); False when CUDA refuses (it then stays pageable) or the buffer is
    empty or pinned already (registering it again is an error)."""
    if buffer.numel() == 0 or buffer.is_pinned():
        return False
    try:
        if int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1)) == 0:
            return True
    except (RuntimeError, AttributeError):
        return False
    _discard_cuda_error(device)
    return False


def _unregister(buffer: torch.Tensor, device: torch.device) -> None:
    try:
        if int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())) != 0:
            _discard_cuda_error(device)
    except (RuntimeError, AttributeError):
        pass


def _discard_cuda_error(device: torch.device) -> None:
    """A refused cudaHostRegister / Unregister leaves its error as the thread's last CUDA error, which torch's next
    kernel-launch check raises as that kernel's own ("CUDA error: out of memory": the run would stop, or the out-of-
    memory fallback would pick a plan that streams, and pins, more). torch's binding cannot clear it
    (no cudaGetLastError), so one tiny kernel's check reads and drops it, as ComfyUI does after a refused pin
    (model_management.discard_cuda_async_error)."""
    try:
        torch.ones(1, dtype=torch.uint8, device=device).add_(1)
        torch.cuda.synchronize(device)
    except RuntimeError:
        pass  # the refusal itself, already handled: the buffer stays pageable


class WeightStreamer:
    def __init__(self, blocks: Sequence[torch.nn.Module], device: torch.device | str, *, slots: int = DEFAULT_SLOTS,
                 resident: Iterable[int] = (), keep: Sequence[torch.nn.Module] = (),
                 unread: Iterable[torch.nn.Module] = (), exercise_on_cpu: bool = False, pin_host_copies: bool = True,
                 pin_limit_bytes: int | None = None, record: bool = False):
        """`blocks` in execution order. `slots`: device slots in the ring (>= 2; prefetch depth `slots - 1`).
        `resident`: indices of whole blocks kept on the device from attach to detach (the plan's resident blocks:
        what of them is in host RAM is copied once, at attach, into a buffer of its own); `keep`: modules whose frozen
        weights outside the blocks are kept on the device the same way (the non-block layers). `unread`: modules whose
        own tensors the step never reads (a full fine-tune's base layers: adapters.FullLayer computes with its trained
        copy alone), left where they are, neither streamed nor kept: the base of the trained layers stays in host RAM.
        `pin_host_copies`: pin the packed host buffers on CUDA (False: pageable, for a host short of lockable RAM).
        `pin_limit_bytes`: pin no more than this many bytes in all (None: no limit of ours); the blocks past it stay
        pageable. Windows lets a process lock about half of the RAM, and ComfyUI keeps its own pins within a share
        of it (nodes/bridge/planning.pinnable_host_bytes gives what that share leaves).
        `record`: keep a log of every install and fetch (tests, bench)."""
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
            raise ValueError(f"WeightStreamer: slots={slots!r} must be an integer >= 2 (one in use, one in flight)")
        self.blocks = list(blocks)
        self.device = indexed_device(device)  # compare like with like below
        self.slot_count = slots
        self.resident = frozenset(resident)
        self.keep = list(keep)
        self.unread = {id(sub) for m in unread for sub in m.modules()}
        self.exercise_on_cpu = exercise_on_cpu
        self.pin_host_copies = pin_host_copies
        self.pin_limit_bytes = pin_limit_bytes
        self.pinned_bytes = 0  # registered by us now (within pin_limit_bytes)
        self.pageable_blocks = 0  # streamed blocks left pageable (the limit reached, or CUDA refused)
        self.active = False
        self._blocks: list[_Block] = []
        self._streamed: list[int] = []  # indices of the blocks with something to stream, in order
        self._ring: list[_Slot] = []
        self._slot_of: dict[int, _Slot] = {}  # block -> the slot holding (or receiving) its weights
        self._by_storage: dict[int, _Slot] = {}  # slot buffer's data_ptr -> slot
        self._temps: dict[int, list[torch.Tensor]] = {}  # block -> its weights in a one-off buffer (no slot free)
        self._installed: set[int] = set()
        # Blocks whose outputs needed a gradient in the last forward with grad: the ones backward will run. Those before
        # the first trained weight (SDXL's first five with attention-only targets) never do: autograd skips them.
        self._backward_blocks: set[int] = set()
        self._kept: list[_Block] = []  # resident blocks and non-block layers copied once at attach (installed)
        self._handles = []
        self._saving = None  # the saved-tensors hook context open while a block runs with grad
        self._copy_stream = None
        self._tick = 0
        self._warned_pin = False
        # Counters: device buffers allocated (the slots at attach; a one-off buffer per fallback), host->device
        # copies, and copies that had no slot (every slot in use or pinned by autograd).
        self.allocations = 0
        self.fetches = 0
        self.fallback_fetches = 0
        # With `record`: ("forward" | "backward", block) per install, and the order of fetches.
        self.install_log: list[tuple[str, int]] | None = [] if record else None
        self.fetch_log: list[int] | None = [] if record else None
        self.max_on_device = 0  # most blocks on the device at once (in slots + one-off buffers)
        # The last attach's seconds by part: packing host buffers ("pack": a block ComfyUI moved since is laid out
        # again), pinning them ("pin"), copying the resident blocks and non-block layers to the device ("keep"), the
        # slots ("slots"). The GPU kit saw a Steps call start 10-17 s on Flux.1-dev: this says where it goes.
        self.setup_seconds: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return self.device.type != "cpu" or self.exercise_on_cpu

    @property
    def _cuda(self) -> bool:
        return self._copy_stream is not None

    # --- attach / detach -------------------------------------------------------------------------------------
    def attach(self) -> "WeightStreamer":
        if self.active:
            raise RuntimeError("WeightStreamer is already attached; detach it first")
        self.active = True
        if not self.enabled:
            return self  # CPU: the weights already are where the compute happens
        try:
            self._set_up()
        except BaseException:  # out of memory for the slots, say: the modules get their host tensors back
            self.detach()
            raise
        return self

    def _set_up(self) -> None:
        """Pack the host buffers, keep the resident blocks and non-block layers, allocate the slots, add the hooks."""
        cuda = self.device.type == "cuda"
        self.setup_seconds = dict.fromkeys(("pack", "pin", "keep", "slots"), 0.0)
        if cuda:
            self._copy_stream = torch.cuda.Stream(self.device)
        in_blocks = {id(m) for block in self.blocks for m in block.modules()}
        self._blocks = []
        for index, block in enumerate(self.blocks):
            packed = self._pack(self._collect(block.modules()), pin=index not in self.resident)
            if index in self.resident:
                self._keep_on_device(packed)
                packed = _Block([], 0)
            self._blocks.append(packed)
        for module in self.keep:
            self._keep_on_device(self._pack(self._collect(m for m in module.modules() if id(m) not in in_blocks),
                                            pin=False))
        self._streamed = [i for i, b in enumerate(self._blocks) if b.tensors]
        largest = max((b.nbytes for b in self._blocks), default=0)
        started = time.perf_counter()
        if self._streamed:
            for _ in range(min(self.slot_count, len(self._streamed))):
                buffer = torch.empty(largest, dtype=torch.uint8, device=self.device)
                self.allocations += 1
                slot = _Slot(buffer, cuda)
                self._ring.append(slot)
                self._by_storage[buffer.untyped_storage().data_ptr()] = slot
        self.setup_seconds["slots"] += time.perf_counter() - started
        # the per-tensor host storages packing replaced, back to the OS (glibc keeps them in its heap otherwise)
        os_compat.release_freed_host_memory()
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._make_pre_forward(index)))
            self._handles.append(block.register_forward_hook(self._make_post_forward(index)))

    def detach(self) -> None:
        if not self.active:
            return
        self._stop_watching()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for index in list(self._installed):
            self._release(index)
        for kept in self._kept:
            for t in kept.tensors:
                (t.module._parameters if t.is_param else t.module._buffers)[t.name] = t.host
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            # No copy reads a host buffer we unpin below: the ring's (copy stream) nor a one-off fetch's (compute).
            torch.cuda.current_stream(self.device).synchronize()
        for block in self._blocks:
            if block.registered:
                _unregister(block.packed, self.device)  # pageable again: no pinned RAM outlives the run
                block.registered = block.pinned = False
        self.pinned_bytes = 0
        # The host tensors stay views of their packed block (same values, pageable): a later attach reuses it.
        self._blocks, self._streamed, self._ring, self._kept = [], [], [], []
        self._slot_of.clear()
        self._by_storage.clear()
        self._temps.clear()
        self._copy_stream = None
        self.active = False

    def __enter__(self) -> "WeightStreamer":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _collect(self, modules: Iterable[torch.nn.Module]) -> list[tuple]:
        """The frozen tensors of `modules` that are not on the device: (module, name, is_param, tensor)."""
        tensors = []
        for module in modules:
            if id(module) in self.unread:
                continue
            for name, param in module._parameters.items():
                if param is not None and not param.requires_grad and self._needs_streaming(param):
                    tensors.append((module, name, True, param))
            for name, buffer in module._buffers.items():
                if buffer is not None and self._needs_streaming(buffer):
                    tensors.append((module, name, False, buffer))
        return tensors

    def _pack(self, tensors: list[tuple], pin: bool = True) -> _Block:
        """`tensors` in one flat host buffer (pinned on CUDA where `pin`); the modules' host tensors become views of
        it."""
        offset = 0
        laid = []
        seen: dict[int, _Tensor] = {}  # the plain tensors laid out (a wrapper subclass's inner ones), by id

        def place(module, name, is_param, host) -> _Tensor:
            nonlocal offset
            if id(host) in seen:  # one tensor under two names (tied weights): one place in the block
                first = seen[id(host)]
                return _Tensor(module, name, is_param, host, first.offset, first.span, first.nbytes)
            span = _span_bytes(host)
            seen[id(host)] = _Tensor(module, name, is_param, host, offset, span, host.numel() * host.element_size())
            offset += -(-span // ALIGN) * ALIGN
            return seen[id(host)]

        wrappers: dict[int, _Tensor] = {}
        for module, name, is_param, host in tensors:
            if not is_traceable_wrapper_subclass(host):
                laid.append(place(module, name, is_param, host))
                continue
            # ComfyUI's QuantizedTensor: its inner tensors (fp8 data, scales) packed like any other; rebuilt at install
            if id(host) not in wrappers:
                names, context = host.__tensor_flatten__()
                parts = {}
                for inner_name in names:
                    inner = getattr(host, inner_name)
                    if is_traceable_wrapper_subclass(inner):
                        raise ValueError(f"weight streaming: {name}'s {inner_name} is itself a tensor subclass "
                                         f"({type(inner).__name__}), which the ring does not carry")
                    parts[inner_name] = place(None, inner_name, False, inner)
                wrappers[id(host)] = _Tensor(module, name, is_param, host, 0, 0, sum(p.nbytes for p in parts.values()),
                                             parts, context)
            first = wrappers[id(host)]
            laid.append(dataclasses.replace(first, module=module, name=name, is_param=is_param))
        result = _Block(laid, offset)
        if not laid:
            return result
        started = time.perf_counter()
        result.packed = self._packed_already(list(seen.values()), offset)
        if result.packed is None:
            packed = torch.empty(offset, dtype=torch.uint8)
            with torch.no_grad():
                for t in seen.values():
                    packed[t.offset:t.offset + t.span].copy_(_raw_bytes(t.host, t.span))
                for t in seen.values():
                    if not t.host.is_pinned():  # pinned by someone else (their record of it): left alone
                        t.host.data = t.view(packed)  # the old storage is freed: host RAM is not doubled
            result.packed = packed
        self.setup_seconds["pack"] += time.perf_counter() - started
        started = time.perf_counter()
        if self._pins_host_copies() and pin:
            within = self.pin_limit_bytes is None or self.pinned_bytes + offset <= self.pin_limit_bytes
            result.registered = within and _register(result.packed, self.device)
            if result.registered:
                self.pinned_bytes += offset
            elif not result.packed.is_pinned():
                self.pageable_blocks += 1
                if not self._warned_pin:
                    self._warned_pin = True
                    why = (f"the {self.pin_limit_bytes / 2 ** 30:.1f} GiB of host RAM ComfyUI leaves to pin are used"
                           if not within else "CUDA refused to pin more host RAM")
                    logging.warning("Headroom: weight streaming pinned %.1f GiB of its host buffers; %s, so the rest "
                                    "crosses from pageable memory, slower", self.pinned_bytes / 2 ** 30, why)
        result.pinned = result.registered or result.packed.is_pinned()
        self.setup_seconds["pin"] += time.perf_counter() - started
        return result

    def _copies_from_pageable_hold_the_cpu(self) -> bool:
        """On CUDA a copy from pageable host memory returns once it is done (a pinned one at once): with pinning off
        (--disable-pinned-memory) every block is such."""
        return self.device.type == "cuda"

    def _pins_host_copies(self) -> bool:
        return self.device.type == "cuda" and self.pin_host_copies and pinned_host.allowed()

    @staticmethod
    def _packed_already(laid: list[_Tensor], nbytes: int) -> torch.Tensor | None:
        """The block's packed buffer when its tensors are views of one already (a previous attach made it)."""
        storage = laid[0].host.untyped_storage()
        if storage.nbytes() != nbytes or laid[0].host.is_pinned():
            return None
        for t in laid:
            if (t.host.untyped_storage().data_ptr() != storage.data_ptr()
                    or t.host.storage_offset() * t.host.element_size() != t.offset):
                return None
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))

    def _needs_streaming(self, tensor: torch.Tensor) -> bool:
        if self.device.type == "cpu":
            return True  # exercise mode: every frozen tensor takes the round trip
        return tensor.device != self.device

    def _keep_on_device(self, block: _Block) -> None:
        """One copy, at attach, into a buffer of its own; installed until detach."""
        if not block.tensors:
            return
        started = time.perf_counter()
        buffer = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)
        buffer.copy_(block.packed)  # from pageable memory: done when it returns
        self.setup_seconds["keep"] += time.perf_counter() - started
        self.allocations += 1
        for t in block.tensors:
            (t.module._parameters if t.is_param else t.module._buffers)[t.name] = _device_object(t, buffer)
        self._kept.append(block)

    # --- the ring ----------------------------------------------------------------------------------------------
    def _victim(self, keep: set[int]) -> _Slot | None:
        """The least recently used slot not installed, not pinned by autograd, not holding a block in `keep`."""
        choices = [s for s in self._ring if not s.installed and s.pins == 0 and s.block not in keep]
        return min(choices, key=lambda s: (s.block is not None, s.used), default=None)

    def _fetch(self, index: int, keep: set[int]) -> bool:
        """Start copying block `index` into a slot (on the copy stream on CUDA). False: no slot could take it."""
        slot = self._victim(keep | {index})
        if slot is None:
            return False
        if slot.block is not None:
            del self._slot_of[slot.block]
        block = self._blocks[index]
        if self._cuda:
            if slot.free_stale:  # unpinned by autograd: its last reader is whatever was launched so far
                slot.free.record(torch.cuda.current_stream(self.device))
                slot.free_recorded, slot.free_stale = True, False
            if slot.free_recorded:
                self._copy_stream.wait_event(slot.free)  # on the device only: the CPU goes on queueing
            with torch.cuda.stream(self._copy_stream):
                slot.buffer[:block.nbytes].copy_(block.packed, non_blocking=True)
                slot.ready.record(self._copy_stream)
        else:
            slot.buffer[:block.nbytes].copy_(block.packed)
        slot.block, slot.free_stale = index, False
        self._tick += 1
        slot.used = self._tick
        self._slot_of[index] = slot
        self.fetches += 1
        if self.fetch_log is not None:
            self.fetch_log.append(index)
        self._count_on_device()
        return True

    def _prefetch(self, around: int, step: int) -> None:
        """Keep the next `slots - 1` streamed blocks after `around` (step +1: forward, -1: backward) in slots. In
        backward the next are those backward will run; past the last of them, the next step's first blocks (those
        backward skips), so its forward starts with no copy and none is made for a block backward never runs."""
        if step > 0:
            later = [i for i in self._streamed if i > around][:self.slot_count - 1]
        else:
            later = [i for i in self._streamed[::-1] if i < around and i in self._backward_blocks]
            later = (later + [i for i in self._streamed if i not in self._backward_blocks])[:self.slot_count - 1]
        if step < 0 and self.slot_count > 2 and self._copies_from_pageable_hold_the_cpu():
            # A copy from pageable memory holds the CPU until it is done. Backward starts copies before queueing its
            # block, and the deepest one's slot frees only when the block running now ends: started here the device
            # would idle through it. One block later (within the ring) it overlaps that block instead.
            later = [i for depth, i in enumerate(later, 1) if depth < self.slot_count - 1 or self._blocks[i].pinned]
        keep = set(later) | {around}
        for index in later:
            if index not in self._slot_of and not self._fetch(index, keep):
                return  # no slot free: the rest come when they are installed

    def _install(self, index: int, phase: str) -> None:
        block = self._blocks[index]
        if index in self._installed or not block.tensors:
            return
        if index not in self._slot_of and not self._fetch(index, set()):
            self._fetch_one_off(index)  # out of order with every slot in use or pinned: correct, not fast
        if index in self._temps:
            views = self._temps[index]
        else:
            slot = self._slot_of[index]
            if self._cuda:
                torch.cuda.current_stream(self.device).wait_event(slot.ready)
            views = slot.params.get(index)
            if views is None:
                views = slot.params[index] = [_device_object(t, slot.buffer) for t in block.tensors]
            slot.installed = True
            self._tick += 1
            slot.used = self._tick
        for t, view in zip(block.tensors, views):
            (t.module._parameters if t.is_param else t.module._buffers)[t.name] = view
        self._installed.add(index)
        if self.install_log is not None:
            self.install_log.append((phase, index))

    def _fetch_one_off(self, index: int) -> None:
        block = self._blocks[index]
        buffer = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)
        buffer.copy_(block.packed, non_blocking=self._cuda)  # on the compute stream: ordered before the block
        self.allocations += 1
        self.fetches += 1
        self.fallback_fetches += 1
        if self.fetch_log is not None:
            self.fetch_log.append(index)
        self._temps[index] = [_device_object(t, buffer) for t in block.tensors]
        self._count_on_device()

    def _release(self, index: int) -> None:
        """Put the host tensors back; the slot may take another block once the device is done with this one."""
        if index not in self._installed:
            return
        self._installed.discard(index)
        for t in self._blocks[index].tensors:
            (t.module._parameters if t.is_param else t.module._buffers)[t.name] = t.host
        if self._temps.pop(index, None) is not None:
            return  # autograd keeps the one-off buffer alive as long as it needs it
        slot = self._slot_of[index]
        slot.installed = False
        if self._cuda:
            slot.free.record(torch.cuda.current_stream(self.device))
            slot.free_recorded, slot.free_stale = True, False

    def _count_on_device(self) -> None:
        self.max_on_device = max(self.max_on_device, len(self._slot_of) + len(self._temps))

    # --- autograd holding slots (blocks not checkpointed) -------------------------------------------------------
    def _watch(self) -> None:
        """While a block runs with grad: a saved tensor viewing a slot pins it (see the module docstring)."""
        self._stop_watching()
        by_storage = self._by_storage

        def pack(tensor):
            # a wrapper subclass (a QuantizedTensor weight) has no storage: its inner tensors' tell
            slot = next((by_storage[p] for p in _storage_pointers(tensor) if p in by_storage), None)
            return tensor if slot is None else _Held(tensor, slot)

        def unpack(packed):
            return packed.tensor if isinstance(packed, _Held) else packed

        try:
            context = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            context.__enter__()
        except RuntimeError:  # saved-tensors hooks disabled here (an enclosing checkpoint's recompute)
            return
        self._saving = context

    def _stop_watching(self) -> None:
        if self._saving is not None:
            context, self._saving = self._saving, None
            context.__exit__(None, None, None)

    # --- hooks ------------------------------------------------------------------------------------------------
    def _make_pre_forward(self, index: int):
        def pre_forward(module, args):
            for other in [i for i in self._installed if i != index]:
                self._release(other)
            self._install(index, "forward")
            if torch.is_grad_enabled() and self._blocks[index].tensors:
                self._watch()

        return pre_forward

    def _make_post_forward(self, index: int):
        def post_forward(module, args, output):
            self._stop_watching()
            self._release(index)
            # The next blocks' copies are started here, after this block's kernels are queued, not before them: a copy
            # from pageable host memory (past the pin limit) holds the CPU until it is done, and the device then has
            # this block to run meanwhile instead of idling.
            self._prefetch(index, +1)
            tensors = _output_tensors(output)
            if torch.is_grad_enabled():
                if tensors:
                    self._backward_blocks.add(index)
                    register_multi_grad_hook(tensors, lambda grads: self._before_backward(index), mode="any")
                else:  # nothing here needs a gradient: backward will not run this block
                    self._backward_blocks.discard(index)
            return output

        return post_forward

    def _before_backward(self, index: int) -> None:
        # Runs on autograd's thread before block `index` computes its gradients (and before checkpointing
        # recomputes it), while the main thread waits in backward(): no concurrent access to the state. The block
        # after it is done with its backward by now (its nodes come first in autograd's order).
        for other in [i for i in self._installed if i != index]:
            self._release(other)
        self._install(index, "backward")
        self._prefetch(index, -1)

    # --- figures for the planner / bench / tests ---------------------------------------------------------------
    def streamed_bytes(self) -> list[int]:
        """Bytes streamed per block (0 for a block with nothing to stream; [] before attach)."""
        return [sum(t.nbytes for t in {id(t.host): t for t in b.tensors}.values()) for b in self._blocks]

    def kept_bytes(self) -> int:
        """Bytes copied once at attach and kept on the device (resident blocks and non-block layers from host RAM)."""
        return sum(t.nbytes for block in self._kept for t in {id(t.host): t for t in block.tensors}.values())

    def streamed_blocks(self) -> set[int]:
        """The indices of the blocks that stream (the rest are resident, or hold no frozen weights)."""
        return set(self._streamed)

    def slot_bytes(self) -> int:
        """Bytes of each device slot: the largest streamed block as packed (0: nothing streams)."""
        return self._ring[0].buffer.numel() if self._ring else 0

    def slot_pointers(self) -> list[int]:
        """The device address of each slot (fixed from attach to detach)."""
        return [slot.buffer.data_ptr() for slot in self._ring]


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
                         device_budget: int | None, slots: int = DEFAULT_SLOTS) -> int:
    """The frozen block weights kept on the device: all ("resident", or "partial" without a budget), none
    ("streamed"), or for "partial" what the room `device_budget` leaves beside everything else (`rest_bytes`) and
    the ring's `slots` (a block each). The run's load keeps ComfyUI to this share (nodes/bridge/comfy_bridge.Placement)."""
    all_blocks = sum(block_weights)
    if placement == "resident" or (placement == "partial" and device_budget is None):
        return all_blocks
    if placement == "streamed":
        return 0
    return max(0, min(all_blocks, device_budget - rest_bytes - slots * max(block_weights, default=0)))


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
                   device_budget: int | None, slots: int = DEFAULT_SLOTS) -> tuple[dict[str, int], int]:
    """The device items of the frozen block weights in one phase, and the bytes of them resident."""
    all_blocks = sum(block_weights)
    if placement == "resident":
        return {f"frozen block weights ({storage})": all_blocks}, all_blocks
    resident_part = resident_block_bytes(placement, block_weights, rest_bytes, device_budget, slots)
    buffers = 0 if resident_part >= all_blocks else slots * max(block_weights, default=0)
    weights = {f"streamed block buffers ({slots} blocks)": buffers}
    if placement == "partial":
        weights[f"resident block weights ({storage}, partial)"] = resident_part
    return weights, resident_part


def placement_cost(placement: str, block_weights: Sequence[int], storage: str, rest_bytes: int,
                   device_budget: int | None, validation_rest_bytes: int | None = None,
                   validation_block_weights: Sequence[int] | None = None, slots: int = DEFAULT_SLOTS) -> FeatureCost:
    """Where the frozen block weights (`block_weights`, as stored) are during a run (policy base_placement):
    "resident" all on the device; "streamed" the ring's `slots` blocks' buffers (the one in use and those in flight),
    the rest in host RAM; "partial" as many as fit the room `device_budget` (the budget less the allocator's share)
    leaves beside everything else a training step holds (`rest_bytes`) and the buffers, the rest streamed. Validation is placed on
    its own (`validation_placement`) in the room it leaves beside what it holds (`validation_rest_bytes`; None: the
    training figure), of the block weights it reads (`validation_block_weights`; None: training's; a full fine-tune's
    training step reads fewer: its trained layers compute with their own copy)."""
    all_blocks = sum(block_weights)
    notes = []
    if placement == "partial" and device_budget is None:
        notes.append("partial placement without a budget: estimated as fully resident")
    training, resident_part = _phase_weights(placement, block_weights, storage, rest_bytes, device_budget, slots)
    validation, _ = _phase_weights(validation_placement(placement, device_budget is not None),
                                   block_weights if validation_block_weights is None else validation_block_weights,
                                   storage,
                                   rest_bytes if validation_rest_bytes is None else validation_rest_bytes,
                                   device_budget)
    # What the training step streams from host RAM (the figure the plan's summary names).
    host = {"streamed block weights": all_blocks - resident_part} if all_blocks > resident_part else {}
    return FeatureCost(training=training, validation=validation, host=host, training_notes=notes)
