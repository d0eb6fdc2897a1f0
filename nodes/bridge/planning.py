"""The planner's view of a ComfyUI MODEL (the bridge's planning part): the budget ComfyUI can make free, the
model described from its own modules and code (blocks and their weight bytes from `diffusion_model`, the same
blocks the trainer checkpoints and streams; activations measured by running it at small calibration sizes,
training/memory/planner.py; ComfyUI's own `memory_required` for the sampling working set and the VAE's
`memory_used_encode/decode` for caching and decoding), and the next smaller policy after an out-of-memory error.
Used by the memory nodes (nodes/memory.py) and the training run (nodes/bridge/comfy_bridge.py)."""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

import comfy.model_management

from ...training.checks import named
from ...training.memory import host_ram, planner, time_model, trained_weights_on_host, weight_streaming
from ...training.core.adapters import AdapterConfig, AdapterSet, _CastProduct, layer_ranks
from ...training.core.optimizers import host_step_rate
from ...training.memory.fused_backward import FusedBackward
from ...training.memory.policy import OffloadPolicy, PolicyError
from ...training.memory.time_model import device_synchronize
from ...training.core.trainer import PRECISIONS, auto_precision
from ...training.data.cache_store import longest_text
from . import controlnet_build, families, video
from .comfy_model import (ComfyDenoiser, comfy_pinned_block_bytes, expected_cond_dims, model_blocks, quantized_layers,
                          quantized_weights_for_inference, replace_inference_tensors, restore_stock_forwards,
                          training_blocks, training_code_paths)
from .encoders import frame_step, spatial_downscale
from .text_encoder_lora import TextEncoderLora, longest_caption, with_text_encoder

log = logging.getLogger(__name__)

# Calibration forwards (latent height, width, text tokens): three areas, two text lengths, so that attention
# maps (quadratic in the area, or area x text) are fitted too. Multiples of 8 latent px: every UNet level divides.
CALIBRATION = ((16, 16, 8), (16, 32, 8), (32, 32, 8), (16, 16, 16), (16, 32, 16))



