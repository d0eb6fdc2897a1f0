"""The memory planner: estimated peak device bytes per phase of a run, itemised, and the fastest policy
that fits a budget.

Inputs:
- `ModelDescription`: the frozen base per block (weight bytes; how much of it is Linear weights, what
  low-bit storage shrinks) and its activation profile per sample, as laws of the latent area and the text
  length (`ActivationLaw`): `saved` = what autograd keeps for the block's backward without checkpointing,
  `inputs` = the block's tensor inputs (all that checkpointing keeps). The profile is *measured* on the
  model's own code (`measure_activations`: forwards at a few small sizes, saved tensors counted through
  autograd's saved-tensor hooks) and fitted (`fit_profile`), then extrapolated to the bucket.
- `TrainableSpec`: trainable parameter shapes and the optimizer (state bytes per optimizer below).
- batch, resolution bucket, `OffloadPolicy`, budget in bytes.

Each memory feature costs itself (training/memory/cost.py FeatureCost, from its module: checkpointing,
activation_offload, weight_streaming, optimizer_parking; lowbit's sizes); `estimate` adds them up with what is no
feature (trainables, gradients, the rest of the activations, sampling, encoders). Items per phase (bytes on the
compute device):
- caching: the larger of text encoders and VAE + its encode working set (encoders load one at a time; a video
  VAE's for the clip's frames, as ComfyUI estimates it);
- training: frozen weights (by placement and storage), trainable weights + gradients (fp32) + optimizer
  state, activations (all blocks' saved tensors; or checkpointed inputs + one block recomputed; or two
  blocks' inputs in flight when offloaded), gradient buffers of one block, allocator overhead;
- validation: frozen weights + adapter + ComfyUI's own inference estimate (memory_required, for the
  cond/uncond batch), one layer's LoRA merge (validation as the saved file), optimizer state and gradients
  unless parked; then the VAE decode (of the clip's frames) once the
  denoiser is released (tiled when it would not fit);
- save: weights, trainables, gradients and optimizer state, no activations.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Callable, Iterable, Sequence

import torch
import torch.utils._pytree as pytree  # torch's own nested-container walk (torch.utils.checkpoint uses it)

from . import (activation_offload, checkpointing, fused_backward, host_ram, lowbit, optimizer_parking,
               sharded_optimizer, sharded_weights, streamed_optimizer_state, text_encoder_training, time_model,
               trained_weights_on_host, weight_streaming)
from .cost import FeatureCost
from .host_ram import HostRoom
from .memory_stats import format_bytes
from .policy import CHECKPOINTING, PLACEMENTS, OffloadPolicy, format_blocks
from .time_model import StepTime

ALLOCATOR_OVERHEAD = 0.05  # caching-allocator rounding and fragmentation, on top of live tensors
TILE_PX = 512  # ComfyUI's default tiled VAE decode tile, in pixels
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps 32-bit state for smaller tensors
PLAN_FORMAT = "headroom.memory_plan"
# A plan that checkpoints only some blocks stops adding blocks as soon as the step fits: it is planned this share of
# the budget short of it. The 5 % allocator overhead is the GPU kit's average; where all-or-nothing checkpointing left
# room to spare, a selective plan sits at the edge, and an activation estimate a few % low (planner / measured ran
# 1.02-1.07x) would then run out of memory.
SELECTION_SLACK = 0.03
# Validation through ComfyUI's model call casts each streamed layer's weight to the device beside a working set of
# varied sizes: the caching allocator then holds more than is live. On an H200 (GPU kit, Flux.1-dev 1024 px, a 3.3
# GiB working set) reserved ran 0.9 GiB over allocated at 8 GiB and reached the cap at 12 and 16; at 6 GiB the
# validation loss ran out of memory at 5.08 GiB allocated of a plan filled to the budget. This share of the working
# set is left free beside it (validation's base share is that much smaller).
VALIDATION_SLACK = 0.3
# A plan predicted at this many times the step of a card that holds the whole run says so (Plan.slow): it fits, but a
# user may rather choose a smaller batch, a smaller optimizer state or a larger card.
SLOW_STEP_RATIO = 3.0


# --- descriptions -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ActivationLaw:
    """Bytes per sample as a function of the latent area A and the text length T:
    const + per_latent_px*A + per_latent_px2*A^2 + per_text_token*T + per_px_token*A*T.
    Linear with memory-efficient attention (SDPA / flash, what ComfyUI uses on CUDA); the quadratic and
    cross terms are the attention maps kept by plain attention (e.g. ComfyUI's CPU path)."""

    const: float = 0.0
    per_latent_px: float = 0.0
    per_latent_px2: float = 0.0
    per_text_token: float = 0.0
    per_px_token: float = 0.0

    def at(self, latent_area: float, text_tokens: float) -> float:
        a, t = latent_area, text_tokens
        value = (self.const + self.per_latent_px * a + self.per_latent_px2 * a * a + self.per_text_token * t
                 + self.per_px_token * a * t)
        return max(0.0, value)


@dataclasses.dataclass(frozen=True)
class BlockProfile:
    name: str
    param_bytes: int  # frozen weights and buffers as loaded
    linear_weight_bytes: int = 0  # the part in Linear weights (what low-bit storage shrinks)
    linear_weight_numel: int = 0
    linear_rows: int = 0  # sum of out_features (int8 keeps one scale per row)
    linear_count: int = 0
    saved: ActivationLaw = ActivationLaw()
    inputs: ActivationLaw = ActivationLaw()
    # Copies of this block's frozen weights that autograd keeps for backward: ComfyUI's manual cast computes with
    # a cast copy of each weight (bf16 weights on a CPU -> fp32; fp8 weights on a GPU -> bf16), and a layer whose
    # input needs a gradient saves that copy until backward. Measured with the base as loaded; the part made by
    # Linear layers goes away with low-bit storage (its layers keep only the packed weight, training/lowbit.py).
    weight_copy_bytes: int = 0
    linear_copy_bytes: int = 0
    # Seconds of this block's forward per sample, a law of the latent area (measured in the calibration forwards,
    # time_model.fit_seconds); zero: not measured.
    forward_s: ActivationLaw = ActivationLaw()
    # Its modules' names (relative to the block) in the order its forward first calls them (measured in the
    # calibration forwards; empty: not measured, module order is assumed): backward meets its layers in reverse.
    call_order: tuple[str, ...] = ()
    # Its backward's seconds per second of its forward, timed at the run's size (time_blocks; the first block of its
    # kind measured for all of them); 0: not measured (time_model.BACKWARD_PER_FORWARD).
    backward_per_forward: float = 0.0

    def copies_kept(self, storage: str) -> int:
        """Bytes of weight copies this block's forward keeps for backward, with the base stored as `storage`."""
        return lowbit.copies_kept(storage, self.weight_copy_bytes, self.linear_copy_bytes)

    def weight_bytes(self, storage: str) -> int:
        """Device bytes of this block's frozen weights when stored as `storage`."""
        return lowbit.stored_bytes(storage, self.param_bytes, self.linear_weight_bytes, self.linear_weight_numel,
                                   self.linear_count, self.linear_rows)


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    name: str
    blocks: tuple[BlockProfile, ...]
    other_param_bytes: int  # weights outside the blocks (embedders, final layer): always resident
    outside_saved: ActivationLaw = ActivationLaw()  # activations saved outside the blocks
    latent_channels: int = 4
    latent_downscale: int = 8
    text_tokens: int = 77
    inference_bytes_per_latent_px: float = 0.0  # ComfyUI's memory_required per latent pixel (batch 1)
    text_encoder_bytes: int = 0
    vae_bytes: int = 0
    # ComfyUI's VAE Encode / Decode working sets for one item of `vae_frames` frames (an image: 1), per pixel of a
    # frame (its formulas are linear in the area, not in the frames: nodes/bridge/planning.vae_estimates).
    vae_encode_bytes_per_px: float = 0.0
    vae_decode_bytes_per_px: float = 0.0
    vae_frames: int = 1
    # One layer's weight in compute precision, made for the product and freed after it (ComfyUI's manual cast of
    # weights stored in another dtype; low-bit storage dequantises the same way): what one layer adds in flight.
    weight_copy_in_flight_bytes: int = 0  # the largest block or outer weight, as loaded
    # The largest block weight's copy (None: not told apart, the largest of all counts in every phase). A layer outside
    # the blocks (an embedder, a text projection: Ideogram 4's 53248 x 4608) makes its copy at the start of a forward,
    # before any block's activations exist and never in backward (its input needs no gradient): it counts only where
    # it exceeds what the blocks hold at the peak (estimate: in_flight_block / in_flight_any).
    block_weight_copy_in_flight_bytes: int | None = None
    largest_linear_numel: int = 0  # the largest block Linear weight, dequantised when stored low-bit
    compute_element_size: int = 2
    stored_element_size: int = 2  # that weight's dtype as loaded (what validation as the saved file rounds to)
    text_encoder_copy_in_flight_bytes: int = 0
    # The time model (time_model.py): seconds of the forward outside the blocks per sample; where the model computes
    # ("cpu": nothing crosses to a device) and the pinned host->device bandwidth measured there (0: the default).
    outside_forward_s: ActivationLaw = ActivationLaw()
    compute_device: str = "cuda"
    h2d_bytes_per_s: float = 0.0
    # The pageable host->device bandwidth there (0: the default), and the host RAM the run's streamed blocks may pin
    # (ComfyUI's pinned-memory share, what it leaves: the bridge's pinnable_host_bytes; None: no limit known). The
    # streamed blocks past it cross at the pageable bandwidth (time_model.pinned_blocks).
    pageable_h2d_bytes_per_s: float = 0.0
    pinnable_bytes: int | None = None
    # The CPU's copy bandwidth into pinned staging buffers there (0: the default; time_model.host_copy_bytes_per_s)
    host_copy_bytes_per_s: float = 0.0
    # The latent area the block forward times were measured at (time_blocks: the run's, batch 1); 0: fitted from the
    # calibration forwards (tiny sizes, extrapolated) or not measured.
    timed_at_area: int = 0
    # The work outside the blocks: its backward per forward second (0: time_model.BACKWARD_PER_FORWARD)
    outside_backward_per_forward: float = 0.0
    # Layers holding ComfyUI's quantized weights (a scaled fp8 / int8 / nvfp4 file): trained as they are, never
    # stored low-bit again (planner._storages); streamed as stored (weight_streaming packs their inner tensors).
    quantized_layers: int = 0
    # A ControlNet run's own blocks (its trained copies of the base's first blocks), measured in its step's forward
    # after the base's blocks: what each keeps for backward (no frozen weights: the TrainableSpec counts theirs).
    # Empty for a LoRA run.
    controlnet_blocks: tuple[BlockProfile, ...] = ()

    def frozen_bytes(self, storage: str = "as_loaded") -> int:
        return self.other_param_bytes + sum(b.weight_bytes(storage) for b in self.blocks)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelDescription":
        data = dict(data)

        def profiles(stored) -> tuple[BlockProfile, ...]:
            return tuple(BlockProfile(**{**b, "saved": ActivationLaw(**b["saved"]),
                                         "inputs": ActivationLaw(**b["inputs"]),
                                         "forward_s": ActivationLaw(**b.get("forward_s", {})),
                                         "call_order": tuple(b.get("call_order", ()))})
                         for b in stored)

        blocks = profiles(data.pop("blocks"))
        return cls(blocks=blocks, controlnet_blocks=profiles(data.pop("controlnet_blocks", ())),
                   outside_saved=ActivationLaw(**data.pop("outside_saved")),
                   outside_forward_s=ActivationLaw(**data.pop("outside_forward_s", {})), **data)

    @property
    def timed(self) -> bool:
        """Whether block forward times were measured (time_model: else estimated from weight bytes)."""
        return any(b.forward_s != ActivationLaw() for b in self.blocks)

    def h2d(self) -> float | None:
        """Pinned host->device bytes per second (None: nothing crosses, a CPU)."""
        if self.compute_device == "cpu":
            return None
        return self.h2d_bytes_per_s or time_model.DEFAULT_H2D_BYTES_PER_S

    def forward_seconds(self, area: float, tokens: float, batch: int, storage: str = "as_loaded") -> list[float]:
        """Each block's forward in seconds for a batch: measured, or (none measured) reading its weights once."""
        if self.timed:
            return [b.forward_s.at(area, tokens) * batch for b in self.blocks]
        bandwidth = time_model.DEVICE_BYTES_PER_S.get(self.compute_device, time_model.DEVICE_BYTES_PER_S["cuda"])
        return [b.weight_bytes(storage) / bandwidth for b in self.blocks]


def _optimizer_state_bytes(optimizer: str, shape: tuple[int, ...]) -> int:
    """Bytes of optimizer state for one fp32 parameter tensor of `shape` (checked against the libraries)."""
    numel = math.prod(shape)
    factored = len(shape) >= 2
    # Factored second moments (Adafactor, CAME) keep the mean over the last dim and over the second-to-last, i.e.
    # shape[:-1] and shape[:-2] + shape[-1:]: for a conv weight [out, in, kh, kw] that is most of the weight's size.
    rows, cols = (math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]) if factored else (numel, 0)
    if optimizer == "AdamW":
        return 8 * numel
    if optimizer in ("AdamW8bit", "PagedAdamW8bit"):
        return 2 * numel + 8 * math.ceil(numel / 256) if numel >= BNB_MIN_8BIT_SIZE else 8 * numel
    if optimizer == "Lion8bit":
        return numel + 4 * math.ceil(numel / 256) if numel >= BNB_MIN_8BIT_SIZE else 4 * numel
    if optimizer == "Adafactor":  # no first moment (beta1=None); second moment factored for matrices
        return 4 * (rows + cols) if factored else 4 * numel
    if optimizer == "CAME":  # full first moment, factored second moment and residual
        return 4 * numel + 8 * (rows + cols) if factored else 8 * numel
    if optimizer == "Prodigy":  # exp_avg, exp_avg_sq, s, p0
        return 16 * numel
    raise ValueError(f"planner: no state model for optimizer {optimizer!r}")


