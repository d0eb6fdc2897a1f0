"""The ComfyUI MODEL as the engine sees it (the bridge's model description): its family, its repeated blocks,
the conditioning widths it expects, its fingerprints, and `ComfyDenoiser`, the engine's Denoiser protocol over a
ModelPatcher. Cached conditioning goes through the model's own `extra_conds` / `process_cond` / `cond_cat` (what
the samplers do), then `BaseModel.apply_model`, which returns the x0 estimate in ComfyUI's own parametrisation;
`sampling_descriptor` reads `model_sampling` (eps / v / flow, sigma table, SD3 or Flux shift).

Imports nothing of Headroom's nodes/ but the family registry: the run (comfy_bridge.py) and the planning
(planning.py) both build on it.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math

import torch

import comfy.clip_model
import comfy.model_base
import comfy.model_management
import comfy.model_sampling
import comfy.samplers
import comfy.text_encoders.llama
import comfy.utils

from ...training.data.cache_store import fingerprint_state_dict, fingerprint_value, item_conditioning
from ...training.memory.lowbit import is_quantized_layer, is_quantized_tensor
from ...training.core.objective import SamplingDescriptor
from . import families
from .rope_autograd import register_rope_autograd


@contextlib.contextmanager
def training_code_paths():
    """Inside the block ComfyUI's models take their training paths (comfy.model_management.in_training: Flux's
    differentiable RoPE, LTX-2's unfused feed-forward) and call the layers Headroom wraps as modules: outside it
    comfy.ops.linear_input_act reads the layer's weight and, for ComfyUI's INT8 weights, runs its own kernel on the
    layer, which a LoRA / OFT wrapper is not (a LoRA on an INT8 Wan stopped at its validation loss). For every
    computation on the training clone with the run's layers attached: the step, the validation loss, "unmerged"
    sampling, and the planner's calibration of the step."""
    before = comfy.model_management.in_training
    comfy.model_management.in_training = True
    try:
        yield
    finally:
        comfy.model_management.in_training = before


# --- what kind of model is this -------------------------------------------------------------------------
def model_family(model: comfy.model_base.BaseModel) -> str | None:
    """The family name of a ComfyUI model (nodes/bridge/families/), or None when no family recognises it."""
    return families.family_name(model)


def sampling_descriptor(model_sampling) -> SamplingDescriptor:
    """The engine's view of a ComfyUI `model_sampling` object."""
    if is_edm_flow(model_sampling):
        # Cosmos Predict2 (text-to-image, image-to-video): rectified flow sampled with EDM-style sigmas
        # (ComfyDenoiser.comfy_input).
        low, high = float(model_sampling.sigma_min), float(model_sampling.sigma_max)
        return SamplingDescriptor("flow", flow_range=(low / (1.0 + low), high / (1.0 + high)))
    if isinstance(model_sampling, comfy.model_sampling.CONST):
        if isinstance(model_sampling, comfy.model_sampling.ModelSamplingFlux):
            # Flux: sigma = e^mu / (e^mu + 1/t - 1) == SD3's shift form with shift = e^mu.
            return SamplingDescriptor("flow", flow_shift=math.exp(float(model_sampling.shift)),
                                      noise_scale=_noise_scale(model_sampling))
        if isinstance(model_sampling, comfy.model_sampling.ModelSamplingDiscreteFlow):
            return SamplingDescriptor("flow", flow_shift=float(model_sampling.shift),
                                      noise_scale=_noise_scale(model_sampling))
    elif isinstance(model_sampling, comfy.model_sampling.ModelSamplingDiscrete) and not isinstance(
            model_sampling, comfy.model_sampling.ModelSamplingDiscreteEDM):
        sigmas = model_sampling.sigmas.detach().float().cpu().clone()
        if isinstance(model_sampling, comfy.model_sampling.V_PREDICTION):
            return SamplingDescriptor("v", sigmas=sigmas)
        if isinstance(model_sampling, comfy.model_sampling.EPS) and not isinstance(model_sampling, comfy.model_sampling.X0):
            return SamplingDescriptor("eps", sigmas=sigmas)
    raise ValueError(
        f"model sampling {type(model_sampling).__mro__[1].__name__}+{type(model_sampling).__mro__[2].__name__} is not "
        "supported for training (supported: discrete eps / v-prediction, and flow models such as SD3 and Flux)"
    )


