"""Qwen-Image: ComfyUI's `comfy.model_base.QwenImage` (comfy/ldm/qwen_image/ QwenImageTransformer2DModel, a dual-stream
MMDiT), text encoder Qwen2.5-VL-7B (comfy/text_encoders/qwen_image.py), the Wan 2.1 VAE: 16-channel video latents
[B, C, T, H, W] with T = 1 for images (latent_formats.Wan21), flow matching (shift 1.15).

Edit variants (Qwen-Image-Edit, Layered) are the same module class; this family recognises them too (their LoRAs
use the same layer names) but trains them as text-to-image models: no reference latents are passed."""
from __future__ import annotations

import comfy.ldm.wan.vae
import comfy.model_base
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.qwen_image
import comfy.text_encoders.qwen_vl

from ....training.core.adapters import TargetPreset
from .base import Family, TinyModel

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
    tiny=TINY,
    position=21,
)
