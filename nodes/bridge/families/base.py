"""What a family module describes: `Family` (recognition, LoRA preset, text / latent facts, LoRA file naming) and
`ControlNetType` (the ControlNet builder hook: how a ControlNet of ComfyUI's own class is built from the frozen
base, saved for the stock loader and applied). Shared helpers of the ControlNet types live here too."""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ....training import public_module
from ....training.core.adapters import TargetPreset


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """How HeadroomTinyModel builds a tiny model of a family from ComfyUI's own classes (seeded random weights, small
    enough for a CPU): the model config, the text encoder(s) shrunk through ComfyUI's `<name>_model_config` options,
    and the VAE. Every code path of the real family (model_sampling, extra_conds, LoRA key maps, samplers) runs."""

    model_config: Callable[[], Any]  # -> a comfy.supported_models config holding a small unet_config
    clip_target: Callable[[], Any]  # -> the comfy.supported_models_base.ClipTarget of its text encoder(s)
    text_encoder_options: dict  # model_options for comfy.sd.CLIP: `<encoder>_model_config` size overrides
    latent_channels: int
    tooltip: str  # one phrase for the node's `family` tooltip
    # -> (a freshly built VAE module to seed, the `config` comfy.sd.VAE is given with its state dict; None: ComfyUI
    # detects the architecture from the state dict as its VAELoader does).
    vae: Callable[[], tuple[torch.nn.Module, dict | None]] | None = None
    # ComfyUI's VAE class, or a subclass of it where comfy.sd.VAE cannot build the architecture small from a config
    # (HunyuanImage 2.1: detected at the released widths only); called as comfy.sd.VAE(sd=..., config=...).
    vae_class: Callable[..., Any] | None = None
    # -> comfy.sd.CLIP's `tokenizer_data`, for tokenizers ComfyUI reads from the text encoder file rather than ships
    # (Flux.2 dev's Mistral "tekken" JSON); None: the shipped tokenizer.
    tokenizer_data: Callable[[], dict] | None = None

    def vae_module(self) -> tuple[torch.nn.Module, dict | None]:
        return self.vae() if self.vae is not None else autoencoder_kl(self.latent_channels)


def autoencoder_kl(latent_channels: int) -> tuple[torch.nn.Module, dict]:
    """A small SD-style AutoencoderKL (the Encoder / Decoder of the SD / SD3 / Flux VAEs, 8x downscale, 32 base
    channels) and the config that makes comfy.sd.VAE build the same architecture."""
    from comfy.ldm.models.autoencoder import AutoencoderKL

    ddconfig = {"double_z": True, "z_channels": latent_channels, "resolution": 64, "in_channels": 3, "out_ch": 3,
                "ch": 32, "ch_mult": [1, 1, 2, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}
    params = {"ddconfig": ddconfig, "embed_dim": latent_channels}
    return AutoencoderKL(**params), {"params": params}


# Tiny text encoders: ComfyUI's CLIP-L / CLIP-G / T5 classes, shrunk through their model_config options.
# Three CLIP layers: SD3 reads the penultimate layer (layer_idx -2), which needs more than two.
TINY_CLIP_L = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
               "projection_dim": 32}
TINY_CLIP_G = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
               "projection_dim": 32}
TINY_T5 = {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 2, "d_kv": 16}


class ControlNetError(ValueError):
    """Bad input to a ControlNet builder: the message names the value and what to do."""

    __module__ = public_module("nodes.controlnet_build")  # its historical place: a clean type name in error reports