def calibration_sizes(model) -> tuple[tuple[int, int, int], ...]:
    """CALIBRATION's (latent height, latent width, text tokens), scaled up for a pixel-space model with large patches
    (HiDream-O1's 32 px: 16 px would be no whole patch, and its position ids need more than one): the same few tokens
    per side as a latent model's 2x2 patches of an 8x VAE. The planner reads activations per latent area, so the
    measured sizes need not be the run's."""
    patch = getattr(model.diffusion_model, "patch_size", None)
    scale = max(1, patch // 8) if isinstance(patch, int) and model.latent_format.spacial_downscale_ratio == 1 else 1
    return tuple((height * scale, width * scale, tokens) for height, width, tokens in CALIBRATION)


# --- budget -----------------------------------------------------------------------------------------------
def available_device_bytes(device: torch.device | None = None) -> int:
    """What ComfyUI can make free on `device`: free memory plus what loaded models occupy there."""
    device = device or comfy.model_management.get_torch_device()
    loaded = sum(m.model_loaded_memory() for m in comfy.model_management.current_loaded_models
                 if m.model is not None and m.device == device)
    return int(comfy.model_management.get_free_memory(device) + loaded)


def calibration_room(patcher) -> int:
    """Device memory the plan's calibration forwards keep free of weights: half of what ComfyUI can make free there
    (0 when the model computes where it is kept, as on the CPU). ComfyUI's load fills the card otherwise, and a base
    larger than the card then left too little for the forwards (Flux-dev measured at 6 to 24 GiB: out of memory,
    so its runs had no plan). The weights left in host RAM are cast layer by layer, as when sampling."""
    device = torch.device(patcher.load_device)
    if device == torch.device(patcher.offload_device):
        return 0
    return available_device_bytes(device) // 2


def budget_bytes(policy: OffloadPolicy, device: torch.device | None = None) -> int:
    """The policy's budget in bytes on ComfyUI's device ("auto": available minus the reserve)."""
    return policy.budget_bytes(available_device_bytes(device) if policy.budget_is_auto else None)


# --- describing a ComfyUI MODEL ------------------------------------------------------------------------------
def calibration_cond(model, text_tokens: int, device: torch.device, x: torch.Tensor | None = None,
                     extra=None) -> dict[str, torch.Tensor]:
    """Zero conditioning of the widths the model expects (what the text cache would hold); with `extra`, its entries
    for latent `x` too (a ControlNet run's control: _ControlNetStep.control)."""
    dims = expected_cond_dims(model)
    family = families.family_of(model)
    if family is not None and family.calibration_pooled_width is not None:  # SDXL: CLIP-G's pooled output
        dims.setdefault("pooled_output", family.calibration_pooled_width(model))
    cond = {"cross_attn": torch.zeros(text_tokens, dims.get("cross_attn", 768), device=device)}
    if "pooled_output" in dims:
        cond["pooled_output"] = torch.zeros(dims["pooled_output"], device=device)
    if family is not None and family.calibration_cond_shapes is not None:  # HiDream: its four encoders' outputs
        cond.update({name: torch.zeros(shape, device=device)
                     for name, shape in family.calibration_cond_shapes(model, text_tokens).items()})
    if extra is not None:
        cond.update(extra(x))
    return cond


def latent_shape(model, height: int, width: int) -> tuple[int, ...]:
    """A one-item latent of the model's format at this latent size: [1, C, h, w], or [1, C, 1, h, w] for video-latent
    formats (latent_dimensions 3: Wan 2.1 latents of Qwen-Image), as the trainer's cached latents are."""
    latent_format = model.latent_format
    frames = (1,) * (latent_format.latent_dimensions - 2)
    return (1, latent_format.latent_channels, *frames, height, width)


def measure_model(patcher, adapter: AdapterConfig, precision: str = "bf16") -> list[planner.ActivationSample]:
    """Forwards of the MODEL at the calibration sizes as training runs it; per-block saved bytes and forward times
    (the planner's time model; on a CPU, the CPU's time).

    The model is loaded through ComfyUI (as sampling would load it) and a LoRA of `adapter`'s settings is
    attached to the module tree for the duration (detached again before returning, also on an error), so
    autograd records exactly what the training step keeps. No backward runs.
    """
    return measure_and_time(patcher, adapter, precision)[0]


@dataclasses.dataclass(frozen=True)
class NewControlNet:
    """A ControlNet a plan builds to measure, then frees (_ControlNetStep): of `blocks` blocks as the ControlNet nodes'
    (0: the type's default), its weights in `dtype` as its run's will be (controlnet_precision). Measured in fp32, a
    bf16 run's ControlNet blocks were counted 1.27x (tiny SDXL) and 1.41x (tiny Flux) what they keep, and at
    SD3.5-Large's width its whole step 5.0x (548 MiB for 110 at 64 px): fp32 weights keep their bf16 casts for
    backward, bf16 weights keep none."""
    blocks: int = 0
    dtype: torch.dtype = torch.float32


def measure_and_time(patcher, adapter: AdapterConfig, precision: str = "bf16", timing: planner.RunShape | None = None,
                     controlnet=None) -> tuple[list[planner.ActivationSample], planner.BlockTimes | None]:
    """measure_model's samples, and with `timing` (a run's shape) each block's forward timed at that shape
    (time_at_run_size; None where it was skipped). With `controlnet` (a run's TrainableControlNet, a NewControlNet, or
    the blocks of an fp32 one: 0 the type's default), the forwards are a ControlNet run's (_ControlNetStep): the
    samples' and times' blocks are the base's then the ControlNet's own, and `adapter` is not used."""
    if isinstance(controlnet, int):
        controlnet = NewControlNet(controlnet)
    with training_code_paths():
        return _measure(patcher, adapter, precision, timing, controlnet)


class _ControlNetStep:
    """A ControlNet run's forward for the calibration: the base frozen (no adapter), the ControlNet's copies of the
    base's first blocks and its hint encoder trained. Measured, not modelled on a LoRA's: the base's blocks before the
    control joins keep nothing, the copies keep what a block of trained weights keeps, and a UNet ControlNet's hint
    encoder runs at the image's pixel size (SD1.5 at 64 px: 0.64x the activations a LoRA's calibration counted)."""

    def __init__(self, patcher, controlnet):
        if isinstance(controlnet, NewControlNet):  # a run about to open (its Init node's plan): built as it will be
            controlnet = controlnet_build.build_controlnet(patcher, blocks=controlnet.blocks, dtype=controlnet.dtype,
                                                           device=patcher.load_device)  # (then freed)
        self.controlnet, self.key = controlnet, controlnet_build.CONTROL_HINT
        self.denoiser = controlnet_build.ControlNetDenoiser(patcher, controlnet)
        base = len(training_blocks(patcher.model.diffusion_model))
        self.blocks = [block for _, block in self.denoiser.blocks()[base:]]

    def control(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The conditioning entry of a random control for latent `x`, as the latent cache holds one: pixels [8h, 8w, 3]
        in 0..1, or the raw VAE latent of the control image ([C, h, w]; [C, frames, h, w] with video latents)."""
        if self.controlnet.hint == "pixels":
            shape = (x.shape[-2] * 8, x.shape[-1] * 8, 3)
        else:
            shape = (self.controlnet.controlnet_type.hint_latent_format().latent_channels, *x.shape[2:])
        return {self.key: torch.rand(shape, generator=torch.Generator().manual_seed(0))}

    def attach(self, root: torch.nn.Module) -> None:
        pass  # the base trains nothing: no adapter

    def detach(self) -> None:
        pass


def _measure(patcher, adapter: AdapterConfig, precision: str, timing: planner.RunShape | None = None, controlnet=None
             ) -> tuple[list[planner.ActivationSample], planner.BlockTimes | None]:
    model = patcher.model
    diffusion_model = model.diffusion_model
    with torch.inference_mode(False):
        room = calibration_room(patcher)
        if room and isinstance(controlnet, NewControlNet):  # and room for the ControlNet _ControlNetStep builds there
            room += controlnet_build.controlnet_trainable(patcher, controlnet.blocks, "AdamW",
                                                          controlnet.dtype).weight_bytes()
        comfy.model_management.load_models_gpu([patcher], memory_required=room)
        with patcher.use_ejected():  # the bare module tree's weight keys (a run's clone loads with its adapters)
            replace_inference_tensors(diffusion_model, patcher)
        denoiser = ComfyDenoiser(patcher)
        blocks = [m for _, m in training_blocks(diffusion_model)]
        weights = [*diffusion_model.parameters(), *diffusion_model.buffers()]
        paths = lora_target_paths(patcher, adapter)
        extra_cond, step = None, None
        if controlnet is not None:
            try:
                step = _ControlNetStep(patcher, controlnet)
            except torch.cuda.OutOfMemoryError:
                # No room for the ControlNet beside the base here: its run is planned as with a default LoRA (the
                # copies timed as the base's blocks), as before the plan measured a ControlNet step
                torch.cuda.empty_cache()
                log.warning("Headroom: no device memory to measure a ControlNet step for the plan; its activations "
                            "are estimated as with a LoRA")
        if step is not None:
            adapters = step
            denoiser, extra_cond = adapters.denoiser, adapters.control
            blocks += adapters.blocks
            weights += adapters.controlnet.parameters()  # trained tensors, not activations
        elif adapter.kind == "full":
            # A full fine-tune's own weights are the size of the base's: measured with probes of the same layers
            # instead (_OneCopyProbe: what FullLayer keeps for backward, without making its weights); the trained
            # weights, their gradients and optimizer state are counted from their shapes (lora_trainable).
            adapters = _OneCopyProbes(diffusion_model, paths)
        else:
            adapters = AdapterSet(diffusion_model, paths, adapter)
            adapters.to(denoiser.device)
        dtype = PRECISIONS[precision]
        device = denoiser.device
        synchronize = device_synchronize(device)
        samples = []
        adapters.attach(diffusion_model)
        try:
            for height, width, tokens in calibration_sizes(model):
                generator = torch.Generator().manual_seed(0)
                x = torch.randn(latent_shape(model, height, width), generator=generator).to(denoiser.device)
                if denoiser.sampling.prediction == "flow":
                    sigma = torch.full((1,), 0.5, device=denoiser.device)
                else:
                    sigma = denoiser.sampling.sigmas[len(denoiser.sampling.sigmas) // 2].reshape(1).to(denoiser.device)
                cond = calibration_cond(model, tokens, denoiser.device, x, extra_cond)

                def run(x=x, sigma=sigma, cond=cond):
                    with torch.autocast(denoiser.device.type, dtype=dtype, enabled=dtype is not None):
                        return denoiser.predict(x, sigma, [cond])

                if synchronize is not None:
                    # On a GPU the first forward at a shape chooses its kernels (cuDNN's algorithm search under
                    # ComfyUI's --fast autotune, lazily loaded kernels, cuBLAS's workspaces): untimed here, or the
                    # fit read that as compute (a cold process planned SDXL at 8.7 s/step for a 0.55 s step).
                    with torch.no_grad():
                        run()
                    synchronize()
                samples.append(planner.measure_activations(run, blocks, weights=weights, latent_area=height * width,
                                                           text_tokens=tokens, synchronize=synchronize))
            timed = None if timing is None else time_at_run_size(model, denoiser, blocks, dtype, timing, synchronize,
                                                                 samples, extra_cond)
        finally:
            adapters.detach()
            restore_stock_forwards(diffusion_model)
            quantized_weights_for_inference(diffusion_model, patcher)  # stock nodes load the MODEL again after
    return samples, timed


def run_latent_shape(model, shape: planner.RunShape) -> tuple[int, ...]:
    """One item of the run's latent (`shape`'s largest bucket): [1, C, h, w], or [1, C, frames, h, w] for a video
    latent format."""
    family = families.family_of(model)
    downscale = family.latent_downscale if family else 8
    size = latent_shape(model, shape.height // downscale, shape.width // downscale)
    if len(size) == 5:
        size = (*size[:2], shape.latent_frames, *size[3:])
    return size


# The most seconds a plan spends timing at the run's size, as the calibration's fit predicts them (a forward, two on a
# GPU, and each kind of block's forward and backward twice more): a GPU's timing of a 1024 px image model takes a
# fraction of this; a CPU's of a real-width model at 512 px, or a long video clip's on a GPU, keep the fit instead.
TIMING_BUDGET_S = 5.0


def time_at_run_size(model, denoiser, blocks: list[torch.nn.Module], dtype, shape: planner.RunShape,
                     synchronize=None, samples: list[planner.ActivationSample] = (), extra_cond=None
                     ) -> planner.BlockTimes | None:
    """Each block's forward timed at the run's latent size (one item, the run's text length; planner.time_blocks),
    under no_grad with the calibration's adapters attached, and the first block of each kind's backward (its ratio to
    the forward: planner.time_blocks with backward): the time model then reads the compute the run's size needs,
    where the calibration's tiny forwards (16-32 latent px) are bound on a GPU by launching kernels. A block that
    ComfyUI's load left (partly) in host RAM visits the device for its own forward (_BlocksOnDevice), so its time is
    its compute, not ComfyUI's per-layer copies. Skipped (None: the calibration's fit is used) where the
    calibration's `samples` predict a forward at the run's size beyond TIMING_BUDGET_S, where the forward and one
    block's weights would not fit what is free on the device, or where it runs out of memory."""
    device = denoiser.device
    size = run_latent_shape(model, shape)
    family = families.family_of(model)
    tokens = shape.text_tokens or (family.text_tokens if family else 77)
    area = math.prod(size[2:])
    repeats = 2 if device.type == "cuda" else 1  # on a GPU the first forward chooses kernels: the second is timed
    if samples:  # what the timing would take, by the calibration's fit
        forward, outside = planner.fit_times(samples)
        seconds = [law.at(area, tokens) for law in forward]
        first = planner.first_of_each_kind([planner.block_kind(block) for block in blocks]).values()
        cost = (repeats * (sum(seconds) + outside.at(area, tokens))
                + 2 * (1 + time_model.BACKWARD_PER_FORWARD) * sum(seconds[i] for i in first))
        if cost > TIMING_BUDGET_S:
            return None
    visiting = _BlocksOnDevice(blocks, device)
    if device.type != "cpu":
        needed = model.memory_required(list(size)) + visiting.largest_bytes
        if needed > comfy.model_management.get_free_memory(device):
            return None
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, generator=generator).to(device)
    if denoiser.sampling.prediction == "flow":
        sigma = torch.full((1,), 0.5, device=device)
    else:
        sigma = denoiser.sampling.sigmas[len(denoiser.sampling.sigmas) // 2].reshape(1).to(device)
    cond = calibration_cond(model, tokens, device, x, extra_cond)

    def run():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            return denoiser.predict(x, sigma, [cond])

    try:
        with torch.no_grad(), visiting:
            return planner.time_blocks(run, blocks, area, synchronize, repeats=repeats, backward=True,
                                       inplace_inputs=families.inplace_blocks(model))
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


class _BlocksOnDevice:
    """While timing: each block's tensors that ComfyUI left in host RAM copied to the device before its forward (a
    pre-hook registered before planner.time_blocks' own, so outside the timed span) and the host tensors put back
    after it: one block's weights on the device at a time, as the run's ring holds them. Not the run's
    WeightStreamer: that packs and pins the host tensors, which a plan must not do to the shared MODEL. Tensor
    subclasses (ComfyUI's quantized weights) stay where they are: their layers cast them, time included."""

    def __init__(self, blocks: list[torch.nn.Module], device: torch.device):
        self.blocks, self.device = blocks, weight_streaming.indexed_device(device)  # as tensors name it: cuda:N
        self.handles, self.swapped = [], []
        self.largest_bytes = max((sum(t.numel() * t.element_size() for _, _, t in self._away(b)) for b in blocks),
                                 default=0)

    def _away(self, block: torch.nn.Module):
        for module in block.modules():
            for store in (module._parameters, module._buffers):
                for name, tensor in store.items():
                    if (tensor is not None and tensor.device != self.device and tensor.device.type != "meta"
                            and type(tensor) in (torch.Tensor, torch.nn.Parameter)):
                        yield store, name, tensor

    def __enter__(self):
        if self.largest_bytes:
            for block in self.blocks:
                self.handles.append(block.register_forward_pre_hook(self._to_device))
                self.handles.append(block.register_forward_hook(self._back))
        return self

    def _to_device(self, block, args):
        for store, name, tensor in list(self._away(block)):
            moved = tensor.detach().to(self.device)
            store[name] = torch.nn.Parameter(moved, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) \
                else moved
            self.swapped.append((store, name, tensor))

    def _back(self, block, args, output):
        while self.swapped:
            store, name, tensor = self.swapped.pop()
            store[name] = tensor

    def __exit__(self, *exc):
        self._back(None, None, None)
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class _OneCopyProbe(torch.nn.Module):
    """A full fine-tune's layer as the planner measures it: adapters.FullLayer computes with its own weight W' alone
    (the base layer is not called, so no cast copy of the base weight is kept for backward), and keeps its input and W'
    (a trained tensor, counted from shapes). Here the same product (adapters._CastProduct) with the base's stored
    weight in W's place, made a leaf that needs a gradient (a view of the frozen weight: the measurement skips it) so
    autograd records what a training step records; nothing the size of the weights is made."""

    def __init__(self, base: torch.nn.Module):
        super().__init__()
        self.base_layer = base

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        base = self.base_layer
        conv = (base.stride, base.padding, base.dilation, base.groups) if isinstance(base, torch.nn.Conv2d) else None
        weight = base.weight.detach().requires_grad_(True)
        return _CastProduct.apply(x, weight, None if base.bias is None else base.bias.detach(), conv, None)


class _OneCopyProbes:
    """_OneCopyProbe on each of `paths`, attached / detached as an AdapterSet is."""

    def __init__(self, root: torch.nn.Module, paths: list[str]):
        self.root, self.paths = root, paths

    def attach(self, root: torch.nn.Module) -> None:
        for path in self.paths:
            parent, _, child = path.rpartition(".")
            module = root.get_submodule(parent)
            setattr(module, child, _OneCopyProbe(getattr(module, child)))

    def detach(self) -> None:
        for path in self.paths:
            parent, _, child = path.rpartition(".")
            module = self.root.get_submodule(parent)
            probe = getattr(module, child)
            if isinstance(probe, _OneCopyProbe):
                setattr(module, child, probe.base_layer)


def describe_comfy_model(patcher, adapter: AdapterConfig, precision: str = "bf16", text_tokens: int | None = None,
                         clip=None, vae=None, frames: int = 1, timing: planner.RunShape | None = None,
                         controlnet=None) -> planner.ModelDescription:
    """The planner's description of a ComfyUI MODEL (and, optionally, its CLIP and VAE, whose estimates are for
    `frames`-frame clips) for training a LoRA of `adapter`'s settings, or with `controlnet` a ControlNet (a run's
    TrainableControlNet, or a new one's: measure_and_time); with `timing` (the run's shape) its block
    times measured at that shape (time_at_run_size), else fitted from the calibration forwards."""
    model = patcher.model
    diffusion_model = model.diffusion_model
    named_blocks = training_blocks(diffusion_model)
    if not named_blocks:
        raise ValueError(f"{type(diffusion_model).__name__} has no repeated blocks to plan with")
    samples, timed = measure_and_time(patcher, adapter, precision, timing, controlnet)
    saved, inputs, outside = planner.fit_profile(samples)
    forward_s, outside_forward_s = planner.fit_times(samples) if timed is None else timed.laws()
    blocks = planner.describe_blocks(named_blocks, saved, inputs, samples, forward_s,
                                     () if timed is None else timed.block_backward_per_forward)
    # A ControlNet run's own blocks, measured after the base's: what they keep and their times (the time model's
    # copies: their backward also makes their weights' gradients)
    controlnet_blocks = planner.trained_block_profiles(
        saved[len(blocks):], inputs[len(blocks):], samples, len(blocks), forward_s[len(blocks):],
        () if timed is None else timed.block_backward_per_forward[len(blocks):])
    device = torch.device(patcher.load_device)
    channels = model.latent_format.latent_channels
    probe = 64  # ComfyUI's estimate is linear in the latent area
    inference = model.memory_required(list(latent_shape(model, probe, probe))) / (probe * probe)
    family = families.family_of(model)
    # The dtype layers compute in: the autocast precision, else ComfyUI's manual-cast dtype, else the weights' own.
    compute_dtype = PRECISIONS[precision] or model.manual_cast_dtype or model.get_dtype()
    # The Linears low-bit storage would re-store: torch's only (ComfyUI's quantized layers are stored low-bit already;
    # lowbit.LowBitStorage leaves them, and weight_copy_in_flight_bytes counts their dequantised copy).
    linears = [m.weight for _, block in named_blocks for m in block.modules()
               if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    description = dict(
        name=type(model).__name__, blocks=blocks, controlnet_blocks=controlnet_blocks,
        other_param_bytes=planner.frozen_bytes(diffusion_model) - sum(b.param_bytes for b in blocks),
        outside_saved=outside, latent_channels=channels, latent_downscale=family.latent_downscale if family else 8,
        text_tokens=text_tokens or (family.text_tokens if family else 77),
        inference_bytes_per_latent_px=float(inference),
        weight_copy_in_flight_bytes=planner.largest_weight_copy_bytes(diffusion_model, model.manual_cast_dtype),
        block_weight_copy_in_flight_bytes=max(planner.largest_weight_copy_bytes(block, model.manual_cast_dtype)
                                              for _, block in named_blocks),
        largest_linear_numel=max((w.numel() for w in linears), default=0),
        stored_element_size=max(linears, key=torch.Tensor.numel).element_size() if linears else 2,
        compute_element_size=torch.empty((), dtype=compute_dtype).element_size(),
        # the time model: where it computes, and the pinned host->device bandwidth there (measured once per process)
        outside_forward_s=outside_forward_s, compute_device=device.type,
        timed_at_area=0 if timed is None else timed.latent_area,
        outside_backward_per_forward=0.0 if timed is None else timed.outside_backward_per_forward,
        h2d_bytes_per_s=float(time_model.h2d_bytes_per_s(device) or 0.0),
        # and what the run may pin for its streamed blocks, the rest crossing at the pageable bandwidth
        pageable_h2d_bytes_per_s=float(time_model.h2d_bytes_per_s(device, pinned=False) or 0.0),
        # and the CPU's copies through the staging buffers of trained weights in host RAM and streamed state
        host_copy_bytes_per_s=float(time_model.host_copy_bytes_per_s(device) or 0.0),
        # (ComfyUI's own pins of this model's blocks counted as freed: the run's training load unpins them)
        pinnable_bytes=pinnable_host_bytes(comfy_pinned_block_bytes(patcher)) if device.type == "cuda" else None,
        quantized_layers=len(quantized_layers(model)),
    )
    if clip is not None:
        description["text_encoder_bytes"] = int(clip.patcher.model_size())
        # ComfyUI's text encoders compute through manual-cast ops in fp32 (comfy/sd1_clip.py).
        description["text_encoder_copy_in_flight_bytes"] = planner.largest_weight_copy_bytes(
            clip.cond_stage_model, torch.float32)
    if vae is not None:
        description.update(vae_estimates(vae, frames))
    return planner.ModelDescription(**description)


@dataclasses.dataclass(frozen=True)
class MeasuredModel:
    """A MODEL's description (describe_comfy_model) and what it was measured for, kept by the run it was measured for
    (TrainingRun.measured) so that the run's own plans (run_plan as it places its base, next_plan_for after an
    out-of-memory error) do not measure the model again: on a GPU each measurement is ComfyUI's load, the calibration
    forwards and the timing at the run's size. An Init node's card plan measures a LoRA or full fine-tune run's model
    before the run opens, for the same inputs (a ControlNet Init's, a new ControlNet of the run's blocks and dtype).
    Reused only for the same MODEL, adapter, precision, run shape and ControlNet blocks and dtype."""
    patcher: object
    adapter: AdapterConfig
    precision: str
    shape: planner.RunShape
    controlnet: tuple | None  # the ControlNet measured with it (measured_controlnet): its blocks and weights' dtype
    description: planner.ModelDescription

    def is_for(self, patcher, adapter: AdapterConfig, precision: str, shape: planner.RunShape, controlnet) -> bool:
        return (self.patcher is patcher and self.adapter == adapter and self.precision == precision
                and self.shape == shape and self.controlnet == measured_controlnet(patcher, controlnet))


def measured_controlnet(patcher, controlnet) -> tuple[int, torch.dtype] | None:
    """What a calibration's ControlNet (as measure_and_time takes it) is to its measurement: its blocks and its
    weights' dtype (None: no ControlNet). A new one of these and a run's own measure alike: their weights' values
    change no activation."""
    if controlnet is None:
        return None
    if isinstance(controlnet, int):
        controlnet = NewControlNet(controlnet)
    if isinstance(controlnet, NewControlNet):
        return controlnet_build.resolved_blocks(patcher, controlnet.blocks), controlnet.dtype
    return controlnet.blocks, next(iter(controlnet.module.parameters())).dtype


def measured_for_run(patcher, adapter: AdapterConfig, precision: str, shape: planner.RunShape, controlnet=None,
                     known: MeasuredModel | None = None) -> MeasuredModel:
    """`known` where it was measured for these inputs, else the model measured now (describe_comfy_model, its block
    times at `shape`; `controlnet` as measure_and_time takes it)."""
    if known is not None and known.is_for(patcher, adapter, precision, shape, controlnet):
        return known
    return MeasuredModel(patcher, adapter, precision, shape, measured_controlnet(patcher, controlnet),
                         describe_comfy_model(patcher, adapter, precision, timing=shape, controlnet=controlnet))


def vae_estimates(vae, frames: int = 1) -> dict:
    """The VAE's weights and ComfyUI's own working-set estimates (`memory_used_encode / _decode`, what VAE Encode /
    Decode load with) for one item: an image, or a `frames`-frame clip for a video VAE (encoded as [1, 3, frames, H, W],
    decoded from [1, C, latent frames, h, w]: ComfyUI's formulas are not linear in frames, e.g. the Wan 2.1 VAE's steps
    up past 4), per pixel of one frame; ComfyUI's formulas are linear in a frame's area."""
    side = 512
    step = frame_step(vae)  # None: an image VAE (plan_run refuses it clips)
    latent = side // spatial_downscale(vae) if spatial_downscale(vae) > 1 else side // 8
    # A video VAE (latent_dim 3: Wan, HunyuanVideo 1.5; Wan 2.1 for Qwen-Image's images) takes 5-D shapes.
    pixel_frames, latent_frames = ((frames,), ((frames - 1) // step + 1,)) if step is not None else ((), ())
    frames = frames if step is not None else 1
    return {
        "vae_bytes": int(vae.patcher.model_size()),
        "vae_frames": frames,
        "vae_encode_bytes_per_px": vae.memory_used_encode([1, 3, *pixel_frames, side, side], vae.vae_dtype) / side ** 2,
        "vae_decode_bytes_per_px": vae.memory_used_decode([1, vae.latent_channels, *latent_frames, latent, latent],
                                                          vae.vae_dtype) / side ** 2,
    }


def lora_target_paths(patcher, adapter: AdapterConfig) -> list[str]:
    """The module paths a LoRA with these settings trains (the trainer's own target selection)."""
    diffusion_model = patcher.model.diffusion_model
    return families.lora_targets(diffusion_model, families.family_name(patcher.model), adapter,
                                 [name for name, _ in model_blocks(diffusion_model)])


def lora_trainable(patcher, adapter: AdapterConfig, optimizer: str, paths: list[str] | None = None
                   ) -> planner.TrainableSpec:
    """The trainable tensors of a LoRA of `adapter`'s settings on this MODEL (its target layers at its rank)."""
    paths = paths if paths is not None else lora_target_paths(patcher, adapter)
    modules = [patcher.model.diffusion_model.get_submodule(p) for p in paths]
    named_blocks = training_blocks(patcher.model.diffusion_model)
    without = blocks_without_backward(patcher, named_blocks, paths)
    if adapter.kind == "full":
        spec = planner.TrainableSpec.of_full_layers(modules, optimizer, 2 if adapter.full_precision == "bf16_stochastic" else 4)
        prefix = first_block_prefix(patcher)
        first = [m for p, m in zip(paths, modules) if (p + ".").startswith(prefix)]
        blocks, outside = planner.unread_base(named_blocks, modules)
        return dataclasses.replace(spec, first_block_elements=planner.TrainableSpec.of_full_layers(first).param_count,
                                   bf16_weights_input="LoRA Config's full_precision",
                                   unread_base_blocks=blocks, unread_base_outside=outside,
                                   block_layers=planner.trained_per_block(named_blocks, modules),
                                   without_backward=without)
    ranks = layer_ranks(paths, adapter)
    return dataclasses.replace(planner.TrainableSpec.lora(modules, [ranks[p] for p in paths], optimizer),
                               without_backward=without)


def blocks_without_backward(patcher, named_blocks, trained_paths) -> int:
    """The first blocks, with none of the trained layers in or before them: backward never runs them
    (planner.TrainableSpec.without_backward). 0 for blocks that add into their inputs (Flux's): checkpointed, they
    go through the reentrant checkpoint, whose anchor needs a gradient, so every one of them runs its backward."""
    if families.inplace_blocks(patcher.model):
        return 0
    return planner.blocks_without_backward([name for name, _ in named_blocks], trained_paths)


def first_block_prefix(patcher) -> str:
    """The path prefix ("name.") of the diffusion model's first training block (forward order); a layer path + "."
    starts with it when the layer lies in that block. A prefix no path has when the model has no blocks."""
    blocks = training_blocks(patcher.model.diffusion_model)
    return blocks[0][0] + "." if blocks else "\0"


# What the Memory Plan node plans (its `kind`): a LoRA of its rank, a full fine-tune of its targets (LoRA Config kind
# full), or a ControlNet of its family's default blocks (Train ControlNet: Init).
PLAN_KINDS = ("lora", "full", "controlnet")


def plan_run(model, policy: OffloadPolicy, mode: str, batch_size: int, width: int, height: int, rank: int,
                  targets: str, optimizer: str, precision: str, text_tokens: int, clip=None, vae=None,
                  *, node: str, frames: int = 1, layers: str = "", layer_ranks: str = "", kind: str = "lora",
                  trained_precision: str = "fp32", controlnet_blocks: int = 0,
                  train_text_encoder: bool = False) -> planner.Plan:
    """The Memory Plan node's plan of a run on `model`: the estimate with `policy` (mode "estimate") or the
    fastest policy that fits the budget (mode "auto"); precision "auto" and text_tokens 0 as the training nodes
    resolve them; `frames`: a video model's longest training clip; `layers`: LoRA Config's filter of the targets,
    `layer_ranks` its ranks per layer; `kind` (PLAN_KINDS): a LoRA, a full fine-tune (its weights in
    `trained_precision`, as LoRA Config's full_precision) or a ControlNet (its weights so, as the ControlNet nodes'
    controlnet_precision; of `controlnet_blocks` blocks, as the ControlNet nodes' blocks, 0 the family's default),
    planned as their Init nodes plan a card; `train_text_encoder`: a LoRA run training `clip`'s text encoders too
    (text_encoder_lora.with_text_encoder, on a caption of one full CLIP chunk); `node`: the node's display name, for
    messages."""
    if precision == "auto":
        precision = auto_precision(model.load_device)
    try:
        if kind not in PLAN_KINDS:
            raise ValueError(f"kind={kind!r}: choose one of {', '.join(PLAN_KINDS)}")
        if trained_precision != "fp32" and kind == "lora":
            raise ValueError(f"trained_precision {trained_precision} is for kinds full and controlnet (their trained "
                             "weights); a LoRA's small factors train in fp32: set it to fp32")
        controlnet = kind == "controlnet"
        if trained_precision == "bf16_stochastic":  # as the runs refuse it; a ControlNet's also computes in bf16
            FusedBackward.check_bf16_weights("trained_precision", policy.fused_backward, precision if controlnet else None)
        adapter = AdapterConfig(rank=rank, alpha=float(rank), targets=targets, layers=layers, layer_ranks=layer_ranks,
                                kind="full" if kind == "full" else "lora",
                                full_precision=trained_precision if kind == "full" else "fp32")
        adapter.validate()
        trained_weights_on_host.check_kind(policy, None if controlnet else adapter.kind, "set kind full on this node")
        budget = budget_bytes(policy, torch.device(model.load_device))
        new = None  # a ControlNet run's: built as its Init node's card plan builds it
        if controlnet:
            controlnet_build.controlnet_type_name(model)  # a family without a ControlNet layout: named, listed
            controlnet_build.check_controlnet_blocks(model, controlnet_blocks, "controlnet_blocks")
            new = NewControlNet(controlnet_blocks, controlnet_build.controlnet_dtype(trained_precision))
        paths = None if controlnet else lora_target_paths(model, adapter)
        encoder = None
        if train_text_encoder:
            if kind != "lora" or clip is None:
                raise ValueError("train_text_encoder plans a LoRA run training the CLIP's text encoders too: set kind "
                                 "lora and connect the clip" + (f" (kind is {kind})" if kind != "lora" else ""))
            encoder = TextEncoderLora(clip, adapter)
        latent_frames = video.check_frames(node, model.model, frames)
        if vae is not None and frames > 1 and frame_step(vae) is None:
            raise ValueError(f"frames={frames}, but this VAE ({type(vae.first_stage_model).__name__}) encodes images; "
                             "connect the video model's VAE")
        shape = planner.RunShape(batch_size, width, height, text_tokens or None, latent_frames)
        description = describe_comfy_model(model, adapter, precision, text_tokens or None, clip, vae, frames,
                                           timing=shape, controlnet=new)
    except (PolicyError, ValueError) as error:
        raise ValueError(named(node, str(error))) from None
    if controlnet:  # as Train ControlNet: Init plans its card
        trainable = dataclasses.replace(controlnet_build.controlnet_trainable(model, new.blocks, optimizer, new.dtype),
                                        bf16_weights_input="controlnet_precision")
    else:
        trainable = lora_trainable(model, adapter, optimizer, paths)
    if encoder is not None:  # any caption of up to 75 tokens is one such chunk (a longer one adds a chunk)
        trainable = with_text_encoder(trainable, encoder, " ".join(["a"] * 75))
    trainable = with_host_step(trainable)
    room = host_ram.host_room(policy.host_ram_budget_gb)
    if mode == "auto":
        return planner.plan_auto(description, trainable, shape, policy, budget, room)
    # the ring's slots as the run chooses them for its policy (run_plan)
    return planner.with_best_slots(description, trainable, shape, planner.estimate(
        description, trainable, shape, policy, budget, room), budget, room)


def pinnable_host_bytes(released: int = 0) -> int | None:
    """The host RAM a run's WeightStreamer may pin: what ComfyUI's share for pinned memory leaves now (its
    MAX_PINNED_MEMORY: 40 % of the RAM on Windows, which lets a process lock about half; none with
    --disable-pinned-memory or a device ComfyUI does not pin for), `released` bytes of ComfyUI's pins counted as
    freed. None where this ComfyUI keeps no such account."""
    most = getattr(comfy.model_management, "MAX_PINNED_MEMORY", None)
    if not isinstance(most, (int, float)):
        return None
    if most <= 0:
        return 0
    return max(0, int(most - max(0, getattr(comfy.model_management, "TOTAL_PINNED_MEMORY", 0) - released)))


def comfy_pins_host_memory() -> bool:
    """False where ComfyUI runs with --disable-pinned-memory (its MAX_PINNED_MEMORY then stays -1; the same on a
    device ComfyUI does not pin for, where nothing crosses); True where this ComfyUI keeps no such account."""
    most = getattr(comfy.model_management, "MAX_PINNED_MEMORY", None)
    return not isinstance(most, (int, float)) or most > 0


def with_host_step(trainable: planner.TrainableSpec) -> planner.TrainableSpec:
    """`trainable` with its optimizer's step in host RAM timed on this machine (the time model's price of
    optimizer_state "cpu" and of a run on the CPU; measured once per process: core/optimizers.host_step_rate)."""
    rate = host_step_rate(trainable.optimizer, trainable.element_size == 2)  # 2 bytes: bf16 with stochastic rounding
    return dataclasses.replace(trainable, host_step_s_per_weight=rate)


def check_host_ram(policy: OffloadPolicy, trainable: planner.TrainableSpec, node: str) -> None:
    """Before a run opens (LoRA and ControlNet Init nodes): what its policy adds to host RAM (optimizer state on the
    host or parked while sampling, the EMA copy) against the policy's host RAM budget. Raises ValueError naming the
    node and what to change rather than letting the OS kill the run (within it, nothing is said: the policy node and
    the Memory Plan node show the room). Offloaded block inputs (checkpointing blocks_cpu_offload) depend on the
    measured model: the Memory Plan node and a card's plan count them."""
    room = host_ram.host_room(policy.host_ram_budget_gb)
    if room is None:
        return
    parking = planner.optimizer_placement_cost(policy, trainable)
    added = host_ram.peak_added(host_ram.added_by_phase([parking], trainable.ema, trainable.param_bytes(),
                                                        trainable.weight_bytes()))
    if not room.fits(added):
        raise ValueError(f"{node}: {room.describe(added)}; {host_ram.advice(room, added)}")


def _run_inputs(run) -> tuple:
    """The planner's inputs for an open run: its model measured as the Memory Plan node measures it, its trainable
    weights, batch, largest bucket and text length, and its policy's budget on the model's device."""
    config = run.config
    adapter = getattr(config, "adapter", None) or AdapterConfig()  # (not used in a ControlNet run's calibration)
    shape = cache_run_shape(run.source_model, run.latent_cache, run.text_cache, config.train.batch_size,
                            "Train LoRA: Steps (Headroom)", config.train.grad_accum)
    # measured once per run: by its Init node's card plan, else by its first plan here
    run.measured = measured_for_run(run.source_model, adapter, config.train.precision, shape,
                                    run.controlnet if run.trains == "controlnet" else None, run.measured)
    description = run.measured.description
    first = 0
    if adapter.kind == "full":  # the first block's trained elements (planner.first_block_gradients_later)
        prefix = first_block_prefix(run.source_model)
        first = sum(t.numel() for key, t in run.adapters.state_dict(copy=False).items() if key.startswith(prefix))
    # A full fine-tune's trained layers' base weights: never read by its training step, left in host RAM
    unread = run.trained.unread_base_layers()
    named_blocks = training_blocks(run.source_model.model.diffusion_model)
    blocks, outside = planner.unread_base(named_blocks, unread) if unread else ((), 0)
    per_block = planner.trained_per_block(named_blocks, unread) if unread else ()
    if getattr(config, "adapter", None) is None:  # a ControlNet run: the base trains nothing, the control joins it
        step_blocks = {**controlnet_build.controlnet_step_blocks(run.source_model, config.blocks),
                       "saved_as_trained": True}
    else:
        step_blocks = {"without_backward": blocks_without_backward(run.source_model, named_blocks,
                                                                   list(run.adapters.layers))}
    trainable = dataclasses.replace(planner.TrainableSpec.from_parameters(run.trainer.params, config.optimizer.name,
                                                                          full=adapter.kind == "full"),
                                    **step_blocks,
                                    state_ranks=run.trainer.state_ranks, weight_ranks=run.trainer.weight_ranks,
                                    first_block_elements=first, unread_base_blocks=blocks, unread_base_outside=outside,
                                    block_layers=per_block)
    encoder = getattr(run.trained, "text_encoder", None)  # a LoRA run training the CLIP's text encoders too
    if encoder is not None:  # its LoRA's tensors are in the trainer's; what its step holds beside them:
        cost = encoder.training_cost(*longest_caption(run.text_cache, encoder.clip))
        trainable = dataclasses.replace(trainable, text_encoder=cost)
    trainable = with_host_step(trainable)
    budget = budget_bytes(run.policy, torch.device(run.source_model.load_device))
    return description, trainable, shape, budget


def next_plan_for(run) -> planner.Plan | None:
    """After an out-of-memory error in a training run (nodes/bridge/comfy_bridge.py TrainingRun): the planner's
    next smaller policy for that run's model, trainable weights, batch, largest bucket and text length."""
    description, trainable, shape, budget = _run_inputs(run)
    return planner.next_smaller_policy(description, trainable, shape, run.policy, budget)


def run_plan(run) -> planner.Plan:
    """The planner's estimate of an open run with its own policy (for the share of the base its load may place on
    the device: planner.Plan.base_device_bytes), with the streamer's slots the planner chooses for it (as the card's
    auto plan does: planner.with_best_slots)."""
    description, trainable, shape, budget = _run_inputs(run)
    return planner.with_best_slots(description, trainable, shape, planner.estimate(
        description, trainable, shape, run.policy, budget), budget)


def cache_run_shape(patcher, latent_cache, text_cache, batch_size: int, node: str, grad_accum: int = 1
                    ) -> planner.RunShape:
    """What a run's largest step processes: its largest bucket (clips' buckets are (w, h, frames)), its longest cached
    text (captions differ in length where the text encoder does not pad), its batch (and its micro-steps per
    optimizer step)."""
    width, height, *frames = max(latent_cache.buckets, key=lambda size: math.prod(size))
    try:
        tokens = longest_text(text_cache, latent_cache)
    finally:  # no shard left mapped by a plan, also where one proved unreadable (Windows could not delete the folder)
        text_cache.release_files()
    latent_frames = video.check_frames(node, patcher.model, frames[0]) if frames else 1
    return planner.RunShape(batch_size, width, height, int(tokens), latent_frames, grad_accum)


def plan_for_card(patcher, latent_cache, text_cache, policy: OffloadPolicy, trainable: planner.TrainableSpec,
                  batch_size: int, precision: str, node: str, adapter: AdapterConfig | None = None,
                  grad_accum: int = 1, controlnet: NewControlNet | None = None
                  ) -> tuple[planner.Plan, MeasuredModel]:
    """The fastest policy whose planned peak fits `policy`'s card (planner.plan_auto), for a run opening on this
    MODEL with these caches: the model measured as the Memory Plan node measures it, with a LoRA of `adapter`'s
    settings, or for a ControlNet run with a new `controlnet` of its blocks and dtype; and that
    measurement, for the run to keep (TrainingRun.measured)."""
    try:
        budget = budget_bytes(policy, torch.device(patcher.load_device))
    except PolicyError as error:
        raise ValueError(f"{node}: {error}") from None
    shape = cache_run_shape(patcher, latent_cache, text_cache, batch_size, node, grad_accum)
    measured = measured_for_run(patcher, adapter or AdapterConfig(), precision, shape, controlnet)
    return planner.plan_auto(measured.description, with_host_step(trainable), shape, policy, budget,
                             host_ram.host_room(policy.host_ram_budget_gb)), measured
