"""SD3 / SD3.5: MMDiT denoisers (`comfy.model_base.SD3`); ControlNets of ComfyUI's SD3 MMDiT ControlNet class."""
from __future__ import annotations

import torch

import comfy.cldm.mmdit
import comfy.controlnet
import comfy.latent_formats
import comfy.ldm.modules.diffusionmodules.mmdit
import comfy.model_base
import comfy.model_detection
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.sd3_clip
import comfy.utils

from ....training.core.adapters import TargetPreset
from .base import (TINY_CLIP_G, TINY_CLIP_L, ControlNetError, ControlNetType, ExportedControlNet, Family, TinyModel,
                   differences, effective)


def hint_latent_format():
    """The latent format `load_controlnet_mmdit` gives SD3 ControlNets: SD3's scale without its shift."""
    latent_format = comfy.latent_formats.SD3()
    latent_format.shift_factor = 0
    return latent_format


def _mmdit_detection_problem(tensors: dict, config: dict) -> str | None:
    meta = {k: v.to("meta") for k, v in tensors.items()}
    converted = comfy.model_detection.convert_diffusers_mmdit(meta, "")
    detected = comfy.model_detection.model_config_from_unet(converted, "", True) if converted else None
    if detected is None:
        return "comfy.model_detection does not recognise the SD3 layout"
    skip = {"self", "dtype", "device", "operations", "num_blocks", "final_layer", "input_size", "out_channels",
            "pos_embed_scaling_factor", "use_checkpoint"}
    signature = comfy.ldm.modules.diffusionmodules.mmdit.MMDiT.__init__
    found = differences(effective(config, signature, skip), effective(detected.unet_config, signature, skip))
    return "; ".join(found) if found else None


def _mmdit_to_diffusers_keys(own: dict[str, torch.Tensor], depth: int, blocks: int) -> dict[str, torch.Tensor]:
    """Invert ComfyUI's own diffusers->MMDiT key map (`comfy.utils.mmdit_to_diffusers`), which is what
    `load_controlnet_mmdit` applies: split fused qkv back into q/k/v, undo the scale/shift swap."""
    out = {}
    used = set()
    for diffusers_key, target in comfy.utils.mmdit_to_diffusers({"depth": depth, "num_blocks": blocks}).items():
        if isinstance(target, str):
            comfy_key, offset, fn = target, None, None
        else:
            comfy_key, offset = target[0], target[1]
            fn = target[2] if len(target) > 2 else None
        if comfy_key not in own:
            continue
        tensor = own[comfy_key]
        if offset is not None:
            tensor = tensor.narrow(offset[0], offset[1], offset[2])
        if fn is not None:
            if fn is not comfy.utils.swap_scale_shift:
                raise ControlNetError(f"unknown key transform {fn} for {diffusers_key} in ComfyUI's MMDiT map")
            tensor = fn(tensor)  # swapping the two halves is its own inverse
        out[diffusers_key] = tensor.contiguous()
        used.add(comfy_key)
    for key, tensor in own.items():  # ControlNet-only keys keep their names (the loader copies them as they are)
        if key not in used:
            out[key] = tensor.contiguous()
    return out