def _never(model) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family. `name` is stored in LoRA run folders and files: never rename one."""

    name: str
    description: str
    recognise: Callable[[Any], bool]  # a comfy.model_base.BaseModel -> is it of this family
    lora_preset: TargetPreset  # the layers targets="preset" trains
    text_tokens: int  # text length the planner assumes when not told (the family's text encoder's usual length)
    # the diffusers pipeline component of the denoiser: its LoRA key prefix (None: ComfyUI maps no diffusers names)
    diffusers_component: str | None
    kohya_base: tuple[str, str]  # (ss_base_model_version, modelspec.architecture) sd-scripts writes
    # modelspec.architecture read from the model itself, for families whose variants other trainers tell apart
    # (Flux.2 dev / Klein 4B / Klein 9B); None from it: none written.
    kohya_architecture: Callable[[Any], str | None] | None = None
    # model -> sd-scripts metadata that depends on the model (SD2: v-prediction or not), written over kohya_base.
    kohya_extra: Callable[[Any], dict[str, str]] | None = None
    kohya_diffusers_block_names: bool = False  # kohya names in diffusers' block naming (SD1.x) instead of the path
    # Regexes of the diffusers layer names to write where ComfyUI's key map lists several for one weight (its
    # conversion tables list Flux.1's names first and other models' aliases after; empty: the first listed).
    diffusers_names_preferred: tuple[str, ...] = ()
    # model -> the pooled conditioning width the planner's calibration adds beyond expected_cond_dims (SDXL), or None.
    calibration_pooled_width: Callable[[Any], int] | None = None
    # (model, text tokens) -> {conditioning name: shape} the planner's calibration gives where the model reads more than
    # cross_attn / pooled_output of the widths its config names (HiDream: T5 width, every Llama layer), or None.
    calibration_cond_shapes: Callable[[Any, int], dict[str, tuple[int, ...]]] | None = None
    latent_downscale: int = 8  # image px per latent px
    # Video families: pixel frames per latent frame of their VAE (clips of frame_step * k + 1 frames: Wan 4); None:
    # an image family (validation makes images; one-frame latents of a video VAE, as Qwen-Image's, are images).
    frame_step: int | None = None
    # model -> the stock node that gives it a clip's start image ("WanImageToVideo": Wan I2V,
    # "HunyuanVideo15ImageToVideo": HunyuanVideo 1.5), or None (no start image). Such a model trains on each clip's
    # first frame as its start image, cached by Cache Latents' start_image.
    start_image: Callable[[Any], str | None] = lambda model: None
    # Families whose model takes the clip's frame rate (extra_conds' `frame_rate`, positions in seconds: LTX-2): the
    # rate it assumes when none is given (ComfyUI's default). They train at each clip's own rate (nodes/bridge/video.py).
    frame_rate: float | None = None
    # Whether a model's blocks add into their inputs in place; asked of every family (registry.inplace_blocks).
    inplace_blocks: Callable[[Any], bool] = _never
    controlnet: ControlNetType | None = None  # the ControlNet this family trains, if any
    tiny: TinyModel | None = None  # the family's tiny model in HeadroomTinyModel, if it has one
    # More tiny models of the family's other variants, by their own HeadroomTinyModel name (flux2: "flux2_dev", as
    # `tiny` is Klein); the module names them in a `TINY_VARIANTS = {...}` dict literal, which the conformance tests
    # read without importing ComfyUI.
    tiny_variants: dict[str, TinyModel] = dataclasses.field(default_factory=dict)
    position: int = 100  # order in lists and messages


@dataclasses.dataclass
class ExportedControlNet:
    tensors: dict[str, torch.Tensor]
    layout: str
    problem: str | None  # why the stock loader would not rebuild it faithfully, or None


class ControlNetType:
    """The ControlNet builder hook of one or more families. `name` is stored in ControlNet run folders and files
    (under their "family" key): never rename one."""

    name: str
    description: str
    hint: str  # "pixels" (RGB 0..1 at 8x the latent size) or "latents" (VAE-encoded)
    extra_conds: tuple[str, ...]  # the conditioning entries the ControlNet reads (as its stock loader passes them)
    blocks_word: str = "blocks"  # what `blocks` counts, for messages
    new_keys: tuple[str, ...] = ()  # prefixes of the module's own layers (not copied from the base)
    input_requires_grad: bool = False  # the base adds residuals in place: x_t must be part of the graph

    def accepts(self, base) -> bool:
        """Whether this ControlNet type is built for a ComfyUI model (`comfy.model_base.BaseModel`)."""
        raise NotImplementedError

    def base_depth(self, diffusion_model: torch.nn.Module) -> int:
        """How many blocks the base has that a ControlNet of this type can copy."""
        raise NotImplementedError

    def latent_input_channels(self, unet_config: dict) -> int | None:
        """The latent channels the base's input takes (more than its latent format's: an inpainting / edit variant)."""
        return unet_config.get("in_channels")

    def default_blocks(self, depth: int) -> int:
        raise NotImplementedError

    def check_blocks(self, blocks: int, depth: int, input_name: str = "blocks") -> None:
        """Refuse a block count this base cannot give; `input_name`: the node input that set it."""
        if blocks > depth:
            raise ControlNetError(f"{input_name}={blocks} is more than the base model's {depth} {self.blocks_word}; "
                                  f"use 1..{depth} (0 = default)")

    def constructor_config(self, base_config: dict, blocks: int) -> dict:
        """The module's constructor arguments from the base's unet_config (without dtype / device / operations)."""
        raise NotImplementedError

    def make_module(self, config: dict, dtype: torch.dtype, device, operations) -> torch.nn.Module:
        raise NotImplementedError

    def zero_initialised(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """Layers whose zero start makes an untrained ControlNet change nothing."""
        raise NotImplementedError

    def base_blocks_without_backward(self, block_names: list[str]) -> int:
        """How many of the base's first training blocks (`block_names`, forward order) run no backward in a run of
        this type: the control joins the base after them and nothing before needs a gradient (the base is frozen;
        planner.TrainableSpec.without_backward). 0: every block does, or not known (the time model then counts them
        all: conservative)."""
        return 0

    def copied_base_blocks(self, block_names: list[str], blocks: int) -> int:
        """How many of the base's first training blocks (`block_names`) a ControlNet of `blocks` copies: its own
        trainable copies run their forward and backward again (planner.TrainableSpec.copied_blocks)."""
        return min(blocks, len(block_names))

    def copy_missing(self, key: str, source, target: torch.Tensor, depth: int) -> bool:
        """A ControlNet key the base lacks or has in another shape: fill `target` and return True when this type
        knows how (else the builder refuses the base)."""
        return False

    def export(self, own: dict[str, torch.Tensor], config: dict, blocks: int) -> ExportedControlNet:
        """The tensors in the key layout the stock ControlNetLoader detects for this type."""
        raise NotImplementedError

    def comfy_controlnet(self, module: torch.nn.Module, device, manual_cast):
        """A `comfy.controlnet.ControlNet` around the module, configured as the stock loader configures one."""
        raise NotImplementedError

    def hint_latent_format(self):
        """The latent format the stock loader gives a latent-hint ControlNet (None for pixel hints)."""


def effective(config: dict, signature_of, skip: set[str]) -> dict:
    params = inspect.signature(signature_of).parameters
    return {name: config.get(name, p.default) for name, p in params.items()
            if name not in skip and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def differences(ours: dict, theirs: dict) -> list[str]:
    def norm(v):
        return list(v) if isinstance(v, tuple) else v
    return [f"{k}: ours {ours[k]!r}, loader {theirs[k]!r}" for k in ours if norm(ours[k]) != norm(theirs[k])]
