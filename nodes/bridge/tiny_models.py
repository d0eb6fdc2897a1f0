"""Built-in tiny models: real ComfyUI MODEL / CLIP / VAE objects small enough for a CPU.

They are built through ComfyUI's own classes (`comfy.supported_models`, `model_base`, `ModelPatcher`,
`comfy.sd.CLIP`, `comfy.sd.VAE`) with small configs and seeded random weights, so every code path the
real SD1.5 / SD3 / Flux models take (model_sampling, extra_conds, LoRA key maps, samplers) is exercised
without downloading anything. The text encoders use ComfyUI's shipped tokenizers; their size is set
through ComfyUI's own `<name>_model_config` model option. What each family's tiny model is lives in its registry
module (`Family.tiny`, nodes/bridge/families/<family>.py); this module builds and seeds it.

Each patcher gets a `cached_patcher_init` factory, as ComfyUI's loaders register in comfy/sd.py: core
code (ComfyUI's own TrainLoraNode, multi-GPU clones) deep-clones a MODEL by calling it.
"""
from __future__ import annotations

import functools
import math
import pathlib

import torch

import comfy.model_management as mm
import comfy.model_patcher
import comfy.sd
import comfy.utils
from comfy.ldm.modules.diffusionmodules.mmdit import get_2d_sincos_pos_embed

from . import families as family_registry


def _tiny_models() -> dict:
    """tiny model name -> (family name, TinyModel): each family's `tiny` under the family's name, then its
    `tiny_variants` under theirs, in registry order."""
    found = {}
    for name, family in family_registry.FAMILIES.items():
        for tiny_name, spec in ([(name, family.tiny)] if family.tiny is not None else []) + list(family.tiny_variants.items()):
            if tiny_name in found or (tiny_name != name and tiny_name in family_registry.FAMILIES):
                raise ImportError(f"nodes/bridge/families/{name}.py: tiny model name {tiny_name!r} is already taken")
            found[tiny_name] = (name, spec)
    return found


TINY_MODELS = _tiny_models()
# The tiny models HeadroomTinyModel builds (its `family` choices): the families with one, and their variants
# (a family module's `tiny` / `tiny_variants`: nodes/bridge/families/<family>.py).
FAMILIES = tuple(TINY_MODELS)
WEIGHTS = ("random", "pretrained")
# Pretrained weights shipped in the package (workflows/pretrain_tiny.py writes them): one checkpoint-style file
# per family (model.diffusion_model. / cond_stage_model. / first_stage_model.), fp16.
WEIGHTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "weights"
PRETRAINED_FILES = {"sd15": WEIGHTS_DIR / "tiny_sd15_shapes.safetensors"}
NODE = "Tiny Model (Headroom)"  # the display name of the node (nodes/tiny.py), for messages


def tiny_spec(family: str):
    """The `TinyModel` of a tiny model name (nodes/bridge/families/base.py), or a ValueError naming the ones there are."""
    if family not in TINY_MODELS:
        raise ValueError(f"{NODE}: unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    return TINY_MODELS[family][1]


def tiny_family(name: str) -> str:
    """The registry family a tiny model belongs to (flux2_dev -> flux2)."""
    tiny_spec(name)
    return TINY_MODELS[name][0]


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm)) or "Norm" in type(module).__name__


@torch.no_grad()
def init_weights_(module: torch.nn.Module, seed: int) -> None:
    """Seeded init of every parameter. ComfyUI's ops skip torch's init (weights normally come from a
    file), so without this the tensors would hold whatever memory was there."""
    generator = torch.Generator().manual_seed(seed)
    for module_name, sub in module.named_modules():
        for name, param in sub.named_parameters(recurse=False):
            if param.numel() == 1 and name != "weight":
                continue  # scalars such as CLIP's logit_scale keep their constructor value
            if _is_norm(sub):
                value = torch.ones(param.shape) if name == "weight" else torch.zeros(param.shape)
            elif name == "bias" or param.ndim < 2:
                value = torch.randn(param.shape, generator=generator) * 0.02 if param.ndim == 1 else torch.zeros(param.shape)
            else:
                fan_in = math.prod(param.shape[1:]) if param.ndim > 1 else param.shape[0]
                std = 0.02 if isinstance(sub, torch.nn.Embedding) else 1.0 / math.sqrt(fan_in)
                value = torch.randn(param.shape, generator=generator) * std
            param.copy_(value.to(param.dtype))
    pos_embed = getattr(module, "pos_embed", None)
    if isinstance(pos_embed, torch.Tensor) and not isinstance(pos_embed, torch.nn.Parameter):
        # MMDiT keeps its fixed sin-cos position table as a buffer that checkpoints fill in.
        grid = int(math.isqrt(pos_embed.shape[1]))
        table = torch.from_numpy(get_2d_sincos_pos_embed(pos_embed.shape[2], grid))
        pos_embed.copy_(table.reshape(pos_embed.shape).to(pos_embed.dtype))


def _check_weights(family: str, weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"{NODE}: weights={weights!r}; choose one of {', '.join(WEIGHTS)}")
    if weights == "pretrained" and family not in PRETRAINED_FILES:
        raise ValueError(f"{NODE}: weights='pretrained' exists for the {', '.join(PRETRAINED_FILES)} family "
                         f"only, not {family!r}; use weights='random' for {family}")


