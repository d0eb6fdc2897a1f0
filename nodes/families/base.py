"""What a family module describes: `Family` (recognition, LoRA preset, text / latent facts, LoRA file naming) and
`ControlNetType` (the ControlNet builder hook: how a ControlNet of ComfyUI's own class is built from the frozen
base, saved for the stock loader and applied). Shared helpers of the ControlNet types live here too."""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ...training import public_module
from ...training.adapters import TargetPreset


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
    diffusers_component: str  # the diffusers pipeline component of the denoiser: its LoRA key prefix
    kohya_base: tuple[str, str]  # (ss_base_model_version, modelspec.architecture) sd-scripts writes
    kohya_diffusers_block_names: bool = False  # kohya names in diffusers' block naming (SD1.x) instead of the path
    calibration_pooled_width: int | None = None  # pooled conditioning width calibration adds beyond expected_cond_dims
    latent_downscale: int = 8  # image px per latent px
    # Whether a model's blocks add into their inputs in place; asked of every family (registry.inplace_blocks).
    inplace_blocks: Callable[[Any], bool] = _never
    controlnet: ControlNetType | None = None  # the ControlNet this family trains, if any
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

    def default_blocks(self, depth: int) -> int:
        raise NotImplementedError

    def check_blocks(self, blocks: int, depth: int) -> None:
        if blocks > depth:
            raise ControlNetError(f"blocks={blocks} is more than the base model's {depth} {self.blocks_word}; use "
                                  f"1..{depth} (0 = default)")

    def constructor_config(self, base_config: dict, blocks: int) -> dict:
        """The module's constructor arguments from the base's unet_config (without dtype / device / operations)."""
        raise NotImplementedError

    def make_module(self, config: dict, dtype: torch.dtype, device, operations) -> torch.nn.Module:
        raise NotImplementedError

    def zero_initialised(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """Layers whose zero start makes an untrained ControlNet change nothing."""
        raise NotImplementedError

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