def _noise_scale(model_sampling) -> float:
    """The factor CONST.noise_scaling puts on the noise (sampling_settings' noise_scale: HiDream-O1's 8.0; else 1)."""
    return float(getattr(model_sampling, "noise_scale", 1.0))


def is_edm_flow(model_sampling) -> bool:
    """ComfyUI's COSMOS_RFLOW sampling (Cosmos Predict2): a rectified flow whose sigma s is EDM's, s = t / (1 - t) of
    the flow time t, and whose input x0 + s * noise is the flow's x_t times 1 + s."""
    return (isinstance(model_sampling, comfy.model_sampling.COSMOS_RFLOW)
            and isinstance(model_sampling, comfy.model_sampling.ModelSamplingCosmosRFlow))


def expected_cond_dims(model: comfy.model_base.BaseModel) -> dict[str, int]:
    """Widths the model expects of cached conditioning: cross_attn [.., D] and pooled_output [D]."""
    config = model.model_config.unet_config
    dims = {}
    # Lumina 2 / Z-Image: cap_feat_dim. Qwen-Image: joint_attention_dim, which its detection leaves to the class
    # default (3584, Qwen2.5-VL-7B's width); neither has a pooled vector.
    # Wan: text_dim, also left to the class default (4096, UMT5-XXL's). Krea 2: a stack of txtlayers encoder layers
    # of txtdim each, flattened into one vector per token. Ideogram 4: llm_features_dim (13 Qwen3-VL-8B layers of 4096
    # side by side), set by its config's unet_extra_config.
    context = (config.get("context_dim") or config.get("context_in_dim") or config.get("cap_feat_dim")
               or _constructor_value(model.diffusion_model, config, "joint_attention_dim")
               or _constructor_value(model.diffusion_model, config, "text_dim")
               or config.get("llm_features_dim")
               or _ltx2_text_width(model.diffusion_model, config)
               or _layer_stack_width(model.diffusion_model, config))
    if context is None and isinstance(config.get("context_embedder_config"), dict):
        context = config["context_embedder_config"].get("params", {}).get("in_features")
    if context:
        dims["cross_attn"] = int(context)
    pooled = config.get("adm_in_channels") or config.get("vec_in_dim")
    if pooled and isinstance(model, (comfy.model_base.SD3, comfy.model_base.Flux)):
        dims["pooled_output"] = int(pooled)
    return dims


def _ltx2_text_width(module: torch.nn.Module, config: dict) -> int | None:
    """LTX-2's text width: its Gemma projection's (caption_channels, 3840), which the DiT's own connectors take. Not for
    LTX-2.3-style models that project text before the connectors (caption_proj_before_connector): their encoder's
    video + audio projections set the width, which the config does not name."""
    if _constructor_value(module, config, "caption_proj_before_connector") is not False:
        return None
    return _constructor_value(module, config, "caption_channels")


def _layer_stack_width(module: torch.nn.Module, config: dict) -> int | None:
    """The text width of a model conditioned on several encoder layers flattened per token (Krea 2: txtlayers x
    txtdim, which its txtfusion adapter unpacks), or None."""
    layers = _constructor_value(module, config, "txtlayers")
    width = _constructor_value(module, config, "txtdim")
    return int(layers) * int(width) if layers and width else None


def _constructor_value(module: torch.nn.Module, config: dict, name: str):
    """A constructor argument of the diffusion model: from its unet_config, else its class's default (None: neither)."""
    if name in config:
        return config[name]
    parameter = inspect.signature(type(module).__init__).parameters.get(name)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


# ComfyUI model classes no LoRA can be trained on, and why (check_trainable: at Init, before any work).
UNTRAINABLE = {
    "PixelDiTT2I": "ComfyUI's PixelDiT blocks modulate and update their activations in place (comfy/ldm/pixeldit: "
                   "apply_adaln_, addcmul_), which autograd cannot differentiate, so no step could run",
}
# ComfyUI model classes that take inputs a run's caches do not hold yet: what is missing, and what the run trains then
# (missing_inputs_note: shown on the Init node before training). Matched by the class itself, not its subclasses.
MISSING_INPUTS = {
    "Kandinsky5": "its image-to-video checkpoints take a start image (the stock Kandinsky5ImageToVideo node's "
                  "time_dim_replace / concat_mask), which the caches do not hold: this run trains text-to-video, on "
                  "single frames (clips need a family module); use a text-to-video checkpoint",
    "WAN22_S2V": "it takes audio (audio_embed) and a reference image, which the caches do not hold: this run trains "
                 "it on text alone; expect the LoRA not to follow audio",
    "WAN21_HuMo": "it takes audio (audio_embed) and reference images, which the caches do not hold: this run trains "
                  "it on text alone; expect the LoRA not to follow audio",
    "WAN22_Animate": "it takes a pose video and a face video, which the caches do not hold: this run trains it on text "
                     "alone; expect the LoRA not to follow poses",
}


