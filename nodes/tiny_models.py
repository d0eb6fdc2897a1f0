"""Built-in tiny models: real ComfyUI MODEL / CLIP / VAE objects small enough for a CPU.

They are built through ComfyUI's own classes (`comfy.supported_models`, `model_base`, `ModelPatcher`,
`comfy.sd.CLIP`, `comfy.sd.VAE`) with small configs and seeded random weights, so every code path the
real SD1.5 / SD3 / Flux models take (model_sampling, extra_conds, LoRA key maps, samplers) is exercised
without downloading anything. The text encoders use ComfyUI's shipped tokenizers; their size is set
through ComfyUI's own `<name>_model_config` model option.

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
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.flux
import comfy.text_encoders.sd3_clip
import comfy.utils
from comfy.ldm.models.autoencoder import AutoencoderKL
from comfy.ldm.modules.diffusionmodules.mmdit import get_2d_sincos_pos_embed
from comfy_api.latest import io

FAMILIES = ("sd15", "sd3", "flux")
WEIGHTS = ("random", "pretrained")
# Pretrained weights shipped in the package (workflows/pretrain_tiny.py writes them): one checkpoint-style file
# per family (model.diffusion_model. / cond_stage_model. / first_stage_model.), fp16.
WEIGHTS_DIR = pathlib.Path(__file__).resolve().parent / "weights"
PRETRAINED_FILES = {"sd15": WEIGHTS_DIR / "tiny_sd15_shapes.safetensors"}

# Text encoders: ComfyUI's CLIP-L / CLIP-G / T5 classes, shrunk through their model_config options.
# Three CLIP layers: SD3 reads the penultimate layer (layer_idx -2), which needs more than two.
_CLIP_L = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
           "projection_dim": 32}
_CLIP_G = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
           "projection_dim": 32}
_T5 = {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 2, "d_kv": 16}

_UNET_SD15 = {
    "use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 32,
    "num_res_blocks": [1, 1], "channel_mult": [1, 2], "transformer_depth": [1, 1],
    "transformer_depth_output": [1, 1, 1, 1], "transformer_depth_middle": 1, "use_spatial_transformer": True,
    "legacy": False, "adm_in_channels": None, "context_dim": _CLIP_L["hidden_size"],
    "use_linear_in_transformer": False, "use_temporal_attention": False, "use_temporal_resblock": False,
}
# SD3's MMDiT: hidden size is 64 * depth by construction. The joint text context is CLIP-L|CLIP-G padded
# to 4096 wide by ComfyUI's SD3 text encoder; the pooled vector is CLIP-L pooled + CLIP-G projection.
_MMDIT_SD3 = {
    "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2, "input_size": None,
    "adm_in_channels": _CLIP_L["hidden_size"] + _CLIP_G["projection_dim"],
    "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 128}},
    "num_patches": 32 * 32, "pos_embed_max_size": 32, "pos_embed_scaling_factor": None,
    "x_block_self_attn_layers": [],
}
# Flux's head geometry is the real one (one 128-wide head, RoPE axes [16, 56, 56], mlp_ratio 4): ComfyUI's
# Flux detection (used by the stock ControlNetLoader) fixes it and derives only the head count from the
# width, so a saved ControlNet of this tiny Flux loads back exactly; one head keeps the width at 128.
_DIT_FLUX = {
    "image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2,
    "vec_in_dim": _CLIP_L["hidden_size"], "context_in_dim": _T5["d_model"], "hidden_size": 128, "mlp_ratio": 4.0,
    "num_heads": 1, "depth": 1, "depth_single_blocks": 2, "axes_dim": [16, 56, 56], "theta": 10000,
    "qkv_bias": True, "guidance_embed": True, "txt_ids_dims": [],
}


def _vae_ddconfig(latent_channels: int) -> dict:
    # Same Encoder/Decoder as the SD / SD3 / Flux VAEs (8x downscale), with 32 base channels.
    return {"double_z": True, "z_channels": latent_channels, "resolution": 64, "in_channels": 3, "out_ch": 3,
            "ch": 32, "ch_mult": [1, 1, 2, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}


def _family_spec(family: str):
    """(model_config, clip_target, text-encoder model_options, latent channels) of a tiny family."""
    if family == "sd15":
        config = comfy.supported_models.SD15(dict(_UNET_SD15))
        clip_target = config.clip_target()
        te_options = {"clip_l_model_config": dict(_CLIP_L)}
        return config, clip_target, te_options, 4
    if family == "sd3":
        config = comfy.supported_models.SD3(dict(_MMDIT_SD3))
        clip_target = comfy.supported_models_base.ClipTarget(
            comfy.text_encoders.sd3_clip.SD3Tokenizer,
            comfy.text_encoders.sd3_clip.sd3_clip(clip_l=True, clip_g=True, t5=False),
        )
        te_options = {"clip_l_model_config": dict(_CLIP_L), "clip_g_model_config": dict(_CLIP_G)}
        return config, clip_target, te_options, 16
    if family == "flux":
        config = comfy.supported_models.Flux(dict(_DIT_FLUX))
        clip_target = comfy.supported_models_base.ClipTarget(
            comfy.text_encoders.flux.FluxTokenizer, comfy.text_encoders.flux.flux_clip()
        )
        te_options = {"clip_l_model_config": dict(_CLIP_L), "t5xxl_model_config": dict(_T5)}
        return config, clip_target, te_options, 16
    raise ValueError(f"HeadroomTinyModel: unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


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
        raise ValueError(f"HeadroomTinyModel: weights={weights!r}; choose one of {', '.join(WEIGHTS)}")
    if weights == "pretrained" and family not in PRETRAINED_FILES:
        raise ValueError(f"HeadroomTinyModel: weights='pretrained' exists for the {', '.join(PRETRAINED_FILES)} family "
                         f"only, not {family!r}; use weights='random' for {family}")


@functools.lru_cache(maxsize=4)
def _pretrained_file(family: str) -> dict:
    path = PRETRAINED_FILES[family]
    if not path.is_file():
        raise FileNotFoundError(f"HeadroomTinyModel: the pretrained weights {path} are missing; regenerate them with "
                                "`python workflows/pretrain_tiny.py` (or use weights='random')")
    return comfy.utils.load_torch_file(str(path), safe_load=True)


def pretrained_state_dict(family: str, prefix: str) -> dict:
    """One part (checkpoint prefix) of the shipped pretrained file, prefix kept; a fresh dict of the same tensors."""
    return {k: v for k, v in _pretrained_file(family).items() if k.startswith(prefix)}


def _check_loaded(part: str, expected: set, got: set) -> None:
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise RuntimeError(f"HeadroomTinyModel: the pretrained {part} does not match the tiny model "
                           f"(missing {missing[:3]}, unexpected {unexpected[:3]}); regenerate it with "
                           "workflows/pretrain_tiny.py")


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_tiny_model_patcher(family: str, seed: int = 0, weights: str = "random", disable_dynamic: bool = False):
    """The MODEL of a tiny family; also the `cached_patcher_init` factory of that MODEL."""
    _check_weights(family, weights)
    config, _, _, _ = _family_spec(family)
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
    _, clip_target, te_options, _ = _family_spec(family)
    clip = comfy.sd.CLIP(clip_target, parameters=0, model_options=te_options, disable_dynamic=disable_dynamic)
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
    _, _, _, latent_channels = _family_spec(family)
    params = {"ddconfig": _vae_ddconfig(latent_channels), "embed_dim": latent_channels}
    reference = AutoencoderKL(**params)
    init_weights_(reference, seed + 2)
    sd = reference.state_dict()
    if weights == "pretrained":
        sd = comfy.utils.state_dict_prefix_replace(pretrained_state_dict(family, "first_stage_model."),
                                                   {"first_stage_model.": ""}, filter_keys=True)
        _check_loaded("VAE", set(reference.state_dict()), set(sd))
    # Through ComfyUI's VAE class and its load path: `config` picks the architecture, `sd` the weights.
    vae = comfy.sd.VAE(sd=sd, config={"params": params})
    vae.latent_channels = latent_channels
    vae.patcher.cached_patcher_init = (_tiny_vae_patcher, (family, seed, weights))
    return vae


def _tiny_vae_patcher(family: str, seed: int = 0, weights: str = "random", disable_dynamic: bool = False):
    return build_tiny_vae(family, seed, weights).patcher


def build_tiny_models(family: str, seed: int = 0, weights: str = "random"):
    """(MODEL patcher, CLIP, VAE) of a tiny family: seeded random weights, or the shipped pretrained ones."""
    if family not in FAMILIES:
        raise ValueError(f"HeadroomTinyModel: unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    _check_weights(family, weights)
    return (build_tiny_model_patcher(family, seed, weights), build_tiny_clip(family, seed, weights),
            build_tiny_vae(family, seed, weights))


class HeadroomTinyModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="HeadroomTinyModel",
            display_name="Tiny Model (Headroom)",
            category="Headroom/models",
            description="A tiny model of a real ComfyUI family (SD1.5 UNet, SD3 MMDiT, Flux DiT) with its text "
            "encoders and VAE: for trying workflows and tests on a CPU, no download. Random weights, or (sd15) the "
            "shipped pretrained ones that draw the synthetic shapes at 64x64, every colour except green.",
            inputs=[
                io.Combo.Input("family", options=list(FAMILIES), default="sd15",
                               tooltip="sd15: eps UNet, 4-channel latents; sd3: MMDiT flow model; flux: "
                               "double/single-stream DiT with guidance input."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFF,
                             tooltip="Seed of the random weights (weights=random)."),
                # Appended last and optional: workflows saved before it existed keep working (random weights).
                io.Combo.Input("weights", options=list(WEIGHTS), default="random", optional=True,
                               tooltip="random: seeded random weights (draws noise). pretrained (sd15 only): the "
                               "shipped weights from workflows/pretrain_tiny.py, which draw 'a <colour> <shape> at "
                               "the <position>' at 64x64 in every synthetic colour except green (held out for the "
                               "demo's LoRA to teach); seed is then unused."),
            ],
            outputs=[io.Model.Output(tooltip="The diffusion model, as a checkpoint loader's MODEL."),
                     io.Clip.Output(tooltip="Its text encoder(s), as a checkpoint loader's CLIP."),
                     io.Vae.Output(tooltip="Its VAE (8x downscale), as a checkpoint loader's VAE.")],
        )

    @classmethod
    def execute(cls, family: str, seed: int, weights: str = "random") -> io.NodeOutput:
        with torch.inference_mode(False):
            # Weights made outside inference mode stay usable by training nodes downstream.
            return io.NodeOutput(*build_tiny_models(family, seed, weights))


NODES = [HeadroomTinyModel]