@functools.lru_cache(maxsize=4)
def _pretrained_file(family: str) -> dict:
    path = PRETRAINED_FILES[family]
    if not path.is_file():
        raise FileNotFoundError(f"{NODE}: the pretrained weights {path} are missing; regenerate them with "
                                "`python workflows/pretrain_tiny.py` (or use weights='random')")
    # Copied out of the file's memory map (7 MB): kept mapped for the process, Windows would refuse to replace the
    # file while ComfyUI runs, and an update of the pack (ComfyUI-Manager's git pull) that changes it would fail.
    return {key: tensor.clone() for key, tensor in comfy.utils.load_torch_file(str(path), safe_load=True).items()}


def pretrained_state_dict(family: str, prefix: str) -> dict:
    """One part (checkpoint prefix) of the shipped pretrained file, prefix kept; a fresh dict of the same tensors."""
    return {k: v for k, v in _pretrained_file(family).items() if k.startswith(prefix)}


def _check_loaded(part: str, expected: set, got: set) -> None:
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise RuntimeError(f"{NODE}: the pretrained {part} does not match the tiny model "
                           f"(missing {missing[:3]}, unexpected {unexpected[:3]}); regenerate it with "
                           "workflows/pretrain_tiny.py")


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_tiny_model_patcher(family: str, seed: int = 0, weights: str = "random", disable_dynamic: bool = False):
    """The MODEL of a tiny family; also the `cached_patcher_init` factory of that MODEL."""
    _check_weights(family, weights)
    config = tiny_spec(family).model_config()
    load_device = mm.get_torch_device()
    unet_dtype = mm.unet_dtype(model_params=0, supported_dtypes=list(config.supported_inference_dtypes))
    manual_cast = mm.unet_manual_cast(unet_dtype, load_device, config.supported_inference_dtypes)
    config.set_inference_dtype(unet_dtype, manual_cast, device=load_device)
    model = config.get_model({}, "", device=mm.unet_offload_device())
    init_weights_(model.diffusion_model, seed)
    if weights == "pretrained":
        # ComfyUI's checkpoint path for the UNet part (load_checkpoint_guess_config does the same).
        sd = pretrained_state_dict(family, "model.diffusion_model.")
        _check_loaded("UNet", set(model.diffusion_model.state_dict()), {k.split(".", 2)[2] for k in sd})
        model.load_model_weights(sd, "model.diffusion_model.")
    patcher_class = comfy.model_patcher.ModelPatcher if disable_dynamic else comfy.model_patcher.CoreModelPatcher
    patcher = patcher_class(model, load_device=load_device, offload_device=mm.unet_offload_device())
    patcher.cached_patcher_init = (build_tiny_model_patcher, (family, seed, weights))
    return patcher


def build_tiny_clip(family: str, seed: int = 0, weights: str = "random", disable_dynamic: bool = False) -> comfy.sd.CLIP:
    _check_weights(family, weights)
    spec = tiny_spec(family)
    clip = comfy.sd.CLIP(spec.clip_target(), parameters=0, model_options=dict(spec.text_encoder_options),
                         tokenizer_data=spec.tokenizer_data() if spec.tokenizer_data is not None else {},
                         disable_dynamic=disable_dynamic)
    init_weights_(clip.cond_stage_model, seed + 1)
    if weights == "pretrained":
        sd = comfy.utils.state_dict_prefix_replace(pretrained_state_dict(family, "cond_stage_model."),
                                                   {"cond_stage_model.": ""}, filter_keys=True)
        _check_loaded("text encoder", set(clip.cond_stage_model.state_dict()), set(sd))
        clip.load_sd(sd, full_model=True)  # ComfyUI's CLIP loading path
    clip.patcher.cached_patcher_init = (_tiny_clip_patcher, (family, seed, weights))
    return clip


def _tiny_clip_patcher(family: str, seed: int = 0, weights: str = "random", disable_dynamic: bool = False):
    return build_tiny_clip(family, seed, weights, disable_dynamic=disable_dynamic).patcher


def build_tiny_vae(family: str, seed: int = 0, weights: str = "random") -> comfy.sd.VAE:
    _check_weights(family, weights)
    spec = tiny_spec(family)
    reference, config = spec.vae_module()
    init_weights_(reference, seed + 2)
    sd = reference.state_dict()
    if weights == "pretrained":
        sd = comfy.utils.state_dict_prefix_replace(pretrained_state_dict(family, "first_stage_model."),
                                                   {"first_stage_model.": ""}, filter_keys=True)
        _check_loaded("VAE", set(reference.state_dict()), set(sd))
    # Through ComfyUI's VAE class and its load path: `config` picks the architecture (None: detected from the
    # state dict, as the VAELoader does), `sd` the weights.
    vae = (spec.vae_class or comfy.sd.VAE)(sd=sd, config=config)
    vae.latent_channels = spec.latent_channels
    vae.patcher.cached_patcher_init = (_tiny_vae_patcher, (family, seed, weights))
    return vae


def _tiny_vae_patcher(family: str, seed: int = 0, weights: str = "random", disable_dynamic: bool = False):
    return build_tiny_vae(family, seed, weights).patcher


def build_tiny_models(family: str, seed: int = 0, weights: str = "random"):
    """(MODEL patcher, CLIP, VAE) of a tiny family: seeded random weights, or the shipped pretrained ones."""
    tiny_spec(family)
    _check_weights(family, weights)
    return (build_tiny_model_patcher(family, seed, weights), build_tiny_clip(family, seed, weights),
            build_tiny_vae(family, seed, weights))
