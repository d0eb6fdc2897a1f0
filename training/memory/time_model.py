"""The planner's time model: the predicted seconds of one training step under a plan (planner.estimate).

    step = max(pipeline, transfer) + optimizer + fill

- pipeline: the ring of the streamer (weight_streaming.py) played block by block, forward then backward: a block
  starts when the one before it is done and its own copy is in; copies run one after another on the copy stream,
  each once its slot's previous block is done (`slots` apart). Per block that is max(its compute, its copy) where
  nothing is left to overlap, and resident blocks between streamed ones hide their copies. Plus the work outside
  the blocks. Never less than compute, nor than the copies.

- compute: every block's forward and backward, the work outside the blocks, and the forward of each checkpointed block
  again (its recompute in backward); no backward for the first blocks nothing trained precedes (`without_backward`),
  and a ControlNet's copies of the first blocks once more (`copies`: its own blocks as timed, else `copied_blocks` of
  the base's). Forward times are measured per block at
  the run's latent size, one item, under no_grad (planner.time_blocks, from the nodes:
  nodes/bridge/planning.time_at_run_size; a block ComfyUI left in host RAM is brought to the device first, so its time
  is compute), or, where that does not fit, in the calibration forwards (planner.measure_activations at 16-32 latent
  px, fitted as a line in the latent area: on a GPU such tiny forwards are bound by launching kernels, so the line
  says little of a 128 px latent); backward is each block's measured ratio of backward to forward times its forward
  (timed with the forward at the run's size, once per kind of block: BlockProfile.backward_per_forward), else
  BACKWARD_PER_FORWARD. A block with no measured time is costed at reading its weights once (weight bytes / device
  memory bandwidth): the least a forward can take.
- transfer: the bytes crossing between host and device in a step over the pinned host->device bandwidth (a streamed
  block past what the run may pin - ComfyUI's pinned-memory share, Windows: 40 % of the RAM - over the pageable
  bandwidth, measured alike: `pinned_blocks` says which, as the streamer pins them): each
  streamed block twice (its forward, and its recompute in backward: a streamed block is always checkpointed), less
  the blocks still in the ring's slots at a turn (the last `slots` streamed blocks at forward -> backward, the
  first `slots` at the next step's forward; the first blocks backward skips, `without_backward`, are fetched in
  backward instead, for the next forward), offloaded block inputs there and back, a full fine-tune's trained
  weights in host RAM (in for forward and backward, the update back), streamed optimizer state (in and back). On a
  CPU nothing crosses.
- the ring's copies overlap compute (copied ahead on a side stream while blocks compute), but those from pageable
  memory hold the CPU, which queues nothing meanwhile: in forward each overlaps one block, in backward one block with
  3 or more slots and none with 2 (added to the pipeline); the others are `serial`:
  queued on the compute stream just before the layer that needs them (trained_weights_on_host.Crossings, the
  streamed state's rings, the offloaded block inputs' hooks), so the card computes nothing meanwhile and they add to
  the step. The physical limit of a streamed step is max(compute + optimizer, transfer) (`StepTime.limit_s`: every
  copy overlapped); the prediction adds what the per-block pipeline loses to it and the serial copies. Phase by
  phase (`StepTime.phase_limit_s`) the limit is higher where one phase is bound by the link and the other by compute:
  a forward's copies cannot wait behind backward's compute (the ring carries only its slots across the turn).
- the CPU's copies through the pinned staging buffers: a full fine-tune's trained weights in host RAM and streamed
  optimizer state are copied by the CPU into a staging buffer before each crossing in, and out of one after each
  crossing back (trained_weights_on_host.Crossings: pinned staging, not pinned weights, the module says why). The CPU
  runs at most a staging buffer or two ahead of the card, so the step takes at least those copies' time at the
  host's copy bandwidth (measured once, as the link's), which can be below the link's (a 2-core VM: 9-10 GB/s on one
  thread).
- not overlapped, so added: the optimizer step (it runs after backward's last gradient: on a card a bandwidth-bound
  estimate from the bytes it reads and writes; in host RAM - optimizer_state "cpu", or a CPU run - the seconds per
  weight of fused backward's step measured once on this machine (TrainableSpec.host_step_s_per_weight), plus
  gradients down and weights up over the link), and the pipeline fill (a copy before any compute can start: none in
  a steady step, whose first streamed blocks are still in the ring from the previous backward).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import torch

from . import pinned_host

# Backward of a frozen base with an adapter: input gradients through every frozen layer (about the forward's work)
# and attention's backward (about 2.5x its forward); no weight gradients of the base. 1.5x the forward, a rule of thumb
# for blocks whose backward was not timed (planner.time_blocks times one block of each kind at the run's size: 0.8-0.9x
# for Flux's and SD3.5's blocks on a CPU at real width, docs/benchmarks/cpu_step_time.md).
BACKWARD_PER_FORWARD = 1.5
# Pinned host->device copies over PCIe 4.0 x16 in practice (about 25 GB/s peak); measured on CUDA when planning.
DEFAULT_H2D_BYTES_PER_S = 20e9
# Pageable host->device copies: the driver stages them through its own pinned buffer, a copy at a time. An assumed
# half of the pinned default, not a measurement (measured on CUDA when planning, as the pinned one).
DEFAULT_PAGEABLE_H2D_BYTES_PER_S = 10e9
# Memory bandwidth for the bandwidth-bound estimates (the optimizer step on a card, a block's forward when none is
# measured): a current GPU's HBM/GDDR order of magnitude, and a desktop's host RAM.
DEVICE_BYTES_PER_S = {"cuda": 1e12, "cpu": 2e10}
H2D_PROBE_BYTES = 256 << 20
# Host RAM -> pinned host RAM copies (torch's copy_, as the staging buffers are filled): a 2-core VM's 9-10 GB/s on
# one thread, 16-17 on two (bench/bench_host_copy.py, docs/BENCHMARKS.md); measured on CUDA when planning, as the link.
DEFAULT_HOST_COPY_BYTES_PER_S = 10e9
# Seconds per weight of one trained tensor's optimizer step in host RAM where it was not measured
# (training/core/optimizers.host_step_s_per_weight measures it for the planner: TrainableSpec.host_step_s_per_weight):
# that probe's AdamW and Adafactor on one thread of a 2-core VM, 10-15 ns (docs/benchmarks/full_finetune.md). A
# bandwidth figure (bytes touched / host RAM bandwidth) was 6-27x too fast.
DEFAULT_HOST_STEP_S_PER_WEIGHT = 15e-9


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A plan's predicted step, in seconds, by part (see the module docstring for the formula)."""

    compute_s: float  # forward + backward of everything, recompute included
    recompute_s: float  # the part of compute_s that recomputes checkpointed blocks
    transfer_s: float  # host <-> device copies, overlapped with compute
    optimizer_s: float
    fill_s: float
    timed: bool = True  # block times measured (False: estimated from weight bytes)
    pipeline_s: float | None = None  # per block max(compute, copy), summed (None: compute_s)
    serial_s: float = 0.0  # the part of transfer_s queued on the compute stream (not overlapped: added)
    pageable_s: float = 0.0  # the part of transfer_s copying streamed blocks from pageable memory (past the pin limit)
    # The CPU's copies into and out of the pinned staging buffers (trained weights in host RAM, streamed state): the
    # step takes at least this long, whatever the card does meanwhile
    host_copy_s: float = 0.0
    # Block times measured at this step's latent size (planner.time_blocks) rather than fitted from the calibration's
    # tiny forwards and extrapolated
    timed_at_run_size: bool = False
    # The step by phase, for the phase floor (phase_limit_s): the forward's compute (the blocks' and the work outside
    # them), and the ring's copies in each phase (those not queued on the compute stream)
    forward_compute_s: float = 0.0
    forward_copy_s: float = 0.0
    backward_copy_s: float = 0.0

    @property
    def card_s(self) -> float:
        """The card's share of the step: its pipeline of compute and copies, the copies it waits for, the optimizer
        step and the fill."""
        pipeline = self.compute_s if self.pipeline_s is None else max(self.pipeline_s, self.compute_s)
        return max(pipeline, self.transfer_s - self.serial_s) + self.serial_s + self.optimizer_s + self.fill_s

    @property
    def total_s(self) -> float:
        return max(self.card_s, self.host_copy_s)

    @property
    def limit_s(self) -> float:
        """The physical limit: max(compute with its recompute + the optimizer step, bytes crossing / bandwidth)."""
        return max(self.compute_s + self.optimizer_s, self.transfer_s)

    @property
    def phase_limit_s(self) -> float:
        """The physical limit phase by phase: max(forward compute, forward copies) + max(backward compute with the
        recompute, backward copies) + the optimizer step, never under `limit_s`. The ring carries only its slots'
        blocks across the forward -> backward turn, so a forward's copies cannot hide behind backward's compute: a
        streamed Flux forward moves as many bytes as its backward in a third of the compute, and is bound by the
        link while backward is bound by compute, however deep the ring (issue 41's limit assumes they all overlap)."""
        if not self.forward_compute_s:  # not split (a record from before the split)
            return self.limit_s
        backward = self.compute_s - self.forward_compute_s
        phases = (max(self.forward_compute_s, self.forward_copy_s) + max(backward, self.backward_copy_s)
                  + self.optimizer_s)
        return max(phases, self.limit_s)

    @property
    def ring_floor_s(self) -> float:
        """What no depth of the ring can take the step below: compute, the copies on the compute stream, the
        optimizer step and the fill, and the CPU's staging copies (planner.fastest_with_slots skips a plan whose
        floors are not below the best's step)."""
        return max(self.card_floor_s, self.host_copy_s)

    @property
    def card_floor_s(self) -> float:
        """The same for the card's share of the step (StepTime.card_s)."""
        return self.compute_s + self.serial_s + self.optimizer_s + self.fill_s

    @property
    def bound(self) -> str:
        if self.host_copy_s and self.host_copy_s >= self.total_s:  # the CPU's staging copies take longest
            return "host-copy"
        return "transfer" if self.transfer_s > self.compute_s else "compute"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_s": self.total_s, "limit_s": self.limit_s,
                "phase_limit_s": self.phase_limit_s, "bound": self.bound}

    def describe(self) -> str:
        parts = [f"{self.serial_s:.3f} s of it on the compute stream" if self.serial_s else "",
                 f"{self.pageable_s:.3f} s from pageable memory" if self.pageable_s else ""]
        serial = f" ({', '.join(p for p in parts if p)})" if any(parts) else ""
        host = f"; the CPU's staging copies {self.host_copy_s:.3f} s" if self.host_copy_s else ""
        phases = ""
        if self.phase_limit_s > self.limit_s + 5e-4:  # one phase bound by the link, the other by compute
            backward = self.compute_s - self.forward_compute_s
            phases = (f", {self.phase_limit_s:.3f} s phase by phase: forward "
                      f"{'transfer' if self.forward_copy_s > self.forward_compute_s else 'compute'}-bound, backward "
                      f"{'transfer' if self.backward_copy_s > backward else 'compute'}-bound")
        text = (f"predicted {self.total_s:.3f} s/step ({self.bound}-bound: compute {self.compute_s:.3f} s incl. "
                f"recompute {self.recompute_s:.3f} s, transfer {self.transfer_s:.3f} s{serial}; + optimizer "
                f"{self.optimizer_s:.3f} s, fill {self.fill_s:.3f} s{host}; physical limit {self.limit_s:.3f} s"
                f"{phases})")
        if not self.timed:
            return text + " - block times not measured: estimated from weight bytes"
        return text + ("; block times measured at the run's size" if self.timed_at_run_size else "")