class MMDiTControlNet(ControlNetType):
    """`comfy.cldm.mmdit.ControlNet`: embedders, pos_embed and the first N joint blocks copied from the base;
    controlnet_blocks and pos_embed_input zero-initialised; hint: latents (VAE-encoded, SD3 scale, no shift);
    file: diffusers SD3 ControlNet keys."""

    name = "sd3"
    description = "SD3 / SD3.5 MMDiT models (SD3 ControlNet, diffusers layout)"
    hint = "latents"
    extra_conds = ("y",)
    blocks_word = "joint blocks"
    new_keys = ("controlnet_blocks.", "pos_embed_input.", "input_hint_block.")

    def accepts(self, base) -> bool:
        return isinstance(base, comfy.model_base.SD3)

    def base_depth(self, diffusion_model: torch.nn.Module) -> int:
        return len(diffusion_model.joint_blocks)

    def default_blocks(self, depth: int) -> int:
        return max(1, depth // 4)  # 6 of 24, as published SD3 ControlNets

    def base_blocks_without_backward(self, block_names: list[str]) -> int:
        # The control is added to each joint block's output: the first block's inputs and weights need no gradient
        return 1 if block_names and block_names[0].startswith("joint_blocks.") else 0

    def constructor_config(self, base_config: dict, blocks: int) -> dict:
        config = dict(base_config)
        config["num_blocks"] = blocks
        # Only the copied blocks exist in the ControlNet (and in its file, which is what the loader reads).
        config["x_block_self_attn_layers"] = [i for i in config.get("x_block_self_attn_layers", []) if i < blocks]
        return config

    def make_module(self, config: dict, dtype: torch.dtype, device, operations) -> torch.nn.Module:
        return comfy.cldm.mmdit.ControlNet(**config, dtype=dtype, device=device, operations=operations)

    def zero_initialised(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        return [*module.controlnet_blocks, module.pos_embed_input]

    def copy_missing(self, key: str, source, target: torch.Tensor, depth: int) -> bool:
        if source is None and key.startswith(f"joint_blocks.{depth - 1}.context_block."):
            # The base's last joint block is "pre-only" (its context output is unused), so it lacks the
            # context post-attention layers; in the ControlNet that block's context output is unused too.
            target.zero_()
            return True
        if source is not None and ".context_block.adaLN_modulation.1." in key and source.shape[0] < target.shape[0]:
            # Pre-only block: its modulation rows are the leading chunks (shift/scale for attention)
            # of the full block's; the gates of the unused context outputs start at zero.
            target.zero_()
            target[: source.shape[0]].copy_(source.to(target.dtype))
            return True
        return False

    def export(self, own: dict[str, torch.Tensor], config: dict, blocks: int) -> ExportedControlNet:
        tensors = _mmdit_to_diffusers_keys(own, config["depth"], blocks)
        return ExportedControlNet(tensors, "sd3-diffusers", _mmdit_detection_problem(tensors, config))

    def comfy_controlnet(self, module: torch.nn.Module, device, manual_cast):
        return comfy.controlnet.ControlNet(module, compression_ratio=1, latent_format=hint_latent_format(),
                                           load_device=device, manual_cast_dtype=manual_cast)

    def hint_latent_format(self):
        return hint_latent_format()


# SD3's MMDiT: hidden size is 64 * depth by construction. The joint text context is CLIP-L|CLIP-G padded
# to 4096 wide by ComfyUI's SD3 text encoder; the pooled vector is CLIP-L pooled + CLIP-G projection.
_TINY_MMDIT = {
    "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2, "input_size": None,
    "adm_in_channels": TINY_CLIP_L["hidden_size"] + TINY_CLIP_G["projection_dim"],
    "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 128}},
    "num_patches": 32 * 32, "pos_embed_max_size": 32, "pos_embed_scaling_factor": None,
    "x_block_self_attn_layers": [],
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.SD3(dict(_TINY_MMDIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(
        comfy.text_encoders.sd3_clip.SD3Tokenizer, comfy.text_encoders.sd3_clip.sd3_clip(clip_l=True, clip_g=True, t5=False)),
    text_encoder_options={"clip_l_model_config": dict(TINY_CLIP_L), "clip_g_model_config": dict(TINY_CLIP_G)},
    latent_channels=16,
    tooltip="sd3: MMDiT flow model",
)

FAMILY = Family(
    name="sd3",
    description="SD3 / SD3.5 MMDiT",
    recognise=lambda model: isinstance(model, comfy.model_base.SD3),
    # Attention and MLP of both streams of each joint block.
    lora_preset=TargetPreset("sd3", (r"^joint_blocks\.\d+\.(context_block|x_block)\.(attn\.(qkv|proj)|mlp\.fc[12])$",)),
    text_tokens=154,
    diffusers_component="transformer",
    kohya_base=("sd3", "stable-diffusion-3/lora"),
    controlnet=MMDiTControlNet(),
    tiny=TINY,
    position=2,
)
