"""SD1.x: UNet denoisers that are plain `comfy.model_base.BaseModel`s of ComfyUI's SD15 config (SD2.x is its own
family, nodes/bridge/families/sd2.py). Also the cldm ControlNet type, which every plain UNet trains (the SD2 and SDXL modules
reuse it)."""
from __future__ import annotations

import logging

import torch

import comfy.cldm.cldm
import comfy.controlnet
import comfy.model_base
import comfy.model_detection
import comfy.ldm.modules.diffusionmodules.openaimodel
import comfy.supported_models

from ....training.core.adapters import TargetPreset
from .base import (TINY_CLIP_L, ControlNetError, ControlNetType, ExportedControlNet, Family, TinyModel, differences,
                   effective)

log = logging.getLogger(__name__)

# The self- and cross-attention projections of every transformer block.
UNET_ATTENTION = (r"\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$",)
# Convolutions inside the UNet blocks (include_conv); the stem conv input_blocks.0.0 stays frozen.
UNET_CONV = r"^(input_blocks\.(?!0\.0$)|middle_block\.|output_blocks\.)"

_UNUSED_CLDM = {"self", "dtype", "device", "operations", "use_checkpoint", "image_size", "transformer_depth_output",
                "hint_channels"}


def _cldm_detection_problem(tensors: dict, config: dict) -> str | None:
    meta = {k: v.to("meta") for k, v in tensors.items()}
    detected = comfy.model_detection.model_config_from_unet(meta, "", True)
    if detected is None:
        return "comfy.model_detection does not recognise the UNet layout"
    ours = effective(config, comfy.cldm.cldm.ControlNet.__init__, _UNUSED_CLDM)
    theirs = effective(detected.unet_config, comfy.cldm.cldm.ControlNet.__init__, _UNUSED_CLDM)
    found = differences(ours, theirs)
    return "; ".join(found) if found else None


class CldmControlNet(ControlNetType):
    """`comfy.cldm.cldm.ControlNet`: time_embed, label_emb, input_blocks and middle_block copied from the base; zero
    convs, middle_block_out and the hint encoder's last conv zero-initialised; hint: pixels; file: cldm keys, or
    the Control-LoRA layout when ComfyUI's detection would rebuild the cldm layout differently."""

    name = "unet"
    description = "SD1.x / SD2.x / SDXL UNet models (cldm ControlNet)"
    hint = "pixels"
    extra_conds = ("y",)
    blocks_word = "input blocks"
    new_keys = ("zero_convs.", "middle_block_out.", "input_hint_block.")

    def accepts(self, base) -> bool:
        return (isinstance(base.diffusion_model, comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel)
                and not base.model_config.unet_config.get("use_temporal_resblock"))

    def base_depth(self, diffusion_model: torch.nn.Module) -> int:
        return len(diffusion_model.input_blocks)

    def default_blocks(self, depth: int) -> int:
        return depth  # the whole encoder: the stock loader derives the architecture from it

    def base_blocks_without_backward(self, block_names: list[str]) -> int:
        # The control joins the middle block's output and the skips the output blocks read: the base's input and
        # middle blocks (about half its compute) need no gradient
        return next((k for k, name in enumerate(block_names) if name.startswith("output_blocks.")), 0)

    def copied_base_blocks(self, block_names: list[str], blocks: int) -> int:
        return self.base_blocks_without_backward(block_names)  # the input and middle blocks, the whole encoder

    def check_blocks(self, blocks: int, depth: int, input_name: str = "blocks") -> None:
        if blocks != depth:
            raise ControlNetError(
                f"{input_name}={blocks}: a UNet ControlNet copies the whole encoder ({depth} input blocks), which is "
                f"how ComfyUI's loader rebuilds it; set {input_name} to 0")

    def constructor_config(self, base_config: dict, blocks: int) -> dict:
        config = dict(base_config)
        config.pop("out_channels", None)
        config["hint_channels"] = 3
        return config

    def make_module(self, config: dict, dtype: torch.dtype, device, operations) -> torch.nn.Module:
        return comfy.cldm.cldm.ControlNet(**config, dtype=dtype, device=device, operations=operations)

    def zero_initialised(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        return [*module.zero_convs, module.middle_block_out, module.input_hint_block[-1]]

    def export(self, own: dict[str, torch.Tensor], config: dict, blocks: int) -> ExportedControlNet:
        problem = _cldm_detection_problem(own, config)
        if problem is None:
            return ExportedControlNet(own, "cldm", None)
        # ComfyUI's Control-LoRA loader builds the ControlNet from the MODEL it is applied to, then loads
        # every `.weight` / `.bias` in the file over it: full weights, any UNet geometry.
        tensors = dict(own)
        tensors["lora_controlnet"] = torch.tensor([])
        log.info("ControlNet saved in the Control-LoRA layout: ComfyUI's detection would rebuild the plain cldm "
                 "layout differently (%s)", problem)
        return ExportedControlNet(tensors, "control-lora", None)

    def comfy_controlnet(self, module: torch.nn.Module, device, manual_cast):
        return comfy.controlnet.ControlNet(module, load_device=device, manual_cast_dtype=manual_cast)


CLDM = CldmControlNet()

_TINY_UNET = {
    "use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 32,
    "num_res_blocks": [1, 1], "channel_mult": [1, 2], "transformer_depth": [1, 1],
    "transformer_depth_output": [1, 1, 1, 1], "transformer_depth_middle": 1, "use_spatial_transformer": True,
    "legacy": False, "adm_in_channels": None, "context_dim": TINY_CLIP_L["hidden_size"],
    "use_linear_in_transformer": False, "use_temporal_attention": False, "use_temporal_resblock": False,
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.SD15(dict(_TINY_UNET)),
    clip_target=lambda: comfy.supported_models.SD15(dict(_TINY_UNET)).clip_target(),
    text_encoder_options={"clip_l_model_config": dict(TINY_CLIP_L)},
    latent_channels=4,
    tooltip="sd15: eps UNet, 4-channel latents",
)

FAMILY = Family(
    name="sd15",
    description="SD1.x UNet",
    # SD1.x UNets are plain BaseModels; so are SD2.x's, which ComfyUI builds from its SD20 config (family sd2).
    recognise=lambda model: (type(model) is comfy.model_base.BaseModel
                             and type(model.diffusion_model).__name__ == "UNetModel"
                             and not isinstance(model.model_config, comfy.supported_models.SD20)),
    lora_preset=TargetPreset("sd15", UNET_ATTENTION, UNET_CONV),
    text_tokens=77,
    diffusers_component="unet",
    kohya_base=("sd_v1", "stable-diffusion-v1/lora"),
    kohya_diffusers_block_names=True,
    controlnet=CLDM,
    tiny=TINY,
    position=0,
)