def ring_fetches(streamed_block_bytes: Sequence[int], slots: int, without_backward: int = 0
                 ) -> tuple[list[int], list[int]]:
    """The blocks the ring copies in a steady step: (in forward, in backward), each in the order copied. Those still
    in a slot at a turn are not copied again (weight_streaming.py): the last `slots` streamed blocks in backward, and
    in forward the first ones. The first `without_backward` blocks run no backward: the ring fetches the first
    `slots - 1` of them (of those streamed) in backward in place of the next forward, which then finds them in the
    ring (and, with fewer than `slots` of them, the lowest blocks backward ran too)."""
    streamed = [i for i, size in enumerate(streamed_block_bytes) if size > 0]
    skipped = [i for i in streamed if i < without_backward]
    run = [i for i in streamed if i >= without_backward]
    if not skipped or not run:
        return streamed[slots:], streamed[:max(0, len(streamed) - slots)][::-1]
    ahead = skipped[:slots - 1]
    in_ring = set(ahead) if len(skipped) >= slots else set(streamed[:slots])
    return [i for i in streamed if i not in in_ring], run[:max(0, len(run) - slots)][::-1] + ahead


def pinned_blocks(streamed_block_bytes: Sequence[int], limit_bytes: int | None) -> set[int]:
    """The streamed blocks the ring pins within `limit_bytes` (None: every one), as weight_streaming.WeightStreamer
    pins them: in forward order, each block that still fits beside those pinned before it; the rest stay pageable."""
    pinned, total = set(), 0
    for i, size in enumerate(streamed_block_bytes):
        if size > 0 and (limit_bytes is None or total + size <= limit_bytes):
            pinned.add(i)
            total += size
    return pinned