@dataclasses.dataclass(frozen=True)
class TrainableSpec:
    """Trainable fp32 tensors by shape, and the optimizer that updates them."""

    shapes: tuple[tuple[int, ...], ...]
    optimizer: str = "AdamW"
    ema: bool = False  # an EMA copy of the weights is kept in host RAM (core/ema.py)
    element_size: int = 4  # bytes per trained weight: 4 (fp32), 2 (bf16 weights: a full fine-tune's, a ControlNet's)
    # Ranks the optimizer state is sharded over (sharded_optimizer.py: a full fine-tune on several devices); 1: whole.
    state_ranks: int = 1
    # Ranks the weights, gradients and state are sharded over (sharded_weights.py: FSDP2, the launcher's
    # --shard-weights); 1: whole.
    weight_ranks: int = 1
    # Trained elements in the model's first block (forward order): backward reaches it last, so its gradients are made
    # only as its own activations go (first_block_gradients_later). 0: not known.
    first_block_elements: int = 0
    full: bool = False  # a full fine-tune's own weights W' (they may live in host RAM: trained_weights_on_host.py)
    # A full fine-tune's trained layers' base weights, which its training step never reads (adapters.FullLayer computes
    # with its trained copy alone) and leaves in host RAM (weight_streaming's `unread`): per block of the model (a
    # profile of those layers, for low-bit storage's figures) and the bytes outside the blocks (`unread_base`). Empty:
    # none (an adapter reads its base).
    unread_base_blocks: tuple[BlockProfile, ...] = ()
    unread_base_outside: int = 0
    # A full fine-tune's trained layers per block of the model (`trained_per_block`: each layer's name relative to the
    # block and its trained elements, weight and bias): with its trained weights in host RAM a checkpointed block's
    # copies stay on the card from its recompute to its backward. Empty: not known.
    block_layers: tuple[tuple[tuple[str, int], ...], ...] = ()
    # The first blocks (forward order) with no trained weight in or before them (`blocks_without_backward`): nothing
    # there needs a gradient, so autograd runs no backward through them (SDXL's first five with attention targets).
    # The time model leaves out their backward and recompute (their activations need no count of their own: the
    # calibration forward saves none there, as training does; checkpointed, their inputs are still counted). 0: none,
    # or not known.
    without_backward: int = 0
    # A ControlNet's trainable copy of the base's first blocks (ControlNetType.copied_base_blocks: a UNet's input and
    # middle blocks, the first N transformer blocks of the others): the time model adds their forward and backward
    # again, timed as the ControlNet's own blocks where measured (ModelDescription.controlnet_blocks), else as the
    # base's. 0: no ControlNet.
    copied_blocks: int = 0
    # A save writes the trained weights as trained (a ControlNet's), not in fp32 (a LoRA's, a full fine-tune's
    # differences): save_bytes.
    saved_as_trained: bool = False
    # The input that would train these fp32 weights in bf16 with stochastic rounding (a ControlNet's
    # "controlnet_precision", a full fine-tune's "full_precision"), for the plan's advice (_weights_advice); "": none
    # (an adapter's small weights).
    bf16_weights_input: str = ""
    # Seconds per weight of the optimizer's step in host RAM on this machine (core/optimizers.host_step_s_per_weight,
    # measured by the nodes' planning); 0: not measured, time_model.DEFAULT_HOST_STEP_S_PER_WEIGHT.
    host_step_s_per_weight: float = 0.0
    # A run that trains the CLIP's text encoders too (text_encoder_training.py): the CLIP's weights and each caption's
    # activations on the device in a step (its LoRA's tensors are in `shapes`). None: the model alone.
    text_encoder: text_encoder_training.TextEncoderTraining | None = None

    @property
    def param_count(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def dtype_name(self) -> str:
        return {4: "fp32", 2: "bf16"}[self.element_size]

    def param_bytes(self) -> int:
        """The trained weights in fp32 (what an fp32 copy of them takes: host masters, EMA)."""
        return 4 * self.param_count

    def weight_bytes(self) -> int:
        """The trained weights as trained (and their gradients: the same dtype)."""
        return self.element_size * self.param_count

    def optimizer_bytes(self) -> int:
        return sum(self._state_bytes())

    def checkpoint_bytes(self) -> int:
        """One checkpoint of the run on disk (core/run_dir.save_checkpoint): the trained weights as trained, the whole
        optimizer state (gathered: rank 0 writes it) and the EMA copy in fp32, with what each tensor adds to its file
        (a safetensors header entry; torch.save's zip entries for the state's tensors: ~800 B per weight with AdamW's
        three, the most of the optimizers') and the RNG state and histories. Those extras matter only for small
        adapters (a tiny SD1.5 LoRA's 112 tensors: a third of its checkpoint; tests/comfy/test_reliability.py)."""
        per_tensor = 1024 + (160 if self.ema else 0)
        return (self.weight_bytes() + self.optimizer_bytes() + (self.param_bytes() if self.ema else 0)
                + per_tensor * len(self.shapes) + (8 << 10))

    def save_bytes(self) -> int:
        """A save of the trained weights as the all-in-one nodes write it: a ControlNet's as trained, a LoRA's factors
        and a full fine-tune's differences in fp32 (nodes/bridge/run_lora.LoraTraining.save_bytes; a full fine-tune's
        are as many as its weights: twice a bf16 model file)."""
        return self.weight_bytes() if self.saved_as_trained else self.param_bytes()

    def save_bf16_bytes(self) -> int:
        """The same save with Train LoRA's `save_dtype` bf16 (0: a ControlNet's, saved as trained, has no choice)."""
        return 0 if self.saved_as_trained else 2 * self.param_count

    def optimizer_share_bytes(self) -> int:
        """The optimizer state one rank holds when it is sharded over `state_ranks` (the largest rank's share)."""
        if self.weight_ranks > 1:
            return sharded_weights.state_share(self.shapes, self._state_bytes(), self.weight_ranks)
        return sharded_optimizer.state_share([math.prod(s) for s in self.shapes], self._state_bytes(), self.state_ranks)

    def _state_bytes(self) -> list[int]:
        return [_optimizer_state_bytes(self.optimizer, s) for s in self.shapes]

    @classmethod
    def from_parameters(cls, params: Iterable[torch.Tensor], optimizer: str = "AdamW", ema: bool = False,
                        full: bool = False) -> "TrainableSpec":
        """The tensors a run trains (bf16 when every one is: a full fine-tune's or a ControlNet's bf16 weights)."""
        params = list(params)
        element_size = 2 if params and all(p.dtype == torch.bfloat16 for p in params) else 4
        return cls(tuple(tuple(p.shape) for p in params), optimizer, ema, element_size=element_size, full=full)

    @classmethod
    def lora(cls, targets: Iterable[torch.nn.Module], rank: int | Sequence[int], optimizer: str = "AdamW"
             ) -> "TrainableSpec":
        """LoRA down/up matrices of rank `rank` (one, or one per target: LoRA Config layer_ranks) on Linear / Conv2d
        `targets`."""
        targets = list(targets)
        ranks = [rank] * len(targets) if isinstance(rank, int) else list(rank)
        shapes = []
        for module, rank in zip(targets, ranks, strict=True):
            if isinstance(module, torch.nn.Conv2d):
                shapes += [(rank, module.in_channels, *module.kernel_size), (module.out_channels, rank, 1, 1)]
            else:
                shapes += [(rank, module.in_features), (module.out_features, rank)]
        return cls(tuple(shapes), optimizer)

    @classmethod
    def of_full_layers(cls, targets: Iterable[torch.nn.Module], optimizer: str = "AdamW", element_size: int = 4
             ) -> "TrainableSpec":
        """A full fine-tune of Linear / Conv2d `targets` (adapters.FullLayer): a trained copy of each weight
        and bias, of `element_size` bytes per weight (4: fp32, 2: bf16 with stochastic rounding)."""
        shapes = []
        for module in targets:
            if isinstance(module, torch.nn.Conv2d):
                shapes.append((module.out_channels, module.in_channels // module.groups, *module.kernel_size))
                out = module.out_channels
            else:
                shapes.append((module.out_features, module.in_features))
                out = module.out_features
            if getattr(module, "bias", None) is not None:
                shapes.append((out,))
        return cls(tuple(shapes), optimizer, element_size=element_size, full=True)


def unread_base(named_blocks: Sequence[tuple[str, torch.nn.Module]], targets: Iterable[torch.nn.Module]
                ) -> tuple[tuple[BlockProfile, ...], int]:
    """A full fine-tune's `targets` (the layers it trains) as the base weights its training step never reads: per block
    of `named_blocks` a BlockProfile of the targets inside it, and the bytes of the targets outside every block
    (TrainableSpec.unread_base_blocks / unread_base_outside)."""
    targets = list(targets)
    wanted = {id(m) for m in targets}
    inside: set[int] = set()
    profiles = []
    for name, block in named_blocks:
        layers = [m for m in block.modules() if id(m) in wanted]
        inside.update(id(m) for m in layers)
        profiles.append(BlockProfile(name=name, param_bytes=sum(frozen_bytes(m) for m in layers),
                                     **_linear_statistics(layers)))
    return tuple(profiles), sum(frozen_bytes(m) for m in targets if id(m) not in inside)


def trained_per_block(named_blocks: Sequence[tuple[str, torch.nn.Module]], targets: Iterable[torch.nn.Module]
                      ) -> tuple[tuple[tuple[str, int], ...], ...]:
    """A full fine-tune of `targets`: per block of `named_blocks`, each trained layer's name relative to the block and
    its elements (weight and bias), in module order (TrainableSpec.block_layers)."""
    wanted = {id(m) for m in targets}
    return tuple(tuple((name, TrainableSpec.of_full_layers([m]).param_count) for name, m in block.named_modules() if id(m) in wanted)
                 for _, block in named_blocks)


def blocks_without_backward(block_names: Sequence[str], trained_paths: Iterable[str]) -> int:
    """How many of the blocks (`block_names`, forward order, paths in the model) come before the first that holds a
    trained layer (`trained_paths`): backward never runs them (TrainableSpec.without_backward). 0 where a trained layer
    lies outside every block (an embedder's output feeds the first block: its gradient runs through all of them)."""
    paths = list(trained_paths)
    inside = [next((k for k, name in enumerate(block_names) if (p + ".").startswith(name + ".")), None) for p in paths]
    if not paths or None in inside:
        return 0
    return min(inside)


def in_call_order(layers: Sequence[tuple[str, int]], call_order: Sequence[str]) -> list[int]:
    """The elements of a block's trained `layers` (name, elements) in the order its forward calls them (BlockProfile.
    call_order; a layer it does not name, or no order at all: after those, in module order)."""
    rank = {name: i for i, name in enumerate(call_order)}
    return [elements for _, elements in sorted(layers, key=lambda layer: rank.get(layer[0], len(rank)))]


def optimizer_placement_cost(policy: OffloadPolicy, trainable: TrainableSpec, pinned: bool = True) -> FeatureCost:
    """Where the policy keeps the optimizer state and the gradients kept between steps (none with fused backward:
    each is freed inside backward, so none to park either): optimizer_parking.optimizer_cost for this run; with the
    state sharded over ranks (`state_ranks`), a rank's share on its device and rank 0's gathered copy on the host;
    streamed (streamed_optimizer_state.py): in host RAM, one tensor's on the card (`pinned`: its staging buffers)."""
    if policy.optimizer_state == "streamed":
        return streamed_optimizer_state.streamed_state_cost(
            trainable.optimizer, trainable.optimizer_bytes(), max(trainable._state_bytes(), default=0),
            streamed_optimizer_state.largest_tensor_shaped(trainable.optimizer, trainable.shapes), pinned)
    sharded = trainable.state_ranks > 1 and sharded_optimizer.applies(policy)
    cost = optimizer_parking.optimizer_cost(
        policy.optimizer_state, policy.park_optimizer_during_validation, trainable.optimizer,
        trainable.optimizer_share_bytes() if sharded else trainable.optimizer_bytes(), trainable.param_bytes(),
        0 if policy.fused_backward else trainable.weight_bytes(), trainable.dtype_name, policy.fused_backward)
    if sharded:
        sharded_optimizer.gathered_copy_cost(cost, trainable.optimizer, trainable.optimizer_bytes())
    return cost


def first_block_gradients_later(trainables: dict[str, int], trainable: TrainableSpec, shape: "RunShape",
                                policy: OffloadPolicy, activation_bytes: int) -> dict[str, int]:
    """A full fine-tune's gradients at the step's peak. Summing every gradient with the activations overstates it
    when one backward pass makes them all: the first block's (forward order) are made only as backward leaves it,
    while its activations go; after that no activation is left. So the peak is the larger of all else + activations
    with the first block's gradients not yet made, and all gradients without activations: the gradients item less
    min(first block's gradients, activations). Only with one backward pass per step on one device (gradient
    accumulation keeps every gradient through the next pass; several ranks copy them all into one buffer to reduce)
    and the gradients kept whole (not fused backward)."""
    if not (trainable.full and trainable.first_block_elements and shape.grad_accum == 1 and not policy.fused_backward
            and trainable.state_ranks == 1 and trainable.weight_ranks == 1):
        return trainables
    name = f"gradients ({trainable.dtype_name})"
    if name not in trainables:
        return trainables
    later = min(trainable.first_block_elements * trainable.element_size, activation_bytes)
    result = {key: value for key, value in trainables.items() if key != name}
    result[f"{name}, the first block's made as its activations go"] = trainables[name] - later
    return result


# --- estimates ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PhaseEstimate:
    phase: str
    items: dict[str, int]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.items.values())


@dataclasses.dataclass
class Plan:
    policy: OffloadPolicy
    phases: list[PhaseEstimate]
    budget_bytes: int | None = None
    reason: str = ""
    host_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # what lives in host RAM instead
    # The frozen base weights the plan keeps on the device (outside the blocks + resident blocks): for "partial"
    # placement, the share a run's load may give ComfyUI (it would otherwise fill its free memory and leave no room
    # for activations: every Flux-dev partial run ran out of memory so on an emulated 6-16 GiB card).
    base_device_bytes: int | None = None
    # The same for validation, placed on its own (weight_streaming.validation_placement): the share a run loads for
    # its validation loss and keeps while sampling, training's share restored by the next training load.
    validation_base_device_bytes: int | None = None
    # Host RAM the run adds beyond the models already loaded, per phase ("training step", "validation"), by item;
    # and the room it has (host_ram.py). None: no host budget applied.
    host_added: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    host_room: HostRoom | None = None
    # The time model (time_model.py): the predicted step, and which whole blocks are checkpointed, stay on the device
    # and stream from host RAM in a training step (indices in forward order).
    step_time: StepTime | None = None
    checkpointed_blocks: tuple[int, ...] = ()
    resident_blocks: tuple[int, ...] = ()
    streamed_blocks: tuple[int, ...] = ()
    stream_slots: int = weight_streaming.DEFAULT_SLOTS  # the ring's device slots (prefetch depth + 1)
    # plan_auto: why the step is predicted SLOW_STEP_RATIO times or more that of a card holding the whole run
    # ("": it is not)
    slow: str = ""
    # plan_auto: what the Offload Policy's fused_backward, off, or bf16 trained weights would allow (_weights_advice;
    # "": nothing more), also at the end of `reason`
    advice: str = ""
    # The host RAM the run may pin for its streamed blocks (ModelDescription.pinnable_bytes; None: not known, or nothing
    # crosses), and the streamed block bytes past it, which cross from pageable memory: slower, and priced so in the
    # predicted step (pinned_line says so).
    pinnable_bytes: int | None = None
    pageable_bytes: int = 0
    # One checkpoint of the run on disk (TrainableSpec.checkpoint_bytes; 0: not known): the Init nodes check the free
    # space under output/ for the ones a run keeps (nodes/bridge/model_files.check_disk_room).
    checkpoint_bytes: int = 0
    save_bytes: int = 0  # one save of the trained weights (TrainableSpec.save_bytes; 0: not known), to models/
    save_bf16_bytes: int = 0  # and in bf16, where the save's dtype is a choice (TrainableSpec.save_bf16_bytes; 0: none)

    def disk_line(self) -> str:
        """A checkpoint's size on disk, for a full fine-tune tens of GB ("" where not known)."""
        if not self.checkpoint_bytes:
            return ""
        return (f"disk: about {format_bytes(self.checkpoint_bytes)} a checkpoint (trained weights and optimizer "
                "state); a run keeps two (the older removed before a save where the disk has no room for a third)"
                + (f"; a save to models/ about {format_bytes(self.save_bytes)}" if self.save_bytes else "")
                + (f" in fp32, {format_bytes(self.save_bf16_bytes)} with save_dtype bf16" if self.save_bf16_bytes
                   else ""))

    @property
    def predicted_s_per_step(self) -> float | None:
        return None if self.step_time is None else self.step_time.total_s

    def blocks_line(self) -> str:
        """Which blocks are checkpointed, resident and streamed (through a ring of how many slots), in one line."""
        count = len(self.resident_blocks) + len(self.streamed_blocks)
        ring = f" through a ring of {self.stream_slots} device slots" if self.streamed_blocks else ""
        return (f"blocks ({count}): checkpointed {_ranges(self.checkpointed_blocks)}; resident "
                f"{_ranges(self.resident_blocks)}; streamed {_ranges(self.streamed_blocks)}{ring}")

    @property
    def peak(self) -> PhaseEstimate:
        return max(self.phases, key=lambda p: p.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    @property
    def host_added_bytes(self) -> int:
        """The most host RAM the run adds in any one phase."""
        return host_ram.peak_added(self.host_added)

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_room is None else self.host_room.fits(self.host_added_bytes)

    @property
    def device_fits(self) -> bool | None:
        return None if self.budget_bytes is None else self.peak_bytes <= self.budget_bytes

    @property
    def fits(self) -> bool | None:
        """The device budget and, where one is applied, the host RAM budget."""
        if self.host_fits is False:
            return False
        return self.device_fits

    def phase(self, name: str) -> PhaseEstimate:
        return next(p for p in self.phases if p.phase == name)

    def to_dict(self) -> dict:
        return {
            "format": PLAN_FORMAT, "policy": self.policy.to_dict(), "budget_bytes": self.budget_bytes,
            "fits": self.fits, "peak_phase": self.peak.phase, "peak_bytes": self.peak_bytes, "reason": self.reason,
            "phases": [{"phase": p.phase, "total_bytes": p.total, "items": dict(p.items), "notes": list(p.notes)}
                       for p in self.phases],
            "host_bytes": dict(self.host_bytes),
            "base_device_bytes": self.base_device_bytes,
            "validation_base_device_bytes": self.validation_base_device_bytes,
            "host_added": {phase: dict(items) for phase, items in self.host_added.items()},
            "host_added_bytes": self.host_added_bytes, "host_fits": self.host_fits,
            "host_in_use_bytes": None if self.host_room is None else self.host_room.in_use_bytes,
            "host_limit_bytes": None if self.host_room is None else self.host_room.limit_bytes,
            "predicted_s_per_step": self.predicted_s_per_step,
            "step_time": None if self.step_time is None else self.step_time.to_dict(),
            "blocks": {"checkpointed": list(self.checkpointed_blocks), "resident": list(self.resident_blocks),
                       "streamed": list(self.streamed_blocks), "slots": self.stream_slots},
            "slow": self.slow, "pinnable_bytes": self.pinnable_bytes, "pageable_bytes": self.pageable_bytes,
            "checkpoint_bytes": self.checkpoint_bytes,
            "save_bytes": self.save_bytes,
            "save_bf16_bytes": self.save_bf16_bytes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def summary(self) -> str:
        """The policy and its planned peak in one line (what a training node shows before its first step)."""
        p = self.policy
        base = f"base {p.base_placement}" + ("" if p.base_storage == "as_loaded" else f" {p.base_storage}")
        streamed = self.host_bytes.get("streamed block weights")
        if streamed:
            base += f" ({format_bytes(streamed)} of blocks streamed from host RAM)"
        checkpoint = "no checkpointing" if p.checkpointing == "off" else f"checkpointing {p.checkpointing}"
        if p.checkpointing != "off" and p.checkpoint_selection is not None:
            checkpoint += f" ({len(self.checkpointed_blocks)} of {len(self.resident_blocks) + len(self.streamed_blocks)} blocks)"
        trained = ", trained weights in host RAM" if p.trained_weights == "host" else ""
        if p.trained_card_blocks:
            trained += f" but {len(p.trained_card_blocks)} blocks' kept on the card"
        text = (f"{base}, {checkpoint}, optimizer state {p.optimizer_state_said}{trained}; planned peak "
                f"{format_bytes(self.peak_bytes)} ({self.peak.phase})")
        encoder = self.text_encoder_bytes()
        if encoder:
            text += f", of a step {format_bytes(encoder)} for the text encoder"
        if self.budget_bytes is not None:
            text += f", budget {format_bytes(self.budget_bytes)}"
        if self.host_bytes:
            text += f", host RAM {format_bytes(sum(self.host_bytes.values()))}"
        if self.host_fits is False:
            text += f"; {self.host_room.describe(self.host_added_bytes)}"
        if self.step_time is not None:
            text += f"; predicted {self.step_time.total_s:.3f} s/step"
        if self.pageable_bytes:
            text += f" ({format_bytes(self.pageable_bytes)} of blocks unpinned: slower)"
        if self.slow:
            text += f" - SLOW: {self.slow}"
        return text + (" - DOES NOT FIT" if self.fits is False else "")

    def text_encoder_bytes(self) -> int:
        """What a training step holds on the device for a text encoder trained too (its CLIP's weights, a step's
        captions' activations: text_encoder_training.py); 0: none."""
        items = self.phase("training step").items
        return sum(size for name, size in items.items() if name.startswith(text_encoder_training.ITEMS))

    def pinned_line(self) -> str:
        """What of the streamed blocks crosses from pageable memory, when some does ("" otherwise)."""
        if not self.pageable_bytes:
            return ""
        return (f"pinned memory: ComfyUI's share leaves {format_bytes(self.pinnable_bytes)} to pin, so "
                f"{format_bytes(self.pageable_bytes)} of the streamed blocks cross from pageable memory, slower "
                "(priced in the predicted step; Windows pins at most 40 % of the RAM; base_storage fp8 halves what "
                "streams)")

    def placement_line(self) -> str:
        """Where the frozen base is in training and in validation, when the two differ ("" otherwise)."""
        train, validate = self.base_device_bytes, self.validation_base_device_bytes
        if train is None or validate is None or train == validate:
            return ""
        more = "more" if validate > train else "less"
        return (f"frozen base on the device: training step {format_bytes(train)}, validation {format_bytes(validate)} "
                f"({more}: validation is placed on its own, with no backward to keep room for)")

    def to_text(self) -> str:
        budget = "no budget" if self.budget_bytes is None else f"budget {format_bytes(self.budget_bytes)}"
        verdict = "" if self.fits is None else (" - fits" if self.fits else " - DOES NOT FIT")
        lines = [f"Headroom memory plan: {self.policy.describe()}",
                 f"peak {format_bytes(self.peak_bytes)} in {self.peak.phase} ({budget}){verdict}"]
        placement = self.placement_line()
        if placement:
            lines.append(placement)
        if self.step_time is not None:
            lines.append(self.step_time.describe())
        if self.resident_blocks or self.streamed_blocks:
            lines.append(self.blocks_line())
        pinned = self.pinned_line()
        if pinned:
            lines.append(pinned)
        for phase in self.phases:
            lines.append(f"{phase.phase}: {format_bytes(phase.total)}")
            for name, value in phase.items.items():
                lines.append(f"  {name:<44} {format_bytes(value):>12}")
            lines += [f"  note: {note}" for note in phase.notes]
        if self.host_bytes:
            lines.append("host RAM instead of the device: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.host_bytes.items()))
        for phase, items in self.host_added.items():
            if items:
                lines.append(f"host RAM added in {phase}: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in items.items()))
        if self.host_room is not None:
            lines.append(self.host_room.describe(self.host_added_bytes))
        disk = self.disk_line()
        if disk:
            lines.append(disk)
        if self.reason:
            lines.append(self.reason)
        return "\n".join(lines)


def _ranges(indices: Sequence[int]) -> str:
    """"0-3,7" for [0, 1, 2, 3, 7]; "none" for none."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What one training step processes."""

    batch: int
    width: int
    height: int
    text_tokens: int | None = None  # None: the description's default
    # Latent frames of a video model's clips (Wan: (frames - 1) / 4 + 1). A video DiT's tokens, and with them what its
    # blocks keep (measured on one frame), grow with h * w * frames.
    latent_frames: int = 1
    # Micro-steps per optimizer step: with more than one, every gradient is kept through the next backward pass.
    grad_accum: int = 1

    def latent_area(self, description: ModelDescription) -> int:
        d = description.latent_downscale
        return (self.height // d) * (self.width // d) * self.latent_frames

    def tokens(self, description: ModelDescription) -> int:
        return description.text_tokens if self.text_tokens is None else self.text_tokens


def estimate(description: ModelDescription, trainable: TrainableSpec, shape: RunShape, policy: OffloadPolicy,
             budget_bytes: int | None = None, host_room: HostRoom | None = None,
             slots: int = weight_streaming.DEFAULT_SLOTS) -> Plan:
    """Peak device bytes per phase of a run with `policy`, itemised; and the host RAM it adds, checked against
    `host_room` where given (host_ram.py). `slots`: the streamer's ring of device slots, a block each (with_best_slots
    chooses it)."""
    area, tokens, batch = shape.latent_area(description), shape.tokens(description), shape.batch
    blocks = description.blocks
    storage = policy.base_storage
    # Validation reads every base weight (as the saved file: base + W' - W); a full fine-tune's training step not its
    # trained layers' (TrainableSpec.unread_base_blocks): on a device the run leaves them in host RAM (on a CPU the
    # host is the device: nothing is left apart).
    validation_block_weights = [b.weight_bytes(storage) for b in blocks]
    unread = [0] * len(blocks)
    apart = description.compute_device != "cpu"
    if trainable.unread_base_blocks and apart:
        if len(trainable.unread_base_blocks) != len(blocks):
            raise ValueError(f"planner: the trained layers' base is given for {len(trainable.unread_base_blocks)} "
                             f"blocks, the model has {len(blocks)}")
        unread = [u.weight_bytes(storage) for u in trainable.unread_base_blocks]
    block_weights = [w - u for w, u in zip(validation_block_weights, unread)]
    saved = [b.saved.at(area, tokens) * batch for b in blocks]
    copies = [b.copies_kept(storage) for b in blocks]  # per block, whatever the batch
    inputs = [b.inputs.at(area, tokens) * batch for b in blocks]
    outside = description.outside_saved.at(area, tokens) * batch

    # Which blocks are recomputed (policy checkpoint_blocks: selective checkpointing; "": every block).
    checkpointed = _checkpointed(policy, len(blocks))

    # What the blocks keep for backward: the base's (its first blocks that run no backward keep nothing, their inputs
    # included: TrainableSpec.without_backward), then a ControlNet run's own blocks (description.controlnet_blocks),
    # recomputed only where every block is (policy.memory_features wraps the run's blocks so).
    own = description.controlnet_blocks
    saved = saved + [b.saved.at(area, tokens) * batch for b in own]
    copies = copies + [b.copies_kept("as_loaded") for b in own]
    inputs = [0 if i < trainable.without_backward else size for i, size in enumerate(inputs)] + [
        b.inputs.at(area, tokens) * batch for b in own]
    every_block = policy.checkpointing != "off" and policy.checkpoint_selection is None
    recomputed = checkpointed + (list(range(len(blocks), len(saved))) if every_block else [])
    kept = sorted(set(range(len(saved))) - set(recomputed))

    # Each memory feature says what it costs (its module's cost function); they are added up here.
    cuda = torch.device(description.compute_device).type == "cuda"
    parking = optimizer_placement_cost(policy, trainable, pinned=cuda)
    if recomputed and kept:  # selective: the features cost the checkpointed blocks, the others keep what they save
        def only(values):
            return [values[i] for i in recomputed]
        block_activations = [feature(policy.checkpointing, only(saved), only(copies), only(inputs))
                             for feature in (checkpointing.activation_cost, activation_offload.activation_cost)]
        block_activations.append(FeatureCost(training={
            "saved activations, blocks not checkpointed": int(sum(saved[i] for i in kept)),
            "weight copies kept for backward, blocks not checkpointed": int(sum(copies[i] for i in kept))}))
    else:
        block_activations = [feature(policy.checkpointing, saved, copies, inputs)
                             for feature in (checkpointing.activation_cost, activation_offload.activation_cost)]
    in_flight_any = lowbit.weight_in_flight(storage, description.weight_copy_in_flight_bytes,
                                            description.largest_linear_numel, description.compute_element_size)
    in_flight_block = in_flight_any if description.block_weight_copy_in_flight_bytes is None else lowbit.weight_in_flight(
        storage, description.block_weight_copy_in_flight_bytes, description.largest_linear_numel,
        description.compute_element_size)

    weights_on_host = policy.trained_weights == "host"
    # The blocks whose trained weights stay on the card with the rest in host RAM (trained_weights_card_blocks).
    card_blocks = policy.trained_card_blocks if weights_on_host else frozenset()
    on_card_elements = sum(elements for i in card_blocks if i < len(trainable.block_layers)
                           for _, elements in trainable.block_layers[i])
    trained = trained_weights_on_host.trained_weights_cost(trainable.shapes, trainable.element_size,
                                                           description.compute_element_size, weights_on_host,
                                                           policy.optimizer_state != "cpu", cuda, on_card_elements)
    gradients = fused_backward.gradients_cost(trainable.shapes, trainable.element_size, policy.fused_backward,
                                              state_on_host=policy.optimizer_state == "cpu",
                                              weights_on_host=weights_on_host, pinned=cuda and not weights_on_host)
    if weights_on_host and checkpointed and trainable.block_layers:
        # What one tensor's step holds beside the kept copies: on the card, and on a CPU host RAM too (the same RAM)
        alongside = sum(trained.training.values()) - on_card_elements * trainable.element_size + sum(
            gradients.training.values()) + (0 if apart else sum(gradients.host_added_training.values()))
        trained.training.update(trained_weights_on_host.recompute_kept_cost(
            [in_call_order(trainable.block_layers[i], blocks[i].call_order) for i in checkpointed
             if i < len(trainable.block_layers) and i not in card_blocks],
            trainable.element_size, alongside, max(math.prod(s) for s in trainable.shapes)))
    if trainable.weight_ranks > 1:  # FSDP2: weights, gradients and state each rank's share (one feature)
        trained = sharded_weights.cost(trainable.shapes, trainable.element_size, trainable._state_bytes(),
                                       trainable.weight_ranks, trainable.optimizer)
        gradients = parking = FeatureCost()
    trainables = {**trained.training, **gradients.training, **parking.training}
    activations = {name: value for cost in block_activations for name, value in cost.training.items()}
    activations["saved activations outside the blocks"] = int(outside)
    activations["gradient buffers of one block"] = int(2 * max(inputs, default=0))
    # A block layer's copy is made at the peak (a block recomputed in backward); an outer layer's only while the blocks
    # hold nothing yet (the start of the forward): that one counts where it is larger than the blocks' activations.
    activations["one layer's weight copy in flight (cast / dequantised)"] = int(max(
        in_flight_block, in_flight_any - sum(activations.values())))
    trainables = first_block_gradients_later(trainables, trainable, shape, policy, sum(activations.values()))
    # Held through the whole step (the text encoder's backward runs after the model's): beside everything above
    encoder = trainable.text_encoder.cost(batch) if trainable.text_encoder is not None else FeatureCost()
    activations.update(encoder.training)

    # Validation (below) keeps the same frozen weights beside the adapter and ComfyUI's sampling working set.
    working_set = int(description.inference_bytes_per_latent_px * area * 2)
    sampling = {**trained.validation, **parking.validation,
                "sampling working set (ComfyUI estimate, cond+uncond)": working_set,
                "allocator slack beside the working set (validation's per-layer casts fragment the cache)": int(
                    VALIDATION_SLACK * working_set),
                # as in training: an outer layer's copy is made before the model call's working set
                "one layer's weight copy in flight (cast / dequantised)": int(max(in_flight_block,
                                                                                   in_flight_any - working_set)),
                # Validation as the saved file (the default, nodes/bridge/comfy_bridge.AsSavedWeight) merges the
                # LoRA into that layer's weight as it runs: the LoRA product in fp32 (ComfyUI's LoRA compute dtype
                # on a CPU; fp16 on some GPUs, so this is the upper bound), the merge rounded to the stored dtype,
                # and that back in compute precision.
                "one layer's LoRA merge in flight (validation as the saved file)": int(
                    description.largest_linear_numel * (4 + description.stored_element_size
                                                        + description.compute_element_size))}

    # Frozen weights by placement, the last: "partial" fills the room everything else leaves. Each phase is placed in
    # its own room (weight_streaming.validation_placement): a training step beside its trainables and activations,
    # validation beside the adapter, parked state and ComfyUI's sampling working set. (One share for both, sized by
    # training alone, put validation over the budget where sampling needs more: Flux.2 Klein at 8 GB.)
    outer_name = "frozen weights outside the blocks"
    outer = {outer_name: description.other_param_bytes - (trainable.unread_base_outside if apart else 0)}
    validation_outer = {outer_name: description.other_param_bytes}
    training_rest = sum(outer.values()) + sum(trainables.values()) + sum(activations.values())
    validation_rest = sum(validation_outer.values()) + sum(sampling.values())
    device_budget = None if budget_bytes is None else int(planned_room(policy, budget_bytes) / (1 + ALLOCATOR_OVERHEAD))
    placement = weight_streaming.placement_cost(policy.base_placement, block_weights, storage, training_rest,
                                                device_budget, validation_rest, validation_block_weights, slots)
    weights = {**outer, **placement.training}
    base_device = outer[outer_name] + weight_streaming.resident_block_bytes(
        policy.base_placement, block_weights, training_rest, device_budget, slots)
    validation_device = description.other_param_bytes + weight_streaming.resident_block_bytes(
        weight_streaming.validation_placement(policy.base_placement, device_budget is not None),
        validation_block_weights, validation_rest, device_budget)
    features: list[FeatureCost] = [trained, parking, gradients, *block_activations, placement, encoder]
    host = {name: value for cost in features for name, value in cost.host.items()}  # in host RAM instead
    left_apart = description.other_param_bytes - outer[outer_name] + sum(unread)
    if left_apart:
        host["trained layers' base weights (the training step never reads them)"] = left_apart
    notes = [note for cost in features for note in cost.training_notes]

    # Whole blocks: a block that is not recomputed must stay on the device (autograd keeps the weights it used until
    # backward); the rest of the resident share goes to checkpointed blocks in forward order, and what is left streams.
    resident_share = base_device - description.other_param_bytes
    resident = _resident_blocks(block_weights, checkpointed, resident_share)
    streamed = sorted(set(range(len(blocks))) - set(resident))
    held = sum(block_weights[i] for i in set(streamed) - set(checkpointed))
    if held:
        weights["streamed blocks not checkpointed (autograd keeps their weights)"] = held

    training_items = {**weights, **trainables, **activations}
    training_items["allocator overhead (5%)"] = int(ALLOCATOR_OVERHEAD * sum(training_items.values()))
    training = PhaseEstimate("training step", training_items, notes)

    # Validation: the same frozen weights, the adapter, ComfyUI's inference estimate for cond + uncond.
    validation_items = {**validation_outer, **placement.validation, **sampling}
    validation_items["allocator overhead (5%)"] = int(ALLOCATOR_OVERHEAD * sum(validation_items.values()))
    validation = PhaseEstimate("validation", validation_items,
                               [note for cost in features for note in cost.validation_notes])
    if description.inference_bytes_per_latent_px == 0:
        validation.notes.append("no inference estimate in the model description")

    pixels = shape.width * shape.height
    decode_full = int(description.vae_decode_bytes_per_px * pixels)
    decode_tiled = int(description.vae_decode_bytes_per_px * min(pixels, TILE_PX * TILE_PX))
    tiled = policy.decode_tiled(description.vae_bytes + decode_full, budget_bytes)
    clip = [f"a {description.vae_frames}-frame clip"] if description.vae_frames > 1 else []
    decode_details = ", ".join(clip + (["tiled 512 px"] if tiled else []))
    decode_name = "decode working set" + (f" ({decode_details})" if decode_details else "")
    decode = PhaseEstimate("validation decode", {
        "VAE weights": description.vae_bytes,
        decode_name: decode_tiled if tiled else decode_full,
    }, ["after the denoiser is released"])

    cache_text = PhaseEstimate("caching (text encoders)", {
        "text encoder weights": description.text_encoder_bytes,
        "one weight copy in flight (fp32 cast)": description.text_encoder_copy_in_flight_bytes,
    })
    encode_name = "encode working set" + (f" ({clip[0]})" if clip else "")
    cache_vae = PhaseEstimate("caching (VAE encode)", {
        "VAE weights": description.vae_bytes,
        encode_name: int(description.vae_encode_bytes_per_px * pixels * batch),
    })
    for phase in (cache_text, cache_vae, decode):
        if not any(phase.items.values()):
            phase.notes.append("encoder sizes not given (connect CLIP / VAE to the plan node)")

    save_items = {k: v for k, v in training_items.items() if k in weights or k in trainables}
    save_items["allocator overhead (5%)"] = int(ALLOCATOR_OVERHEAD * sum(save_items.values()))
    save = PhaseEstimate("save", save_items)

    host_added = host_ram.added_by_phase(features, trainable.ema, trainable.param_bytes(), trainable.weight_bytes())

    # The time model (time_model.py): compute and the ring's copies overlap; the optimizer step, the first copy and
    # the copies queued on the compute stream (`crossing`: offloaded inputs, trained weights, streamed state) do not.
    h2d = description.h2d()
    streamed_bytes = [block_weights[i] if i in set(streamed) else 0 for i in range(len(blocks))]
    pin_limit = description.pinnable_bytes if h2d is not None else None
    pinned = time_model.pinned_blocks(streamed_bytes, pin_limit)
    crossing = staged = 0  # staged: what the CPU also copies through the pinned staging buffers
    if policy.checkpointing == "blocks_cpu_offload":
        crossing += 2 * int(sum(inputs[i] for i in recomputed))  # block inputs to host RAM and back
    if weights_on_host:
        # in for the forward, for recompute + backward; update back (but the blocks kept on the card)
        staged += 3 * (trainable.weight_bytes() - on_card_elements * trainable.element_size)
    if policy.optimizer_state == "streamed":
        staged += 2 * trainable.optimizer_bytes()  # each tensor's state to the card for its step, and back
    crossing += staged
    host_step = policy.optimizer_state == "cpu" or description.compute_device == "cpu"
    # a text encoder trained too: each caption's encode (text_encoder_training.py) before the model's forward
    encoder_forward_s = trainable.text_encoder.forward_s * batch if trainable.text_encoder is not None else 0.0
    host_rate = trainable.host_step_s_per_weight or time_model.DEFAULT_HOST_STEP_S_PER_WEIGHT
    step = time_model.step_time(
        description.forward_seconds(area, tokens, batch, storage),
        description.outside_forward_s.at(area, tokens) * batch + encoder_forward_s, checkpointed,
        streamed_bytes, h2d, crossing,
        time_model.optimizer_step_s(trainable.weight_bytes(), trainable.optimizer_bytes(), host_step,
                                    description.compute_device, h2d, host_rate, trainable.param_count),
        description.timed, slots, [b.backward_per_forward for b in blocks], description.outside_backward_per_forward,
        pin_limit, description.pageable_h2d_bytes_per_s or None, staged, description.host_copy_bytes_per_s or None,
        trainable.without_backward, trainable.copied_blocks,
        [(b.forward_s.at(area, tokens) * batch, b.backward_per_forward) for b in own] if description.timed else ())
    if description.timed_at_area:
        step = dataclasses.replace(step, timed_at_run_size=description.timed_at_area == area)
    return Plan(policy, [cache_text, cache_vae, training, validation, decode, save], budget_bytes, host_bytes=host,
                base_device_bytes=base_device, validation_base_device_bytes=validation_device,
                host_added=host_added, host_room=host_room, step_time=step, checkpointed_blocks=tuple(checkpointed),
                resident_blocks=tuple(resident), streamed_blocks=tuple(streamed), stream_slots=slots,
                pinnable_bytes=pin_limit,
                pageable_bytes=sum(size for i, size in enumerate(streamed_bytes) if size and i not in pinned),
                checkpoint_bytes=trainable.checkpoint_bytes(), save_bytes=trainable.save_bytes(),
                save_bf16_bytes=trainable.save_bf16_bytes())


def planned_room(policy: OffloadPolicy, budget_bytes: int) -> int:
    """The bytes a plan fills of `budget_bytes`: all of it, or SELECTION_SLACK less where only some blocks are
    checkpointed (selective_plans; the run's own estimate, nodes/bridge/planning.run_plan, sizes its share alike)."""
    if policy.checkpointing == "off" or policy.checkpoint_selection is None:
        return budget_bytes
    return int(budget_bytes * (1 - SELECTION_SLACK))


def _checkpointed(policy: OffloadPolicy, count: int) -> list[int]:
    """The indices of the blocks `policy` recomputes in backward, of `count` blocks."""
    if policy.checkpointing == "off":
        return []
    selection = policy.checkpoint_selection
    if selection is None:
        return list(range(count))
    if selection and max(selection) >= count:
        raise ValueError(f"checkpoint_blocks {sorted(selection)} are not among this model's {count} blocks")
    return sorted(selection)


def spread(items: Sequence[int]) -> list[int]:
    """`items` reordered so that any first k of them lie evenly among the rest: positions in van der Corput order
    (0, 1/2, 1/4, 3/4, 1/8, ...)."""
    n = len(items)
    bits = max(1, (n - 1).bit_length())
    keys = sorted(range(1 << bits), key=lambda k: int(f"{k:0{bits}b}"[::-1], 2))
    return [items[k] for k in keys if k < n]


def _resident_blocks(block_weights: Sequence[int], checkpointed: Sequence[int], share: int) -> list[int]:
    """The blocks kept on the device within `share` bytes: those not checkpointed first (they must be), then the
    checkpointed ones spread evenly over the model while they fit (`spread`): the ring copies the next streamed block
    while a resident one computes, so resident blocks between streamed ones hide copies (time_model.ring_pass)."""
    chosen, room = [], share
    first = sorted(set(range(len(block_weights))) - set(checkpointed))
    for i in [*first, *spread(list(checkpointed))]:
        if block_weights[i] <= room:
            chosen.append(i)
            room -= block_weights[i]
    return sorted(chosen)


# --- choosing a policy ------------------------------------------------------------------------------------
def candidate_policies(base: OffloadPolicy, storages: Sequence[str] | None = None,
                       trained_weights_host: bool = False) -> list[OffloadPolicy]:
    """Every valid policy variant of `base`, fastest first: resident > partial > streamed, then no
    checkpointing > checkpointing > offloaded checkpointing, then optimizer state on the device > streamed (fused
    backward) > host;
    `trained_weights_host` (a full fine-tune with fused backward): then the same with the trained weights in host
    RAM (slower: their traffic every step); with `storages`, each further storage (precision change) after all
    variants of the previous one. A `base` with its trained weights in host RAM keeps them there."""
    places = ["host"] if base.trained_weights == "host" else ["device"] + (["host"] if trained_weights_host else [])
    result = []
    for storage in storages or [base.base_storage]:
        for place in places:
            for placement in PLACEMENTS:
                for activations in CHECKPOINTING:
                    if placement != "resident" and activations == "off":
                        continue  # invalid: see OffloadPolicy.validate
                    for optimizer_state in _optimizer_states(base):
                        result.append(base.replace(base_storage=storage, base_placement=placement,
                                                   checkpointing=activations, optimizer_state=optimizer_state,
                                                   trained_weights=place, checkpoint_blocks="",
                                                   trained_weights_card_blocks=""))
    return result


def _optimizer_states(base: OffloadPolicy) -> tuple[str, ...]:
    """Where the optimizer state may be, fastest first: on the card; streamed to it for each tensor's step (fused
    backward only); in host RAM, stepped there."""
    return ("gpu", "streamed", "cpu") if base.fused_backward else ("gpu", "cpu")


def _streams_trained_weights(trainable: TrainableSpec, base: OffloadPolicy) -> bool:
    """Whether the planner may put the trained weights in host RAM: a full fine-tune with fused backward on."""
    return trainable.full and base.fused_backward


def _storages(base: OffloadPolicy, description: ModelDescription | None = None) -> list[str]:
    """The base storages to try, in order: `base`'s; then, from "as_loaded" only, fp8, int8 and nf4, less those whose
    optional package (bitsandbytes) is not installed. A base of ComfyUI's quantized layers: `base`'s alone (stored
    low-bit already)."""
    if description is not None and description.quantized_layers:
        return [base.base_storage]
    lower = [s for s in ("fp8", "int8", "nf4") if base.base_storage == "as_loaded" and lowbit.storage_installed(s)]
    return [base.base_storage] + lower


def selective_plans(description: ModelDescription, trainable: TrainableSpec, shape: RunShape, policy: OffloadPolicy,
                    budget_bytes: int, host_room: HostRoom | None = None) -> list[Plan]:
    """`policy` (checkpointing "blocks", every block) with only some blocks checkpointed, the plans that fit: the
    blocks whose recompute costs the least time per byte of activations it frees first (forward seconds / (saved +
    weight copies - inputs)), one more at a time. Planned SELECTION_SLACK short of the budget. "resident": the first
    that fits (each further block only adds recompute); "partial": every one that fits (each further block also
    frees room for resident blocks, so less streams: the time model weighs the two). None for "streamed" (every block
    streams, so every block is recomputed)."""
    if policy.checkpointing != "blocks" or policy.base_placement == "streamed" or policy.checkpoint_selection is not None:
        return []
    area, tokens, batch = shape.latent_area(description), shape.tokens(description), shape.batch
    storage = policy.base_storage
    forward = description.forward_seconds(area, tokens, batch, storage)
    freed = [(b.saved.at(area, tokens) - b.inputs.at(area, tokens)) * batch + b.copies_kept(storage)
             for b in description.blocks]
    order = sorted(range(len(freed)), key=lambda i: (freed[i] <= 0, forward[i] / max(freed[i], 1.0), i))
    plans = []
    for count in range(1, len(order)):
        selective = policy.replace(checkpoint_blocks=format_blocks(order[:count]))
        plan = estimate(description, trainable, shape, selective, budget_bytes, host_room)
        if plan.fits and plan.peak_bytes <= planned_room(selective, budget_bytes):
            plans.append(plan)
            if policy.base_placement == "resident":
                break
    return plans


def _seconds(plan: Plan) -> float:
    return plan.predicted_s_per_step if plan.predicted_s_per_step is not None else math.inf


def _rank(plan: Plan) -> tuple[float, float]:
    """The fastest predicted step first; of equals (a floor both reach, such as the CPU's staging copies), the one
    whose card does its share sooner."""
    return _seconds(plan), plan.step_time.card_s if plan.step_time is not None else math.inf


def _slowness(plan: Plan, unbounded: Plan) -> str:
    """Why `plan`'s step is predicted SLOW_STEP_RATIO times or more that of `unbounded` (the fastest policy on a card
    that holds the whole run), naming the part that costs most; "" when it is not."""
    step, reference = plan.step_time, _seconds(unbounded)
    if step is None or not 0 < reference < math.inf or step.total_s < SLOW_STEP_RATIO * reference:
        return ""
    parts = {"the optimizer step" + (" in host RAM" if plan.policy.optimizer_state == "cpu" else ""): step.optimizer_s,
             "host <-> device copies": step.transfer_s, "recomputing checkpointed blocks": step.recompute_s,
             "the CPU's copies through the staging buffers": step.host_copy_s}
    part, seconds = max(parts.items(), key=lambda item: item[1])
    untimed = "" if step.timed else (" (block times not measured: compute estimated from weight bytes, so the ratio "
                                     "is high)")
    return (f"predicted {step.total_s / reference:.1f}x the step of a card that holds the whole run "
            f"({reference:.3f} s/step), most of it {part} ({seconds:.3f} s){untimed}")


def _option(plan: Plan, storage: str) -> str:
    p = plan.policy
    return (f"{p.base_placement}/{p.checkpointing}/optimizer {p.optimizer_state}"
            f"{'' if p.base_storage == storage else '/' + p.base_storage}"
            + ("/trained weights host" if p.trained_weights == "host" else "")
            + (f" needs {format_bytes(plan.peak_bytes)} ({plan.peak.phase})" if not plan.device_fits else
               f" adds {format_bytes(plan.host_added_bytes)} of host RAM")
            + f", {_seconds(plan):.3f} s/step")


def plan_auto(description: ModelDescription, trainable: TrainableSpec, shape: RunShape, base: OffloadPolicy,
              budget_bytes: int, host_room: HostRoom | None = None) -> Plan:
    """The policy with the smallest predicted step time (time_model.py) of those (see candidate_policies, and
    selective checkpointing: selective_plans) whose estimated peak fits `budget_bytes` and whose added host RAM fits
    `host_room` (where given), with the reason.

    The frozen base's storage stays what `base` says while any variant fits; only when none does are
    lower-precision storages (fp8, then int8, then nf4) tried, and the reason says the numerics change.
    """
    storages = _storages(base, description)
    candidates = candidate_policies(base, storages, _streams_trained_weights(trainable, base))
    tried: list[Plan] = []
    for storage in storages:
        fitting: list[Plan] = []
        for policy in (p for p in candidates if p.base_storage == storage):
            plan = estimate(description, trainable, shape, policy, budget_bytes, host_room)
            if plan.fits:
                found = [plan, *selective_plans(description, trainable, shape, policy, budget_bytes, host_room)]
                fitting += found + [kept for p in found if (kept := with_trained_blocks_on_card(
                    description, trainable, shape, p, budget_bytes, host_room)) is not None]
            else:
                tried.append(plan)
        if not fitting:
            continue
        plan = fastest_with_slots(description, trainable, shape, fitting, budget_bytes, host_room)
        faster = [p for p in sorted(tried, key=_seconds) if _seconds(p) < _seconds(plan)]
        faster = faster[:3] + [p for p in faster[3:] if p.device_fits][:3]  # + those host RAM ruled out
        plan.reason = (f"chosen: the fastest policy that fits (predicted {_seconds(plan):.3f} s/step) - peak "
                       f"{format_bytes(plan.peak_bytes)} ({plan.peak.phase}) within the budget of "
                       f"{format_bytes(budget_bytes)}.")
        if plan.policy.checkpoint_selection is not None:
            plan.reason += (f" Checkpointing {len(plan.checkpointed_blocks)} of {len(description.blocks)} blocks, "
                            "those whose recompute costs least per byte saved; planned "
                            f"{SELECTION_SLACK:.0%} under the budget (allocator slack).")
        if plan.policy.trained_card_blocks:
            blocks = sum(1 for layers in trainable.block_layers if layers)
            plan.reason += (f" The trained weights of {len(plan.policy.trained_card_blocks)} of {blocks} blocks stay "
                            "on the card (the most that fit, largest first); the others cross from host RAM each step.")
        if faster:
            plan.reason += " Faster options over budget: " + "; ".join(_option(p, storage) for p in faster) + "."
        if storage != base.base_storage:
            plan.reason += (f" No policy fits with the base as loaded: the base is stored as {storage}, "
                            "which changes its numerics.")
        plan.slow = _slowness(plan, estimate(description, trainable, shape, candidates[0], None))
        if plan.slow:
            plan.reason += f" Slow: {plan.slow}."
        plan.advice = _weights_advice(description, trainable, shape, base, budget_bytes, host_room, plan)
        plan.reason += plan.advice
        return plan
    on_device = [p for p in tried if p.device_fits]
    if on_device:  # the card has room; host RAM has not, for any of them
        least = min(on_device, key=lambda p: p.host_added_bytes)
        least.reason = (f"nothing fits host RAM: the least is {least.host_room.describe(least.host_added_bytes)} "
                        f"with {least.policy.describe()}; {host_ram.advice(least.host_room, least.host_added_bytes)}.")
        return least
    smallest = min(tried, key=lambda p: p.peak_bytes)
    smallest.reason = (f"nothing fits the budget of {format_bytes(budget_bytes)}: the smallest estimate is "
                       f"{format_bytes(smallest.peak_bytes)} ({smallest.peak.phase}) with {smallest.policy.describe()}; "
                       "lower the batch size or resolution, or free device memory.")
    untried = [s for s in lowbit.BITSANDBYTES_STORAGES if base.base_storage == "as_loaded" and s not in storages]
    if untried:
        smallest.reason += (f" Base storage {' / '.join(untried)} was not tried: it needs the optional package "
                            "bitsandbytes (python -m pip install bitsandbytes, then restart ComfyUI).")
    smallest.advice = _weights_advice(description, trainable, shape, base, budget_bytes, host_room)
    smallest.reason += smallest.advice
    return smallest


# The Offload Policy's fused_backward, and bf16 trained weights, are weighed for a plan (and said, never chosen) where
# the gradients fused backward frees are at least this share of the budget (a ControlNet's fp32 weights: SDXL's
# 4.7 GiB; a LoRA's are a few hundred MiB), and said where they fit what the plan does not, or are predicted at most
# FUSED_ADVICE_SPEEDUP of the plan's step.
FUSED_ADVICE_SHARE = 1 / 16
FUSED_ADVICE_SPEEDUP = 0.67
_FUSED_SAID = ("fused_backward on in the Offload Policy (each trained tensor stepped in backward and its gradient "
               "freed; gradient clipping per tensor; not with precision fp16 or gradient accumulation)")


def _weights_advice(description: ModelDescription, trainable: TrainableSpec, shape: RunShape, base: OffloadPolicy,
                    budget_bytes: int, host_room: HostRoom | None, chosen: Plan | None = None) -> str:
    """What the Offload Policy's fused_backward (where off) would allow where the run keeps a full set of large
    gradients, or else its fp32 trained weights in bf16 (`trainable.bf16_weights_input`, which fused backward steps):
    a fit with the base as loaded where `chosen` (the plan made; None: nothing fits) has none, or a step predicted much
    faster. Said, not chosen: fused backward clips gradients per tensor and cannot run with fp16 or gradient
    accumulation; bf16 weights change the numerics. "" where accumulation is asked, the gradients are small, or
    neither allows anything more."""
    if shape.grad_accum > 1 or trainable.weight_bytes() < FUSED_ADVICE_SHARE * budget_bytes:
        return ""
    fused = base.replace(fused_backward=True)
    weighed = dataclasses.replace(trainable, bf16_weights_input="")  # (its plans weigh nothing more: fused is on)
    options = [] if base.fused_backward else [(weighed, f" With {_FUSED_SAID}")]
    if trainable.bf16_weights_input and trainable.element_size == 4:
        options.append((dataclasses.replace(weighed, element_size=2),
                        f" With {trainable.bf16_weights_input} bf16_stochastic (the trained weights in bf16, each "
                        "update rounded stochastically; precision bf16)" +
                        ("" if base.fused_backward else f" and {_FUSED_SAID}")))
    for weights, said in options:
        plan = plan_auto(description, weights, shape, fused, budget_bytes, host_room)
        if not plan.fits or plan.policy.base_storage != base.base_storage:
            continue
        if chosen is None or chosen.policy.base_storage != base.base_storage:
            return (f"{said} it fits with the base as loaded: peak {format_bytes(plan.peak_bytes)} with "
                    f"{plan.policy.describe()}.")
        if math.isfinite(_seconds(chosen)) and _seconds(plan) <= FUSED_ADVICE_SPEEDUP * _seconds(chosen):
            return (f"{said}: predicted {_seconds(plan):.3f} s/step instead of {_seconds(chosen):.3f}, with "
                    f"{plan.policy.describe()}.")
    return ""


# The ring's device slots the planner weighs (with_best_slots): prefetch depth 1 to 3. Each slot more holds a block
# more on the card, so fewer stay resident; it pays where copies come in bursts the ring cannot smooth (blocks of
# uneven size or compute, resident ones between streamed ones).
SLOT_CHOICES = (2, 3, 4)


def with_best_slots(description: ModelDescription, trainable: TrainableSpec, shape: RunShape, plan: Plan,
                    budget_bytes: int | None, host_room: HostRoom | None = None) -> Plan:
    """`plan` (an estimate: no reason yet) with the number of the streamer's device slots (SLOT_CHOICES) whose plan
    fits and predicts the fastest step; the fewest of equals. `plan` itself where no block streams (or no budget:
    nothing to weigh), or on a CPU."""
    if not plan.streamed_blocks or budget_bytes is None or description.h2d() is None:
        return plan
    best = plan
    for slots in SLOT_CHOICES:
        if slots == plan.stream_slots:
            continue
        other = estimate(description, trainable, shape, plan.policy, budget_bytes, host_room, slots)
        if not other.fits or other.peak_bytes > planned_room(plan.policy, budget_bytes):
            continue
        if _rank(other) < _rank(best) or (_rank(other) == _rank(best) and slots < best.stream_slots):
            best = other
    return best


def fastest_with_slots(description: ModelDescription, trainable: TrainableSpec, shape: RunShape, plans: Sequence[Plan],
                       budget_bytes: int | None, host_room: HostRoom | None = None) -> Plan:
    """Of `plans` (estimates that fit, at the ring's default slots) the fastest predicted once each has the slots that
    suit it (with_best_slots): a policy may win only with a deeper ring. Of equal steps the one whose card is done
    sooner (`_rank`), then the first. A plan whose StepTime floors rank no better than the best so far cannot win at
    any depth, and is not estimated again (on the Flux-like recorded timings, 6-48 GiB: 3-32 of 11-120 plans weighed;
    plan_auto 0.3-0.5 s on a 2-core VM)."""
    ordered = sorted(plans, key=_rank)  # stable: the first of equals stays first
    best = with_best_slots(description, trainable, shape, ordered[0], budget_bytes, host_room)
    for plan in ordered[1:]:
        if plan.step_time is None or (plan.step_time.ring_floor_s, plan.step_time.card_floor_s) >= _rank(best):
            continue
        other = with_best_slots(description, trainable, shape, plan, budget_bytes, host_room)
        if _rank(other) < _rank(best):
            best = other
    return best


def with_trained_blocks_on_card(description: ModelDescription, trainable: TrainableSpec, shape: RunShape, plan: Plan,
                                budget_bytes: int, host_room: HostRoom | None = None) -> Plan | None:
    """`plan` (its trained weights in host RAM) with the trained weights of as many blocks as fit kept on the card
    (policy trained_weights_card_blocks), the largest blocks first: each byte kept saves its three crossings per step,
    so the most bytes kept is the fastest; None when it does not apply or not one block fits."""
    policy = plan.policy
    if policy.trained_weights != "host" or policy.trained_card_blocks or not trainable.block_layers:
        return None
    sizes = [sum(elements for _, elements in layers) for layers in trainable.block_layers]
    order = sorted((i for i, size in enumerate(sizes) if size), key=lambda i: (-sizes[i], i))
    # Every block kept, with no trained layer outside them: that is the trained weights on the card (its own candidate)
    outside = trainable.param_count - sum(sizes)
    best, low, high = None, 1, len(order) - (0 if outside > 0 else 1)
    while low <= high:  # more blocks on the card only adds to the card's peak: the most that fit, by bisection
        middle = (low + high) // 2
        kept = estimate(description, trainable, shape,
                        policy.replace(trained_weights_card_blocks=format_blocks(order[:middle])), budget_bytes,
                        host_room)
        if kept.fits:
            best, low = kept, middle + 1
        else:
            high = middle - 1
    return best


def next_smaller_policy(description: ModelDescription, trainable: TrainableSpec, shape: RunShape,
                        current: OffloadPolicy, budget_bytes: int | None = None) -> Plan | None:
    """After an out-of-memory error: the first policy slower than `current` whose estimated peak is at
    least 10 % below `current`'s (a smaller step would likely fail again), or None when none is. A `current` that
    checkpoints only some blocks, or keeps some blocks' trained weights on the card, is followed by the same policy
    with every block checkpointed and every trained weight in host RAM, and so on."""
    current_peak = estimate(description, trainable, shape, current, budget_bytes).peak_bytes
    storages = _storages(current, description)
    candidates = candidate_policies(current, storages, _streams_trained_weights(trainable, current))
    every_block = current.replace(checkpoint_blocks="", trained_weights_card_blocks="")
    at = next((i for i, p in enumerate(candidates) if p == every_block), -1)
    start = at if every_block != current and at >= 0 else at + 1
    for policy in candidates[start:]:
        plan = estimate(description, trainable, shape, policy, budget_bytes)
        if plan.peak_bytes <= 0.9 * current_peak:
            return plan
    return None


# --- measuring activations ------------------------------------------------------------------------------------
@dataclasses.dataclass
class ActivationSample:
    """Bytes measured in one forward: per block (saved for backward, tensor inputs) and outside the blocks."""

    latent_area: int
    text_tokens: int
    block_saved: list[int]  # activations (weight copies not included)
    block_inputs: list[int]
    outside_saved: int  # everything saved outside the blocks (their few weight copies included)
    block_weight_copies: list[int] = dataclasses.field(default_factory=list)  # see BlockProfile.weight_copy_bytes
    block_linear_copies: list[int] = dataclasses.field(default_factory=list)  # the part made by Linear layers
    # Seconds of each block's forward, and of the rest of the forward (time_model.py; empty / 0: not timed)
    block_forward_s: list[float] = dataclasses.field(default_factory=list)
    outside_forward_s: float = 0.0
    # Per block, its modules' names (relative to the block) in the order its forward first called them
    block_call_order: list[tuple[str, ...]] = dataclasses.field(default_factory=list)

    @property
    def total_saved(self) -> int:
        return sum(self.block_saved) + sum(self.block_weight_copies) + self.outside_saved


def _storage_key(tensor: torch.Tensor) -> int:
    # A QuantizedTensor has no storage of its own (a wrapper subclass): its data's (a quantized layer's backward
    # saves its weight: then the weight's own key, skipped as a weight).
    return (tensor._qdata if lowbit.is_quantized_tensor(tensor) else tensor).untyped_storage().data_ptr()


def _storage_bytes(tensor: torch.Tensor) -> int:
    return tensor_bytes(tensor) if lowbit.is_quantized_tensor(tensor) else tensor.untyped_storage().nbytes()


def measure_activations(run_forward: Callable[[], object], blocks: Sequence[torch.nn.Module],
                        weights: Iterable[torch.Tensor] = (), latent_area: int = 0, text_tokens: int = 0,
                        synchronize: Callable[[], None] | None = None) -> ActivationSample:
    """Count what one forward keeps for backward, per block (no checkpointing; tensors counted once each).

    `run_forward()` runs the forward as training does (the trainables attached, grad enabled) and returns
    its output, which is dropped afterwards (no backward is needed). Tensors sharing storage with
    `weights` (the frozen parameters) are not activations and are skipped. A saved tensor that a layer of a
    block made from its own weight (a cast copy: same shape as the layer's weight, no gradient) is counted
    apart, as that block's weight copies: they do not grow with the latent area, and low-bit storage drops
    those of Linear layers. Weight copies are counted once per layer call and not held: when ComfyUI keeps part
    of the base in host RAM, every such layer casts a device copy of its weight, and holding them all would
    bring the whole model to the device (a Flux-dev plan on an 8 GiB card ran out of memory measuring).

    Each block's forward is timed too (the time model, time_model.py), and the rest of the forward; `synchronize`
    waits for the device's queued work (CUDA: torch.cuda.synchronize) so a time is the block's own. The counting
    hooks run inside the timed spans: at calibration sizes they are part of what is measured.
    """
    weight_keys = {_storage_key(w) for w in weights}
    seen: set[int] = set()
    current: list[int | None] = [None]
    layers: list[tuple[torch.nn.Module, int]] = []  # the layers (with their own weight) running now, innermost last
    block_saved = [0] * len(blocks)
    block_inputs = [0] * len(blocks)
    block_copies = [0] * len(blocks)
    linear_copies = [0] * len(blocks)
    outside = [0]
    calls = [0]  # layer calls so far: a layer's weight copy is counted once per call
    sync = synchronize or (lambda: None)
    forward_s = [0.0] * len(blocks)
    started = [0.0]
    copied: set[int] = set()  # the layer calls whose weight copy is counted

    def is_weight_copy(tensor: torch.Tensor) -> bool:
        if tensor.requires_grad or not layers:
            return False
        own = layers[-1][0]._parameters.get("weight")
        # Compared by size, not shape: a matmul saves the transposed view of the copy.
        return own is not None and tensor.numel() == own.numel()

    def add(tensor: torch.Tensor) -> bool:
        """Count a saved tensor; True when it is to be held until the forward ends (see `kept`)."""
        key = _storage_key(tensor)
        if key in weight_keys or key in seen:
            return False
        if current[0] is not None and is_weight_copy(tensor):
            layer, call = layers[-1]
            if call not in copied:
                copied.add(call)
                size = _storage_bytes(tensor)
                block_copies[current[0]] += size
                if isinstance(layer, torch.nn.Linear):
                    linear_copies[current[0]] += size
            return False  # counted by its layer call, so its address may be reused without a miscount
        seen.add(key)
        size = _storage_bytes(tensor)
        if current[0] is None:
            outside[0] += size
        else:
            block_saved[current[0]] += size
        return True

    # The saved tensors are held here, not in the graph: a pack hook that returns the tensor itself makes
    # autograd hold a strong reference from the graph to a tensor whose grad_fn is in that graph, a cycle
    # through C++ that gc cannot see, so every measured forward stayed in memory (a Flux-width model: +2.8
    # GiB per plan). Holding them until the forward ends also keeps storage addresses unique while counting.
    kept: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> None:
        if add(tensor):
            kept.append(tensor)

    def unpack(_: None):
        raise RuntimeError("planner.measure_activations: a calibration forward cannot run backward")

    def enter_layer(module, args) -> None:
        calls[0] += 1
        layers.append((module, calls[0]))

    def leave_layer(module, args, output) -> None:  # returns None: a forward hook's result would replace the output
        layers.pop()

    call_order: list[dict[str, None]] = [{} for _ in blocks]  # per block, names in first-call order (dict: ordered)

    handles = []
    for index, block in enumerate(blocks):
        def pre(module, args, kwargs, index=index):
            current[0] = index
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            keys = {}
            for t in tensors:
                keys.setdefault(_storage_key(t), _storage_bytes(t))
            block_inputs[index] += sum(keys.values())  # each call's (a batch run in groups calls it per group)
            sync()
            started[0] = time.perf_counter()

        def post(module, args, output, index=index):
            sync()
            forward_s[index] += time.perf_counter() - started[0]
            current[0] = None

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post))
        for name, layer in block.named_modules():
            if layer._parameters.get("weight") is not None:
                handles.append(layer.register_forward_pre_hook(enter_layer))
                handles.append(layer.register_forward_hook(leave_layer))
            if name:
                handles.append(layer.register_forward_pre_hook(
                    lambda module, args, name=name, order=call_order[index]: order.setdefault(name)))
    try:
        sync()
        begun = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            output = run_forward()
        sync()
        total_s = time.perf_counter() - begun
        del output
    finally:
        kept.clear()
        for handle in handles:
            handle.remove()
    return ActivationSample(latent_area, text_tokens, block_saved, block_inputs, outside[0], block_copies, linear_copies,
                            forward_s, max(0.0, total_s - sum(forward_s)), [tuple(order) for order in call_order])


_LAW_TERMS = ("const", "per_latent_px", "per_latent_px2", "per_text_token", "per_px_token")


def fit_profile(samples: Sequence[ActivationSample]) -> tuple[list[ActivationLaw], list[ActivationLaw], ActivationLaw]:
    """Per-block laws (saved, inputs) and the outside law, least-squares from the samples. A term is fitted
    only when the samples can tell it apart: the area term needs two areas, the quadratic term three,
    the text term two text lengths, the cross term a second area at a second text length."""
    areas = {s.latent_area for s in samples}
    tokens = {s.text_tokens for s in samples}
    if len(areas) < 2:
        raise ValueError("fit_profile: the samples must differ in latent area")
    terms = ["const", "per_latent_px"]
    if len(areas) >= 3:
        terms.append("per_latent_px2")
    if len(tokens) >= 2:
        terms.append("per_text_token")
        if len({s.latent_area for s in samples if s.text_tokens != samples[0].text_tokens}) >= 2:
            terms.append("per_px_token")
    # Features scaled to about 1 so the solve is well conditioned.
    a_scale = max(areas)
    t_scale = max(max(tokens), 1)
    scale = {"const": 1.0, "per_latent_px": a_scale, "per_latent_px2": a_scale ** 2,
             "per_text_token": t_scale, "per_px_token": a_scale * t_scale}
    features = {
        "const": lambda s: 1.0, "per_latent_px": lambda s: s.latent_area / a_scale,
        "per_latent_px2": lambda s: (s.latent_area / a_scale) ** 2, "per_text_token": lambda s: s.text_tokens / t_scale,
        "per_px_token": lambda s: s.latent_area * s.text_tokens / (a_scale * t_scale),
    }
    design = torch.tensor([[features[t](s) for t in terms] for s in samples], dtype=torch.float64)

    def solve(values: Sequence[int]) -> ActivationLaw:
        target = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
        coefficients = torch.linalg.lstsq(design, target).solution.squeeze(1).tolist()
        return ActivationLaw(**{t: c / scale[t] for t, c in zip(terms, coefficients)})

    saved = [solve([s.block_saved[i] for s in samples]) for i in range(len(samples[0].block_saved))]
    inputs = [solve([s.block_inputs[i] for s in samples]) for i in range(len(samples[0].block_inputs))]
    return saved, inputs, solve([s.outside_saved for s in samples])


@dataclasses.dataclass(frozen=True)
class BlockTimes:
    """Seconds of each block's forward and of the rest of the forward for one item at one latent area (time_blocks)."""

    latent_area: int
    block_forward_s: tuple[float, ...]
    outside_forward_s: float
    # Per block its backward's seconds per forward second (0: not measured); the first block of each kind timed
    block_backward_per_forward: tuple[float, ...] = ()

    @property
    def outside_backward_per_forward(self) -> float:
        """The blocks' ratio (weighted by their forward) for the work outside them, which is not timed apart."""
        pairs = [(r, f) for r, f in zip(self.block_backward_per_forward, self.block_forward_s) if r > 0]
        seconds = sum(f for _, f in pairs)
        return sum(r * f for r, f in pairs) / seconds if seconds > 0 else 0.0

    def laws(self) -> tuple[list[ActivationLaw], ActivationLaw]:
        """The time laws through these times: proportional to the latent area, so exact at the area measured (the
        run's: the planner reads them there) and scaled by area elsewhere (a smaller bucket)."""
        area = max(self.latent_area, 1)
        return ([ActivationLaw(per_latent_px=seconds / area) for seconds in self.block_forward_s],
                ActivationLaw(per_latent_px=self.outside_forward_s / area))


def block_kind(block: torch.nn.Module) -> tuple:
    """What makes two blocks compute alike: their class and their tensors' names, shapes and dtypes."""
    return (type(block).__name__, *((name, tuple(t.shape), t.dtype) for name, t in
                                    (*block.named_parameters(), *block.named_buffers())))


def first_of_each_kind(kinds: Sequence[tuple]) -> dict[tuple, int]:
    """The index of the first block of each kind, by kind (`kinds`: each block's block_kind)."""
    return {kind: index for index, kind in reversed(list(enumerate(kinds)))}


def _needing_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """A floating-point tensor needing a gradient, as a block's inputs do in training: made from a fresh leaf, not the
    leaf itself (blocks add to their inputs in place, which autograd refuses on a leaf)."""
    return tensor.detach().requires_grad_(True).clone() if tensor.is_floating_point() else tensor


def time_backward(block: torch.nn.Module, args: tuple, kwargs: dict, forward_s: float,
                  synchronize: Callable[[], None] | None = None, inplace_inputs: bool = False) -> float:
    """`block`'s backward in seconds per second of its forward (`forward_s`, timed apart): the block run on these
    inputs with gradients on (every floating-point input needing one, as in training; `inplace_inputs`: through the
    trainer's protection for blocks that add into their inputs, checkpointing.inplace_safe) and its outputs' backward
    timed. 0 where it cannot tell (no output needs a gradient, or the forward took no time)."""
    sync = synchronize or (lambda: None)
    run = checkpointing.inplace_safe(block) if inplace_inputs else block
    with torch.enable_grad():  # (time_blocks runs under no_grad: an input's clone made there would need none)
        args, kwargs = pytree.tree_map_only(torch.Tensor, _needing_gradient, (args, kwargs))
        outputs = [t for t in pytree.tree_leaves(run(*args, **kwargs))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outputs or forward_s <= 0:
            return 0.0
        sync()
        started = time.perf_counter()
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        sync()
        return (time.perf_counter() - started) / forward_s


def time_blocks(run_forward: Callable[[], object], blocks: Sequence[torch.nn.Module], latent_area: int,
                synchronize: Callable[[], None] | None = None, repeats: int = 1, backward: bool = False,
                inplace_inputs: bool = False) -> BlockTimes:
    """Each block's forward timed in `repeats` forwards of `run_forward()` (the last counts: the first pays for
    choosing kernels and making handles), and the rest of the forward. `synchronize` waits for the device's queued
    work (CUDA) before a block starts and after it ends, so a time is the block's own compute: hooks registered
    before this call (nodes/bridge/planning._BlocksOnDevice copying a block that ComfyUI left in host RAM to the
    device) run outside the timed span. Why apart from measure_activations: the time model needs times at the run's
    size (calibration sizes are tiny, and on a GPU a tiny forward is bound by launching kernels, not by the compute
    the run's size needs), where counting saved tensors would keep a training step's activations; timed under
    no_grad, only hooks that read the clock. With `backward`: the first block of each kind (block_kind) is run again
    on the inputs it had in the last forward, with gradients, and its backward timed (time_backward: one block's
    activations at a time, as a checkpointed block's recompute holds them); its ratio to its forward stands for
    every block of its kind."""
    sync = synchronize or (lambda: None)
    forward_s = [0.0] * len(blocks)
    started = [0.0]
    kinds = [block_kind(block) for block in blocks] if backward else []
    first_of_kind = first_of_each_kind(kinds)
    inputs: dict[int, tuple] = {}

    def pre(module, args, kwargs, index):
        if index in first_of_kind.values():
            inputs[index] = (args, kwargs)  # the last forward's are kept (tensors the model made: no copy)
        sync()
        started[0] = time.perf_counter()

    def post(index):
        def hook(module, args, output):
            sync()
            forward_s[index] += time.perf_counter() - started[0]
        return hook

    total_s = 0.0
    handles = [h for i, block in enumerate(blocks)
               for h in (block.register_forward_pre_hook(lambda m, a, k, i=i: pre(m, a, k, i), with_kwargs=True),
                         block.register_forward_hook(post(i)))]
    try:
        for _ in range(max(1, repeats)):
            forward_s[:] = [0.0] * len(blocks)
            sync()
            begun = time.perf_counter()
            output = run_forward()
            sync()
            total_s = time.perf_counter() - begun
            del output
    finally:
        for handle in handles:
            handle.remove()
    ratios = [0.0] * len(blocks) if backward else []
    for kind, index in first_of_kind.items():
        args, kwargs = inputs.pop(index, ((), {}))
        try:
            ratio = 0.0
            # Twice, the second counts, on any device: a process's first backward (autograd's threads, the in-place
            # protection's hooks) took 0.4 s on a CPU where the block's took 0.3 ms
            for _ in range(2 if args or kwargs else 0):
                ratio = time_backward(blocks[index], args, kwargs, forward_s[index], sync, inplace_inputs)
        except (torch.cuda.OutOfMemoryError, RuntimeError, TypeError, ValueError):
            # not measured (no room for one block's activations; a block that cannot be run again on its own inputs):
            # the time model's rule of thumb, the plan unharmed
            ratio = 0.0
        for i, other in enumerate(kinds):
            if other == kind:
                ratios[i] = ratio
    return BlockTimes(int(latent_area), tuple(forward_s), max(0.0, total_s - sum(forward_s)), tuple(ratios))


def fit_times(samples: Sequence[ActivationSample]) -> tuple[list[ActivationLaw], ActivationLaw]:
    """Per-block forward seconds per sample and the rest of the forward's, each a line in the latent area
    (time_model.fit_seconds). The first forward pays for one-time setup (kernels chosen, handles made): it is left
    out where the others still show two areas. Laws of zero where the samples were not timed."""
    timed = [s for s in samples if s.block_forward_s]
    if len(timed) > 2 and len({s.latent_area for s in timed[1:]}) >= 2:
        timed = timed[1:]
    if not timed:
        return [ActivationLaw()] * len(samples[0].block_saved if samples else []), ActivationLaw()
    areas = [s.latent_area for s in timed]

    def law(seconds):
        const, per_px = time_model.fit_seconds(areas, seconds)
        return ActivationLaw(const=const, per_latent_px=per_px)

    blocks = [law([s.block_forward_s[i] for s in timed]) for i in range(len(timed[0].block_forward_s))]
    return blocks, law([s.outside_forward_s for s in timed])


def trained_block_profiles(saved: Sequence[ActivationLaw], inputs: Sequence[ActivationLaw],
                           samples: Sequence[ActivationSample], first: int, forward_s: Sequence[ActivationLaw] = (),
                           backward_per_forward: Sequence[float] = ()) -> tuple[BlockProfile, ...]:
    """Profiles of blocks whose weights are all trained (a ControlNet's copies: ModelDescription.controlnet_blocks),
    measured after `first` frozen blocks in the same `samples` (and times): what they keep for backward and their
    times, no frozen weights."""
    return tuple(BlockProfile(
        name=f"trained block {index}", param_bytes=0, saved=saved_law, inputs=inputs_law,
        weight_copy_bytes=max((s.block_weight_copies[first + index] for s in samples if s.block_weight_copies),
                              default=0),
        forward_s=forward_s[index] if index < len(forward_s) else ActivationLaw(),
        backward_per_forward=backward_per_forward[index] if index < len(backward_per_forward) else 0.0)
        for index, (saved_law, inputs_law) in enumerate(zip(saved, inputs)))


def describe_blocks(named_blocks: Sequence[tuple[str, torch.nn.Module]], saved: Sequence[ActivationLaw],
                    inputs: Sequence[ActivationLaw], samples: Sequence[ActivationSample] = (),
                    forward_s: Sequence[ActivationLaw] = (), backward_per_forward: Sequence[float] = ()
                    ) -> tuple[BlockProfile, ...]:
    """BlockProfiles from the modules (frozen weight bytes, frozen Linear statistics), fitted activation laws
    and the weight copies the `samples` measured (the largest seen: they do not depend on the size); trainable
    tensors (adapters) are left out, the TrainableSpec counts them."""
    profiles = []
    for index, ((name, block), saved_law, inputs_law) in enumerate(zip(named_blocks, saved, inputs)):
        profiles.append(BlockProfile(
            name=name,
            param_bytes=frozen_bytes(block),
            **_linear_statistics(block.modules()),
            saved=saved_law, inputs=inputs_law,
            weight_copy_bytes=max((s.block_weight_copies[index] for s in samples if s.block_weight_copies), default=0),
            linear_copy_bytes=max((s.block_linear_copies[index] for s in samples if s.block_linear_copies), default=0),
            forward_s=forward_s[index] if index < len(forward_s) else ActivationLaw(),
            call_order=next((s.block_call_order[index] for s in samples if s.block_call_order), ()),
            backward_per_forward=backward_per_forward[index] if index < len(backward_per_forward) else 0.0,
        ))
    return tuple(profiles)


def _linear_statistics(modules: Iterable[torch.nn.Module]) -> dict[str, int]:
    """BlockProfile's Linear fields for the frozen torch Linears among `modules`: what low-bit storage re-stores
    (ComfyUI's quantized layers are not: stored low-bit already)."""
    linears = [m for m in modules if isinstance(m, torch.nn.Linear)
               and isinstance(m.weight, torch.nn.Parameter) and not m.weight.requires_grad]
    return {"linear_weight_bytes": sum(m.weight.numel() * m.weight.element_size() for m in linears),
            "linear_weight_numel": sum(m.weight.numel() for m in linears),
            "linear_rows": sum(m.out_features for m in linears), "linear_count": len(linears)}


def largest_weight_copy_bytes(module: torch.nn.Module, compute_dtype: torch.dtype | None) -> int:
    """Bytes of the largest frozen weight of `module` cast to `compute_dtype` (0 when nothing needs a cast: every
    weight already in that dtype, or no cast dtype). Embedding tables are left out: a lookup reads rows, ComfyUI
    does not cast the table for it."""
    if compute_dtype is None:
        return 0
    size = torch.empty((), dtype=compute_dtype).element_size()
    # A QuantizedTensor reports the dequantised dtype, which may be the compute dtype, and is dequantised all the same
    # (its layer's backward: comfy.ops QuantLinearFunc).
    return max((t.numel() * size for layer in module.modules() if not isinstance(layer, torch.nn.Embedding)
                for t in layer.parameters(recurse=False)
                if not t.requires_grad and (t.dtype != compute_dtype or lowbit.is_quantized_tensor(t))), default=0)


def frozen_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's frozen parameters and buffers (shared tensors once), as stored (tensor_bytes)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers()) if not t.requires_grad}
    return sum(tensor_bytes(t) for t in tensors.values())


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor's storage takes. A wrapper tensor subclass (ComfyUI's QuantizedTensor, comfy_kitchen: the
    weights of a scaled fp8 / int8 / nvfp4 file) reports the numel and dtype of its dequantised value (fp8 as bf16:
    twice its size); what it stores is its inner tensors (`__tensor_flatten__`: the fp8 data and its scales)."""
    if lowbit.is_quantized_tensor(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(getattr(tensor, name).numel() * getattr(tensor, name).element_size() for name in names)
    return tensor.numel() * tensor.element_size()
