"""Qwen-Image: ComfyUI's `comfy.model_base.QwenImage` (comfy/ldm/qwen_image/ QwenImageTransformer2DModel, a dual-stream
MMDiT), text encoder Qwen2.5-VL-7B (comfy/text_encoders/qwen_image.py), the Wan 2.1 VAE: 16-channel video latents
[B, C, T, H, W] with T = 1 for images (latent_formats.Wan21), flow matching (shift 1.15).

Edit variants (Qwen-Image-Edit, Layered) are the same module class; this family recognises them too (their LoRAs
use the same layer names). ControlNets: InstantX's layout (ComfyUI's QwenImageControlNetModel), which the stock
ControlNetLoader detects and rebuilds at the released widths."""
from __future__ import annotations

import math

import torch

import comfy.controlnet
import comfy.latent_formats
import comfy.ldm.qwen_image.controlnet
import comfy.ldm.qwen_image.model
import comfy.ldm.wan.vae
import comfy.model_base
import comfy.model_detection
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.qwen_image
import comfy.text_encoders.qwen_vl

from ....training.core.adapters import TargetPreset
from .base import ControlNetError, ControlNetType, ExportedControlNet, Family, TinyModel, differences, effective


def _instantx_detection_problem(tensors: dict, config: dict) -> str | None:
    """What the stock loader (load_controlnet_qwen_instantx: Qwen-Image detection, then the class defaults for every
    width it does not read) would build differently from this module, or None."""
    meta = {k: v.to("meta") for k, v in tensors.items()}
    detected = comfy.model_detection.model_config_from_unet(meta, "", True)
    if detected is None:
        return "comfy.model_detection does not recognise the Qwen-Image layout"
    skip = {"self", "dtype", "device", "operations", "final_layer", "image_model"}
    signature = comfy.ldm.qwen_image.model.QwenImageTransformer2DModel.__init__
    found = differences(effective(config, signature, skip), effective(detected.unet_config, signature, skip))
    return "; ".join(found) if found else None


class InstantXQwenControlNet(ControlNetType):
    """`comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel` (InstantX): the base's embedders and first N
    transformer blocks copied; controlnet_blocks and controlnet_x_embedder zero-initialised; hint: latents (VAE-encoded,
    Wan 2.1 scale); file: the module's own keys, which ComfyUI's loader detects as InstantX's Qwen-Image layout.
    The loader rebuilds it at the released widths (24 heads of 128, text 3584): only a real-width one loads back."""

    name = "qwen_image"
    description = "Qwen-Image (InstantX ControlNet layout)"
    hint = "latents"
    extra_conds = ()  # the stock loader passes none (the text attention mask neither)
    blocks_word = "transformer blocks"
    new_keys = ("controlnet_blocks.", "controlnet_x_embedder.")
    # The base adds the residuals into a slice of its image stream in place (comfy/ldm/qwen_image/model.py).
    input_requires_grad = True

    def accepts(self, base) -> bool:
        return type(base) is comfy.model_base.QwenImage

    def base_depth(self, diffusion_model: torch.nn.Module) -> int:
        return len(diffusion_model.transformer_blocks)

    def latent_input_channels(self, unet_config: dict) -> int | None:
        return unet_config.get("in_channels", 64) // unet_config.get("patch_size", 2) ** 2  # 2x2 patches folded in

    @staticmethod
    def _reaching(blocks: int, depth: int) -> int:
        """How many of the ControlNet's blocks reach the base: ComfyUI's module repeats each block's output
        ceil(60 / blocks) times (60: the released depth) and the base adds the first `depth` of them."""
        return math.ceil(min(depth, 60) / math.ceil(60 / blocks))

    def default_blocks(self, depth: int) -> int:
        # 5, as InstantX's Qwen-Image ControlNet Union, or fewer where a shallow base would leave some unused.
        return max(n for n in range(1, min(5, depth) + 1) if self._reaching(n, depth) == n)

    def check_blocks(self, blocks: int, depth: int, input_name: str = "blocks") -> None:
        super().check_blocks(blocks, depth, input_name)
        if self._reaching(blocks, depth) < blocks:
            raise ControlNetError(f"{input_name}={blocks}: ComfyUI's Qwen-Image ControlNet repeats each block's output "
                                  f"ceil(60 / blocks) times over the base's blocks, so on this {depth}-block base only "
                                  f"{self._reaching(blocks, depth)} would ever be used; use "
                                  f"{self.default_blocks(depth)} (0 = default)")

    def constructor_config(self, base_config: dict, blocks: int) -> dict:
        return dict(base_config, num_layers=blocks)

    def make_module(self, config: dict, dtype: torch.dtype, device, operations) -> torch.nn.Module:
        return comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel(**config, dtype=dtype, device=device,
                                                                         operations=operations)

    def zero_initialised(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        return [*module.controlnet_blocks, module.controlnet_x_embedder]

    def export(self, own: dict[str, torch.Tensor], config: dict, blocks: int) -> ExportedControlNet:
        tensors = {k: v.contiguous() for k, v in own.items()}
        return ExportedControlNet(tensors, "qwen-image-instantx", _instantx_detection_problem(tensors, config))

    def comfy_controlnet(self, module: torch.nn.Module, device, manual_cast):
        return comfy.controlnet.ControlNet(module, compression_ratio=1, latent_format=comfy.latent_formats.Wan21(),
                                           load_device=device, manual_cast_dtype=manual_cast, extra_conds=[])

    def hint_latent_format(self):
        return comfy.latent_formats.Wan21()

# Qwen2.5-VL-7B's language model shrunk through ComfyUI's `qwen25_7b_model_config` option (comfy/text_encoders/llama.py
# Qwen25_7BVLI_Config; head_dim 128 and the M-RoPE sections [16, 24, 24] are fixed there). Qwen-Image reads the
# last layer.
TINY_QWEN25_7B = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "num_key_value_heads": 1}