def ring_pass(order: Sequence[int], compute_s: Sequence[float], copy_s: Sequence[float], streamed: set[int],
              slots: int) -> float:
    """Seconds of one pass (forward or backward) over the blocks in `order` through the ring: `compute_s` per block,
    `copy_s` per block (0: no copy in this pass: resident, or still in a slot), `streamed` the blocks that use a
    slot (copied or kept from the turn)."""
    compute_end, copy_end, ends, users = 0.0, 0.0, {}, []
    for i in order:
        ready = 0.0
        if i in streamed:
            if copy_s[i] > 0:
                previous = users[-slots] if len(users) >= slots else None  # the slot's last block
                copy_end = max(copy_end, ends[previous] if previous is not None else 0.0) + copy_s[i]
                ready = copy_end
            users.append(i)
        compute_end = max(compute_end, ready) + compute_s[i]
        ends[i] = compute_end
    return compute_end


def step_time(forward_s: Sequence[float], outside_forward_s: float, checkpointed: Sequence[int],
              streamed_block_bytes: Sequence[int], h2d_bytes_per_s: float | None, serial_transfer_bytes: int = 0,
              optimizer_s: float = 0.0, timed: bool = True, slots: int = 2,
              backward_per_forward: Sequence[float] = (), outside_backward_per_forward: float = 0.0,
              pin_limit_bytes: int | None = None, pageable_bytes_per_s: float | None = None,
              staged_bytes: int = 0, host_copy_bytes_per_s: float | None = None, without_backward: int = 0,
              copied_blocks: int = 0, copies: Sequence[tuple[float, float]] = ()) -> StepTime:
    """The predicted step. `forward_s`: each block's forward (batch included); `checkpointed`: the indices
    recomputed in backward; `streamed_block_bytes`: per block, the bytes streamed from host RAM (one copy; 0: a
    resident block); `h2d_bytes_per_s` None: nothing crosses (a CPU); `serial_transfer_bytes`: further bytes crossing
    per step on the compute stream (not overlapped); `slots`: the ring's device slots (weight_streaming.WeightStreamer);
    `backward_per_forward`: per block its backward's seconds per forward second, measured (planner.time_blocks; 0 or
    missing: BACKWARD_PER_FORWARD), and the same for the work outside the blocks; `pin_limit_bytes`: the host RAM the
    ring may pin (None: all of it; the blocks past it copy at `pageable_bytes_per_s`, None:
    DEFAULT_PAGEABLE_H2D_BYTES_PER_S); `staged_bytes`: the part of `serial_transfer_bytes` the CPU also copies through
    the pinned staging buffers, at `host_copy_bytes_per_s` (None: DEFAULT_HOST_COPY_BYTES_PER_S); `without_backward`:
    the first blocks, which no trained weight precedes, run no backward (nor its recompute; ring_fetches);
    `copied_blocks`: a ControlNet's trainable copy of the first blocks (TrainableSpec.copied_blocks) runs their forward
    and backward again, and their recompute where every block is checkpointed (the run checkpoints its own blocks only
    then: policy.memory_features), on the card beside the ring, as the work outside the blocks; timed as the base
    blocks they copy, or where `copies` is given as measured: the ControlNet's own blocks' (forward seconds, backward
    per forward), whose backward also makes its weights' gradients (a base block's makes its input's only)."""
    ratios = [r if r > 0 else BACKWARD_PER_FORWARD for r in
              (*backward_per_forward[:len(forward_s)], *[0.0] * (len(forward_s) - len(backward_per_forward)))]
    copies = [(f, r if r > 0 else BACKWARD_PER_FORWARD) for f, r in copies] or [
        (forward_s[i], ratios[i]) for i in range(min(copied_blocks, len(forward_s)))]
    copied_recompute = sum(f for f, _ in copies) if len(set(checkpointed)) == len(forward_s) else 0.0
    own = sum((1 + r) * f for f, r in copies) + copied_recompute
    ratios = [0.0 if i < without_backward else r for i, r in enumerate(ratios)]
    checkpointed = [i for i in checkpointed if i >= without_backward]
    outside_ratio = outside_backward_per_forward if outside_backward_per_forward > 0 else BACKWARD_PER_FORWARD
    base_recompute = sum(forward_s[i] for i in checkpointed)
    recompute = base_recompute + copied_recompute
    compute = (sum((1 + r) * f for r, f in zip(ratios, forward_s)) + (1 + outside_ratio) * outside_forward_s
               + base_recompute + own)
    forward_compute = sum(forward_s) + outside_forward_s + sum(f for f, _ in copies)
    if h2d_bytes_per_s is None:
        return StepTime(compute, recompute, 0.0, optimizer_s, 0.0, timed, compute, forward_compute_s=forward_compute)
    forward_copies, backward_copies = (set(part) for part in ring_fetches(streamed_block_bytes, slots,
                                                                         without_backward))
    pinned = pinned_blocks(streamed_block_bytes, pin_limit_bytes)
    pageable_rate = pageable_bytes_per_s or DEFAULT_PAGEABLE_H2D_BYTES_PER_S
    copy = [size / (h2d_bytes_per_s if i in pinned else pageable_rate) for i, size in enumerate(streamed_block_bytes)]
    streamed = {i for i, size in enumerate(streamed_block_bytes) if size > 0}
    recomputed = set(checkpointed)
    n = len(forward_s)
    backward = [r * f + (f if i in recomputed else 0.0) for i, (r, f) in enumerate(zip(ratios, forward_s))]
    # The ring's pinned copies overlap as ring_pass plays them. A pageable copy holds the CPU until it is done, so
    # nothing is queued meanwhile (weight_streaming._prefetch): in forward it overlaps only the block that started it
    # (the streamed block `slots - 1` before it); in backward, with 3 or more slots, only the block queued before the
    # one that started it (the streamed block `slots - 1` after it), and with 2 slots nothing (its slot frees when the
    # block running then ends): the whole copy is added.
    order = sorted(streamed)
    position = {block: k for k, block in enumerate(order)}
    pageable_forward = [i for i in forward_copies if i not in pinned]
    pageable_backward = [i for i in backward_copies if i not in pinned]
    held = sum(max(0.0, copy[i] - forward_s[order[position[i] - (slots - 1)]]) for i in pageable_forward)
    if slots > 2:
        def overlapped(i):  # the block backward runs while a pageable copy of `i` holds the CPU (none past the end)
            k = position[i] + slots - 1
            return backward[order[k]] if k < len(order) else 0.0
        held += sum(max(0.0, copy[i] - overlapped(i)) for i in pageable_backward)
    else:  # in the pipeline, not `serial`: a deeper ring overlaps them (ring_floor_s stays a floor for every depth)
        held += sum(copy[i] for i in pageable_backward)
    pipeline = ((1 + outside_ratio) * outside_forward_s + own + held
                + ring_pass(range(n), forward_s,
                            [c if i in forward_copies and i in pinned else 0.0 for i, c in enumerate(copy)],
                            streamed, slots)
                + ring_pass(range(n - 1, -1, -1), backward,
                            [c if i in backward_copies and i in pinned else 0.0 for i, c in enumerate(copy)],
                            streamed, slots))
    copies = [copy[i] for i in (*forward_copies, *backward_copies)]
    serial = serial_transfer_bytes / h2d_bytes_per_s
    return StepTime(compute, recompute, sum(copies) + serial, optimizer_s, 0.0, timed, pipeline, serial,
                    pageable_s=sum(copy[i] for i in (*pageable_forward, *pageable_backward)),
                    host_copy_s=staged_bytes / (host_copy_bytes_per_s or DEFAULT_HOST_COPY_BYTES_PER_S),
                    forward_compute_s=forward_compute, forward_copy_s=sum(copy[i] for i in forward_copies),
                    backward_copy_s=sum(copy[i] for i in backward_copies))