def _model_class(model: comfy.model_base.BaseModel) -> str:
    """The ComfyUI model class (comfy.supported_models) a MODEL was loaded as, e.g. "Kandinsky5"."""
    return type(getattr(model, "model_config", None)).__name__


def check_trainable(model: comfy.model_base.BaseModel) -> None:
    """A MODEL whose class cannot train -> a ValueError saying why, before any work."""
    for untrainable, why in UNTRAINABLE.items():
        base = getattr(comfy.model_base, untrainable, None)  # the model_base class of the same name: its subclasses too
        if _model_class(model) == untrainable or (base is not None and isinstance(model, base)):
            raise ValueError(f"this MODEL ({_model_class(model)}) cannot train a LoRA: {why}; train another model")


# Adapter kinds that cannot wrap ComfyUI's quantized layers, and why (check_quantized_kind: at Init, before any work).
# lora / dora (peft's LoRA layers call the base layer and read its weight through peft's dequantize hook, which hands
# back the QuantizedTensor: its ops dequantize), oft (rotates the base layer's output) and full (reads the base
# dequantized: run_lora.patched_base_reader) train on them.
QUANTIZED_UNSUPPORTED = {
    "loha": "peft's LoHa layers take torch Linear / Conv layers only",
    "lokr": "peft's LoKr layers take torch Linear / Conv layers only",
}


def check_quantized_kind(model: comfy.model_base.BaseModel, kind: str) -> None:
    """A MODEL with ComfyUI's quantized layers and an adapter kind that cannot wrap them -> a ValueError naming the
    layer and what to do, before any work."""
    quantized = quantized_layers(model) if kind in QUANTIZED_UNSUPPORTED else []
    if quantized:
        raise ValueError(
            f"this MODEL's layers hold ComfyUI's quantized weights ({len(quantized)} layers, e.g. {quantized[0]}: a "
            f"scaled fp8 / int8 / nvfp4 file), and LoRA Config (Headroom) kind {kind} cannot train on them "
            f"({QUANTIZED_UNSUPPORTED[kind]}): choose kind lora, dora, oft or full, or load the model from a bf16 / "
            "fp16 / fp32 file")


def quantized_layers(model: comfy.model_base.BaseModel) -> list[str]:
    """Paths of the diffusion model's layers whose weight is ComfyUI's QuantizedTensor (comfy.ops mixed-precision
    layers, as the stock loaders build a scaled fp8 / int8 / nvfp4 file). Adapters train on them (adapters.is_linear);
    what cannot is refused by name (check_quantized_kind)."""
    return [path for path, module in model.diffusion_model.named_modules() if is_quantized_layer(module)]


def missing_inputs_note(model: comfy.model_base.BaseModel, node: str) -> str:
    """What an Init node says before training about inputs this MODEL's class takes that the caches do not hold
    ("" when none)."""
    name = _model_class(model)
    return f"{node}: {name}: {MISSING_INPUTS[name]}" if name in MISSING_INPUTS else ""


def check_caches(model: comfy.model_base.BaseModel, latent_cache, text_cache) -> None:
    """Wrong cache for this model -> a clear error, before any GPU work."""
    channels = model.latent_format.latent_channels
    if len(latent_cache) == 0:
        raise ValueError("the LATENT_CACHE holds no items")
    if int(latent_cache.latent_channels) != channels:
        raise ValueError(
            f"the LATENT_CACHE has {latent_cache.latent_channels}-channel latents but this "
            f"model denoises {channels}-channel latents: cache the images with this model's VAE"
        )
    clips = sorted(bucket[2] for bucket in getattr(latent_cache, "buckets", {}) if len(bucket) > 2)
    family = families.family_of(model)
    if clips and (family is None or family.frame_step is None):  # a Wan-VAE cache of clips for Qwen-Image, say
        raise ValueError(f"the LATENT_CACHE holds clips of up to {clips[-1]} frames but this model "
                         f"({type(model).__name__}) trains on images: cache the dataset with max_frames 1, or train a "
                         f"video model ({', '.join(n for n, f in families.FAMILIES.items() if f.frame_step)})")
    sample = item_conditioning(text_cache, latent_cache, 0)
    for name, width in expected_cond_dims(model).items():
        if name not in sample:
            raise ValueError(f"the TEXT_CACHE has no '{name}' but this model needs it: "
                             "cache the captions with this model's text encoder (CLIP)")
        if int(sample[name].shape[-1]) != width:
            raise ValueError(
                f"the TEXT_CACHE '{name}' is {sample[name].shape[-1]} wide but this model "
                f"expects {width}: cache the captions with this model's text encoder (CLIP)"
            )