class _TinyVisionQwen25VLModel(comfy.text_encoders.qwen_image.Qwen25_7BVLIModel):
    """ComfyUI's Qwen2.5-VL text model with its vision tower built small. ComfyUI builds that tower at its released
    size whatever the config (1280 wide, 32 blocks: 0.67 B parameters, no model option), which a CPU tiny model cannot
    carry; it only encodes images given to the edit text-encode node, which the tiny model's prompts never are.
    Given to comfy.sd.CLIP through ComfyUI's own `qwen25_7b_class` model option."""

    def __init__(self, device="cpu", dtype=None, model_options={}, **kwargs):
        super().__init__(device=device, dtype=dtype, model_options=model_options, **kwargs)
        transformer = self.transformer
        transformer.visual = comfy.text_encoders.qwen_vl.Qwen2VLVisionTransformer(
            hidden_size=32, output_hidden_size=TINY_QWEN25_7B["hidden_size"], intermediate_size=64, num_heads=2,
            num_layers=1, device=device, dtype=dtype, ops=self.operations)


def _tiny_wan_vae():
    """ComfyUI's Wan 2.1 VAE (comfy/ldm/wan/vae.py) at base width 16. comfy.sd.VAE's detection of a Wan 2.1 state
    dict reads the base width (`decoder.head.0.gamma`) and the image / output channels from the tensors and fixes the
    rest (dim_mult [1, 2, 4, 4], 2 res blocks, temporal downsampling [False, True, True], 16 latent channels): the width
    is the only size it can represent, so the tiny VAE is the released design at 16 instead of 96 base channels, and
    config None makes comfy.sd.VAE detect it as the VAELoader does."""
    return comfy.ldm.wan.vae.WanVAE(dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                    temperal_downsample=[False, True, True], image_channels=3, conv_out_channels=3,
                                    dropout=0.0), None


# QwenImage's detection (comfy/model_detection.py) reads only the input channels and the depth; the other sizes are
# the class defaults (24 heads of 128, RoPE axes [16, 56, 56], text width 3584). The tiny one keeps the head width and
# RoPE (one head: width 128), takes its text width from the tiny encoder, and has 2 blocks.
_TINY_DIT = {
    "image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2,
    "attention_head_dim": 128, "num_attention_heads": 1, "joint_attention_dim": TINY_QWEN25_7B["hidden_size"],
    "axes_dims_rope": [16, 56, 56],
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.QwenImage(dict(_TINY_DIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(comfy.text_encoders.qwen_image.QwenImageTokenizer,
                                                               comfy.text_encoders.qwen_image.te()),
    text_encoder_options={"qwen25_7b_model_config": dict(TINY_QWEN25_7B), "qwen25_7b_class": _TinyVisionQwen25VLModel},
    latent_channels=16,
    tooltip="qwen_image: Qwen-Image MMDiT with a Qwen2.5-VL text encoder and the Wan 2.1 VAE (5-D latents)",
    vae=_tiny_wan_vae,
)

FAMILY = Family(
    name="qwen_image",
    description="Qwen-Image MMDiT (Qwen2.5-VL encoder, Wan 2.1 VAE)",
    recognise=lambda model: type(model) is comfy.model_base.QwenImage,
    # Attention (image q/k/v/out, text q/k/v/out) and both streams' MLPs of each transformer block (diffusers' names,
    # which ComfyUI's module paths are); the modulation linears (img_mod / txt_mod) are left out, as musubi-tuner's
    # default leaves them out.
    lora_preset=TargetPreset("qwen_image", (
        r"^transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
        r"|(img|txt)_mlp\.net\.(0\.proj|2))$",)),
    text_tokens=128,  # the system prompt is cut off by the encoder: the prompt's own tokens
    diffusers_component="transformer",
    # sd-scripts does not train Qwen-Image: musubi-tuner's names (its architecture id "qwen_image"; modelspec.architecture
    # "Qwen-Image/lora", musubi_tuner/utils/sai_model_spec.py).
    kohya_base=("qwen_image", "Qwen-Image/lora"),
    controlnet=InstantXQwenControlNet(),
    tiny=TINY,
    position=21,
)