def optimizer_step_s(weight_bytes: int, state_bytes: int, on_host: bool, device_type: str,
                     h2d_bytes_per_s: float | None, host_s_per_weight: float = DEFAULT_HOST_STEP_S_PER_WEIGHT,
                     elements: int = 0) -> float:
    """On a card bandwidth-bound: the step reads weights, gradients (the weights' size) and state, and writes weights
    and state. In host RAM (optimizer_state "cpu", or `device_type` "cpu") `elements` weights at `host_s_per_weight`
    each (measured: a CPU steps far below its memory bandwidth), and with a card the gradients go down
    and the weights come back over the link."""
    if not on_host and device_type != "cpu":
        return (3 * weight_bytes + 2 * state_bytes) / DEVICE_BYTES_PER_S.get(device_type, DEVICE_BYTES_PER_S["cuda"])
    link = 0.0 if h2d_bytes_per_s is None else 2 * weight_bytes / h2d_bytes_per_s
    return elements * host_s_per_weight + link


def fit_seconds(areas: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(const, per_latent_px) of a line through measured times, both >= 0: a time that fell with the area (noise in
    tiny calibration forwards) is taken as flat."""
    n = len(areas)
    mean_a, mean_t = sum(areas) / n, sum(seconds) / n
    spread = sum((a - mean_a) ** 2 for a in areas)
    slope = max(0.0, sum((a - mean_a) * (t - mean_t) for a, t in zip(areas, seconds)) / spread) if spread else 0.0
    return max(0.0, mean_t - slope * mean_a), slope


def device_synchronize(device: torch.device):
    """What waits for `device`'s queued work before a time is read (CUDA: torch.cuda.synchronize); None on a CPU,
    whose work is done when the call returns."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def _copy_bytes_per_s(source: torch.Tensor, target: torch.Tensor, synchronize=lambda: None) -> float:
    """Bytes per second of `target.copy_(source)`, timed over 3 copies after a warm-up (the first copy pays for
    setting the path up and touching the pages). `source` written first: untouched pageable memory maps the OS's
    shared zero page, whose copy reads from cache (too fast)."""
    target.copy_(source, non_blocking=True)
    synchronize()
    started = time.perf_counter()
    for _ in range(3):
        target.copy_(source, non_blocking=True)
    synchronize()
    return 3 * source.numel() * source.element_size() / (time.perf_counter() - started)


@functools.lru_cache(maxsize=None)
def _measured_h2d(device: str, pinned: bool = True) -> float:
    source = target = None
    try:
        source = torch.empty(H2D_PROBE_BYTES, dtype=torch.uint8, pin_memory=pinned).fill_(1)
        target = torch.empty(H2D_PROBE_BYTES, dtype=torch.uint8, device=device)
        return _copy_bytes_per_s(source, target, lambda: torch.cuda.synchronize(device))
    finally:
        del source, target
        pinned_host.release_cached()  # torch would keep the probe's pinned buffer locked for the whole process


@functools.lru_cache(maxsize=None)
def measured_host_copy(pinned: bool = True) -> float:
    """As Crossings fills a staging buffer: torch's copy_ from pageable host RAM into a pinned (or, `pinned` False,
    pageable) buffer of H2D_PROBE_BYTES (bench/bench_host_copy.py measures it on a machine without CUDA)."""
    source = target = None
    try:
        source = torch.empty(H2D_PROBE_BYTES, dtype=torch.uint8).fill_(1)
        target = torch.empty(H2D_PROBE_BYTES, dtype=torch.uint8, pin_memory=pinned)
        return _copy_bytes_per_s(source, target)
    finally:
        del source, target
        pinned_host.release_cached()


def host_copy_bytes_per_s(device: torch.device | str) -> float | None:
    """Bytes per second the CPU copies from host RAM into a pinned staging buffer (trained_weights_on_host.Crossings):
    measured once per process on CUDA (256 MiB), None on a CPU (nothing crosses), DEFAULT_HOST_COPY_BYTES_PER_S
    elsewhere or when measuring fails."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return DEFAULT_HOST_COPY_BYTES_PER_S
    try:
        return measured_host_copy()
    except RuntimeError:
        return DEFAULT_HOST_COPY_BYTES_PER_S


def h2d_bytes_per_s(device: torch.device | str, pinned: bool = True) -> float | None:
    """Host->device bandwidth for `device` from pinned host RAM (or pageable: the streamed blocks past the pin limit):
    measured once per process on CUDA (a 256 MiB copy), None on a CPU (nothing crosses), DEFAULT_H2D_BYTES_PER_S
    (DEFAULT_PAGEABLE_H2D_BYTES_PER_S) elsewhere or when measuring fails."""
    device = torch.device(device)
    default = DEFAULT_H2D_BYTES_PER_S if pinned else DEFAULT_PAGEABLE_H2D_BYTES_PER_S
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return default
    try:
        return _measured_h2d(str(device), pinned)
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return default