def batchable_groups(per_item: list[dict]) -> list[list[int]]:
    """Items (their model conds) in groups ComfyUI can concatenate into one batch (every cond's `can_concat`)."""
    groups: list[list[int]] = []
    for i, conds in enumerate(per_item):
        for group in groups:
            first = per_item[group[0]]
            if first.keys() == conds.keys() and all(first[k].can_concat(conds[k]) for k in conds):
                group.append(i)
                break
        else:
            groups.append([i])
    return groups


def model_blocks(diffusion_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks: the elements of the model's top-level ModuleLists, plus a UNet's middle block. A model with
    no ModuleList of its own, built around a language model (HiDream-O1: its Qwen3-VL decoder's `language_model.layers`
    next to a vision tower's `visual.blocks`), has the largest ModuleList one level down (by parameters) as its blocks."""
    blocks = []
    for name, child in diffusion_model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            blocks += [(f"{name}.{i}", block) for i, block in enumerate(child)]
        elif name == "middle_block":
            blocks.append((name, child))
    if not blocks:
        nested = [(f"{name}.{inner}", grandchild) for name, child in diffusion_model.named_children()
                  for inner, grandchild in child.named_children() if isinstance(grandchild, torch.nn.ModuleList)]
        if nested:
            name, largest = max(nested, key=lambda item: sum(p.numel() for p in item[1].parameters()))
            blocks = [(f"{name}.{i}", block) for i, block in enumerate(largest)]
    return blocks


def training_blocks(diffusion_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks as the model actually *calls* them: `model_blocks`, with sequential containers
    replaced by their layers. ComfyUI's UNet runs a TimestepEmbedSequential through
    `forward_timestep_embed(block, ...)`, which calls each layer but never the block itself, so hooks or
    checkpoint wrappers on the block would never run; on its layers they do."""
    blocks = []
    for name, block in model_blocks(diffusion_model):
        if isinstance(block, torch.nn.Sequential):
            blocks += [(f"{name}.{child_name}", child) for child_name, child in block.named_children()]
        else:
            blocks.append((name, block))
    return blocks


def comfy_pinned_block_keys(patcher) -> list[str]:
    """The keys of the block weights ComfyUI's offload pinned in host RAM (its patcher's own record)."""
    pinned = getattr(patcher, "pinned", None) or ()
    blocks = tuple(f"diffusion_model.{name}." for name, _ in training_blocks(patcher.model.diffusion_model))
    return sorted(key for key in pinned if key.startswith(blocks))


def comfy_pinned_block_bytes(patcher) -> int:
    """Their bytes, as ComfyUI counts them (the pinned tensor's nbytes)."""
    return sum(comfy.utils.get_attr(patcher.model, key).nbytes for key in comfy_pinned_block_keys(patcher))


def made_in_inference_mode(tensor: torch.Tensor) -> bool:
    """Whether autograd would refuse to save this tensor: an inference tensor, or a Parameter made under inference
    mode whose data a later `module.to(...)` replaced outside it. Module.to keeps the Parameter object and sets its
    `.data` (torch's set_data path for CPU -> CUDA and dtype moves), so `is_inference()` turns False while the
    Parameter still has no version counter: "Inference tensors do not track version counter" at the first backward
    (seen on an H200, where ComfyUI's load moves every weight; on the CPU nothing moves)."""
    if tensor.is_inference():
        return True
    try:
        tensor._version
    except RuntimeError:
        return True
    return False


def replace_inference_tensors(module: torch.nn.Module, patcher=None, key_prefix: str = "diffusion_model.") -> None:
    """Give weights made under inference mode (ComfyUI's loaders run there) normal storage, same values.

    Autograd cannot save inference tensors for backward, and a frozen Linear's weight is saved to get the
    gradient of its input. A load to the GPU keeps the loader's Parameter objects and swaps their data
    (made_in_inference_mode); on the CPU they are the loader's tensors themselves. Either way they are cloned
    once here, the way ComfyUI's own weight patching swaps parameters (comfy.utils.set_attr_param).

    `patcher`: the ComfyUI ModelPatcher whose diffusion_model `module` is (`key_prefix` its weights' keys there: ""
    for a CLIP's patcher, whose model is the module). Weights it pinned in host RAM (its partial load registers their
    memory with CUDA) are unpinned before their clone and the clone pinned again: freeing memory still registered
    broke every later CUDA call of the process ("resource already mapped").

    One tensor at a time, holding only names: the replaced tensor is freed before the next is cloned, so the
    weights never exist twice (a list of the parameters themselves kept every old one alive to the end:
    +4.8 GiB for SDXL, +24 GB for Flux-dev).
    """
    pinned = patcher.pinned if patcher is not None else set()
    with torch.inference_mode(False):
        names = [(name, True) for name, param in module.named_parameters() if made_in_inference_mode(param)]
        names += [(name, False) for name, buffer in module.named_buffers() if made_in_inference_mode(buffer)]
        for name, is_parameter in names:
            key = key_prefix + name
            was_pinned = key in pinned
            if was_pinned:
                patcher.unpin_weight(key)
            old = comfy.utils.get_attr(module, name)
            if is_parameter:
                comfy.utils.set_attr_param(module, name, old.detach().clone())
            else:
                comfy.utils.set_attr(module, name, old.clone())
            del old
            if was_pinned:
                patcher.pin_weight_to_device(key)


def quantized_weights_for_inference(module: torch.nn.Module, patcher=None) -> None:
    """Give ComfyUI's quantized weights (QuantizedTensor parameters) back as inference tensors, same values, before
    ComfyUI's own code runs on the module under inference mode again (its samplers, every stock node).

    Why: training needs them as normal tensors (replace_inference_tensors; a load outside inference mode clones them
    too: comfy.ops._quantized_apply), but ComfyUI's `module.to(...)` under inference mode, which every load and
    unload calls, re-wraps each QuantizedTensor parameter as torch.nn.Parameter, and that fails for a normal one
    ("Cannot set version_counter for inference tensor"): after a training step the stock KSampler could not load
    the MODEL. One tensor at a time (never the weights twice), unpinning and pinning as replace_inference_tensors."""
    pinned = patcher.pinned if patcher is not None else set()
    with torch.inference_mode():
        names = [name for name, param in module.named_parameters() if is_quantized_tensor(param)
                 and not param.is_inference()]
        for name in names:
            key = f"diffusion_model.{name}"
            was_pinned = key in pinned
            if was_pinned:
                patcher.unpin_weight(key)
            old = comfy.utils.get_attr(module, name)
            comfy.utils.set_attr_param(module, name, old.clone())  # detach() of a normal one fails here too
            del old
            if was_pinned:
                patcher.pin_weight_to_device(key)


def data_fingerprint(latent_cache) -> str:
    """Which items a run trains on: their captions and bucket sizes, in order, and how often an item repeats per epoch
    where it does (kohya-style repeat folders; items without are as before, so earlier runs resume); cache
    fingerprints name the encoders."""
    bucket_of = {i: list(bucket) for bucket, indices in latent_cache.buckets.items() for i in indices}
    repeats = [latent_cache.repeats(i) for i in range(len(latent_cache))]
    items = [[latent_cache.text_key(i), bucket_of[i], *([repeats[i]] if repeats[i] != 1 else [])]
             for i in range(len(latent_cache))]
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def base_fingerprint(patcher) -> str:
    """The frozen weights a MODEL trains with: its unpatched weights plus its own weight patches (LoRAs loaded
    before training). While another clone is loaded its patches are merged into the shared module; ComfyUI's
    backups (shared by all clones) then hold the unpatched values."""
    state = dict(patcher.model.diffusion_model.state_dict())
    for key, backup in patcher.backup.items():
        if key.startswith("diffusion_model."):
            state[key[len("diffusion_model."):]] = backup.weight
    combined = fingerprint_state_dict(state) + fingerprint_value(patcher.patches)
    return hashlib.sha256(combined.encode()).hexdigest()


# --- conditioning -> model inputs ------------------------------------------------------------------------
REFERENCE_LATENTS = "reference_latents"  # the conditioning entry ComfyUI's ReferenceLatent node appends to
# Suffix of the cached flag that marks an entry the text encoder gave without a batch dimension (caching.py)
AS_GIVEN = ":as_given"
FRAME_RATE = "frame_rate"  # the clip's frames per second, where LTXVConditioning sets it (nodes/bridge/video.py)


def model_inputs(model: comfy.model_base.BaseModel, cond: dict, noise: torch.Tensor, device) -> dict:
    """The model's inputs (`extra_conds`) for one item's conditioning, as the samplers make them: cached tensors get
    their batch dimension back; `reference_latents` is a list of unbatched VAE latents (as VAE Encode gives them,
    not process_in'ed), passed on as the list of [1, C, h, w] ReferenceLatent appends; a 0-d bool is an encoder's flag
    (LTX-2's unprocessed_ltxav_embeds), passed on as the bool it was."""
    as_given = {name[:-len(AS_GIVEN)] for name in cond if name.endswith(AS_GIVEN)}
    params = {}
    for name, value in cond.items():
        if not torch.is_tensor(value) or name.endswith(AS_GIVEN):
            continue
        if value.dtype == torch.bool and value.ndim == 0:  # cached flags (caching.py)
            params[name] = value.item()
        else:  # the batch dimension caching took off, except where the encoder gave the entry without one
            params[name] = value.to(device) if name in as_given else value.unsqueeze(0).to(device)
    if REFERENCE_LATENTS in cond:
        params[REFERENCE_LATENTS] = [latent.unsqueeze(0).to(device) for latent in cond[REFERENCE_LATENTS]]
    if cond.get(FRAME_RATE) is not None:  # a float (an item's clip rate): a constant cond, batches split by it
        params[FRAME_RATE] = float(cond[FRAME_RATE])
    downscale = model.latent_format.spacial_downscale_ratio  # image px per latent px (8; Flux.2: 16)
    # latent_shapes: what the samplers give every model for an unpacked latent (one stream); models that pack several
    # (LTX-2's video + audio) read the streams from it.
    params.update(device=device, noise=noise, width=noise.shape[-1] * downscale, height=noise.shape[-2] * downscale,
                  prompt_type="positive", latent_shapes=[noise.shape])
    # ComfyUI's encoders always give pooled_output, None where they have none; HunyuanVideo's encode_adm reads it.
    params.setdefault("pooled_output", None)
    return model.extra_conds(**params)


def reference_inputs(model: comfy.model_base.BaseModel, cond: dict, latent: torch.Tensor) -> list[str]:
    """The model inputs `extra_conds` makes of reference latents (e.g. Flux / Kontext, Flux.2, Qwen-Image-Edit:
    ref_latents); empty when the model takes none. Asked of the model itself, with one cached item's conditioning
    and latent [C, h, w] as its own reference: no list of families."""
    noise = latent.unsqueeze(0).float()
    with torch.no_grad():
        without = model_inputs(model, cond, noise, noise.device)
        with_reference = model_inputs(model, {**cond, REFERENCE_LATENTS: [latent.float()]}, noise, noise.device)
    return sorted(set(with_reference) - set(without))


def check_reference_cache(model: comfy.model_base.BaseModel, latent_cache, text_cache) -> list[str]:
    """A run that passes every item's cached control latents as its reference: the cache must hold them for every
    item, and the model must take reference latents. Returns the model inputs they become; otherwise a ValueError
    saying what to do."""
    kind = getattr(latent_cache, "control_kind", None)
    if kind is None:
        raise ValueError("the LATENT_CACHE has no control images to use as references: give the dataset each "
                         "target's reference image as its control image (Dataset from Images' control_images, or "
                         "Dataset from Folder's control_folder) and cache it with Cache Latents' control_encoding "
                         "'latents'")
    if kind != "latents":
        raise ValueError(f"the LATENT_CACHE holds its control images as {kind}, not VAE latents: set Cache Latents' "
                         "control_encoding to 'latents'")
    missing = [i for i in range(len(latent_cache)) if not latent_cache.has_control(i)]
    if missing:
        raise ValueError(f"{len(missing)} cached item(s) have no reference (control) image, e.g. "
                         f"{latent_cache.name(missing[0])}: give every item one")
    inputs = reference_inputs(model, item_conditioning(text_cache, latent_cache, 0), latent_cache.control(0))
    if not inputs:
        raise ValueError(f"this MODEL ({type(model).__name__}) takes no reference latents (its extra_conds ignores "
                         "ReferenceLatent's reference_latents): train an edit / reference model (e.g. Flux.1 "
                         "Kontext, Flux.2, Qwen-Image-Edit), or set reference to 'none'")
    return inputs


# --- models ComfyUI runs for inference only ---------------------------------------------------------------
class _OutOfPlaceLlamaBlock(comfy.text_encoders.llama.TransformerBlock):
    """ComfyUI's Llama-style decoder layer (comfy/text_encoders/llama.py TransformerBlock) with its last residual added
    out of place while autograd records: the stock forward writes it into the layer's input (`torch.add(residual, x,
    out=output)`), which autograd refuses ("functions with out=... arguments don't support automatic differentiation")
    whenever a LoRA makes anything in the layer require grad. The same additions in the same order: the same values.
    Without grad (sampling) the stock forward runs as it is. HiDream-O1's denoiser is such a decoder
    (comfy/ldm/hidream_o1: Qwen3-VL-8B's layers over text and image tokens)."""

    def forward(self, x, attention_mask=None, freqs_cis=None, optimized_attention=None, past_key_value=None):
        if not torch.is_grad_enabled():
            return super().forward(x, attention_mask=attention_mask, freqs_cis=freqs_cis,
                                   optimized_attention=optimized_attention, past_key_value=past_key_value)
        attended, present_key_value = self.self_attn(hidden_states=self.input_layernorm(x), attention_mask=attention_mask,
                                                     freqs_cis=freqs_cis, optimized_attention=optimized_attention,
                                                     past_key_value=past_key_value)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), present_key_value


class _OutOfPlaceCLIPLayer(comfy.clip_model.CLIPLayer):
    """ComfyUI's CLIP encoder layer (comfy/clip_model.py CLIPLayer) with its residuals added out of place while autograd
    records: the stock forward adds them into the layer's input (`x += ...`), which the layer norm before it saved for
    backward ("modified by an inplace operation"). The same additions in the same order: the same values. Without
    grad (CLIP Text Encode, sampling) the stock forward runs as it is. A text-encoder LoRA trains through it
    (text_encoder_lora)."""

    def forward(self, x, mask=None, optimized_attention=None):
        if not torch.is_grad_enabled():
            return super().forward(x, mask, optimized_attention)
        x = x + self.self_attn(self.layer_norm1(x), mask, optimized_attention)
        return x + self.mlp(self.layer_norm2(x))


# ComfyUI's layers whose stock forward autograd cannot differentiate -> the same layer with one it can
_TRAINABLE_LAYERS = {comfy.text_encoders.llama.TransformerBlock: _OutOfPlaceLlamaBlock,
                     comfy.clip_model.CLIPLayer: _OutOfPlaceCLIPLayer}


def make_trainable(root: torch.nn.Module) -> None:
    """Give layers whose stock forward autograd cannot differentiate a forward it can, same values (_TRAINABLE_LAYERS:
    the Llama-style decoder layers of a diffusion model, a CLIP's encoder layers; their class is swapped in place, so
    ComfyUI's samplers, hooks and checkpoint wrappers see the same modules)."""
    for module in root.modules():
        trainable = _TRAINABLE_LAYERS.get(type(module))
        if trainable is not None:
            module.__class__ = trainable


def restore_stock_forwards(root: torch.nn.Module) -> None:
    """Undo make_trainable (the planner's measurement leaves the MODEL as it found it, a text-encoder LoRA the CLIP)."""
    stock = {trainable: layer for layer, trainable in _TRAINABLE_LAYERS.items()}
    for module in root.modules():
        layer = stock.get(type(module))
        if layer is not None:
            module.__class__ = layer


def clear_model_caches(diffusion_model: torch.nn.Module) -> None:
    """Forget what the model caches across sampler steps keyed by the prompt alone, not by its weights (HiDream-O1's
    text-prefix K/V, `clear_kv_cache`): a training step or a new LoRA changes those weights, and a cached K/V would
    also hold the previous step's autograd graph."""
    clear = getattr(diffusion_model, "clear_kv_cache", None)
    if callable(clear):
        clear()


# --- the denoiser -----------------------------------------------------------------------------------------
class ComfyDenoiser:
    """The engine's Denoiser over a ComfyUI ModelPatcher (the training clone)."""

    def __init__(self, patcher):
        # Some ComfyUI models (ErnieImage, JoyImage, Cosmos Predict2, Anima) call comfy_kitchen's RoPE ops, which have
        # no backward of their own, even while training: give them one (nodes/bridge/rope_autograd.py).
        register_rope_autograd()
        self.patcher = patcher
        self.model: comfy.model_base.BaseModel = patcher.model
        # The patcher's model_sampling: a stock ModelSampling* node (SD3 / Flux shift, EDM, v-prediction) object-patches
        # it, and the samplers use the patched one; the module's own attribute is the unpatched default.
        model_sampling = patcher.get_model_object("model_sampling")
        self.sampling = sampling_descriptor(model_sampling)
        self.edm_flow = is_edm_flow(model_sampling)
        self.device = torch.device(patcher.load_device)
        # Blocks that add into their inputs in place (Flux's `img += ...`): see training/memory/checkpointing.py.
        self.inplace_blocks = families.inplace_blocks(self.model)
        make_trainable(self.model.diffusion_model)

    def to_model_latent(self, latents: torch.Tensor) -> torch.Tensor:
        return self.model.process_latent_in(latents)

    def _model_conds(self, x_t: torch.Tensor, conds) -> dict:
        return comfy.samplers.cond_cat(self._item_conds(x_t, conds))

    def _item_conds(self, x_t: torch.Tensor, conds) -> list[dict]:
        per_item = []
        for i, cond in enumerate(conds):
            model_conds = model_inputs(self.model, cond, x_t[i:i + 1], self.device)
            per_item.append({k: v.process_cond(batch_size=1, area=None) for k, v in model_conds.items()})
        return per_item

    def comfy_input(self, x_t: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (input, sigma) ComfyUI's apply_model takes for the engine's x_t at noise level sigma: the same, except
        for rectified flow under EDM sigmas (is_edm_flow), where the flow time t is ComfyUI's sigma t / (1 - t) and
        its input is x_t * (1 + sigma): COSMOS_RFLOW.calculate_input divides that back to x_t, and the model sees
        timestep sigma / (1 + sigma) = t."""
        if not self.edm_flow:
            return x_t, sigma
        comfy_sigma = sigma / (1.0 - sigma)
        scale = (1.0 + comfy_sigma).view(-1, *([1] * (x_t.ndim - 1))).to(x_t)
        return x_t * scale, comfy_sigma

    def predict(self, x_t: torch.Tensor, sigma: torch.Tensor, conds) -> torch.Tensor:
        x_t, sigma = self.comfy_input(x_t, sigma)
        clear_model_caches(self.model.diffusion_model)  # every step sees its own weights
        try:
            return self.grouped_forward(x_t, sigma, self._item_conds(x_t, conds),
                                        lambda index, x, s, cond: self.model.apply_model(x, s, transformer_options={},
                                                                                         **cond))
        finally:
            clear_model_caches(self.model.diffusion_model)

    @staticmethod
    def grouped_forward(x_t: torch.Tensor, sigma: torch.Tensor, per_item: list[dict], forward) -> torch.Tensor:
        """forward(item indices or None, x_t, sigma, batched conds) over the batch, in item order."""
        groups = batchable_groups(per_item)
        if len(groups) == 1:
            return forward(None, x_t, sigma, comfy.samplers.cond_cat(per_item))
        # Conditioning ComfyUI cannot batch (text of different lengths where the model takes it as it is, e.g. an
        # unpadded T5 for Chroma): one forward per group, as ComfyUI's sampler runs such conds apart.
        outputs, order = [], []
        for group in groups:
            index = torch.tensor(group, device=x_t.device)
            part_sigma = sigma.index_select(0, index.to(sigma.device)) if sigma.ndim and sigma.shape[0] == len(per_item) else sigma
            outputs.append(forward(index, x_t.index_select(0, index), part_sigma,
                                   comfy.samplers.cond_cat([per_item[i] for i in group])))
            order += group
        inverse = torch.argsort(torch.tensor(order, device=x_t.device))
        return torch.cat(outputs).index_select(0, inverse)

    def blocks(self) -> list[tuple[str, torch.nn.Module]]:
        return training_blocks(self.model.diffusion_model)  # what checkpointing wraps: blocks that get called
