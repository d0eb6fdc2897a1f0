"""Flux.1 dev / schnell: Flux DiT denoisers (`comfy.model_base.Flux`, not Flux 2); ControlNets of ComfyUI's XLabs
double-block ControlNet class. Flux blocks add into their inputs in place (training/memory/checkpointing.py)."""
from __future__ import annotations

import dataclasses

import torch

import comfy.controlnet
import comfy.ldm.flux.controlnet
import comfy.ldm.flux.model
import comfy.model_base
import comfy.model_detection
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.flux

from ....training.core.adapters import TargetPreset
from .base import TINY_CLIP_L, TINY_T5, ControlNetType, ExportedControlNet, Family, TinyModel, differences


def _flux_detection_problem(tensors: dict, config: dict) -> str | None:
    meta = {k: v.to("meta") for k, v in tensors.items()}
    detected = comfy.model_detection.model_config_from_unet(meta, "", True)
    if detected is None:
        return "comfy.model_detection does not recognise the Flux layout"
    fields = [f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)
              if f.name not in ("out_channels", "depth_single_blocks")]
    defaults = {f.name: f.default for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}
    ours = {k: config.get(k, defaults[k]) for k in fields}
    theirs = {k: detected.unet_config.get(k, defaults[k]) for k in fields}
    found = differences(ours, theirs)
    return "; ".join(found) if found else None


class XLabsFluxControlNet(ControlNetType):
    """`comfy.ldm.flux.controlnet.ControlNetFlux` (XLabs): img/txt/time/vector/guidance in and the first N double
    blocks copied from the base; controlnet_blocks and pos_embed_input zero-initialised; hint: pixels; file: XLabs
    keys (BFL names, `*_norm.scale`)."""

    name = "flux"
    description = "Flux.1 dev / schnell (double-block ControlNet, XLabs layout)"
    hint = "pixels"
    extra_conds = ("y", "guidance")
    blocks_word = "double blocks"
    new_keys = ("controlnet_blocks.", "pos_embed_input.", "input_hint_block.")
    # Flux adds the residuals into a slice of its activations in place, which autograd allows only when those
    # activations are part of the graph: they are once the input requires grad.
    input_requires_grad = True

    def accepts(self, base) -> bool:
        return type(base) is comfy.model_base.Flux and base.model_config.unet_config.get("image_model") == "flux"

    def base_depth(self, diffusion_model: torch.nn.Module) -> int:
        return len(diffusion_model.double_blocks)

    def default_blocks(self, depth: int) -> int:
        return min(2, depth)  # as XLabs'

    def constructor_config(self, base_config: dict, blocks: int) -> dict:
        config = dict(base_config)
        config["depth"] = blocks
        config["depth_single_blocks"] = 0  # a double-block ControlNet
        return config

    def make_module(self, config: dict, dtype: torch.dtype, device, operations) -> torch.nn.Module:
        return comfy.ldm.flux.controlnet.ControlNetFlux(**config, dtype=dtype, device=device, operations=operations)

    def zero_initialised(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        return [*module.controlnet_blocks, module.pos_embed_input]

    def export(self, own: dict[str, torch.Tensor], config: dict, blocks: int) -> ExportedControlNet:
        # XLabs files carry BFL's original names: RMSNorm scales are `*_norm.scale` (the loader renames them back).
        tensors = {(k[: -len(".weight")] + ".scale" if k.endswith("_norm.weight") else k): v for k, v in own.items()}
        return ExportedControlNet(tensors, "flux-xlabs", _flux_detection_problem(tensors, config))

    def comfy_controlnet(self, module: torch.nn.Module, device, manual_cast):
        return comfy.controlnet.ControlNet(module, load_device=device, manual_cast_dtype=manual_cast,
                                           extra_conds=["y", "guidance"])


# Flux's head geometry is the real one (one 128-wide head, RoPE axes [16, 56, 56], mlp_ratio 4): ComfyUI's
# Flux detection (used by the stock ControlNetLoader) fixes it and derives only the head count from the
# width, so a saved ControlNet of this tiny Flux loads back exactly; one head keeps the width at 128.
_TINY_DIT = {
    "image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2,
    "vec_in_dim": TINY_CLIP_L["hidden_size"], "context_in_dim": TINY_T5["d_model"], "hidden_size": 128, "mlp_ratio": 4.0,
    "num_heads": 1, "depth": 1, "depth_single_blocks": 2, "axes_dim": [16, 56, 56], "theta": 10000,
    "qkv_bias": True, "guidance_embed": True, "txt_ids_dims": [],
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.Flux(dict(_TINY_DIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(comfy.text_encoders.flux.FluxTokenizer,
                                                               comfy.text_encoders.flux.flux_clip()),
    text_encoder_options={"clip_l_model_config": dict(TINY_CLIP_L), "t5xxl_model_config": dict(TINY_T5)},
    latent_channels=16,
    tooltip="flux: double/single-stream DiT with guidance input",
)

FAMILY = Family(
    name="flux",
    description="Flux.1 dev / schnell DiT",
    # Flux 2 and Chroma subclass ComfyUI's Flux class but are families of their own.
    recognise=lambda model: (isinstance(model, comfy.model_base.Flux)
                             and not isinstance(model, (comfy.model_base.Flux2, comfy.model_base.Chroma))),
    # Attention and MLP of both streams of the double blocks, both linears of the single blocks.
    lora_preset=TargetPreset("flux", (r"^double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])$",
                                      r"^single_blocks\.\d+\.(linear1|linear2)$")),
    text_tokens=256,
    diffusers_component="transformer",
    kohya_base=("flux1", "flux-1-dev/lora"),
    # ComfyUI's Flux blocks (and those of models built on them) add into their inputs in place (`img += ...`).
    inplace_blocks=lambda model: isinstance(model, comfy.model_base.Flux),
    controlnet=XLabsFluxControlNet(),
    tiny=TINY,
    position=3,
)
